"""Where attention runs: one record — a kernel, and optionally a mesh over which the keys are
sharded with a schedule — and the one place a call is routed by it."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Literal, get_args

import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .._numerics import Dims, Layout, check_choice
from .._partials import REDUCTIONS, AxisName, Reduction
from .._sharding import SequenceSharding
from ..energy import Energy
from ._energies import check_energy
from ._flash import flash_attention
from ._registry import KERNELS, Backend, check_backend, kernel_call, resolve
from ._ring import ring_decode
from ._tree import tree_decode


Schedule = Literal["tree", "ring"]
"""How the devices of a sharded KV cache meet: their partial results merge (`"tree"`, the
paper's Algorithm 3) or the shards travel around the ring (`"ring"`, the baseline)."""
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)

AttentionName = Literal["energy", "reference", "flash", "tree", "ring"]
"""The names of `AttentionBackend`s: `"energy"`, `"reference"` and `"flash"` are the kernels
`"energy"`, `"reference"` and `"auto"` on one device; `"tree"` and `"ring"` shard the keys
over a mesh."""
ATTENTION_NAMES: tuple[AttentionName, ...] = get_args(AttentionName)


@dataclasses.dataclass(frozen=True, init=False)
class AttentionBackend:
    """Where attention runs (hashable: a static configuration).

    - `kernel`: the [`flash_attention`][treeattn.decode.flash_attention] backend of every
      local step — a name, or an ordered tuple whose first eligible entry runs, e.g.
      `("pallas", "auto")`: the Pallas decode kernel for decode steps, `"auto"` for prefill
      chunks.
    - `mesh`, `kv_axis`: when given, the keys (a KV cache) are sharded along the sequence over
      the mesh axis `kv_axis`, and the devices meet by `schedule`: `"tree"`
      ([`tree_decode`][treeattn.decode.tree_decode], merged with `reduction`) or `"ring"`
      ([`ring_decode`][treeattn.decode.ring_decode], the Ring Attention baseline).

    A name builds one: `AttentionBackend("energy")` (attention as the gradient of the free
    energy, `kernel="energy"`), `"reference"` (`kernel="reference"`, written out in plain
    `jnp`), `"flash"` (`kernel="auto"`, or the `kernel` given), `"tree"` and `"ring"` (with
    `mesh=` and `kv_axis=`). Keywords override: `AttentionBackend("tree", kernel="energy",
    mesh=mesh, kv_axis="kv")` runs the energy kernel on every shard.
    """

    kernel: Backend | tuple[Backend, ...]
    mesh: Mesh | None
    kv_axis: AxisName | None
    schedule: Schedule
    reduction: Reduction

    def __init__(
        self,
        name: AttentionName | None = None,
        *,
        kernel: Backend | Sequence[Backend] | None = None,
        mesh: Mesh | None = None,
        kv_axis: AxisName | Sequence[str] | None = None,
        schedule: Schedule | None = None,
        reduction: Reduction = "allreduce",
        flash_backend: str | None = None,
    ):
        fn = "AttentionBackend"
        if name is not None:
            check_choice(fn, "name", name, ATTENTION_NAMES)
        if flash_backend is not None:
            warnings.warn(
                "AttentionBackend(flash_backend=x) is deprecated: pass kernel=(x, 'auto')",
                DeprecationWarning,
                stacklevel=2,
            )
            if kernel is None:
                kernel = (flash_backend, "auto") if flash_backend != "auto" else "auto"  # type: ignore[assignment]
        if kernel is None:
            kernel = name if name in ("energy", "reference") else "auto"
        names = check_backend(fn, kernel)
        sharded = name in ("tree", "ring") or schedule is not None or mesh is not None
        if sharded and (mesh is None or kv_axis is None):
            what = f"the {name!r} attention backend" if name else "a sharded attention backend"
            raise ValueError(f"{fn}: {what} needs mesh= and kv_axis=")
        if schedule is None:
            schedule = "ring" if name == "ring" else "tree"
        check_choice(fn, "schedule", schedule, SCHEDULES)
        check_choice(fn, "reduction", reduction, REDUCTIONS)
        if mesh is not None:
            assert kv_axis is not None
            SequenceSharding.create(fn, mesh, kv_axis)  # the axes are the mesh's
            kv_axis = kv_axis if isinstance(kv_axis, str) else tuple(kv_axis)
        object.__setattr__(self, "kernel", names[0] if len(names) == 1 else names)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "kv_axis", kv_axis)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "reduction", reduction)

    @classmethod
    def of(
        cls, backend: AttentionBackend | AttentionName, mesh=None, kv_axis=None
    ) -> AttentionBackend:
        """`backend` as a record: a record as it is, a name with `mesh` and `kv_axis`."""
        if isinstance(backend, AttentionBackend):
            return backend
        if not isinstance(backend, str):
            raise ValueError(
                f"attention backend must be one of {ATTENTION_NAMES} or an AttentionBackend, "
                f"got {backend!r}"
            )
        return cls(backend, mesh=mesh, kv_axis=kv_axis)

    @property
    def sharded(self) -> bool:
        """The keys are sharded along the sequence over `mesh`."""
        return self.mesh is not None

    @property
    def sharding(self) -> SequenceSharding | None:
        """The sequence sharding of the keys (None: one device)."""
        if self.mesh is None or self.kv_axis is None:
            return None
        return SequenceSharding.create("AttentionBackend", self.mesh, self.kv_axis)

    @property
    def decoding(self) -> AttentionBackend:
        """The backend that decoding (`Decoder`, `prefill`, `decode_step`, `generate`, a model
        call with a cache) runs for a model on this one: `"energy"` on one device becomes
        `"flash"`, whose `"auto"` kernel computes the same attention fused where a kernel
        serves the energy (softmax, on every platform), and through the energy kernel
        otherwise; any other backend is kept. The gradient of the free energy materialises
        every logit of a step, where a fused kernel streams the cache once."""
        if self.mesh is None and self.kernel == "energy":
            return AttentionBackend("flash")
        return self

    @property
    def name(self) -> AttentionName:
        """The name this record answers to: its schedule when sharded, else `"energy"` or
        `"reference"` for those kernels, `"flash"` for the others."""
        if self.sharded:
            return self.schedule
        if self.kernel in ("energy", "reference"):
            return self.kernel  # type: ignore[return-value]
        return "flash"

    def attend(
        self,
        q: Float[Array, "batch q_seq heads qk"],
        k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
        v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
        *,
        causal: bool = False,
        q_offset: int | Int[Array, ""] | Int[Array, " batch"] = 0,
        kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
        kv_positions: Int[Array, " kv_seq"] | Int[Array, "batch kv_seq"] | None = None,
        shard_lengths: Int[Array, " devices"] | Int[Array, "batch devices"] | None = None,
        mask: Bool[Array, "#batch #heads #q_seq #kv_seq"] | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        kv_layout: Layout = "bshd",
        energy: Energy | None = None,
        kv_finite: bool = False,
        q_segment_ids: Int[Array, "#batch q_seq"] | None = None,
        kv_segment_ids: Int[Array, "#batch kv_seq"] | None = None,
    ) -> Float[Array, "batch q_seq heads dv"]:
        """Attention on this backend: [`flash_attention`][treeattn.decode.flash_attention] on
        one device, else [`tree_decode`][treeattn.decode.tree_decode] or
        [`ring_decode`][treeattn.decode.ring_decode] over the mesh (arguments as theirs;
        `shard_lengths` replaces `kv_length`, `q_offset` and `kv_positions` where every
        query sees every filled key, and needs a mesh). **Returns:** the output."""
        kw: dict[str, Any] = dict(locals(), backend=self.kernel)
        for name in ("self", "q", "k", "v", "q_offset", "shard_lengths"):
            del kw[name]
        if q_segment_ids is None and kv_segment_ids is None:
            del kw["q_segment_ids"], kw["kv_segment_ids"]
        if self.mesh is None:
            if shard_lengths is not None:
                raise ValueError(
                    "AttentionBackend.attend: shard_lengths describes a sharded cache; this "
                    "backend has no mesh"
                )
            return flash_attention(q, k, v, q_offset=q_offset, **kw)[0]
        sharded = tree_decode if self.schedule == "tree" else ring_decode
        if shard_lengths is not None:
            kw.update(kv_length=None, kv_positions=None)
        return sharded(
            q,
            k,
            v,
            mesh=self.mesh,
            kv_axis=self.kv_axis,  # type: ignore[arg-type]
            reduction=self.reduction,
            q_offset=None if shard_lengths is not None else q_offset,
            shard_lengths=shard_lengths,
            **kw,
        )


def cache_layout(
    backend: AttentionBackend | AttentionName,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    energy: Energy | None = None,
    platform: str | None = None,
) -> Layout:
    """The layout of a KV cache that `backend` reads where it lies: that of the kernel it
    runs for a decode step (one query per row over a partly filled cache) of these sizes,
    dtype and `energy` when lowered for `platform` (default: this process's, or, for a kernel
    this process cannot run, e.g. cuDNN on a CPU host lowering for a GPU, the platform that
    runs it) — e.g. head-major `"bhsd"` for the C++ CPU kernel and the `"energy"` kernel,
    `"bshd"` for the GPU kernels. A cache in the other layout is transposed on every step."""
    be = AttentionBackend.of(backend)
    energy = check_energy("cache_layout", energy)
    dims = Dims(1, 64, num_heads, num_kv_heads, head_dim, head_dim, 1, "bhsd")
    kw: dict[str, Any] = dict(
        causal=True, has_length=True, q_offset=None, has_positions=False, energy=energy
    )
    call = kernel_call(dims, dtype, **kw)
    choice = resolve("cache_layout", be.kernel, call)
    if platform is None and call.host not in dict(choice.kernels):
        return KERNELS[choice.kernels[0][1]].layout
    return KERNELS[choice.kernel(platform or call.host)].layout
