"""Backend adapters for `flash_attention`, and the switch that picks one.

Each adapter maps the common call — `q[batch, q_seq, heads, dim]`, K/V in `kv_layout`, absolute
query positions `q_offset[batch]`, filled lengths `kv_length[batch]` — onto one fused kernel and
returns `(out, lse)` with `lse` float32 `[batch, heads, q_seq]` in natural log.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..energy._checks import default_scale
from ._flash import (
    DecodeDims,
    check_decode,
    fused,
    per_row,
    reference_forward,
    xla_forward,
)
from ._native import cpu_forward, load_kernel


BACKENDS = ("auto", "flash_attn_jax", "cudnn", "pallas", "cpu", "xla", "reference")

# "auto" on CPU takes the C++ kernel up to this many query rows per kv head (group * q_seq):
# decoding and speculative steps, where the kernel streams K/V at memory speed. Longer rows
# (prefill) are matrix products, which XLA's blocked kernel does better.
CPU_MAX_ROWS = 16


class BackendUnavailable(ValueError):
    """The requested backend cannot run this call here (no GPU, missing package, shape...)."""


def _gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def _flash_attn_jax_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    """FlashAttention-2 via flash-attn-jax (CUDA; fp16/bf16; head dim <= 256).

    Its public `flash_mha` hides the log-sum-exp; `flash_fwd.flash_mha_fwd` returns it (float32,
    [batch, heads, q_seq]). Its causal mask is bottom-right aligned to the end of K, which is
    our convention only when the queries are the last positions (checked by the selector).
    """
    del q_offset, kv_length, kv_pos, block
    flash_fwd = importlib.import_module("flash_attn_jax.flash_fwd")
    if dims.layout == "bhsd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out, lse = flash_fwd.flash_mha_fwd(
        q, k, v, softmax_scale=scale, is_causal=causal, window_size_left=-1, window_size_right=-1
    )
    return out, lse.astype(jnp.float32)


def _cudnn_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    """cuDNN through `jax.nn.dot_product_attention(..., return_residual=True)`.

    Its lse comes back as [batch, q_seq, heads] in the input dtype (and under stop_gradient);
    its `is_causal` aligns top-left, so causality is folded into the key lengths, which is exact
    for one query per row (the selector allows nothing else).
    """
    del kv_pos, block
    if dims.layout == "bhsd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    lengths = jnp.minimum(kv_length, q_offset + 1) if causal else kv_length
    out, lse = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        key_value_seq_lengths=lengths,
        implementation="cudnn",
        return_residual=True,
    )
    return out, jnp.swapaxes(lse.astype(jnp.float32), 1, 2)


def _pallas_split(kv_seq: int) -> tuple[int, int, int]:
    """(k_splits, block_k, padded length) meeting the decode kernel's divisibility rules."""
    splits = max(1, min(16, kv_seq // 256))
    padded = -(-kv_seq // (16 * splits)) * 16 * splits
    per_split = padded // splits
    block_k = next(b for b in (128, 64, 32, 16) if per_split % b == 0)
    return splits, block_k, padded


def _pallas_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    """The Pallas split-K decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention`),
    one query per row; interpreted on CPU. `m + log(l)` of its residuals is the lse."""
    del kv_pos, block
    from jax.experimental.pallas.ops.gpu import decode_attention

    b, kh, g = dims.batch, dims.kv_heads, dims.group
    if dims.layout == "bshd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # the kernel reads head-major rows
    splits, block_k, padded = _pallas_split(dims.kv_seq)
    if padded != dims.kv_seq:
        pad = ((0, 0), (0, 0), (0, padded - dims.kv_seq), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)  # masked by the key lengths below
    lengths = jnp.minimum(kv_length, q_offset + 1) if causal else kv_length
    # The kernel multiplies a boolean mask into float logits, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        out, (denom, m) = decode_attention.mqa(
            q[:, 0].reshape(b * kh, g, dims.qk),
            k.reshape(b * kh, padded, dims.qk),
            v.reshape(b * kh, padded, dims.dv),
            kv_seq_len=jnp.repeat(lengths, kh),
            sm_scale=scale,
            k_splits=splits,
            block_k=block_k,
            interpret=not _gpu(),
            return_residuals=True,
        )
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    out = out.reshape(b, 1, dims.heads, dims.dv).astype(q.dtype)
    return out, lse.reshape(b, dims.heads, 1).astype(jnp.float32)


_FORWARD = {
    "flash_attn_jax": _flash_attn_jax_forward,
    "cudnn": _cudnn_forward,
    "pallas": _pallas_forward,
    "cpu": cpu_forward,
    "xla": xla_forward,
}


def why_not(
    backend: str,
    dims: DecodeDims,
    dtype,
    *,
    causal: bool,
    has_length: bool,
    q_offset,
    has_positions: bool = False,
) -> str | None:
    """Why `backend` cannot run this call here, or None if it can."""
    if backend in ("xla", "reference"):
        return None
    if backend == "cpu":
        if jax.default_backend() != "cpu":
            return f"it runs on XLA:CPU (jax.default_backend() is {jax.default_backend()!r})"
        if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
            return f"it takes float32/bfloat16 only, got {jnp.dtype(dtype)}"
        return load_kernel()
    if has_positions:
        return "it needs the keys in position order (kv_positions was given)"
    if backend == "pallas":
        return None if dims.q_seq == 1 else f"it decodes one query per row (q_seq={dims.q_seq})"
    if not _gpu():
        return f"it needs a GPU (jax.default_backend() is {jax.default_backend()!r})"
    if backend == "cudnn":
        if causal and dims.q_seq > 1:
            return "its causal mask aligns top-left; only q_seq=1 is supported with causal=True"
        return None
    # flash_attn_jax
    try:
        importlib.import_module("flash_attn_jax.flash_fwd")
    except Exception as e:  # ImportError, or a missing libcudart
        return f"flash-attn-jax is not importable ({e}); install 'treeattn[cuda]'"
    if jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
        return f"it takes float16/bfloat16 only, got {jnp.dtype(dtype)}"
    if max(dims.qk, dims.dv) > 256:
        return f"head dims must be <= 256, got qk={dims.qk}, dv={dims.dv}"
    if has_length:
        return "it cannot mask a partly filled cache (kv_length)"
    if causal and not (isinstance(q_offset, int) and q_offset == dims.kv_seq - dims.q_seq):
        return "its causal mask needs the queries at the end of K (static q_offset = kv - q)"
    return None


def select_backend(
    backend: str,
    dims: DecodeDims,
    dtype,
    *,
    causal: bool,
    has_length: bool,
    q_offset,
    has_positions: bool = False,
) -> str:
    """Resolve `backend` ("auto" -> the best that can run this call here)."""
    if backend not in BACKENDS:
        raise ValueError(f"flash_attention: backend must be one of {BACKENDS}, got {backend!r}")
    kw = dict(causal=causal, has_length=has_length, q_offset=q_offset, has_positions=has_positions)
    if backend != "auto":
        reason = why_not(backend, dims, dtype, **kw)
        if reason is not None:
            raise BackendUnavailable(f"flash_attention: backend={backend!r} unavailable: {reason}")
        return backend
    # On GPUs: FlashAttention, then cuDNN, then the Pallas decode kernel. On CPU the
    # interpreted Pallas kernel is for testing only: the C++ kernel decodes, the blockwise XLA
    # kernel does the rest (and everything where no C++ compiler is found).
    if _gpu():
        order = ("flash_attn_jax", "cudnn", "pallas", "xla")
    elif dims.group * dims.q_seq <= CPU_MAX_ROWS:
        order = ("cpu", "xla")
    else:
        order = ("xla",)
    return next(b for b in order if why_not(b, dims, dtype, **kw) is None)


def flash_attention(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    *,
    causal: bool = False,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] | Int[Array, " batch"] = 0,
    kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    backend: str = "auto",
    kv_layout: str = "bshd",
    block_size: int | None = None,
    kv_positions: Int[Array, " kv_seq"] | Int[Array, "batch kv_seq"] | None = None,
) -> tuple[Float[Array, "batch q_seq heads dv"], Float[Array, "batch heads q_seq"]]:
    r"""Fused attention of local keys, returning the output and its log-sum-exp.

    $$o_{b,i,h} = \sum_a p_a v_a, \qquad \mathrm{lse}_{b,h,i} = \log\sum_a e^{s\,q\cdot k_a}$$

    over the keys a row can see: `a < kv_length[b]` (the filled part of a cache) and, when
    `causal`, `a <= q_offset[b] + i` (bottom-right by absolute position). `lse` is the free
    energy at $\zeta = 0$ of these keys, so partial results over disjoint key sets merge exactly
    with [`merge_partials`][treeattn.energy.merge_partials]; a row with no visible key gets
    `out = 0`, `lse = -inf`.

    **Arguments:**

    - `q`: `[batch, q_seq, heads, dim]`; `k`, `v`: `[batch, kv_seq, kv_heads, dim]`
      (`kv_layout="bshd"`) or head-major `[batch, kv_heads, kv_seq, dim]` (`"bhsd"`, which
      streams at memory speed on CPU). `heads % kv_heads == 0` (GQA/MQA).
    - `causal`, `q_offset`: bottom-right causal mask; `q_offset` (int, scalar or `[batch]`) is
      the position of query 0.
    - `kv_length`: int, scalar or `[batch]`: keys at or past it are ignored.
    - `scale`: default $1/\sqrt{dim}$.
    - `backend`: `"auto"`, `"flash_attn_jax"`, `"cudnn"`, `"pallas"`, `"cpu"` (a C++ kernel
      for XLA:CPU, built on first use), `"xla"`, `"reference"`; see `docs/decode.md`. An
      unavailable choice raises `BackendUnavailable` saying why.
    - `kv_positions`: absolute position of each key slot (`[kv_seq]` or `[batch, kv_seq]`), for
      caches not stored in position order (round-robin over devices); default: slot `a` holds
      position `a`. A key counts when its position is below `kv_length` (and, when causal, not
      after the query). Only the `"cpu"`, `"xla"` and `"reference"` backends take it.
    - `block_size`: keys per block of the `"xla"` kernel (and of every backend's backward);
      default: as many as keep a block's logits under 64 MB.

    **Returns:** `(out, lse)`: `out[batch, q_seq, heads, dv]` in the input dtype, `lse`
    float32 (float64 for float64 inputs) `[batch, heads, q_seq]`. Differentiable in q, k, v
    (and through lse) for every backend: the fused ones share a blockwise backward.
    """
    fn = "flash_attention"
    dims = check_decode(fn, q, k, v, kv_layout=kv_layout, kv_length=kv_length, q_offset=q_offset)
    positions = None
    if kv_positions is not None:
        if not jnp.issubdtype(jnp.result_type(kv_positions), jnp.integer) or jnp.shape(
            kv_positions
        ) not in ((dims.kv_seq,), (dims.batch, dims.kv_seq)):
            raise ValueError(
                f"{fn}: kv_positions must be integer with shape [kv_seq] = ({dims.kv_seq},) or "
                f"[batch, kv_seq] = {(dims.batch, dims.kv_seq)}, got {jnp.shape(kv_positions)}"
            )
        positions = jnp.broadcast_to(
            jnp.asarray(kv_positions).astype(jnp.int32), (dims.batch, dims.kv_seq)
        )
    name = select_backend(
        backend,
        dims,
        jnp.result_type(q),
        causal=causal,
        has_length=kv_length is not None,
        q_offset=q_offset,
        has_positions=positions is not None,
    )
    s = default_scale(dims.qk, scale)
    offsets = per_row(q_offset, dims.batch, 0)
    lengths = per_row(kv_length, dims.batch, dims.kv_seq)
    if positions is None:
        lengths = jnp.minimum(lengths, dims.kv_seq)
    return _run(
        name,
        q,
        k,
        v,
        offsets,
        lengths,
        positions,
        dims=dims,
        causal=causal,
        scale=s,
        block=block_size,
    )


@functools.partial(jax.jit, static_argnames=("name", "dims", "causal", "scale", "block"))
def _run(name, q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    if name == "reference":
        return reference_forward(
            q, k, v, q_offset, kv_length, kv_pos, dims=dims, causal=causal, scale=scale
        )
    with jax.named_scope(f"flash_attention_{name}"):
        return fused(
            _FORWARD[name], q, k, v, q_offset, kv_length, kv_pos, dims, causal, scale, block
        )


def flash_attention_reference(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    *,
    causal: bool = False,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] | Int[Array, " batch"] = 0,
    kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    kv_layout: str = "bshd",
    kv_positions: Int[Array, " kv_seq"] | Int[Array, "batch kv_seq"] | None = None,
) -> tuple[Float[Array, "batch q_seq heads dv"], Float[Array, "batch heads q_seq"]]:
    """The float32 twin of [`flash_attention`][treeattn.decode.flash_attention]: all logits
    written out, plain `jnp`, differentiated by JAX."""
    return flash_attention(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        q_offset=q_offset,
        kv_length=kv_length,
        backend="reference",
        kv_layout=kv_layout,
        kv_positions=kv_positions,
    )
