"""`MultiheadAttention`: a drop-in `equinox.nn.MultiheadAttention` on every treeattn backend."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Literal, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import decode, energy
from .._numerics import (
    Dims,
    Layout,
    Window,
    check_window,
    compute_dtype,
    default_scale,
    from_rows,
    rows_visibility,
    tilt_at_zero,
    to_rows,
    visibility,
)
from .._partials import Reduction
from ..energy import Context, Energy, LinearKernel, Softmax
from ._cache import Cache, KVCache, LinearCache
from ._layers import RMSNorm, RotaryEmbedding, apply_linear


AttentionPath = Literal["energy", "reference", "flash", "tree", "ring"]
"""Where a layer's attention runs (see `AttentionBackend`)."""
ATTENTION_PATHS: tuple[AttentionPath, ...] = get_args(AttentionPath)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """Where attention runs (hashable: a static configuration).

    - `name`: `"energy"` (attention as `jax.grad` of the free energy), `"reference"` (its
      twin, softmax written out), `"flash"` (`treeattn.decode.flash_attention`), `"tree"`
      (the KV cache sharded over `mesh` axis `kv_axis`, `treeattn.decode.tree_decode`), or
      `"ring"` (the same sharded cache through the Ring Attention baseline,
      `treeattn.decode.ring_decode`: p - 1 steps passing the shards around, for comparison).
    - `kernel`: the `flash_attention` backend of `"flash"`, `"tree"` and `"ring"`: a name, or
      an ordered tuple of names of which the first that can serve a call runs — e.g.
      `("pallas", "auto")`:
      the Pallas decode kernel for decode steps, `"auto"` for prefill chunks.
    - `mesh`, `kv_axis`, `reduction`: for `"tree"` (`"ring"` takes the mesh and axis).
    - `flash_backend` (the former spelling, still accepted): a kernel name `x` means
      `kernel=(x, "auto")`.
    """

    name: AttentionPath = "energy"
    kernel: decode.Backend | tuple[decode.Backend, ...] = "auto"
    mesh: Mesh | None = None
    kv_axis: str | tuple[str, ...] | None = None
    reduction: Reduction = "allreduce"
    flash_backend: dataclasses.InitVar[str | None] = None

    def __post_init__(self, flash_backend):
        if flash_backend is not None:
            kernel = flash_backend if flash_backend == "auto" else (flash_backend, "auto")
            object.__setattr__(self, "kernel", kernel)
        if isinstance(self.kernel, list):  # hashable: the backend is a static argument
            object.__setattr__(self, "kernel", tuple(self.kernel))
        if isinstance(self.kv_axis, list):
            object.__setattr__(self, "kv_axis", tuple(self.kv_axis))
        if self.name not in ATTENTION_PATHS:
            raise ValueError(
                f"attention backend must be one of {ATTENTION_PATHS}, got {self.name!r}"
            )
        if self.sharded and (self.mesh is None or self.kv_axis is None):
            raise ValueError(f"the {self.name!r} attention backend needs mesh= and kv_axis=")

    @property
    def sharded(self) -> bool:
        """The KV cache is sharded along the sequence over `mesh` (`"tree"` and `"ring"`)."""
        return self.name in ("tree", "ring")


def as_backend(backend, mesh=None, kv_axis=None) -> AttentionBackend:
    if isinstance(backend, AttentionBackend):
        return backend
    return AttentionBackend(name=backend, mesh=mesh, kv_axis=kv_axis)


def cache_layout(backend: AttentionBackend, attention_energy: Energy | None = None) -> Layout:
    """The cache layout `backend` reads where it lies: `"bshd"` for `"energy"` and
    `"reference"` (their matrix products take `[kv, kv_heads, d]`) and for the fused GPU kernels
    (cuDNN, flash-attn and Pallas take `[batch, seq, kv_heads, d]`; a head-major cache would be
    transposed in full on every step); head-major `"bhsd"` for the fused kernels on CPU, which
    stream it at memory speed. With another energy than `Softmax()`: head-major `"bhsd"`,
    which its batched (per kv head) matrix products read in place, except on `"tree"` and
    `"ring"`, whose `tree_energy_attention` takes `[kv, kv_heads, d]` shards."""
    if not is_default_energy(attention_energy):
        return "bshd" if backend.sharded else "bhsd"
    if backend.name in ("energy", "reference") or jax.default_backend() == "gpu":
        return "bshd"
    return "bhsd"


def check_layer_mask(mask, q_seq: int, kv_seq: int, heads: int) -> None:
    """A layer's `mask`: boolean `[q_seq, kv_seq]` or `[num_heads, q_seq, kv_seq]`."""
    if mask is None:
        return
    dtype = jnp.result_type(mask)
    if dtype != jnp.bool_:
        raise ValueError(f"MultiheadAttention: mask must be boolean (True = attend), got {dtype}")
    allowed = ((q_seq, kv_seq), (heads, q_seq, kv_seq))
    if tuple(jnp.shape(mask)) not in allowed:
        raise ValueError(
            f"MultiheadAttention: mask must have shape [q_seq, kv_seq] = {allowed[0]} or "
            f"[num_heads, q_seq, kv_seq] = {allowed[1]}, got {tuple(jnp.shape(mask))}"
        )


def attend(
    q: Float[Array, "q_seq heads qk"],
    k: Array,
    v: Array,
    *,
    kv_layout: Layout,
    kv_length: Int[Array, ""] | None,
    q_offset: Int[Array, ""] | int,
    causal: bool,
    mask: Bool[Array, ...] | None,
    kv_positions: Array | None,
    backend: AttentionBackend,
    shard_lengths: Int[Array, " devices"] | None = None,
    local_window_size: Window | None = None,
    attention_energy: Energy | None = None,
) -> Float[Array, "q_seq heads vo"]:
    r"""Attention of `q` over keys/values `[kv, kv_heads, d]` (`kv_layout="bshd"`, without the
    batch axis) or head-major `[kv_heads, kv, d]` (`"bhsd"`) on `backend`. Key slot `a` holds
    position `kv_positions[a]` (default `a`); it is visible when that position is below
    `kv_length` (if given: a partly filled cache), if `causal`, not after the query (query
    `i` sits at `q_offset + i`), within `local_window_size = (left, right)` of it
    ($i - \mathrm{left} \le j \le i + \mathrm{right}$), and where `mask` allows. For
    `"tree"`, `shard_lengths` (the filled slots of each shard of a round-robin cache) replaces
    `kv_length`, `q_offset` and positions where every query sees every filled key.
    `attention_energy` (None: `Softmax()`, the fused paths) any other
    [`Energy`][treeattn.energy.Energy]: see `_attend_energy`."""
    ordered_slots = (
        kv_positions is not None
        and attention_energy is not None
        and not attention_energy.monoid.commutative
    )
    if not is_default_energy(attention_energy) and (backend.name != "ring" or ordered_slots):
        # The ring of an ordered energy over a round-robin cache (whose shards interleave
        # positions) takes the gathered path below, as the tree does.
        assert attention_energy is not None and shard_lengths is None
        return _attend_energy(
            q,
            k,
            v,
            kv_layout=kv_layout,
            kv_length=kv_length,
            q_offset=q_offset,
            causal=causal,
            mask=mask,
            kv_positions=kv_positions,
            backend=backend,
            attention_energy=attention_energy,
            local_window_size=local_window_size,
        )
    name = backend.name
    if name in ("energy", "reference"):
        if kv_layout == "bhsd":  # a transposed copy of the cache: these are the checking paths;
            # the fused ones (flash, tree) read the head-major cache as it is
            k, v = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)
        kv_seq, heads = k.shape[0], q.shape[1]
        dims = Dims(q.shape[0], kv_seq, heads, k.shape[1], q.shape[-1], v.shape[-1])
        vis = visibility(
            dims,
            causal=causal,
            q_offset=q_offset,
            kv_positions=kv_positions,
            kv_length=kv_length,
            mask=mask,
            window=local_window_size,
        )
        if vis is not None and (vis.shape[0] > 1 or vis.shape[1] > 1):
            # per-head visibility: the energy functions take [heads, q_seq, kv_seq]
            full = jnp.broadcast_to(vis, (dims.kv_heads, dims.group, dims.q_seq, kv_seq))
            vis = full.reshape(heads, dims.q_seq, kv_seq)
        elif vis is not None:
            vis = jnp.broadcast_to(vis[0, 0], (dims.q_seq, kv_seq))
        fn = energy.energy_attention if name == "energy" else energy.attention_reference
        return fn(q, k, v, mask=vis)
    positions = None if kv_positions is None else kv_positions[None]
    if mask is not None:  # [batch, #heads, q_seq, kv_seq]
        mask = mask[None, None] if mask.ndim == 2 else mask[None]
    if name == "flash":
        out, _ = decode.flash_attention(
            q[None],
            k[None],
            v[None],
            causal=causal,
            q_offset=q_offset,
            kv_length=kv_length,
            backend=backend.kernel,
            kv_layout=kv_layout,
            kv_positions=positions,
            local_window_size=local_window_size,
            mask=mask,
        )
        return out[0]
    assert backend.mesh is not None and backend.kv_axis is not None
    per_shard = shard_lengths is not None
    sharded_decode = decode.tree_decode if name == "tree" else decode.ring_decode
    if not is_default_energy(attention_energy):  # the ring of any other energy
        sharded_decode = functools.partial(decode.ring_decode, energy=attention_energy)
    out = sharded_decode(
        q[None],
        k[None],
        v[None],
        mesh=backend.mesh,
        kv_axis=backend.kv_axis,
        kv_length=None if per_shard else kv_length,
        causal=causal,
        q_offset=None if per_shard else q_offset,
        backend=backend.kernel,
        reduction=backend.reduction,
        kv_layout=kv_layout,
        kv_positions=positions,
        shard_lengths=None if shard_lengths is None else shard_lengths[None],
        local_window_size=local_window_size,
        mask=mask,
    )
    return out[0]


def is_default_energy(e: Energy | None) -> bool:
    """None or `Softmax()` with every default: the fused paths."""
    return e is None or energy.is_plain_softmax(e)


IN_PLACE_LOGITS = 1 << 24
"""Logits (heads x queries x cache slots) up to which a call with a cache reads it in place
(every decode step); a longer prefill chunk goes through `energy_attention`, blockwise."""


def position_free(e: Energy) -> bool:
    """The energy's logits do not depend on the absolute positions of the keys (no ALiBi, no
    logits of a user's energy, which may read them)."""
    logits = type(e).logits
    if logits is Energy.logits or logits is LinearKernel.logits:
        return True
    return logits is Softmax.logits and getattr(e, "alibi_slopes", None) is None


def _attend_energy(
    q,
    k,
    v,
    *,
    kv_layout,
    kv_length,
    q_offset,
    causal,
    mask,
    kv_positions,
    backend,
    attention_energy,
    local_window_size=None,
):
    """Attention of any energy over a KV cache or a sequence of keys.

    - A cache on `"energy"`, `"reference"` or `"flash"` (there is no fused kernel of a
      general energy) is read where it lies (`_energy_in_place`): its unfilled slots, the keys
      after a query and outside its window are masked, a cache sharded round-robin gives each
      slot's position to the energy's context (its logits see true positions) — no copy and no
      gather. Only an ordered monoid (stick-breaking) over a round-robin cache, whose keys are
      not in position order, gathers them into order first.
    - On `"tree"` and `"ring"`, `tree_energy_attention(energy=...)` over `backend.mesh`; a
      round-robin cache is passed as it lies with a mask from its positions, when the energy's
      monoid is commutative and its logits do not depend on positions; otherwise gathered into
      order.
    - Otherwise (no cache, or a long prefill chunk) `energy_attention(energy=...)`.
    """
    kv_seq = k.shape[0] if kv_layout == "bshd" else k.shape[1]
    heads, q_seq = q.shape[1], q.shape[0]
    commutative = attention_energy.monoid.commutative
    if (
        kv_length is not None
        and not backend.sharded
        and heads * q_seq * kv_seq <= IN_PLACE_LOGITS
        and (kv_positions is None or commutative)
    ):
        return _energy_in_place(
            q,
            k,
            v,
            kv_layout=kv_layout,
            kv_length=kv_length,
            q_offset=q_offset,
            causal=causal,
            mask=mask,
            kv_positions=kv_positions,
            attention_energy=attention_energy,
            local_window_size=local_window_size,
        )
    if kv_layout == "bhsd":
        k, v = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)
    kw = {"energy": attention_energy}
    if kv_positions is not None and commutative and position_free(attention_energy):
        # Order does not matter: the slots are read as they lie, a mask says which are seen.
        dims = Dims(q_seq, kv_seq, heads, k.shape[1], q.shape[-1], v.shape[-1])
        vis = visibility(
            dims,
            causal=causal,
            q_offset=q_offset,
            kv_positions=kv_positions,
            kv_length=kv_length,
            mask=mask,
            window=local_window_size,
        )
        assert vis is not None  # kv_length or positions are always given here
        kw.update(mask=_energy_mask(vis, dims), causal=False, q_offset=q_offset)
    else:
        if kv_positions is not None:  # a permutation of the slots: put slot a at position a
            order = jnp.argsort(kv_positions)
            k, v = k[order], v[order]
        if kv_length is not None:
            filled = jnp.broadcast_to(jnp.arange(kv_seq) < kv_length, (q_seq, kv_seq))
            mask = filled if mask is None else jnp.logical_and(mask, filled)
        kw.update(causal=causal, mask=mask, q_offset=q_offset, local_window_size=local_window_size)
    if backend.sharded:
        assert backend.mesh is not None and backend.kv_axis is not None
        return energy.tree_energy_attention(
            q, k, v, mesh=backend.mesh, kv_axis=backend.kv_axis, reduction=backend.reduction, **kw
        )
    return energy.energy_attention(q, k, v, **kw)


def _energy_mask(vis, dims: Dims):
    """`visibility`'s `[#kv_heads, #group, #q_seq, kv]` as the energy functions' mask,
    `[q_seq, kv]` or `[heads, q_seq, kv]`."""
    if vis.shape[0] > 1 or vis.shape[1] > 1:
        full = jnp.broadcast_to(vis, (dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq))
        return full.reshape(dims.heads, dims.q_seq, dims.kv_seq)
    return jnp.broadcast_to(vis[0, 0], (dims.q_seq, dims.kv_seq))


def _energy_in_place(
    q,
    k,
    v,
    *,
    kv_layout,
    kv_length,
    q_offset,
    causal,
    mask,
    kv_positions,
    attention_energy,
    local_window_size,
):
    r"""Attention of any energy over a KV cache where it lies: $\partial F/\partial\zeta$ at 0
    of the energy's free energy over the visible slots, per kv head one batched product for
    the logits and one for the values, read from the head-major cache without a copy (a
    `"bshd"` cache is transposed by the products). The energy's context gives each slot its
    position (`kv_positions`, or the slot), so position-dependent logits (ALiBi) are right in
    a round-robin cache; its keys are reduced in slot order, which is position order unless the
    cache is round-robin (then only commutative monoids come here). Values of slots no query
    sees are not zeroed: a cache's unfilled slots hold zeros, never NaN."""
    e = attention_energy
    if kv_layout == "bhsd":
        k_logits, v_heads = jnp.swapaxes(k, 0, 1), v  # a transpose folded into the product
    else:
        k_logits, v_heads = k, jnp.swapaxes(v, 0, 1)
    kv_seq, kv_heads = k_logits.shape[0], k_logits.shape[1]
    q_seq, heads = q.shape[0], q.shape[1]
    dims = Dims(q_seq, kv_seq, heads, kv_heads, q.shape[-1], v.shape[-1])
    vis = visibility(
        dims,
        causal=causal,
        q_offset=q_offset,
        kv_positions=kv_positions,
        kv_length=kv_length,
        mask=mask,
        window=local_window_size,
    )
    vis_rows = rows_visibility(vis, dims)
    ct = compute_dtype(q.dtype)
    q_pos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(q_seq, dtype=jnp.int32)
    k_pos = (
        jnp.arange(kv_seq, dtype=jnp.int32)
        if kv_positions is None
        else jnp.asarray(kv_positions, jnp.int32)
    )
    group_of_row = np.arange(dims.rows) // max(q_seq, 1)
    head = np.arange(kv_heads)[:, None] * dims.group + group_of_row[None, :]
    ctx = Context(
        dims, default_scale(dims.qk, None), jnp.tile(q_pos, dims.group), k_pos, head, kv_seq
    )
    qr = to_rows(q.astype(ct), dims)
    k_logits, v_heads = k_logits.astype(ct), v_heads.astype(ct)

    def total(zeta):
        x = e.logits(qr, k_logits, ctx)
        if vis_rows is not None:
            x = jnp.where(vis_rows, x, jnp.zeros((), x.dtype))
        tilt = tilt_at_zero(zeta, v_heads, True)  # 0, not a product; its gradient reads V once
        state = e.monoid.lift(e.elements(x, tilt, ctx), vis_rows)
        once = e.once(ctx)
        if once is not None:  # a sink: once per query row
            once = jax.tree.map(
                lambda o, s: jnp.broadcast_to(o, s.shape).astype(s.dtype), once, state
            )
            state = e.monoid.combine(once, state)
        return jnp.sum(e.readout(state, ctx))

    zeta = jnp.zeros((kv_heads, dims.rows, dims.dv), ct)
    with jax.named_scope("energy_over_cache"):
        out = jax.grad(total)(zeta)
    return from_rows(out, dims).astype(q.dtype)


def _tree_devices(backend: AttentionBackend) -> int:
    """The devices the `"tree"` backend splits a cache over (its shards)."""
    assert backend.mesh is not None and backend.kv_axis is not None
    axes = (backend.kv_axis,) if isinstance(backend.kv_axis, str) else backend.kv_axis
    return math.prod(backend.mesh.shape.get(a, 0) for a in axes)


class MultiheadAttention(eqx.Module):
    r"""Multi-head attention, a drop-in replacement for `equinox.nn.MultiheadAttention`.

    Same constructor arguments, field names and shapes (so weights move over with
    `eqx.tree_at`), same call signature and results, plus:

    - `num_kv_heads`: grouped-query attention (GQA; `1` is MQA). `key_proj` and `value_proj` then
      have `num_kv_heads * qk_size` and `num_kv_heads * vo_size` outputs.
    - `causal`: a causal mask aligned bottom-right by absolute position.
    - `local_window_size`: a sliding window by absolute position, jax's meaning: `(left, right)`
      lets the query at position $i$ see keys at $i - \mathrm{left} \le j \le i +
      \mathrm{right}$ (an int `w` is `(w, w)`); Mistral's `sliding_window=W` is `(W - 1, 0)`
      with `causal=True`.
    - `rotary`: a [`RotaryEmbedding`][treeattn.models.RotaryEmbedding] applied to queries and keys
      at their absolute positions.
    - `qk_norm_eps`: an [`RMSNorm`][treeattn.models.RMSNorm] with this epsilon over each head of
      the queries (`query_norm`) and keys (`key_norm`) after the projections, before the
      rotary embedding (Qwen3).
    - `cache`: a [`KVCache`][treeattn.models.KVCache]; the call then appends the new keys and
      values, attends over everything cached, and returns `(output, new_cache)`.
    - `backend`: `"energy"` (default; attention as `jax.grad` of the free energy),
      `"reference"`, `"flash"`, `"tree"`, or an
      [`AttentionBackend`][treeattn.models.AttentionBackend]; overridable per call.
    - `energy`: the [`Energy`][treeattn.energy.Energy] whose gradient is the attention; None
      (default) is `Softmax()`, on every backend's own path. Any other energy is a field of the
      layer (its array parameters — β, a sink logit, a bias — train with the weights) and runs
      through `treeattn.energy`: `energy_attention(energy=...)` on `"energy"`, `"reference"` and
      `"flash"`, `tree_energy_attention(energy=...)` on `"tree"`.

    Dtypes follow Equinox: each projection runs in the promotion of its weights' and its
    input's dtypes (float32 weights and bfloat16 inputs: heads, attention and the output
    projection in float32, and a float32 result), and query and key/value heads of different
    dtypes are promoted to one, as `jnp.result_type` would under standard promotion (also when
    `jax_numpy_dtype_promotion="strict"`).

    Dropout on the attention weights (`dropout_p`, or `dropout.p` set to an array, traced or
    not, e.g. with `eqx.tree_at`) runs on every backend: in training the weights
    $\mathrm{softmax}(q k^\top / \sqrt{d})$ are then formed explicitly, one dropout key per
    head as in Equinox; in inference (or with a Python `p == 0`) the backend's fused path runs.

    Differences from Equinox: a query that may attend to nothing gets output 0 (Equinox averages
    every value).
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    rotary: RotaryEmbedding | None
    query_norm: RMSNorm | None
    key_norm: RMSNorm | None
    energy: Energy | None

    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    local_window_size: Window | None = eqx.field(static=True)
    backend: AttentionBackend = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: float = 0.0,
        inference: bool = False,
        dtype=None,
        *,
        num_kv_heads: int | None = None,
        causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        rotary: RotaryEmbedding | None = None,
        qk_norm_eps: float | None = None,
        backend: str | AttentionBackend = "energy",
        mesh: Mesh | None = None,
        kv_axis: str | tuple[str, ...] | None = None,
        energy: Energy | None = None,
        key: PRNGKeyArray,
    ):
        if energy is not None and not isinstance(energy, Energy):
            raise ValueError(
                "MultiheadAttention: energy must be a treeattn.energy.Energy (e.g. Sigmoid()) "
                f"or None, got {type(energy).__name__}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"MultiheadAttention: num_heads={num_heads} must be a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        qkey, kkey, vkey, okey = jax.random.split(key, 4)
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        output_size = query_size if output_size is None else output_size
        if rotary is not None and rotary.dim != qk_size:
            raise ValueError(f"MultiheadAttention: rotary dim {rotary.dim} != qk_size {qk_size}")
        lin = eqx.nn.Linear
        self.query_proj = lin(
            query_size, num_heads * qk_size, use_bias=use_query_bias, dtype=dtype, key=qkey
        )
        self.key_proj = lin(
            key_size, num_kv_heads * qk_size, use_bias=use_key_bias, dtype=dtype, key=kkey
        )
        self.value_proj = lin(
            value_size, num_kv_heads * vo_size, use_bias=use_value_bias, dtype=dtype, key=vkey
        )
        self.output_proj = lin(
            num_heads * vo_size, output_size, use_bias=use_output_bias, dtype=dtype, key=okey
        )
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)
        self.rotary = rotary
        self.query_norm, self.key_norm = (
            (None, None)
            if qk_norm_eps is None
            else (
                RMSNorm(qk_size, qk_norm_eps, dtype=dtype),
                RMSNorm(qk_size, qk_norm_eps, dtype=dtype),
            )
        )
        self.energy = energy
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.query_size, self.key_size, self.value_size = query_size, key_size, value_size
        self.output_size, self.qk_size, self.vo_size = output_size, qk_size, vo_size
        self.use_query_bias, self.use_key_bias = use_query_bias, use_key_bias
        self.use_value_bias, self.use_output_bias = use_value_bias, use_output_bias
        self.causal = causal
        self.local_window_size = check_window("MultiheadAttention", local_window_size)
        self.backend = as_backend(backend, mesh, kv_axis)

    def _project(self, proj, x, heads):
        return apply_linear(proj, x).reshape(x.shape[0], heads, -1)

    @jax.named_scope("treeattn.models.MultiheadAttention")
    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "num_heads q_seq kv_seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: Callable | None = None,
        cache: Cache | None = None,
        backend: str | AttentionBackend | None = None,
    ) -> Float[Array, "q_seq o_size"] | tuple[Float[Array, "q_seq o_size"], Cache]:
        """**Arguments:** as `equinox.nn.MultiheadAttention.__call__` (`query`, `key_`, `value`,
        `mask`, `key`, `inference`, `deterministic`, `process_heads`), plus `cache` (the KV cache
        of this layer: the new keys and values are appended, and attention runs over all cached
        tokens, the queries at the positions after them; or, with a `LinearKernel` energy, a
        `LinearCache`: the new keys are added to its linear state, which the queries attend
        to in constant time) and `backend` (overrides the layer's; a linear state runs the same
        on every backend).

        **Returns:** `[q_seq, output_size]`, or `(output, new_cache)` when `cache` is given.
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "MultiheadAttention()(deterministic=...) is deprecated in favour of "
                "MultiheadAttention()(inference=...)",
                stacklevel=2,
            )
        q_seq, kv_seq = query.shape[0], key_.shape[0]
        if value.shape[0] != kv_seq:
            raise ValueError("key and value must both be sequences of equal length.")
        check_layer_mask(mask, q_seq, kv_seq, self.num_heads)
        be = self.backend if backend is None else as_backend(backend)
        q = self._project(self.query_proj, query, self.num_heads)
        k = self._project(self.key_proj, key_, self.num_kv_heads)
        v = self._project(self.value_proj, value, self.num_kv_heads)
        # Query and key/value heads of different dtypes: one dtype, as Equinox's einsums promote.
        with jax.numpy_dtype_promotion("standard"):
            heads_dtype = jnp.result_type(q, k, v)
        q, k, v = q.astype(heads_dtype), k.astype(heads_dtype), v.astype(heads_dtype)
        if self.query_norm is not None and self.key_norm is not None:
            with jax.numpy_dtype_promotion("standard"):
                q, k = self.query_norm(q).astype(heads_dtype), self.key_norm(k).astype(heads_dtype)
        if process_heads is not None:
            shapes = (q.shape, k.shape, v.shape)
            q, k, v = process_heads(q, k, v)
            if (q.shape, k.shape, v.shape) != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")
        # Absolute positions: after a cache of n tokens the new ones are n, n+1, ...; without a
        # cache the queries are the last q_seq positions of the key sequence (bottom-right).
        if cache is None:
            k_pos = jnp.arange(kv_seq, dtype=jnp.int32)
            q_offset = kv_seq - q_seq
        else:
            k_pos = cache.length + jnp.arange(kv_seq, dtype=jnp.int32)
            q_offset = cache.length
        q_pos = q_offset + jnp.arange(q_seq, dtype=jnp.int32)
        if self.rotary is not None:
            q, k = self.rotary(q, q_pos), self.rotary(k, k_pos)
        # Equinox's rule: dropout is off in inference and for a Python rate of 0; a rate held
        # as an array (possibly traced) is applied as it is.
        p = self.dropout.p
        dropout_on = not (self.dropout.inference if inference is None else inference) and not (
            isinstance(p, int | float) and p == 0
        )
        default = is_default_energy(self.energy)
        if dropout_on and not default:
            raise ValueError(
                f"MultiheadAttention: attention dropout forms softmax weights; it cannot be "
                f"combined with energy={type(self.energy).__name__}(...) (set dropout_p=0)"
            )
        if cache is not None:
            if dropout_on:
                raise ValueError("attention dropout is for training, not for a KV cache")
            if mask is not None:
                raise ValueError(
                    "MultiheadAttention: mask= cannot be combined with cache= (with a cache, "
                    "keys are masked by the filled length and, if causal, by position)"
                )
        if cache is None:
            if dropout_on:
                attn = self._attend_with_dropout(q, k, v, mask, q_offset, key, inference)
            else:
                attn = attend(
                    q,
                    k,
                    v,
                    kv_layout="bshd",
                    kv_length=None,
                    # Without causality the alignment of queries to keys is moot; more
                    # queries than keys would give the kernels a negative offset.
                    q_offset=q_offset if self.causal or self.local_window_size else 0,
                    causal=self.causal,
                    mask=mask,
                    kv_positions=None,
                    backend=be,
                    local_window_size=self.local_window_size,
                    attention_energy=self.energy,
                )
            new_cache = None
        elif isinstance(cache, LinearCache):
            attn, new_cache = self._attend_linear_state(q, k, v, cache)
        else:
            new_cache = cache.append(k, v)
            assert not isinstance(new_cache.k, tuple) and not isinstance(new_cache.v, tuple)
            q = q.astype(new_cache.k.dtype)  # a cache may be kept in another dtype
            positions = fills = None
            if (
                cache.devices > 1
                and be.sharded
                and _tree_devices(be) == cache.devices
                and (q_seq == 1 or not self.causal)
                and self.local_window_size is None
                and default
            ):
                # Every query sees every filled key (a decode step): each shard needs only its
                # fill count, which the fused GPU kernels take (they refuse key positions).
                fills = new_cache.shard_lengths()
            elif cache.devices > 1:
                positions = jnp.asarray(cache.positions(), jnp.int32)
            attn = attend(
                q,
                new_cache.k,
                new_cache.v,
                kv_layout=new_cache.layout,
                kv_length=new_cache.length,
                q_offset=q_offset,
                causal=self.causal,
                mask=mask,
                kv_positions=positions,
                backend=be,
                shard_lengths=fills,
                local_window_size=self.local_window_size,
                attention_energy=self.energy,
            )
        # In the heads' dtype (a cache may hold another), then projected as Equinox does.
        out = apply_linear(self.output_proj, attn.reshape(q_seq, -1).astype(heads_dtype))
        return out if new_cache is None else (out, new_cache)

    @property
    def uses_linear_state(self) -> bool:
        """Whether a [`LinearCache`][treeattn.models.LinearCache] can serve this layer: its
        energy is a `LinearKernel` and it has no sliding window (a sum over every past key
        cannot forget the keys that leave a window)."""
        return isinstance(self.energy, LinearKernel) and self.local_window_size is None

    def init_cache(
        self, max_len: int, *, dtype=None, linear_state: bool | None = None, **kwargs
    ) -> Cache:
        """An empty cache for this layer: a `LinearCache` when `uses_linear_state` (unless
        `linear_state=False`), else a `KVCache` (`kwargs` go to `KVCache.create`: `mesh`,
        `kv_axis`, `block`, `layout`, `batch`). `dtype` defaults to the query projection's."""
        dtype = dtype or self.query_proj.weight.dtype
        if linear_state is None:
            linear_state = self.uses_linear_state
        if linear_state:
            if not self.uses_linear_state:
                raise ValueError(
                    "MultiheadAttention.init_cache: linear_state=True needs energy=LinearKernel"
                    f"(...) without a sliding window, got energy={type(self.energy).__name__} "
                    f"and local_window_size={self.local_window_size}"
                )
            assert isinstance(self.energy, LinearKernel)
            return LinearCache.create(
                self.num_kv_heads,
                max_len,
                self.qk_size,
                self.vo_size,
                energy=self.energy,
                dtype=dtype,
                batch=kwargs.get("batch"),
            )
        kwargs.setdefault("layout", cache_layout(self.backend, self.energy))
        return KVCache.create(
            self.num_kv_heads, max_len, self.qk_size, self.vo_size, dtype=dtype, **kwargs
        )

    def _attend_linear_state(self, q, k, v, cache: LinearCache):
        """Attention against the layer's linear state, which absorbs the new keys first (not
        causal) or along the chunk (causal: query i sees the state and the chunk's keys up to
        i). Tokens at positions `>= cache.stop` (padding) are not absorbed."""
        state = cache.state
        if isinstance(state, tuple):
            raise ValueError(
                "MultiheadAttention: this LinearCache holds a model's layers; pass cache.layer(i)"
            )
        if not self.uses_linear_state:
            raise ValueError(
                "MultiheadAttention: a LinearCache serves energy=LinearKernel(...) without a "
                f"sliding window; this layer has energy={type(self.energy).__name__} and "
                f"local_window_size={self.local_window_size} (use a KVCache)"
            )
        assert isinstance(self.energy, LinearKernel)
        if state.feature_map is not self.energy.feature_map:
            raise ValueError(
                "MultiheadAttention: the LinearCache was made for another feature map than the "
                "layer's energy (create it with energy=layer.energy)"
            )
        n = k.shape[0]
        absorbed = cache.length + jnp.arange(n, dtype=jnp.int32) < cache.stop
        if self.causal:
            if q.shape[0] != n:
                raise ValueError(
                    f"MultiheadAttention: a causal call with a LinearCache takes as many queries "
                    f"as keys, got {q.shape[0]} and {n}"
                )
            out, state = state.attend_causal(q, k, v, mask=absorbed)
        else:
            state = state.update(k, v, mask=absorbed)
            out = state.attend(q)
        length = cache.length + n
        return out, dataclasses.replace(cache, state=state, length=length)

    def _attend_with_dropout(self, q, k, v, mask, q_offset, key, inference):
        """Softmax attention with dropout on the weights (Equinox's semantics)."""
        group = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        logits = jnp.einsum("shd,Shd->hsS", q, k).astype(jnp.float32) / jnp.sqrt(self.qk_size)
        dims = Dims(q.shape[0], k.shape[0], self.num_heads, self.num_heads, q.shape[-1], 1)
        vis = visibility(
            dims, causal=self.causal, q_offset=q_offset, mask=mask, window=self.local_window_size
        )
        visible = jnp.ones(logits.shape, bool) if vis is None else vis.reshape(-1, *vis.shape[2:])
        visible = jnp.broadcast_to(visible, logits.shape)
        logits = jnp.where(visible, logits, -jnp.inf)
        weights = jax.nn.softmax(logits, axis=-1, where=visible)
        weights = jnp.where(jnp.isfinite(weights), weights, 0.0).astype(q.dtype)
        # One dropout key per head, as Equinox splits them.
        keys = None if key is None else jax.random.split(key, self.num_heads)
        with jax.numpy_dtype_promotion("standard"):  # a rate held as a float32 array
            weights = jax.vmap(lambda w, k: self.dropout(w, key=k, inference=inference))(
                weights, keys
            )
        weights = weights.astype(q.dtype)
        return jnp.einsum("hsS,Shd->shd", weights, v)
