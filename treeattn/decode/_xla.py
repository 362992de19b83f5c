r"""The portable blockwise kernel (`backend="xla"`), and the one backward every fused kernel
shares.

A kernel maps the common call — `q[batch, q_seq, heads, qk]`, K/V in the call's layout,
absolute query positions `q_offset[batch]`, filled lengths `kv_length[batch]`, optional key
positions `kv_pos[batch, kv_seq]`, an optional boolean `mask` and additive `bias` (each
`[batch, #heads, #q_seq, kv_seq]`, axes of size 1 broadcast), and the static `causal` and
sliding `window` — to `(out, lse)`: `out[batch, q_seq, heads, dv]` in the input
dtype and `lse[batch, q_seq, heads]` float32 (float64 for float64 inputs), natural log, the
free energy at $\zeta = 0$ of the keys each row sees (`-inf` for none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._numerics import (
    COVERED,
    SKIPPED,
    Dims,
    batch_coverage,
    compute_dtype,
    from_rows,
    lse_from_rows,
    lse_to_rows,
    rows_bias,
    rows_visibility,
    to_rows,
    visibility,
)
from .._partials import merge_partials


def match_vma(tree, *refs):
    """`tree` typed as varying over every mesh axis any of `refs` varies over.

    Inside `shard_map`, a loop carry that starts as a constant (zeros, -inf) but is updated with
    shard-local values must be typed as varying from the start. `zeros_like` inherits the
    varying axes of its argument (on every supported jax), and XLA folds the added zero away.
    """
    zero = jnp.zeros((), jnp.float32)
    for r in refs:
        if r is not None:
            zero = zero + jnp.zeros_like(r, shape=(), dtype=jnp.float32)
    return jax.tree.map(lambda leaf: leaf + zero.astype(leaf.dtype), tree)


def _k_spec(dims: Dims) -> str:
    return "bkd" if dims.layout == "bshd" else "kbd"


def _v_spec(dims: Dims) -> str:
    return "bkv" if dims.layout == "bshd" else "kbv"


def _hide_unseen(x, vis, dims: Dims):
    """A block of K or V with the keys no row sees set to 0 (`where`, not a 0 weight: an
    unfilled cache slot may hold NaN, and 0 * NaN is NaN in the product)."""
    seen = jnp.any(vis, axis=1)  # [#kv_heads, b]
    seen = seen.T[..., None] if dims.layout == "bshd" else seen[..., None]
    return jnp.where(seen, x, jnp.zeros((), x.dtype))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q_offset", "kv_length", "kv_pos", "mask", "bias"],
    meta_fields=["causal", "window"],
)
@dataclasses.dataclass(frozen=True)
class Row:
    """What decides the keys one batch row sees, besides the keys themselves: query offset,
    filled length, key positions, mask and bias of that row (`mask`/`bias`
    `[#heads, #q_seq, kv_seq]`), the static causal flag and window."""

    q_offset: jax.Array
    kv_length: jax.Array
    kv_pos: jax.Array | None
    mask: jax.Array | None
    bias: jax.Array | None
    causal: bool
    window: tuple[int, int] | None

    def block(self, dims: Dims, size: int, start, first):
        """Visibility `[#kv_heads, #rows, size]` of the keys in slots `start .. start + size`
        (the `visibility` of their positions, minus slots before `first`, covered by the
        previous block), and the block's bias in the rows layout (or None)."""
        slot = start + jnp.arange(size, dtype=jnp.int32)
        pos = slot if self.kv_pos is None else lax.dynamic_slice_in_dim(self.kv_pos, start, size)
        block = dataclasses.replace(dims, kv_seq=size)

        def cut(x):
            if x is None or x.shape[-1] == size:
                return x
            return lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)

        vis = visibility(
            block,
            causal=self.causal,
            q_offset=self.q_offset,
            kv_positions=pos,
            kv_length=self.kv_length,
            slots=slot >= first,
            mask=cut(self.mask),
            window=self.window,
        )
        vis = rows_visibility(vis, block)
        assert vis is not None  # `slots` is always given
        bias = cut(self.bias)
        return vis, None if bias is None else rows_bias(bias, block)


def _block_partial(qr, kb, vb, visible, bias, dims: Dims, *, hide: bool = True):
    """`(out, lse)` of one block of keys with one exponential pass, in the rows layout: out
    normalised, lse the block's free energy; a row that sees no key gives (0, -inf). With
    `hide`, values no row sees are zeroed first (not needed when every key is seen)."""
    if hide:
        vb = _hide_unseen(vb, visible, dims)
    logits = jnp.einsum(f"kmd,{_k_spec(dims)}->kmb", qr, kb)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    x = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(x, axis=-1, initial=-jnp.inf)
    finite = jnp.isfinite(m)
    m_safe = jnp.where(finite, m, 0.0)
    e = jnp.exp(x - m_safe[..., None])
    total = jnp.sum(e, axis=-1)
    out = jnp.einsum(f"kmb,{_v_spec(dims)}->kmv", e, vb)
    out = out / jnp.where(finite, total, 1.0)[..., None]
    lse = jnp.where(finite, m_safe + jnp.log(jnp.where(finite, total, 1.0)), m)
    return out, lse


LOGITS_BUDGET = 1 << 24  # logits elements per block (64 MB in float32)
MAX_BLOCK = 1024  # keys per block at most: a masked block stays in cache


def block_size(dims: Dims, block: int | None) -> int:
    """Keys per block: `block`, or as many as keep one block's logits within LOGITS_BUDGET,
    at most MAX_BLOCK. Blocks past the filled length are not visited, and only the keys of a
    visited block are masked, so a partly filled cache costs what its filled part costs."""
    if block is not None:
        return max(1, min(block, dims.kv_seq))
    rows = dims.kv_heads * dims.rows
    budget = max(256, min(MAX_BLOCK, LOGITS_BUDGET // max(rows, 1)))
    return max(1, min(dims.kv_seq, budget))


def _dense_row(q, k, v, row: Row, *, dims: Dims, scale):
    """One batch row as one block (no loop), for a call in which every key up to the filled
    length is seen by some query (values of keys hidden by a mask or window are zeroed)."""
    ct = compute_dtype(q.dtype)
    qr = to_rows(q.astype(ct), dims) * jnp.asarray(scale, ct)
    vis, bias = row.block(dims, dims.kv_seq, 0, 0)
    hide = row.mask is not None or row.window is not None
    out, lse = _block_partial(qr, k.astype(ct), v.astype(ct), vis, bias, dims, hide=hide)
    return from_rows(out, dims).astype(q.dtype), lse_from_rows(lse, dims)


def _limit(dims: Dims, q_offset, kv_length, causal, window):
    """The first slot past every key any query could see, when keys are in position order."""
    limit = kv_length
    if causal:
        limit = jnp.minimum(limit, q_offset + dims.q_seq)
    if window is not None:
        limit = jnp.minimum(limit, q_offset + dims.q_seq + window[1])
    return limit


def _block_range(dims: Dims, row: Row, size: int):
    """The blocks of `size` keys `[lo, hi)` the row's queries may see: blocks past the filled
    length (or past the last query, when causal, or outside every query's window) hold no
    visible key when keys are in position order; with key positions, every block."""
    total = -(-dims.kv_seq // size)
    if row.kv_pos is not None:
        return 0, total
    limit = _limit(dims, row.q_offset, row.kv_length, row.causal, row.window)
    hi = jnp.clip((limit + size - 1) // size, 0, total)
    lo = 0 if row.window is None else jnp.clip((row.q_offset - row.window[0]) // size, 0, hi)
    return lo, hi


QUERY_CHUNK = 1024
"""A causal or windowed call with more queries than this runs in chunks of at most this many
queries, each over only the key blocks its own queries see: the blocks above the diagonal (or
outside the window) are skipped, forward and backward."""


def _query_chunks(dims: Dims, row: Row) -> tuple[int, int]:
    """`(n, size)`: the call's queries run in `n` chunks of `size` (1 chunk: not cut). The last
    chunk is moved back to end at the last query, so it repeats rows of the one before it
    (no padding: a padded row would see keys, and take a bias, that no real row does)."""
    cut = row.causal or row.window is not None
    if not cut or row.kv_pos is not None or dims.q_seq <= QUERY_CHUNK:
        return 1, dims.q_seq
    n = -(-dims.q_seq // QUERY_CHUNK)
    return n, -(-dims.q_seq // n)


def _chunk_row(row: Row, start, size: int) -> Row:
    """The row's rules for its queries `start .. start + size - 1` (a mask or bias with a
    query axis of size 1 is broadcast over the queries, and passed whole)."""

    def cut(x):
        if x is None or x.shape[1] == 1:
            return x
        return lax.dynamic_slice_in_dim(x, start, size, axis=1)

    return dataclasses.replace(
        row, q_offset=row.q_offset + start, mask=cut(row.mask), bias=cut(row.bias)
    )


def _join_chunks(x, q_seq: int, axis: int = 0):
    """Chunks' results stacked in front (`[n, ..., size, ...]`, queries on `axis` of a chunk)
    as one `[..., q_seq, ...]`: every chunk whole but the last, of which only the rows past the
    one before it are kept."""
    n, size = x.shape[0], x.shape[axis + 1]
    x = jnp.moveaxis(x, axis + 1, 1)
    own = q_seq - (n - 1) * size
    x = jnp.concatenate([x[:-1].reshape(-1, *x.shape[2:]), x[-1, size - own :]])
    return jnp.moveaxis(x, 0, axis)


def _xla_row(q, k, v, row: Row, *, dims: Dims, scale, block):
    """One batch row; a causal or windowed one with many queries in chunks of queries
    (`QUERY_CHUNK`), each over the key blocks it sees."""
    n, size = _query_chunks(dims, row)
    if n == 1:
        return _xla_chunk(q, k, v, row, dims=dims, scale=scale, block=block)
    local = dataclasses.replace(dims, q_seq=size)

    def one(c):
        start = jnp.minimum(c * size, dims.q_seq - size)
        q_c = lax.dynamic_slice_in_dim(q, start, size)
        row_c = _chunk_row(row, start, size)
        return _xla_chunk(q_c, k, v, row_c, dims=local, scale=scale, block=block)

    out, lse = lax.map(one, jnp.arange(n, dtype=jnp.int32))
    return _join_chunks(out, dims.q_seq), _join_chunks(lse, dims.q_seq)


def _xla_chunk(q, k, v, row: Row, *, dims: Dims, scale, block):
    """Online softmax over blocks of `block` keys, merged with `merge_partials`. Only the
    blocks of `_block_range` are visited, so a partly filled cache costs what its filled part
    costs, a sliding window what the window costs, and a chunk of causal queries the blocks up
    to its last query."""
    ct = compute_dtype(q.dtype)
    qr = to_rows(q.astype(ct), dims) * jnp.asarray(scale, ct)
    size = block_size(dims, block)
    lo, n_blocks = _block_range(dims, row, size)
    ax = dims.seq_axis

    def body(i, carry):
        out, lse = carry
        first = i * size
        # The last block is moved back to end at kv_seq; keys it shares with the previous
        # block are masked out (no padding, no copy of the cache).
        start = jnp.minimum(first, dims.kv_seq - size)
        kb = lax.dynamic_slice_in_dim(k, start, size, axis=ax).astype(ct)
        vb = lax.dynamic_slice_in_dim(v, start, size, axis=ax).astype(ct)
        vis, bias = row.block(dims, size, start, first)
        b_out, b_lse = _block_partial(qr, kb, vb, vis, bias, dims)
        out, lse = merge_partials(out, lse, b_out, b_lse)
        assert out is not None
        return out, lse

    init = (
        jnp.zeros((dims.kv_heads, dims.rows, dims.dv), ct),
        jnp.full((dims.kv_heads, dims.rows), -jnp.inf, ct),
    )
    init = match_vma(init, q, k, v, row.q_offset, row.kv_length, row.mask, row.bias)
    out, lse = lax.fori_loop(lo, n_blocks, body, init)
    return from_rows(out, dims).astype(q.dtype), lse_from_rows(lse, dims)


def _empty(q, k, v, q_offset, kv_length, mask, bias, dims: Dims):
    out = jnp.zeros((dims.batch, dims.q_seq, dims.heads, dims.dv), q.dtype)
    lse = jnp.full((dims.batch, dims.q_seq, dims.heads), -jnp.inf, compute_dtype(q.dtype))
    return match_vma((out, lse), q, k, v, q_offset, kv_length, mask, bias)


def xla_forward(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, *, dims, causal, window, scale, block
):
    """The portable kernel. Three cases, chosen at run time:

    - no row sees a key (a shard past the filled part of a cache): no work, `(0, -inf)`;
    - every key is seen by some row and the logits fit LOGITS_BUDGET (a full cache, a
      prefill; no sliding window): one block, all logits at once (XLA's matrix products, no
      loop);
    - otherwise (a partly filled cache): an online softmax over blocks of keys, each block's
      `(out, lse)` merged with `merge_partials`; blocks past the filled length, or outside
      every query's sliding window, are not visited and the unfilled keys of the last one are
      masked out of the values (they may hold NaN). A causal or windowed call of more than
      `QUERY_CHUNK` queries runs in chunks of queries, each over the blocks it sees.
    """
    blocked = functools.partial(_xla_row, dims=dims, scale=scale, block=block)
    limit = _limit(dims, q_offset, kv_length, causal, window)
    first_pos = 0 if kv_pos is None else jnp.min(kv_pos, axis=-1)
    rows = Row(q_offset, kv_length, kv_pos, mask, bias, causal, window)
    branches = [
        lambda: _empty(q, k, v, q_offset, kv_length, mask, bias, dims),
        lambda: jax.vmap(blocked)(q, k, v, rows),
    ]
    case = jnp.where(jnp.any(first_pos < limit), 1, 0)
    dense_fits = dims.kv_heads * dims.rows * dims.kv_seq <= LOGITS_BUDGET or block is not None
    # A sliding window reads only the blocks it overlaps: the blockwise loop, not all logits.
    dense_ok = kv_pos is None and window is None
    if dense_ok and dense_fits and (block is None or block >= dims.kv_seq):
        dense = functools.partial(_dense_row, dims=dims, scale=scale)
        branches.append(lambda: jax.vmap(dense)(q, k, v, rows))
        case = jnp.where(jnp.all(limit >= dims.kv_seq), 2, case)
    with jax.named_scope("flash_xla"):
        return lax.switch(case, branches)


# ---------------------------------------------------------------------------------------------
# The gradient of every fused kernel: a blockwise backward from (out, lse)
# ---------------------------------------------------------------------------------------------


def _backward_row(q, k, v, row: Row, out, lse, d_out, d_lse, *, dims: Dims, scale, block):
    """Cotangents of (q, k, v, bias) for one batch row (`_backward_chunk`); a causal or
    windowed one with many queries in chunks of queries (`_query_chunks`), each over the key
    blocks it sees, their key, value (and broadcast bias) cotangents summed. The rows the last
    chunk repeats get zero cotangents there, so they add nothing twice."""
    n, size = _query_chunks(dims, row)
    if n == 1:
        args = (q, k, v, row, out, lse, d_out, d_lse)
        dq, dk, dv, db = _backward_chunk(*args, dims=dims, scale=scale, block=block)
    else:
        local = dataclasses.replace(dims, q_seq=size)
        per_query_bias = row.bias is not None and row.bias.shape[1] != 1

        def one(carry, c):
            start = jnp.minimum(c * size, dims.q_seq - size)
            q_c, out_c, lse_c, do_c, dl_c = (
                lax.dynamic_slice_in_dim(x, start, size) for x in (q, out, lse, d_out, d_lse)
            )
            # False for the rows the last chunk repeats from the one before it.
            own = start + jnp.arange(size, dtype=jnp.int32) >= c * size
            do_c = jnp.where(own[:, None, None], do_c, jnp.zeros((), do_c.dtype))
            dl_c = jnp.where(own[:, None], dl_c, jnp.zeros((), dl_c.dtype))
            args = (q_c, k, v, _chunk_row(row, start, size), out_c, lse_c, do_c, dl_c)
            dq_c, dk_c, dv_c, db_c = _backward_chunk(*args, dims=local, scale=scale, block=block)
            dk, dv, db = carry
            if db is not None:  # a bias broadcast over the queries
                return (dk + dk_c, dv + dv_c, db + db_c), (dq_c, None)
            return (dk + dk_c, dv + dv_c, db), (dq_c, db_c)

        ct = compute_dtype(q.dtype)
        db0 = None
        if row.bias is not None and not per_query_bias:
            db0 = jnp.zeros(row.bias.shape, ct)
        init = (jnp.zeros(k.shape, ct), jnp.zeros(v.shape, ct), db0)
        refs = (q, k, v, row.q_offset, row.kv_length, row.mask, row.bias, out, lse, d_out, d_lse)
        init = match_vma(init, *refs)
        (dk, dv, db), (dq, db_chunks) = lax.scan(one, init, jnp.arange(n, dtype=jnp.int32))
        dq = _join_chunks(dq, dims.q_seq)
        if db_chunks is not None:  # [n, #heads, size, kv] -> [#heads, q_seq, kv]
            db = _join_chunks(db_chunks, dims.q_seq, axis=1)
    if db is not None:
        assert row.bias is not None
        db = db.astype(row.bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db


def _backward_chunk(q, k, v, row: Row, out, lse, d_out, d_lse, *, dims: Dims, scale, block):
    r"""Cotangents of (q, k, v, bias), in the compute dtype, one block of keys at a time; the
    blocks outside `_block_range` hold no visible key and are skipped (a branch, not a loop
    of dynamic length, so that the backward itself is differentiable).

    With $p_a = e^{x_a - \mathrm{lse}}$: $\partial x_a = p_a(\bar o\cdot v_a - \bar o\cdot o +
    \overline{\mathrm{lse}})$, $\bar q = s\sum_a \partial x_a k_a$,
    $\bar k_a = s\sum \partial x_a q$, $\bar v_a = \sum p_a \bar o$ (FlashAttention-2's
    backward, plus the lse cotangent); the bias is added to $x$, so $\bar b = \partial x$
    (summed over the axes it broadcasts along). Hidden keys get exactly 0 (`where`), whatever
    they hold.
    """
    ct = compute_dtype(q.dtype)
    qr = to_rows(q.astype(ct), dims) * jnp.asarray(scale, ct)
    do = to_rows(d_out.astype(ct), dims)  # [kh, rows, dv]
    o = to_rows(out.astype(ct), dims)
    lse_r = lse_to_rows(lse, dims).astype(ct)
    dl = lse_to_rows(d_lse, dims).astype(ct)
    lse_safe = jnp.where(jnp.isfinite(lse_r), lse_r, 0.0)
    delta = jnp.sum(do * o, axis=-1) - dl  # [kh, rows]
    size = block_size(dims, block)
    ax = dims.seq_axis
    ks, vs = _k_spec(dims), _v_spec(dims)
    has_bias = row.bias is not None

    def block_grads(kb, vb, start, first):
        vis, bias = row.block(dims, size, start, first)
        kb, vb = _hide_unseen(kb, vis, dims), _hide_unseen(vb, vis, dims)
        logits = jnp.einsum(f"kmd,{ks}->kmb", qr, kb)
        if bias is not None:
            logits = logits + bias.astype(ct)
        # Hidden logits leave the exponential (not its result): e^(x - lse) of a hidden key
        # with a large bias overflows, and a second derivative through `where` is 0 * inf.
        p = jnp.exp(jnp.where(vis, logits - lse_safe[..., None], -jnp.inf))
        dp = jnp.einsum(f"kmv,{vs}->kmb", do, vb)
        dx = jnp.where(vis, p * (dp - delta[..., None]), 0.0)
        dq_b = jnp.einsum(f"kmb,{ks}->kmd", dx, kb)
        dk_b = jnp.einsum(f"kmb,kmd->{ks}", dx, qr)
        dv_b = jnp.einsum(f"kmb,kmv->{vs}", p, do)
        # dx [kv_heads, rows, b] -> [heads, q_seq, b], summed to the bias's broadcast shape.
        db_b = None
        if has_bias:
            assert row.bias is not None
            db_b = dx.reshape(dims.heads, dims.q_seq, -1)
            db_b = jnp.sum(
                db_b, axis=tuple(i for i in (0, 1) if row.bias.shape[i] == 1), keepdims=True
            )
        return dq_b, dk_b, dv_b, db_b

    def add_at(total, part, start, axis):
        # Add (not write): keys shared with the previous block got 0 here.
        current = lax.dynamic_slice_in_dim(total, start, size, axis=axis)
        return lax.dynamic_update_slice_in_dim(total, current + part, start, axis=axis)

    def body(i, carry):
        dq, dk, dv, db = carry
        first = i * size
        start = jnp.minimum(first, dims.kv_seq - size)
        kb = lax.dynamic_slice_in_dim(k, start, size, axis=ax).astype(ct)
        vb = lax.dynamic_slice_in_dim(v, start, size, axis=ax).astype(ct)

        def skipped(kb, vb):
            bias_b = None
            if has_bias:
                assert row.bias is not None
                bias_b = jnp.zeros((*row.bias.shape[:2], size), ct)
            zeros = (jnp.zeros_like(qr), jnp.zeros_like(kb), jnp.zeros_like(vb), bias_b)
            return match_vma(zeros, *vma_refs)

        # Under `vmap` the batch's: computed when some row sees the block (a batched
        # predicate would run both branches and select).
        seen = batch_coverage(jnp.where((i >= lo) & (i < hi), COVERED, SKIPPED)) != SKIPPED
        grads = lambda kb, vb: block_grads(kb, vb, start, first)  # noqa: E731
        dq_b, dk_b, dv_b, db_b = lax.cond(seen, grads, skipped, kb, vb)
        dk, dv = add_at(dk, dk_b, start, ax), add_at(dv, dv_b, start, ax)
        if has_bias:
            db = add_at(db, db_b, start, 2)
        return dq + dq_b, dk, dv, db

    vma_refs = (q, k, v, row.q_offset, row.kv_length, row.mask, row.bias, out, lse, d_out, d_lse)
    lo, hi = _block_range(dims, row, size)
    if size >= dims.kv_seq:
        dq, dk, dv, db = block_grads(k.astype(ct), v.astype(ct), 0, 0)
    else:
        db0 = None if row.bias is None else jnp.zeros(row.bias.shape, ct)
        init = (jnp.zeros(qr.shape, ct), jnp.zeros(k.shape, ct), jnp.zeros(v.shape, ct), db0)
        init = match_vma(init, *vma_refs)
        dq, dk, dv, db = lax.fori_loop(0, -(-dims.kv_seq // size), body, init)
    # dk picked up q * scale already (qr is scaled).
    return from_rows(dq * jnp.asarray(scale, ct), dims), dk, dv, db


@dataclasses.dataclass(frozen=True)
class Static:
    """What a kernel call fixes at trace time (hashable): the sizes and layout, the causal flag,
    the sliding window, the scale, the block size (None: the kernel's own), whether the call
    has a filled length (a KV cache) and whether its keys and values are known to be finite."""

    dims: Dims
    causal: bool
    window: tuple[int, int] | None
    scale: float
    block: int | None = None
    has_length: bool = True
    kv_finite: bool = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 9))
def fused(forward, q, k, v, q_offset, kv_length, kv_pos, mask, bias, static: Static):
    """`forward(q, k, v, q_offset, kv_length, kv_pos, mask, bias, None, static=static)` ->
    (out, lse) of softmax, with the blockwise backward (differentiable in q, k, v and the
    bias).

    Kernels whose lse is not differentiable (or whose forward cannot be differentiated at all:
    Pallas, cuDNN's residual, flash-attn-jax, the C++ kernel, a dynamic-length loop) get their
    gradient here. Forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) is not defined for
    them; use reverse mode, or a kernel that JAX differentiates (`"energy"`, `"reference"`).
    """
    return forward(q, k, v, q_offset, kv_length, kv_pos, mask, bias, None, static=static)


def _fused_fwd(forward, q, k, v, q_offset, kv_length, kv_pos, mask, bias, static):
    # Calling `fused` (not `forward`) here keeps the residuals differentiable through this
    # same rule, so the gradient can itself be differentiated (training through attention).
    args = (q, k, v, q_offset, kv_length, kv_pos, mask, bias)
    out, lse = fused(forward, *args, static)  # type: ignore[misc]
    return (out, lse), (*args, out, lse)


def _fused_bwd(forward, static, res, cts):
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, out, lse = res
    d_out, d_lse = cts
    dims, scale, block = static.dims, static.scale, static.block
    row_fn = functools.partial(_backward_row, dims=dims, scale=scale, block=block)
    rows = Row(q_offset, kv_length, kv_pos, mask, bias, static.causal, static.window)
    # On GPUs float32 dots default to TF32 (~1e-3 relative); the backward of float32 inputs
    # asks for full precision (XLA:CPU computes float32 dots in full precision either way).
    precise = jnp.dtype(q.dtype).itemsize >= 4
    with jax.default_matmul_precision("highest") if precise else contextlib.nullcontext():
        dq, dk, dv, db = jax.vmap(row_fn)(q, k, v, rows, out, lse, d_out, d_lse)

    def no_cotangent(x):
        return None if x is None else np.zeros(x.shape, jax.dtypes.float0)

    return (
        dq,
        dk,
        dv,
        no_cotangent(q_offset),
        no_cotangent(kv_length),
        no_cotangent(kv_pos),
        no_cotangent(mask),
        db,
    )


fused.defvjp(_fused_fwd, _fused_bwd)
