"""The one registry of attention kernels: a small record per kernel (name, eligibility with a
reason, forward), and the one place where a backend choice is resolved for a call."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from .._numerics import Dims
from ._gpu import cudnn_forward, flash_attn_jax_forward, pallas_forward
from ._native import cpu_forward, load_kernel
from ._xla import xla_forward


Backend = Literal["auto", "flash_attn_jax", "cudnn", "pallas", "cpu", "xla", "reference"]
"""A kernel of `flash_attention`, or `"auto"`: the first eligible one for the platform."""
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# "auto" on CPU takes the C++ kernel up to this many query rows per kv head (group * q_seq):
# decoding and speculative steps, where the kernel streams K/V at memory speed. Longer rows
# (prefill) are matrix products, which XLA's blocked kernel does better.
CPU_MAX_ROWS = 16


class BackendUnavailable(ValueError):
    """The requested backend cannot run this call here (no GPU, missing package, shape...)."""


@dataclasses.dataclass(frozen=True)
class Call:
    """What a kernel must support for one call: sizes and layout, dtype, the features used,
    and the platform it runs on."""

    dims: Dims
    dtype: jnp.dtype
    causal: bool
    has_length: bool  # a partly filled cache (kv_length given)
    q_offset: int | None  # the position of query 0 when static, else None
    has_positions: bool  # keys carry explicit positions (kv_positions)
    platform: str  # "cpu", "gpu" (CUDA), "rocm", "tpu"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel: `why_not(call)` is None when it can serve the call, else the reason;
    `forward` maps the common call to `(out, lse)` (see `_xla.py`)."""

    name: Backend
    why_not: Callable[[Call], str | None]
    forward: Callable | None  # None: differentiated by JAX itself (the reference)


def platform() -> str:
    """The platform the default backend runs on ("cpu", "gpu", "rocm", "tpu")."""
    name = jax.default_backend()
    return "gpu" if name == "cuda" else name


def _cpu_why_not(call: Call) -> str | None:
    if call.platform != "cpu":
        return f"it runs on XLA:CPU (the platform is {call.platform!r})"
    if call.dtype not in (jnp.float32, jnp.bfloat16):
        return f"it takes float32/bfloat16 only, got {call.dtype}"
    return load_kernel()


def _pallas_why_not(call: Call) -> str | None:
    if call.has_positions:
        return "it needs the keys in position order (kv_positions was given)"
    if call.dims.q_seq != 1:
        return f"it decodes one query per row (q_seq={call.dims.q_seq})"
    if call.dims.dv != call.dims.qk:
        return f"its value dim must equal the head dim (qk={call.dims.qk}, dv={call.dims.dv})"
    return None


def _cudnn_why_not(call: Call) -> str | None:
    if call.has_positions:
        return "it needs the keys in position order (kv_positions was given)"
    if call.platform != "gpu":
        return f"it needs a GPU with CUDA (the platform is {call.platform!r})"
    if call.causal and call.dims.q_seq > 1:
        return "its causal mask aligns top-left; only q_seq=1 is supported with causal=True"
    return None


def _flash_attn_jax_why_not(call: Call) -> str | None:
    dims = call.dims
    if call.has_positions:
        return "it needs the keys in position order (kv_positions was given)"
    if call.platform != "gpu":
        return f"it needs a GPU with CUDA (the platform is {call.platform!r})"
    try:
        importlib.import_module("flash_attn_jax.flash_fwd")
    except Exception as e:  # ImportError, or a missing libcudart
        return f"flash-attn-jax is not importable ({e}); install 'treeattn[cuda]'"
    if call.dtype not in (jnp.float16, jnp.bfloat16):
        return f"it takes float16/bfloat16 only, got {call.dtype}"
    if max(dims.qk, dims.dv) > 256:
        return f"head dims must be <= 256, got qk={dims.qk}, dv={dims.dv}"
    if call.has_length:
        return "it cannot mask a partly filled cache (kv_length)"
    if call.causal and call.q_offset != dims.kv_seq - dims.q_seq:
        return "its causal mask needs the queries at the end of K (static q_offset = kv - q)"
    return None


def _pallas(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    interpret = platform() != "gpu"  # Triton on GPUs; interpreted elsewhere (for testing)
    return pallas_forward(
        q,
        k,
        v,
        q_offset,
        kv_length,
        kv_pos,
        dims=dims,
        causal=causal,
        scale=scale,
        block=block,
        interpret=interpret,
    )


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("flash_attn_jax", _flash_attn_jax_why_not, flash_attn_jax_forward),
        Kernel("cudnn", _cudnn_why_not, cudnn_forward),
        Kernel("pallas", _pallas_why_not, _pallas),
        Kernel("cpu", _cpu_why_not, cpu_forward),
        Kernel("xla", lambda call: None, xla_forward),
        Kernel("reference", lambda call: None, None),
    )
}


def auto_order(call: Call) -> tuple[str, ...]:
    """The kernels `"auto"` tries, in order, for this call's platform. On GPUs: FlashAttention,
    cuDNN, the Pallas decode kernel, then the portable kernel. On CPU the C++ kernel decodes
    (few query rows per kv head) and the blockwise XLA kernel does the rest, and everything
    when no C++ compiler is found; interpreted Pallas is for testing only."""
    if call.platform == "gpu":
        return ("flash_attn_jax", "cudnn", "pallas", "xla")
    if call.platform == "cpu" and call.dims.rows <= CPU_MAX_ROWS:
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


def resolve(fn: str, backend: str | Sequence[str], call: Call) -> str:
    """The kernel that runs `call`: the first eligible of `backend` (`"auto"` expands to
    `auto_order`). When none is, raises `BackendUnavailable` with every reason."""
    reasons = []
    for name in check_backend(fn, backend):
        if name == "auto":
            return next(b for b in auto_order(call) if KERNELS[b].why_not(call) is None)
        reason = KERNELS[name].why_not(call)
        if reason is None:
            return name
        reasons.append(f"backend={name!r} unavailable: {reason}")
    raise BackendUnavailable(f"{fn}: " + "; ".join(reasons))


@functools.cache
def forward_of(name: str) -> Callable | None:
    return KERNELS[name].forward


def kernel_call(
    dims: Dims, dtype, *, causal: bool, has_length: bool, q_offset, has_positions: bool
) -> Call:
    """The `Call` record of a kernel call on this process's platform."""
    return Call(
        dims=dims,
        dtype=jnp.dtype(dtype),
        causal=causal,
        has_length=has_length,
        q_offset=q_offset if isinstance(q_offset, int) else None,
        has_positions=has_positions,
        platform=platform(),
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
) -> str:
    """The kernel `flash_attention` would run for a call of these sizes (`dims` of one call:
    batch and layout included) on this process's platform; raises `BackendUnavailable`."""
    call = kernel_call(
        dims,
        dtype,
        causal=causal,
        has_length=has_length,
        q_offset=q_offset,
        has_positions=has_positions,
    )
    return resolve("flash_attention", backend, call)
