"""The reference twin of `flash_attention`: every logit written out in plain `jnp`, float32,
differentiated by JAX. Written independently of the kernels it checks (it shares none of their
blocking, rows layout or merging), as Pallas pairs `mqa` with `mqa_reference`; which keys a
query sees comes from the one visibility builder, `_numerics.visibility`, as everywhere."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._numerics import Dims, compute_dtype, visibility


def reference_forward(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, *, dims: Dims, causal, window, scale
):
    """`(out[b, q, h, dv], lse[b, q, h])` of the common kernel call, materialising
    `[batch, heads, q_seq, kv_seq]` logits. Keys or values holding NaN/inf that a row does not
    see do not reach it; a row that sees one gets NaN."""
    ct = compute_dtype(q.dtype)
    if dims.layout == "bhsd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # -> [b, s, kv_heads, d]
    k = jnp.repeat(k.astype(ct), dims.group, axis=2)  # GQA: query head h reads kv head h // g
    v = jnp.repeat(v.astype(ct), dims.group, axis=2)
    bad = jnp.any(~jnp.isfinite(k), axis=-1) | jnp.any(~jnp.isfinite(v), axis=-1)  # [b, s, h]
    k = jnp.where(bad[..., None], 0.0, k)
    v = jnp.where(bad[..., None], 0.0, v)
    logits = jnp.einsum("bqhd,bshd->bhqs", q.astype(ct) * jnp.asarray(scale, ct), k)
    logits = jnp.where(jnp.swapaxes(bad, 1, 2)[:, :, None, :], jnp.nan, logits)
    if bias is not None:
        logits = logits + bias.astype(ct)
    one = functools.partial(visibility, dims, causal=causal, window=window)
    seen = jax.vmap(
        lambda off, length, pos, m: one(q_offset=off, kv_length=length, kv_positions=pos, mask=m)
    )(q_offset, kv_length, kv_pos, mask)  # [b, #kv_heads, #group, #q, s]
    assert seen is not None  # kv_length is always given
    seen = jnp.broadcast_to(seen, (dims.batch, dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq))
    seen = seen.reshape(dims.batch, dims.heads, dims.q_seq, dims.kv_seq)
    logits = jnp.where(seen, logits, -jnp.inf)
    top = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    weights = jnp.where(seen, jnp.exp(logits - top), 0.0)
    total = jnp.sum(weights, axis=-1)
    lse = jnp.log(total) + top[..., 0]  # -inf for a row that sees nothing
    out = jnp.einsum("bhqs,bshd->bqhd", weights / jnp.where(total == 0, 1.0, total)[..., None], v)
    return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)
