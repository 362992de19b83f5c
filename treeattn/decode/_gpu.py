"""Adapters of the GPU kernels to the common call of `_xla.py` (same arguments, `(out, lse)`
with lse float32 `[batch, q_seq, heads]`): FlashAttention-2 via flash-attn-jax, cuDNN via
`jax.nn.dot_product_attention`, and the Pallas split-K decode kernel. Each converts layouts and
the lse convention here, once."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp


def flash_attn_jax_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    """FlashAttention-2 via flash-attn-jax (CUDA; fp16/bf16; head dim <= 256).

    Its public `flash_mha` hides the log-sum-exp; `flash_fwd.flash_mha_fwd` returns it (float32,
    `[batch, heads, q_seq]`). Its causal mask is bottom-right aligned to the end of K, which is
    our convention only when the queries are the last positions (checked by eligibility).
    """
    del q_offset, kv_length, kv_pos, block
    flash_fwd = importlib.import_module("flash_attn_jax.flash_fwd")
    if dims.layout == "bhsd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out, lse = flash_fwd.flash_mha_fwd(
        q, k, v, softmax_scale=scale, is_causal=causal, window_size_left=-1, window_size_right=-1
    )
    return out, jnp.swapaxes(lse.astype(jnp.float32), 1, 2)


def cudnn_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    """cuDNN through `jax.nn.dot_product_attention(..., return_residual=True)`.

    Its lse comes back as `[batch, q_seq, heads]` in the input dtype (and under stop_gradient);
    its `is_causal` aligns top-left, so causality is folded into the key lengths, which is exact
    for one query per row (eligibility allows nothing else).
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
    return out, lse.astype(jnp.float32)


def _pallas_split(kv_seq: int) -> tuple[int, int, int]:
    """(k_splits, block_k, padded length) meeting the decode kernel's divisibility rules."""
    splits = max(1, min(16, kv_seq // 256))
    padded = -(-kv_seq // (16 * splits)) * 16 * splits
    per_split = padded // splits
    block_k = next(b for b in (128, 64, 32, 16) if per_split % b == 0)
    return splits, block_k, padded


def pallas_forward(
    q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block, interpret: bool
):
    """The Pallas split-K decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention`),
    one query per row; interpreted off GPUs. `m + log(l)` of its residuals is the lse."""
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
    # The kernel masks by adding a large negative number to the logits and multiplies its
    # weights into every value row of a block: an unfilled slot holding NaN would reach every
    # row. Slots at or past the length are zeroed first (fused with the padding copy).
    keep = (jnp.arange(padded, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, :, None]
    k = jnp.where(keep, k, jnp.zeros((), k.dtype))
    v = jnp.where(keep, v, jnp.zeros((), v.dtype))
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
            interpret=interpret,
            return_residuals=True,
        )
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    out = out.reshape(b, 1, dims.heads, dims.dv).astype(q.dtype)
    return out, lse.reshape(b, 1, dims.heads).astype(jnp.float32)
