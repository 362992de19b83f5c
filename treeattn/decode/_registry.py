"""The one registry of attention kernels: a small record per kernel (name, eligibility with a
reason, forward), and the one place where a backend choice is resolved — once for every
platform a call may be lowered for, so that one jitted function lowers correctly for CPU and
CUDA, and a program for a GPU can be lowered or exported from a CPU-only machine.

How a choice reaches the compiled program: `resolve` gives a `Choice` (the kernel per lowering
platform, or why none can serve there); `dispatch(choice)` is a forward that stages every
choice with `jax.lax.platform_dependent`, so the platform a program is lowered for picks its
kernel and the other branches are dropped from the module. A platform where the requested
backend cannot run gets a branch that raises `BackendUnavailable` when it is lowered.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import jax
import jax.extend.backend
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from .._numerics import Dims, Layout, Window, compute_dtype
from ..energy import Energy, is_plain_softmax
from ._energies import SOFTMAX, energy_forward, energy_reference_forward, name_of
from ._gpu import cudnn_forward, flash_attn_jax_forward, pallas_forward
from ._native import cpu_forward, load_kernel
from ._reference import reference_forward
from ._xla import xla_forward


Backend = Literal["auto", "flash_attn_jax", "cudnn", "pallas", "cpu", "xla", "energy", "reference"]
"""A kernel of `flash_attention`, or `"auto"`: the first eligible one for the platform."""
BACKENDS: tuple[Backend, ...] = get_args(Backend)

Platform = Literal["cpu", "cuda", "rocm", "tpu"]
"""A lowering platform (JAX's names). "tpu" stands for every platform not named here."""
PLATFORMS: tuple[Platform, ...] = get_args(Platform)

# "auto" on CPU takes the C++ kernel up to this many query rows per kv head (group * q_seq):
# decoding and speculative steps, where the kernel streams K/V at memory speed. Longer rows
# (prefill) are matrix products, which XLA's blocked kernel does better.
CPU_MAX_ROWS = 16

# The Pallas decode kernel's tiles are [block, head dim]; Triton needs power-of-two block
# shapes, so head dims are padded to the next power of two, up to this one.
PALLAS_MAX_HEAD_DIM = 256

_FLASH_ATTN_JAX = "flash_attn_jax 0.6.2"


class BackendUnavailable(ValueError):
    """The requested backend cannot run this call on the platform it is lowered for (no GPU,
    missing package, unsupported dtype or shape...); the message says why."""


# ---------------------------------------------------------------------------------------------
# What the local machine allows on CUDA (only knowable where a GPU and its libraries are)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CudaTarget:
    """The local CUDA stack, as far as this process can know it.

    cuDNN's availability, version and the compute capability are read through JAX's own checks
    (`jax._src.cudnn.fused_attention_stablehlo`), which JAX runs again while tracing a cuDNN
    call: what they refuse here, tracing would refuse too. On a machine without a GPU they say
    "no cuDNN", so lowering for CUDA from a CPU host never picks cuDNN or flash-attn-jax.
    """

    cudnn: int | None  # cuDNN version as JAX reports it (e.g. 91000); None: not available
    cudnn_missing: str  # why not, when `cudnn` is None
    hopper: bool  # compute capability >= 9.0 (JAX's check_compute_capability("9.0"))
    sm103: bool  # compute capability == 10.3 (JAX's is_cuda_compute_capability_equal)
    capability: tuple[int, int] | None  # of the first local CUDA device; None: none here
    flash_attn_jax: str | None  # None: usable; else why not


_CUDNN_MODULE = "jax._src.cudnn.fused_attention_stablehlo"


def cudnn_module():
    """JAX's cuDNN attention module, or a string saying why it cannot be used.

    treeattn calls its `dot_product_attention` directly: `jax.nn.dot_product_attention` casts
    cuDNN's float32 softmax statistics (the lse) to the input dtype, and a bfloat16 lse is not
    accurate enough to merge partials (tree, ring, blockwise) or to recompute the softmax in the
    backward. The function is private to JAX; its signature is checked here.
    """
    try:
        fas = importlib.import_module(_CUDNN_MODULE)
        params = inspect.signature(fas.dot_product_attention).parameters
    except Exception as e:
        return f"{_CUDNN_MODULE} cannot be imported ({e})"
    needed = {"q_seqlen", "kv_seqlen", "mask_type", "qkv_layout", "return_residual", "scale"}
    if not needed <= set(params) or not hasattr(fas, "MaskType"):
        return (
            f"{_CUDNN_MODULE}.dot_product_attention of jax {jax.__version__} lacks "
            f"{sorted(needed - set(params))}: treeattn reads cuDNN's float32 lse through it"
        )
    return fas


@functools.cache
def _flash_attn_jax_missing() -> str | None:
    """Why flash-attn-jax cannot run in this process, or None. Its limits, from its 0.6.2
    sources: it requires jax < 0.9; importing it needs CUDA's runtime; lowering its forward
    calls `ctypes.CDLL("libcudart.so")` (`flash_attn_jax/util.py`, `get_sm_count`), a name
    pip's CUDA runtime does not ship (it has `libcudart.so.12`)."""
    major_minor = tuple(int(x) for x in jax.__version__.split(".")[:2])
    if major_minor >= (0, 9):
        return f"{_FLASH_ATTN_JAX} requires jax<0.9 (this is jax {jax.__version__})"
    try:
        importlib.import_module("flash_attn_jax.flash_fwd")
    except Exception as e:  # ImportError, or a missing libcudart.so.12
        return f"flash-attn-jax is not importable ({e}); install 'treeattn[cuda]'"
    try:
        ctypes.CDLL("libcudart.so")
    except OSError as e:
        return (
            f"{_FLASH_ATTN_JAX} loads 'libcudart.so' by that name while lowering, which fails "
            f"here ({e}); pip's CUDA runtime ships 'libcudart.so.12': put a 'libcudart.so' "
            "link to it on LD_LIBRARY_PATH"
        )
    return None


def _cuda_capability() -> tuple[int, int] | None:
    try:
        devices = jax.local_devices(backend="cuda")
    except Exception:  # no CUDA backend in this process
        return None
    cap = getattr(devices[0], "compute_capability", None) if devices else None
    if not isinstance(cap, str):
        return None
    major, _, minor = cap.partition(".")
    return int(major), int(minor or 0)


def cuda_target() -> CudaTarget:
    """Probe the local CUDA stack (cheap; not cached, so that a test can stub JAX's checks)."""
    fas = cudnn_module()
    version, missing, hopper, sm103 = None, "", False, False
    if isinstance(fas, str):
        missing = fas
    else:
        try:
            version = int(fas.check_cudnn_version())
            hopper = bool(fas.check_compute_capability("9.0"))
            sm103 = bool(fas.is_cuda_compute_capability_equal("10.3"))
        except Exception as e:  # "cuDNN is not detected.", no GPU backend
            version, missing = None, f"{e}".rstrip(".")
    return CudaTarget(
        cudnn=version,
        cudnn_missing=missing,
        hopper=hopper,
        sm103=sm103,
        capability=_cuda_capability(),
        flash_attn_jax=_flash_attn_jax_missing(),
    )


def host_platform() -> Platform:
    """The lowering platform of this process's default backend ("cpu", "cuda", "rocm", "tpu").
    JAX calls both CUDA and ROCm devices "gpu"; the backend's platform version tells them
    apart."""
    backend = jax.extend.backend.get_backend()
    if backend.platform == "gpu":
        return "rocm" if "rocm" in backend.platform_version.lower() else "cuda"
    return "cpu" if backend.platform == "cpu" else "tpu"


# ---------------------------------------------------------------------------------------------
# The call, the kernels and their eligibility
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """What a kernel must support for one call: sizes and layout, dtype, the features used, the
    platform it is lowered for, the platform of the process, and the local CUDA stack."""

    dims: Dims
    dtype: jnp.dtype
    causal: bool
    has_length: bool  # a partly filled cache (kv_length given)
    q_offset: int | None  # the position of query 0 when static, else None
    has_positions: bool  # keys carry explicit positions (kv_positions)
    platform: Platform  # the lowering platform
    host: Platform = "cpu"  # the platform of this process's default backend
    cuda: CudaTarget | None = None  # the local CUDA stack (for platform "cuda")
    window: Window | None = None  # a sliding window (left, right) by absolute position
    has_mask: bool = False  # a boolean mask [batch, #heads, #q_seq, kv_seq]
    has_bias: bool = False  # an additive bias on the logits, same shape
    energy: str | None = None  # None: `Softmax()`; else the energy, named for messages
    has_masking: bool = False  # segment ids, a prefix, chunks or a mask function

    def extras(self) -> str | None:
        """What of a window, mask and bias this call uses (for the kernels that take none
        of them), or None."""
        used = [
            name
            for name, on in (
                (f"local_window_size={self.window}", self.window is not None),
                ("mask", self.has_mask),
                ("bias", self.has_bias),
                ("segment ids, prefix_length, chunk_size or mask_mod", self.has_masking),
            )
            if on
        ]
        return ", ".join(used) or None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel and every fact about it.

    - `why_not(call)`: None when it can serve the call, else the reason (citing the upstream
      limit); whether it computes the call's energy is checked from `energies`.
    - `forward(q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking, *, static,
      platform)`: the common call of `_xla.py` to `(out, lse)`, lse float32
      `[batch, q_seq, heads]` (for another energy than softmax, its free energy at 0).
    - `layout`: the layout of K and V it reads where they lie (a KV cache for it is allocated
      so); the other is transposed first.
    - `energies`: `"softmax"` (`Softmax()` only) or `"any"` (every `Energy`).
    - `masking`: whether it takes the rules of a `Masking` (segment ids, a prefix, chunks, a
      mask function); the others refuse a call that has them.
    - `differentiable`: JAX differentiates its forward (both modes); otherwise its gradient is
      the shared blockwise backward of softmax (`_xla.fused`), reverse mode only.
    """

    name: Backend
    why_not: Callable[[Call], str | None]
    forward: Callable
    layout: Layout
    energies: Literal["softmax", "any"] = "softmax"
    differentiable: bool = False
    masking: bool = False


def _cpu_why_not(call: Call) -> str | None:
    if call.platform != "cpu":
        return f"it is an XLA:CPU FFI kernel (lowering for {call.platform})"
    if call.dtype not in (jnp.float32, jnp.bfloat16):
        return f"it takes float32/bfloat16 only, got {call.dtype}"
    if call.has_mask or call.has_bias:
        what = " and ".join(n for n, on in (("mask", call.has_mask), ("bias", call.has_bias)) if on)
        return f"it masks by position and length only (a {what} was given)"
    return load_kernel()


def _pallas_why_not(call: Call) -> str | None:
    dims = call.dims
    if call.platform not in ("cuda", "cpu"):
        return (
            f"it lowers through Triton for CUDA (lowering for {call.platform}); on CPU it "
            "runs interpreted, for testing"
        )
    if call.has_positions:
        return "it needs the keys in position order (kv_positions was given)"
    if extras := call.extras():
        return f"it masks by key length only ({extras} was given)"
    if dims.q_seq != 1:
        return f"it decodes one query per row (q_seq={dims.q_seq})"
    if call.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
        return f"it takes float16/bfloat16/float32 (Triton dots), got {call.dtype}"
    if max(dims.qk, dims.dv) > PALLAS_MAX_HEAD_DIM:
        return (
            f"head dims must be <= {PALLAS_MAX_HEAD_DIM} (padded to a power of two for "
            f"Triton's block shapes), got qk={dims.qk}, dv={dims.dv}"
        )
    return None


def _cuda_fp16_call(call: Call, kind: str, takes: str) -> str | None:
    """What a CUDA kernel of float16/bfloat16 only, which takes keys in position order and
    `takes` besides, cannot serve of `call`."""
    if call.platform != "cuda":
        return f"it is {kind}, CUDA only (lowering for {call.platform})"
    if call.has_positions:
        return "it needs the keys in position order (kv_positions was given)"
    if extras := call.extras():
        return f"treeattn passes it {takes} only ({extras} was given)"
    if call.dtype not in (jnp.float16, jnp.bfloat16):
        return (
            f"it takes float16/bfloat16 only, got {call.dtype} (cast the inputs to bfloat16 to "
            "use it)"
        )
    return None


def _cudnn_why_not(call: Call) -> str | None:
    # The limits are those of jax's fused_attention_stablehlo (check_layout,
    # check_is_flash_attention), which raise NotImplementedError/ValueError while tracing.
    dims = call.dims
    if reason := _cuda_fp16_call(call, "a cuDNN custom call", "key lengths"):
        return reason
    if call.causal and dims.q_seq > 1:
        return "its causal mask aligns top-left; only q_seq=1 is supported with causal=True"
    target = call.cuda
    if target is None or target.cudnn is None:
        why = "no local CUDA stack was probed" if target is None else target.cudnn_missing
        return (
            f"cuDNN is not available here ({why}); JAX checks cuDNN's version and the GPU's "
            "compute capability while tracing, so lowering for CUDA uses it only on a machine "
            "with the GPU and jax[cuda12]"
        )
    if target.sm103 and target.cudnn < 91100:
        return f"compute capability 10.3 needs cuDNN >= 9.11 (found {target.cudnn})"
    h_max = 256 if target.hopper else 128
    for name, d in (("qk", dims.qk), ("dv", dims.dv)):
        if d % 8 or d > h_max:
            arch = "Hopper or later" if target.hopper else "before Hopper"
            return f"head dims must be multiples of 8 and <= {h_max} ({arch}), got {name}={d}"
    if dims.dv != dims.qk and not (target.hopper and target.cudnn >= 91000):
        return (
            f"a value dim different from the head dim (qk={dims.qk}, dv={dims.dv}) needs "
            "Hopper and cuDNN >= 9.10"
        )
    return None


def _flash_attn_jax_why_not(call: Call) -> str | None:
    # From flash_attn_jax 0.6.2's flash_fwd.flash_mha_fwd (asserts) and FlashAttention-2.
    dims = call.dims
    if reason := _cuda_fp16_call(call, "a CUDA kernel", "a causal flag"):
        return reason
    if dims.dv != dims.qk:
        return f"its value dim must equal the head dim (qk={dims.qk}, dv={dims.dv})"
    if dims.qk > 256:
        return f"head dims must be <= 256, got {dims.qk}"
    if call.has_length:
        return "it cannot mask a partly filled cache (kv_length)"
    if call.causal and call.q_offset != dims.kv_seq - dims.q_seq:
        return "its causal mask needs the queries at the end of K (static q_offset = kv - q)"
    missing = _flash_attn_jax_missing() if call.cuda is None else call.cuda.flash_attn_jax
    if missing is not None:
        return missing
    cap = None if call.cuda is None else call.cuda.capability
    if cap is None:
        return "the GPU's compute capability cannot be read here (no local CUDA device)"
    if not (cap[0] == 8 or cap == (9, 0)):
        return f"its kernels are built for sm80-sm89 and sm90, this GPU is sm{cap[0]}{cap[1]}"
    return None


def _energy_why_not(call: Call) -> str | None:
    if call.has_bias:
        return (
            "it takes no bias: an energy's logits are its own (energy.logits); write the bias "
            "into a subclass's logits, or pass a mask"
        )
    return None


def _reference_why_not(call: Call) -> str | None:
    if call.has_bias and call.energy is not None:
        return (
            f"it takes no bias with energy={call.energy}: an energy's logits are its own "
            "(energy.logits); write the bias into a subclass's logits, or pass a mask"
        )
    return None


def _softmax_kernel(forward: Callable) -> Callable:
    """A softmax kernel's forward in the common signature (it reads no energy, no platform)."""

    def run(
        q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking=None, *, static, platform
    ):
        del energy, platform, masking  # a kernel that takes no masking refuses it
        kw = dict(dims=static.dims, causal=static.causal, window=static.window)
        return forward(
            q,
            k,
            v,
            q_offset,
            kv_length,
            kv_pos,
            mask,
            bias,
            **kw,
            scale=static.scale,
            block=static.block,
        )

    return run


def _pallas(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking=None, *, static, platform
):
    # Triton on CUDA; interpreted elsewhere (the CPU tests run it so).
    run = functools.partial(pallas_forward, interpret=platform != "cuda")
    return _softmax_kernel(run)(
        q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, static=static, platform=platform
    )


def _reference(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking=None, *, static, platform
):
    """Softmax written out (`_reference.py`), or another energy's definition key by key (and
    so any call with masking rules: softmax is an energy too)."""
    del platform
    if masking is None and (energy is None or is_plain_softmax(energy)):
        kw = dict(dims=static.dims, causal=static.causal, window=static.window)
        return reference_forward(
            q, k, v, q_offset, kv_length, kv_pos, mask, bias, **kw, scale=static.scale
        )
    energy = SOFTMAX if energy is None else energy
    return energy_reference_forward(
        q, k, v, q_offset, kv_length, kv_pos, mask, energy, masking, static=static
    )


def _energy(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking=None, *, static, platform
):
    del platform, bias  # a bias is refused by eligibility
    energy = SOFTMAX if energy is None else energy
    args = (q, k, v, q_offset, kv_length, kv_pos, mask, energy, masking)
    return energy_forward(*args, static=static)


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel(
            "flash_attn_jax",
            _flash_attn_jax_why_not,
            _softmax_kernel(flash_attn_jax_forward),
            layout="bshd",
        ),
        Kernel("cudnn", _cudnn_why_not, _softmax_kernel(cudnn_forward), layout="bshd"),
        Kernel("pallas", _pallas_why_not, _pallas, layout="bshd"),
        Kernel("cpu", _cpu_why_not, _softmax_kernel(cpu_forward), layout="bhsd"),
        Kernel("xla", lambda call: None, _softmax_kernel(xla_forward), layout="bhsd"),
        Kernel(
            "energy",
            _energy_why_not,
            _energy,
            "bhsd",
            energies="any",
            differentiable=True,
            masking=True,
        ),
        Kernel(
            "reference",
            _reference_why_not,
            _reference,
            "bshd",
            energies="any",
            differentiable=True,
            masking=True,
        ),
    )
}


def auto_order(call: Call) -> tuple[str, ...]:
    """The kernels `"auto"` tries, in order, for this call's platform.

    - CUDA: the Pallas split-K decode kernel (one query per row: it splits the cache over the
      GPU, where a prefill kernel would leave most of it idle), FlashAttention-2 (prefill and
      training without a partly filled cache), cuDNN, then the portable kernel.
    - CPU: the C++ kernel decodes (few query rows per kv head) and the blockwise XLA kernel
      does the rest; the C++ kernel is built on first use, so only a CPU process takes it
      (a GPU process lowering for CPU takes xla).
    - ROCm, TPU and anything else: the portable kernel.
    - Another energy than `Softmax()`, or segment ids and the other rules of a `Masking`:
      `"energy"` (no kernel is fused for them).
    """
    if call.energy is not None or call.has_masking:
        return ("energy",)
    if call.platform == "cuda":
        return ("pallas", "flash_attn_jax", "cudnn", "xla")
    if call.platform == "cpu" and call.host == "cpu" and call.dims.rows <= CPU_MAX_ROWS:
        return ("cpu", "xla")
    return ("xla",)


def check_backend(fn: str, backend) -> tuple[str, ...]:
    """`backend` (a name, or an ordered sequence of names: the first eligible one runs) as a
    tuple of known names; raises `ValueError` naming the unknown one."""
    names = (backend,) if isinstance(backend, str) else tuple(backend)
    if not names:
        raise ValueError(f"{fn}: backend must name at least one of {BACKENDS}")
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {name!r}")
    return names


def why_not(name: str, call: Call) -> str | None:
    """Why kernel `name` cannot serve `call`, or None."""
    kernel = KERNELS[name]
    if call.energy is not None and kernel.energies == "softmax":
        return (
            f"it computes softmax only, not energy={call.energy} (the 'energy' kernel "
            "computes any energy)"
        )
    if call.has_masking and not kernel.masking:
        return (
            "it takes no segment ids, prefix_length, chunk_size or mask_mod (the 'energy' "
            "kernel takes them)"
        )
    return kernel.why_not(call)


def _resolve_one(names: tuple[str, ...], call: Call) -> tuple[str | None, str]:
    """(the kernel for `call`, "") or (None, every reason)."""
    reasons = []
    for name in names:
        candidates = auto_order(call) if name == "auto" else (name,)
        for candidate in candidates:
            reason = why_not(candidate, call)
            if reason is None:
                return candidate, ""
            reasons.append(f"backend={candidate!r} unavailable on {call.platform}: {reason}")
    return None, "; ".join(dict.fromkeys(reasons))


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel chosen for each lowering platform, or why none can serve there (hashable:
    a static argument of the jitted kernel call)."""

    fn: str
    kernels: tuple[tuple[str, str], ...]  # (platform, kernel)
    refusals: tuple[tuple[str, str], ...]  # (platform, message)

    def kernel(self, platform: str) -> str:
        """The kernel for `platform`; raises `BackendUnavailable` if there is none."""
        platform = platform if platform in PLATFORMS else "tpu"
        for p, name in self.kernels:
            if p == platform:
                return name
        raise BackendUnavailable(dict(self.refusals)[platform])


def resolve(fn: str, backend: str | Sequence[str], call: Call) -> Choice:
    """The kernel that runs `call` on each platform of `PLATFORMS`: the first eligible of
    `backend` (`"auto"` expands to `auto_order`). When no platform has one, raises
    `BackendUnavailable` with every reason; otherwise a platform without one raises it when a
    program is lowered for it."""
    names = check_backend(fn, backend)
    kernels, refusals = [], []
    for p in PLATFORMS:
        name, reason = _resolve_one(names, dataclasses.replace(call, platform=p))
        if name is None:
            refusals.append((p, f"{fn}: {reason}"))
        else:
            kernels.append((p, name))
    if not kernels:
        raise BackendUnavailable(
            f"{fn}: no platform can run it: "
            + " | ".join(r.removeprefix(f"{fn}: ") for _, r in refusals)
        )
    return Choice(fn, tuple(kernels), tuple(refusals))


def kernel_call(
    dims: Dims, dtype, *, q_offset=None, energy: Energy | None = None, **features
) -> Call:
    """The `Call` record of a kernel call (`features`: the other fields of `Call`), for this
    process's platform (`resolve` replaces the platform with each lowering platform in
    turn). `q_offset` is kept when static; `energy` by name, None for `Softmax()`."""
    host = host_platform()
    return Call(
        dims=dims,
        dtype=jnp.dtype(dtype),
        q_offset=q_offset if isinstance(q_offset, int) else None,
        platform=host,
        host=host,
        cuda=cuda_target(),
        energy=None if energy is None or is_plain_softmax(energy) else name_of(energy),
        **features,
    )


def select_backend(
    backend: Backend | Sequence[Backend],
    dims: Dims,
    dtype,
    *,
    causal: bool,
    has_length: bool,
    q_offset,
    has_positions: bool = False,
    platform: Platform | None = None,
    window: Window | None = None,
    has_mask: bool = False,
    has_bias: bool = False,
    energy: Energy | None = None,
    has_masking: bool = False,
) -> str:
    """The kernel `flash_attention` would run for a call of these sizes (`dims` of one call:
    batch and layout included) and this `energy` (None: `Softmax()`) when lowered for
    `platform` (default: this process's); raises `BackendUnavailable` saying why none can."""
    features = dict(locals())
    del features["backend"], features["platform"]
    call = kernel_call(**features)
    return resolve("flash_attention", backend, call).kernel(platform or call.host)


# ---------------------------------------------------------------------------------------------
# Dispatch: one branch per platform, chosen when the program is lowered
# ---------------------------------------------------------------------------------------------


def _raise_unavailable(*args, message: str):
    raise BackendUnavailable(message)


# A branch for a platform where the requested backend cannot run: it stands for the kernel's
# result while tracing (so tracing for every platform at once succeeds) and raises
# `BackendUnavailable` if a program is lowered (or run) for that platform. It holds the output
# and the lse together, so that neither can be dropped while the other is used.
unavailable_p = Primitive("treeattn_backend_unavailable")
unavailable_p.multiple_results = True
unavailable_p.def_impl(_raise_unavailable)
unavailable_p.def_abstract_eval(lambda *avals, message: list(avals))
mlir.register_lowering(
    unavailable_p,
    lambda ctx, *args, message: _raise_unavailable(message=message),
)
batching.primitive_batchers[unavailable_p] = lambda args, dims, *, message: (
    unavailable_p.bind(*args, message=message),
    dims,
)


def _branch(name: str, platform: str, message: str | None) -> Callable:
    """The forward of kernel `name` on `platform` (or the refusal `message`)."""
    gpu = platform in ("cuda", "rocm")

    def run(q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking, *, static):
        dims = static.dims
        out_dtype, lse_dtype = q.dtype, compute_dtype(q.dtype)
        if message is not None:
            out = jnp.zeros((dims.batch, dims.q_seq, dims.heads, dims.dv), out_dtype)
            lse = jnp.full((dims.batch, dims.q_seq, dims.heads), -jnp.inf, lse_dtype)
            out, lse = unavailable_p.bind(out, lse, message=message)
            return out, lse
        # GPU dots on float32 run in TF32 (~1e-3 relative) unless asked for full precision.
        precise = gpu and jnp.dtype(q.dtype).itemsize >= 4
        with jax.default_matmul_precision("highest") if precise else contextlib.nullcontext():
            args = (q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking)
            out, lse = KERNELS[name].forward(*args, static=static, platform=platform)
        return out.astype(out_dtype), lse.astype(lse_dtype)

    return run


@functools.cache
def dispatch(choice: Choice) -> Callable:
    """The forward of `choice`: `(q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy,
    masking, *, static) -> (out, lse)`, staging each platform's kernel with
    `jax.lax.platform_dependent`; platforms sharing a kernel share one branch."""
    per_platform: dict[str, tuple[str, str | None]] = {}
    for p, name in choice.kernels:
        per_platform[p] = (name, None)
    for p, message in choice.refusals:
        per_platform[p] = ("", message)
    # One branch per distinct (kernel, interpreted or not, full precision or not).
    keys = {
        p: (name, message, name == "pallas" and p != "cuda", p in ("cuda", "rocm"))
        for p, (name, message) in per_platform.items()
    }
    branches = {key: _branch(key[0], p, key[1]) for p, key in reversed(keys.items())}

    def forward(
        q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy=None, masking=None, *, static
    ):
        bound = {key: functools.partial(b, static=static) for key, b in branches.items()}
        by_platform = {p: bound[keys[p]] for p in PLATFORMS}
        default = by_platform.pop("tpu")
        args = (q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking)
        return jax.lax.platform_dependent(*args, default=default, **by_platform)

    return forward


def differentiable(choice: Choice) -> bool:
    """Whether JAX differentiates every kernel of `choice` (else the shared backward runs)."""
    return all(KERNELS[name].differentiable for _, name in choice.kernels)
