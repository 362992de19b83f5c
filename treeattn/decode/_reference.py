"""The reference twin of `flash_attention`: every logit written out in plain `jnp`, float32,
differentiated by JAX. Written independently of the kernels it checks (it shares no helper
with them), as Pallas pairs `mqa` with `mqa_reference`."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .._numerics import Dims, compute_dtype


def reference_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims: Dims, causal, scale):
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
    pos = jnp.arange(dims.kv_seq)[None, :] if kv_pos is None else kv_pos  # [#b, s]
    seen = pos[:, None, :] < kv_length[:, None, None]  # [b, 1, s]
    if causal:
        q_pos = q_offset[:, None] + jnp.arange(dims.q_seq)[None, :]  # [b, q]
        seen = seen & (pos[:, None, :] <= q_pos[:, :, None])
    seen = seen[:, None]  # [b, 1, q or 1, s]
    logits = jnp.where(seen, logits, -jnp.inf)
    top = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    weights = jnp.where(seen, jnp.exp(logits - top), 0.0)
    total = jnp.sum(weights, axis=-1)
    lse = jnp.log(total) + top[..., 0]  # -inf for a row that sees nothing
    out = jnp.einsum("bhqs,bshd->bqhd", weights / jnp.where(total == 0, 1.0, total)[..., None], v)
    return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)
