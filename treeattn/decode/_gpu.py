"""Adapters of the GPU kernels to the common call of `_xla.py` (same arguments, `(out, lse)`
with lse float32 `[batch, q_seq, heads]`): FlashAttention-2 via flash-attn-jax, cuDNN via
JAX's cuDNN attention, and the Pallas split-K decode kernel. Each converts layouts and the lse
convention here, once, and gives a row that sees no key `(0, -inf)` whatever the kernel does
with it. Which calls each may serve is decided in `_registry.py`, from the limits cited there.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from .._numerics import Dims
from ._batching import owns_batch


def visible_lengths(kv_length, q_offset, *, causal: bool, dims: Dims):
    """Keys each row sees when the kernel masks by length only: `kv_length`, and with one
    causal query at `q_offset`, keys up to it. Clipped at 0: a shard past the fill point has
    length 0 and, causal, a negative offset."""
    lengths = kv_length
    if causal:
        assert dims.q_seq == 1, "causality as a length holds for one query per row"
        lengths = jnp.minimum(lengths, q_offset + 1)
    return jnp.maximum(lengths, 0).astype(jnp.int32)


def empty_rows(out, lse, seen):
    """`(0, -inf)` for the rows of `seen` (bool, broadcast against lse `[b, q, h]`) that are
    False, whatever the kernel returned there (NaN from 0/0, +inf, garbage)."""
    seen = jnp.broadcast_to(seen, lse.shape)
    out = jnp.where(seen[..., None], out, jnp.zeros((), out.dtype))
    return out, jnp.where(seen, lse, -jnp.inf)


# ---------------------------------------------------------------------------------------------
# flash-attn-jax
# ---------------------------------------------------------------------------------------------


def flash_attn_jax_forward(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, *, dims, causal, window, scale, block
):
    """FlashAttention-2 via flash-attn-jax 0.6.2 (CUDA; fp16/bf16; head dim <= 256).

    Its public `flash_mha` hides the log-sum-exp; `flash_fwd.flash_mha_fwd` returns it (float32,
    `[batch, heads, q_seq]`). Its causal mask is bottom-right aligned to the end of K, which is
    our convention only when the queries are the last positions (checked by eligibility). A
    row that sees no key (causal, more queries than keys) gets lse = +inf there; here -inf.
    """
    del q_offset, kv_length, kv_pos, block
    assert mask is None and bias is None and window is None  # refused by eligibility
    flash_fwd = importlib.import_module("flash_attn_jax.flash_fwd")
    if dims.layout == "bhsd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out, lse = flash_fwd.flash_mha_fwd(
        q, k, v, softmax_scale=scale, is_causal=causal, window_size_left=-1, window_size_right=-1
    )
    lse = jnp.swapaxes(lse.astype(jnp.float32), 1, 2)
    return empty_rows(out, lse, ~jnp.isposinf(lse) & (dims.kv_seq > 0))


# ---------------------------------------------------------------------------------------------
# cuDNN
# ---------------------------------------------------------------------------------------------


@functools.cache
def _cudnn_kernel(layout: str, scale: float, q_seq: int):
    def kernel(q, k, v, lengths):
        fas = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
        # Head-major caches are read as they are (cuDNN's BNTH layout); only q is transposed.
        if layout == "bhsd":
            q = jnp.swapaxes(q, 1, 2)
        out, stats = fas.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=jnp.full(lengths.shape, q_seq, jnp.int32),
            kv_seqlen=lengths,
            scale=scale,
            mask_type=fas.MaskType.PADDING,
            qkv_layout="BNTH" if layout == "bhsd" else "BTNH",
            return_residual=True,
        )
        if layout == "bhsd":
            out = jnp.swapaxes(out, 1, 2)
        # cuDNN's softmax statistics are float32 [batch, heads, q_seq]: the lse, natural log.
        return out, jnp.swapaxes(stats, 1, 2).astype(jnp.float32)

    return owns_batch(kernel)


def cudnn_forward(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, *, dims, causal, window, scale, block
):
    """cuDNN's fused attention (`jax._src.cudnn.fused_attention_stablehlo`, what
    `jax.nn.dot_product_attention(implementation="cudnn")` calls), with its float32 lse.

    `jax.nn.dot_product_attention` would round the lse to the input dtype: in an 8-shard tree
    merge at bfloat16 that alone costs ~2e-2. Its mask aligns top-left, so causality is folded
    into the key lengths, which is exact for one query per row (eligibility allows nothing
    else); the query lengths are passed explicitly and the call owns its batch axis, so `vmap`
    folds into it.
    """
    del kv_pos, block
    assert mask is None and bias is None and window is None  # refused by eligibility
    lengths = visible_lengths(kv_length, q_offset, causal=causal, dims=dims)
    out, lse = _cudnn_kernel(dims.layout, float(scale), dims.q_seq)(q, k, v, lengths)
    return empty_rows(out, lse, (lengths > 0)[:, None, None])


# ---------------------------------------------------------------------------------------------
# Pallas
# ---------------------------------------------------------------------------------------------


def _pallas_split(kv_seq: int) -> tuple[int, int, int]:
    """(k_splits, block_k, padded length) meeting the decode kernel's divisibility rules."""
    splits = max(1, min(16, kv_seq // 256))
    padded = -(-kv_seq // (16 * splits)) * 16 * splits
    per_split = padded // splits
    block_k = next(b for b in (128, 64, 32, 16) if per_split % b == 0)
    return splits, block_k, padded


def pallas_head_dim(dims: Dims) -> int:
    """The head dim the Pallas kernel runs at: Triton's block shapes are powers of two (and at
    least 16 for its dots), so qk and dv are both zero-padded to the next one."""
    return max(16, 1 << (max(dims.qk, dims.dv) - 1).bit_length())


def pallas_forward(
    q,
    k,
    v,
    q_offset,
    kv_length,
    kv_pos,
    mask,
    bias,
    *,
    dims,
    causal,
    window,
    scale,
    block,
    interpret: bool,
):
    """The Pallas split-K decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention`),
    one query per row; interpreted off GPUs. `m + log(l)` of its residuals is the lse.

    Head dims are zero-padded to a power of two (zero columns of q and K leave q·k unchanged;
    the zero columns of V are sliced off), which also serves a value dim different from the
    head dim. float32 runs at full precision: the caller traces it under
    `jax.default_matmul_precision("highest")`, which the Triton lowering maps to IEEE dots
    (its default is TF32, ~1e-3 relative)."""
    del kv_pos, block
    assert mask is None and bias is None and window is None  # refused by eligibility
    from jax.experimental.pallas.ops.gpu import decode_attention

    b, kh, g = dims.batch, dims.kv_heads, dims.group
    d = pallas_head_dim(dims)
    if dims.layout == "bshd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # the kernel reads head-major rows
    splits, block_k, padded = _pallas_split(dims.kv_seq)
    lengths = visible_lengths(kv_length, q_offset, causal=causal, dims=dims)
    if padded != dims.kv_seq or d != dims.qk or d != dims.dv:
        # Masked by the key lengths below; fused with the copy that zeroes unfilled slots.
        k = jnp.pad(k, ((0, 0), (0, 0), (0, padded - dims.kv_seq), (0, d - dims.qk)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, padded - dims.kv_seq), (0, d - dims.dv)))
    qp = jnp.pad(q[:, 0], ((0, 0), (0, 0), (0, d - dims.qk)))
    # The kernel masks by adding a large negative number to the logits and multiplies its
    # weights into every value row of a block: an unfilled slot holding NaN would reach every
    # row. Slots at or past the length are zeroed first (fused with the padding copy).
    keep = (jnp.arange(padded, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, :, None]
    k = jnp.where(keep, k, jnp.zeros((), k.dtype))
    v = jnp.where(keep, v, jnp.zeros((), v.dtype))
    # The kernel multiplies a boolean mask into float logits, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        out, (denom, m) = decode_attention.mqa(
            qp.reshape(b * kh, g, d),
            k.reshape(b * kh, padded, d),
            v.reshape(b * kh, padded, d),
            kv_seq_len=jnp.repeat(lengths, kh),
            sm_scale=scale,
            k_splits=splits,
            block_k=block_k,
            interpret=interpret,
            return_residuals=True,
        )
    seen = denom > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    out = out.reshape(b, 1, dims.heads, d)[..., : dims.dv].astype(q.dtype)
    lse = lse.reshape(b, 1, dims.heads).astype(jnp.float32)
    return empty_rows(out, lse, seen.reshape(b, 1, dims.heads))
