r"""Fused local attention that returns `(out, lse)`: the per-device step of tree decoding.

`lse` is the free energy of the local keys at $\zeta = 0$, $\log\sum_a e^{s\,q\cdot k_a}$, so two
results over disjoint keys merge exactly with `treeattn.energy.merge_partials`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int

from ..energy import merge_partials
from ..energy._checks import compute_dtype


Layout = Literal["bshd", "bhsd"]
LAYOUTS = ("bshd", "bhsd")


@dataclasses.dataclass(frozen=True)
class DecodeDims:
    """Sizes of one batched attention call; hashable, so it can be a static argument."""

    batch: int
    q_seq: int
    heads: int
    kv_heads: int
    kv_seq: int
    qk: int
    dv: int
    layout: str

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def seq_axis(self) -> int:
        """The sequence axis of K and V without the batch axis."""
        return 0 if self.layout == "bshd" else 1


def kv_shape(layout: str, batch: int, seq: int, kv_heads: int, dim: int) -> tuple[int, ...]:
    return (batch, seq, kv_heads, dim) if layout == "bshd" else (batch, kv_heads, seq, dim)


def check_decode(
    fn: str, q, k, v, *, kv_layout: str, kv_length=None, q_offset: Any = 0
) -> DecodeDims:
    """Validate the batched layout; `ValueError`s name the shapes."""
    if kv_layout not in LAYOUTS:
        raise ValueError(f"{fn}: kv_layout must be 'bshd' or 'bhsd', got {kv_layout!r}")
    qs, ks, vs = jnp.shape(q), jnp.shape(k), jnp.shape(v)
    names = "[batch, seq, kv_heads, dim]" if kv_layout == "bshd" else "[batch, kv_heads, seq, dim]"
    if len(qs) != 4:
        raise ValueError(f"{fn}: q must have shape [batch, q_seq, heads, dim], got shape {qs}")
    for name, shape in (("k", ks), ("v", vs)):
        if len(shape) != 4:
            raise ValueError(
                f"{fn}: {name} must have shape {names} (kv_layout={kv_layout!r}), got {shape}"
            )
    if kv_layout == "bshd":
        _, kv_seq, kv_heads, qk = ks
        v_seq, v_heads = vs[1], vs[2]
    else:
        _, kv_heads, kv_seq, qk = ks
        v_heads, v_seq = vs[1], vs[2]
    batch, q_seq, heads, q_dim = qs
    if ks[0] != batch or vs[0] != batch:
        raise ValueError(f"{fn}: batch sizes differ: q {qs}, k {ks}, v {vs}")
    if q_dim != qk:
        raise ValueError(f"{fn}: q {qs} and k {ks} disagree on the head dim ({q_dim} != {qk})")
    if (v_seq, v_heads) != (kv_seq, kv_heads):
        raise ValueError(f"{fn}: k {ks} and v {vs} must agree on seq and kv_heads ({kv_layout})")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{fn}: num_heads={heads} (q {qs}) must be a multiple of num_kv_heads={kv_heads} "
            f"(k {ks})"
        )
    dtypes = {jnp.result_type(x) for x in (q, k, v)}
    if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
        raise ValueError(
            f"{fn}: q, k, v must share one floating dtype, got {jnp.result_type(q)}, "
            f"{jnp.result_type(k)}, {jnp.result_type(v)}"
        )
    for name, value in (("kv_length", kv_length), ("q_offset", q_offset)):
        if value is None or isinstance(value, int) and not isinstance(value, bool):
            continue
        if isinstance(value, bool) or not jnp.issubdtype(jnp.result_type(value), jnp.integer):
            raise ValueError(f"{fn}: {name} must be an integer or integer array, got {value!r}")
        if jnp.ndim(value) not in (0, 1) or jnp.ndim(value) == 1 and jnp.shape(value)[0] != batch:
            raise ValueError(
                f"{fn}: {name} must be a scalar or have shape [batch] = ({batch},), got "
                f"{jnp.shape(value)}"
            )
    return DecodeDims(batch, q_seq, heads, kv_heads, kv_seq, qk, vs[3], kv_layout)


def per_row(x, batch: int, default: int) -> Int[Array, " batch"]:
    """An int or [batch] integer argument as int32 [batch]."""
    x = default if x is None else x
    return jnp.broadcast_to(jnp.asarray(x).astype(jnp.int32), (batch,))


# ---------------------------------------------------------------------------------------------
# Shared pieces: the query rows of each kv head, key visibility, one block's partial
# ---------------------------------------------------------------------------------------------


def q_rows(q: Array, dims: DecodeDims, dtype) -> Array:
    """[q_seq, heads, d] -> [kv_heads, group * q_seq, d] (row m = g * q_seq + t)."""
    t, kh, g = dims.q_seq, dims.kv_heads, dims.group
    return q.astype(dtype).reshape(t, kh, g, -1).transpose(1, 2, 0, 3).reshape(kh, g * t, -1)


def from_rows(x: Array, dims: DecodeDims) -> Array:
    """[kv_heads, group * q_seq, d] -> [q_seq, heads, d]."""
    t, kh, g = dims.q_seq, dims.kv_heads, dims.group
    return x.reshape(kh, g, t, -1).transpose(2, 0, 1, 3).reshape(t, kh * g, -1)


def lse_from_rows(lse: Array, dims: DecodeDims) -> Array:
    """[kv_heads, group * q_seq] -> [heads, q_seq]."""
    return lse.reshape(dims.heads, dims.q_seq)


def row_positions(q_offset: Array, dims: DecodeDims) -> Array:
    """Absolute position of each query row, [group * q_seq]."""
    return jnp.tile(q_offset + jnp.arange(dims.q_seq, dtype=jnp.int32), dims.group)


def block_visibility(slot, first, pos, kv_length, rows_pos, causal: bool) -> Array:
    """Which keys of a block count: slots not before `first` (already covered by an earlier
    block), keys whose absolute position `pos` is inside the filled length, and, when causal,
    not after the query."""
    valid = (slot >= first) & (pos < kv_length)
    if not causal:
        return valid[None, None, :]
    return valid[None, None, :] & (pos[None, None, :] <= rows_pos[None, :, None])


def block_partial(logits: Array, visible: Array, v_block: Array, v_spec: str):
    """`(out, lse)` of one block of keys, with one exponential pass: out normalised, lse the
    block's free energy; an empty row gives (0, -inf)."""
    x = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(x, axis=-1, initial=-jnp.inf)
    finite = jnp.isfinite(m)
    m_safe = jnp.where(finite, m, 0.0)
    e = jnp.exp(x - m_safe[..., None])
    total = jnp.sum(e, axis=-1)
    out = jnp.einsum(f"kmb,{v_spec}->kmv", e, v_block)
    out = out / jnp.where(finite, total, 1.0)[..., None]
    lse = jnp.where(finite, m_safe + jnp.log(jnp.where(finite, total, 1.0)), -jnp.inf)
    return out, lse


def match_vma(tree, *refs):
    """`tree` typed as varying over every mesh axis any of `refs` varies over.

    Inside `shard_map`, a loop carry that starts as a constant (zeros, -inf) but is updated with
    shard-local values must be typed as varying from the start. `zeros_like` inherits the
    varying axes of its argument (on every supported jax), and XLA folds the added zero away.
    """
    zero = jnp.zeros((), jnp.float32)
    for r in refs:
        zero = zero + jnp.zeros_like(r, shape=(), dtype=jnp.float32)
    return jax.tree.map(lambda leaf: leaf + zero.astype(leaf.dtype), tree)


def _k_spec(layout: str) -> str:
    return "bkd" if layout == "bshd" else "kbd"


def _v_spec(layout: str) -> str:
    return "bkv" if layout == "bshd" else "kbv"


# ---------------------------------------------------------------------------------------------
# The portable blockwise kernel ("xla") and the reference twin
# ---------------------------------------------------------------------------------------------


def _xla_row(q, k, v, q_offset, kv_length, kv_pos, *, dims: DecodeDims, causal, scale, block):
    """One batch row: online softmax over blocks of `block` keys, merged with
    `merge_partials`. Blocks past the filled length (or past the last query, when causal) are
    not visited, so a partly filled cache costs what its filled part costs."""
    ct = compute_dtype(q.dtype)
    qr = q_rows(q, dims, ct) * jnp.asarray(scale, ct)
    rows_pos = row_positions(q_offset, dims)
    size = block
    limit = kv_length
    if causal:
        limit = jnp.minimum(limit, q_offset + dims.q_seq)
    total_blocks = -(-dims.kv_seq // size)
    if kv_pos is None:  # contiguous: blocks past the limit hold no visible key
        n_blocks = jnp.clip((limit + size - 1) // size, 0, total_blocks)
    else:
        n_blocks = total_blocks
    ax = dims.seq_axis

    def body(i, carry):
        out, lse = carry
        first = i * size
        # The last block is moved back to end at kv_seq; keys it shares with the previous
        # block are masked out (no padding, no copy of the cache).
        start = jnp.minimum(first, dims.kv_seq - size)
        kb = lax.dynamic_slice_in_dim(k, start, size, axis=ax).astype(ct)
        vb = lax.dynamic_slice_in_dim(v, start, size, axis=ax).astype(ct)
        logits = jnp.einsum(f"kmd,{_k_spec(dims.layout)}->kmb", qr, kb)
        slot = start + jnp.arange(size, dtype=jnp.int32)
        pos = slot if kv_pos is None else lax.dynamic_slice_in_dim(kv_pos, start, size)
        visible = block_visibility(slot, first, pos, kv_length, rows_pos, causal)
        b_out, b_lse = block_partial(logits, visible, vb, _v_spec(dims.layout))
        out, lse = merge_partials(out, lse, b_out, b_lse)
        assert out is not None
        return out, lse

    rows = dims.group * dims.q_seq
    init = (
        jnp.zeros((dims.kv_heads, rows, dims.dv), ct),
        jnp.full((dims.kv_heads, rows), -jnp.inf, ct),
    )
    init = match_vma(init, q, k, v, q_offset, kv_length)
    with jax.named_scope("flash_xla"):
        out, lse = lax.fori_loop(0, n_blocks, body, init)
    return from_rows(out, dims).astype(q.dtype), lse_from_rows(lse, dims)


LOGITS_BUDGET = 1 << 24  # logits elements per block (64 MB in float32)


def block_size(dims: DecodeDims, block: int | None) -> int:
    """Keys per block: `block`, or as many as keep one block's logits within LOGITS_BUDGET
    (so a decode step over a shard of up to ~1M keys is one block: no loop, no slicing)."""
    if block is not None:
        return max(1, min(block, dims.kv_seq))
    rows = dims.kv_heads * dims.group * dims.q_seq
    return max(1, min(dims.kv_seq, max(256, LOGITS_BUDGET // max(rows, 1))))


def _empty(q, k, v, q_offset, kv_length, dims: DecodeDims):
    out = jnp.zeros((dims.batch, dims.q_seq, dims.heads, dims.dv), q.dtype)
    lse = jnp.full((dims.batch, dims.heads, dims.q_seq), -jnp.inf, compute_dtype(q.dtype))
    return match_vma((out, lse), q, k, v, q_offset, kv_length)


def xla_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    """The portable kernel: blockwise online softmax, `(out, lse)` per block merged with
    `merge_partials`; one block (no loop) when the logits fit LOGITS_BUDGET. A call whose rows
    see no key at all (a shard past the filled part of a cache) does no work."""
    size = block_size(dims, block)
    kw = dict(dims=dims, causal=causal, scale=scale)
    if size >= dims.kv_seq:
        row = functools.partial(_reference_row, **kw)
    else:
        row = functools.partial(_xla_row, block=size, **kw)
    limit = jnp.minimum(kv_length, q_offset + dims.q_seq) if causal else kv_length
    first_pos = 0 if kv_pos is None else jnp.min(kv_pos, axis=-1)
    return lax.cond(
        jnp.any(first_pos < limit),
        lambda: jax.vmap(row)(q, k, v, q_offset, kv_length, kv_pos),
        lambda: _empty(q, k, v, q_offset, kv_length, dims),
    )


def _reference_row(q, k, v, q_offset, kv_length, kv_pos, *, dims: DecodeDims, causal, scale):
    ct = compute_dtype(q.dtype)
    qr = q_rows(q, dims, ct) * jnp.asarray(scale, ct)
    logits = jnp.einsum(f"kmd,{_k_spec(dims.layout)}->kmb", qr, k.astype(ct))
    slot = jnp.arange(dims.kv_seq, dtype=jnp.int32)
    pos = slot if kv_pos is None else kv_pos
    visible = block_visibility(slot, 0, pos, kv_length, row_positions(q_offset, dims), causal)
    out, lse = block_partial(logits, visible, v.astype(ct), _v_spec(dims.layout))
    return from_rows(out, dims).astype(q.dtype), lse_from_rows(lse, dims)


def reference_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block=None):
    del block
    row = functools.partial(_reference_row, dims=dims, causal=causal, scale=scale)
    return jax.vmap(row)(q, k, v, q_offset, kv_length, kv_pos)


# ---------------------------------------------------------------------------------------------
# The gradient of every fused backend: a blockwise backward from (out, lse)
# ---------------------------------------------------------------------------------------------


def _backward_row(
    q,
    k,
    v,
    q_offset,
    kv_length,
    kv_pos,
    out,
    lse,
    d_out,
    d_lse,
    *,
    dims: DecodeDims,
    causal,
    scale,
    block,
):
    r"""Cotangents of (q, k, v) for one batch row, one block of keys at a time.

    With $p_a = e^{x_a - \mathrm{lse}}$: $\partial x_a = p_a(\bar o\cdot v_a - \bar o\cdot o +
    \overline{\mathrm{lse}})$, $\bar q = s\sum_a \partial x_a k_a$,
    $\bar k_a = s\sum \partial x_a q$, $\bar v_a = \sum p_a \bar o$ (FlashAttention-2's
    backward, plus the lse cotangent).
    """
    ct = compute_dtype(q.dtype)
    qr = q_rows(q, dims, ct) * jnp.asarray(scale, ct)
    do = q_rows(d_out, dims, ct)  # [kh, rows, dv]
    o = q_rows(out, dims, ct)
    lse_r = lse.reshape(dims.kv_heads, dims.group * dims.q_seq).astype(ct)
    dl = d_lse.reshape(dims.kv_heads, dims.group * dims.q_seq).astype(ct)
    lse_safe = jnp.where(jnp.isfinite(lse_r), lse_r, 0.0)
    delta = jnp.sum(do * o, axis=-1) - dl  # [kh, rows]
    rows_pos = row_positions(q_offset, dims)
    size = block_size(dims, block)
    ax = dims.seq_axis
    ks, vs = _k_spec(dims.layout), _v_spec(dims.layout)

    def block_grads(kb, vb, start, first):
        logits = jnp.einsum(f"kmd,{ks}->kmb", qr, kb)
        slot = start + jnp.arange(size, dtype=jnp.int32)
        pos = slot if kv_pos is None else lax.dynamic_slice_in_dim(kv_pos, start, size)
        visible = block_visibility(slot, first, pos, kv_length, rows_pos, causal)
        p = jnp.exp(jnp.where(visible, logits, -jnp.inf) - lse_safe[..., None])
        dp = jnp.einsum(f"kmv,{vs}->kmb", do, vb)
        dx = p * (dp - delta[..., None])
        dq_b = jnp.einsum(f"kmb,{ks}->kmd", dx, kb)
        dk_b = jnp.einsum(f"kmb,kmd->{ks}", dx, qr)
        dv_b = jnp.einsum(f"kmb,kmv->{vs}", p, do)
        return dq_b, dk_b, dv_b

    def body(i, carry):
        dq, dk, dv = carry
        first = i * size
        start = jnp.minimum(first, dims.kv_seq - size)
        kb = lax.dynamic_slice_in_dim(k, start, size, axis=ax).astype(ct)
        vb = lax.dynamic_slice_in_dim(v, start, size, axis=ax).astype(ct)
        dq_b, dk_b, dv_b = block_grads(kb, vb, start, first)
        dq = dq + dq_b
        # Add (not write): keys shared with the previous block got 0 here.
        dk = lax.dynamic_update_slice_in_dim(
            dk, lax.dynamic_slice_in_dim(dk, start, size, axis=ax) + dk_b, start, axis=ax
        )
        dv = lax.dynamic_update_slice_in_dim(
            dv, lax.dynamic_slice_in_dim(dv, start, size, axis=ax) + dv_b, start, axis=ax
        )
        return dq, dk, dv

    if size >= dims.kv_seq:
        dq, dk, dv = block_grads(k.astype(ct), v.astype(ct), 0, 0)
    else:
        init = (jnp.zeros(qr.shape, ct), jnp.zeros(k.shape, ct), jnp.zeros(v.shape, ct))
        init = match_vma(init, q, k, v, q_offset, kv_length, out, lse, d_out, d_lse)
        dq, dk, dv = lax.fori_loop(0, -(-dims.kv_seq // size), body, init)
    dq = from_rows(dq * jnp.asarray(scale, ct), dims)
    # dk picked up q * scale already (qr is scaled).
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 7, 8, 9, 10))
def fused(forward, q, k, v, q_offset, kv_length, kv_pos, dims, causal, scale, block):
    """`forward(q, k, v, q_offset, kv_length, kv_pos, ...)` -> (out, lse), with the blockwise
    backward.

    Backends whose lse is not differentiable (or whose forward cannot be differentiated at all:
    Pallas, cuDNN's residual, flash-attn-jax, a dynamic-length loop) get their gradient here.
    """
    return forward(
        q, k, v, q_offset, kv_length, kv_pos, dims=dims, causal=causal, scale=scale, block=block
    )


def _fused_fwd(forward, q, k, v, q_offset, kv_length, kv_pos, dims, causal, scale, block):
    # Calling `fused` (not `forward`) here keeps the residuals differentiable through this
    # same rule, so the gradient can itself be differentiated (training through attention).
    out, lse = fused(forward, q, k, v, q_offset, kv_length, kv_pos, dims, causal, scale, block)  # type: ignore[misc]
    return (out, lse), (q, k, v, q_offset, kv_length, kv_pos, out, lse)


def _fused_bwd(forward, dims, causal, scale, block, res, cts):
    q, k, v, q_offset, kv_length, kv_pos, out, lse = res
    d_out, d_lse = cts
    row = functools.partial(_backward_row, dims=dims, causal=causal, scale=scale, block=block)
    dq, dk, dv = jax.vmap(row)(q, k, v, q_offset, kv_length, kv_pos, out, lse, d_out, d_lse)

    def no_cotangent(x):
        return None if x is None else np.zeros(x.shape, jax.dtypes.float0)

    return (dq, dk, dv, no_cotangent(q_offset), no_cotangent(kv_length), no_cotangent(kv_pos))


fused.defvjp(_fused_fwd, _fused_bwd)
