r"""Blockwise evaluation of any energy in O(N·d) memory, with its exact gradient.

The queries are cut into chunks and the keys into blocks of `block_size`, so that a tile of
logits stays in cache; a tile that no query sees is skipped (`_on_tile`). For each chunk of
queries, a scan lifts each block to its monoid state and folds it into the running state (in
key order, so ordered monoids hold too), never holding more than one block of logits. The
gradient of $F$ is a custom VJP that keeps only the per-block states (`[blocks, kv_heads,
rows]`): it pulls the cotangent of $F$ back through the readout and the fold to each block's
state, then recomputes each block's logits once more and pulls back through them
(FlashAttention's recomputation, for any monoid).

Attention $o = \partial F/\partial\zeta|_0$ has a custom VJP of its own (`blockwise_attention`),
so that training through it never differentiates a scan, and the VJP of $o$ with cotangent
$\bar o$ is the gradient of $H = \langle\bar o, \partial F/\partial\zeta\rangle$, the
derivative of $F$ along $\bar o$ — a JVP, evaluated blockwise with each block's state and its
tangent.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from .._numerics import (
    COVERED,
    PARTIAL,
    SKIPPED,
    Dims,
    Masking,
    Window,
    as_position,
    batch_coverage,
    compute_dtype,
    default_scale,
    tile_coverage,
    visibility,
)
from ._energies import make_context
from ._local import local_state, readout


AUTO_BLOCK = 256
"""The block size chosen automatically."""
AUTO_ELEMENTS = 1 << 26
"""Above this many logits (`kv_heads * rows * kv_seq`, 256 MiB in float32) the general path
evaluates blockwise; below it the materialised form is the faster one (`docs/energies.md`)."""
TILE_ELEMENTS = 1 << 20
"""Blockwise attention cuts the queries into chunks of at most this many logits per tile
(`heads * chunk * block`, 4 MiB in float32: a tile's elementwise work stays in cache)."""


GRADIENT_ELEMENTS = 1 << 22
"""Above this many logits (16 MiB in float32) F evaluated for its gradient alone (the
diagnostics) goes blockwise: its backward reads the logits more than once, which then no
longer fit in cache (received attention at 1,024 tokens, 8 heads: 44 ms materialised, 13 ms
blockwise)."""


CAUSAL_ELEMENTS = 1 << 23
"""The threshold for causal self-attention (as many queries as keys, of `AUTO_ELEMENTS`):
blockwise evaluation skips about half of its tiles, while the materialised form pays
logits-sized passes for the mask (measured from $2^{24}$ logits on the 2-core CPU of the
benchmarks, `docs/energies.md`)."""


def choose_block(
    dims: Dims,
    block_size: int | None,
    elements: int = AUTO_ELEMENTS,
    causal: bool = False,
) -> int | None:
    """The block size to use: `block_size` if given (0: never), else `AUTO_BLOCK` above
    `elements` logits (above `CAUSAL_ELEMENTS` for causal self-attention, if fewer)."""
    if block_size == 0:
        return None
    if block_size is not None:
        return block_size if block_size < dims.kv_seq else None
    if causal and dims.q_seq == dims.kv_seq:
        elements = min(elements, CAUSAL_ELEMENTS)
    if dims.kv_heads * dims.rows * dims.kv_seq > elements:
        return AUTO_BLOCK
    return None


@dataclasses.dataclass(frozen=True)
class Blocks:
    dims: Dims  # of one block
    blocks: int
    kv_total: int
    scale: float
    causal: bool
    at_zero: bool
    window: Window | None = None


def _split(x, blocks: int, axis: int):
    """`x` padded along `axis` to `blocks` equal blocks, the block axis moved to the front."""
    n = x.shape[axis]
    size = -(-n // blocks)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size * blocks - n)
    x = jnp.pad(x, widths)
    shape = x.shape[:axis] + (blocks, size) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _tile_visibility(cfg: Blocks, mark_b, rules: Masking | None, q_offset, b):
    """Which keys of block `b` the queries at `q_offset` see (`mark_b`: the block's slice of
    the boolean mask and of the key segment ids)."""
    mask_b, kv_segments_b = mark_b
    start = b * cfg.dims.kv_seq
    slots = start + jnp.arange(cfg.dims.kv_seq) < cfg.kv_total
    return visibility(
        cfg.dims,
        causal=cfg.causal,
        mask=mask_b,
        q_offset=q_offset,
        kv_offset=start,
        slots=slots,
        window=cfg.window,
        masking=None if rules is None else rules.keys(kv_segments_b),
    )


def _on_tile(cfg: Blocks, mark_b, rules: Masking | None, q_offset, b, body, skipped, *args):
    """`body(vis, *args)` for the tile of key block `b` and the queries at `q_offset` when a
    query may see one of its keys (`vis` None when every query sees every key), else
    `skipped(*args)`, what an unseen tile contributes. The bounds of the rules decide first
    (`tile_coverage`), without building the tile's visibility; where they cannot tell exactly
    (segments, chunks, a mask or a mask function), the visibility itself decides."""
    mask_b, kv_segments_b = mark_b
    start = b * cfg.dims.kv_seq
    coverage = tile_coverage(
        cfg.dims,
        causal=cfg.causal,
        q_offset=q_offset,
        kv_offset=start,
        kv_valid=jnp.minimum(cfg.kv_total - start, cfg.dims.kv_seq),
        window=cfg.window,
        masking=None if rules is None else rules.keys(kv_segments_b),
        dense=mask_b is not None,
    )
    if coverage is None:
        return body(_tile_visibility(cfg, mark_b, rules, q_offset, b), *args)
    # Causal and window bounds are exact: a tile they call partial has a visible key.
    exact = mask_b is None and (
        rules is None or (kv_segments_b is None and rules.chunk is None and rules.mask_mod is None)
    )

    def partial(*args):
        vis = _tile_visibility(cfg, mark_b, rules, q_offset, b)
        if exact or vis is None:
            return body(vis, *args)
        seen = batch_coverage(jnp.where(jnp.any(vis), PARTIAL, SKIPPED)) != SKIPPED
        return lax.cond(seen, lambda *a: body(vis, *a), skipped, *args)

    branches = {SKIPPED: skipped, PARTIAL: partial, COVERED: lambda *a: body(None, *a)}
    return lax.switch(coverage, [branches[i] for i in sorted(branches)], *args)


def _block_state(cfg: Blocks, energy, q, k_b, v_b, zeta, vis, q_offset, b):
    ctx = make_context(cfg.dims, cfg.scale, q_offset, b * cfg.dims.kv_seq, cfg.kv_total)
    return local_state(energy, q, k_b, v_b, zeta, vis, ctx, cfg.at_zero)


def _context(cfg: Blocks, q_offset):
    return make_context(cfg.dims, cfg.scale, q_offset, 0, cfg.kv_total)


def _forward(cfg: Blocks, energy, q, ks, vs, zeta, marks, rules, q_offset):
    monoid = energy.monoid
    shape = (cfg.dims.kv_heads, cfg.dims.rows)
    init = monoid.identity(shape, compute_dtype(q.dtype))

    def step(state, xs):
        k_b, v_b, mark_b, b = xs

        def body(vis, k_b, v_b):
            return _block_state(cfg, energy, q, k_b, v_b, zeta, vis, q_offset, b)

        s = _on_tile(cfg, mark_b, rules, q_offset, b, body, lambda *_: init, k_b, v_b)
        return monoid.combine(state, s), s

    xs = (ks, vs, marks, jnp.arange(cfg.blocks))
    # Checkpointed bodies: differentiating this scan (training through attention, a second
    # derivative of F) recomputes a block's logits instead of storing every block's.
    merged, states = lax.scan(jax.checkpoint(step), init, xs)
    return readout(energy, merged, _context(cfg, q_offset)), (merged, states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def blockwise_terms(cfg: Blocks, energy, q, ks, vs, zeta, marks, rules, q_offset):
    """F `[q_seq, heads]` of blocked keys `ks[blocks, size, kv_heads, qk]`; `marks` the
    blocks' slices of the mask and key segment ids, `rules` the rest of the masking."""
    return _forward(cfg, energy, q, ks, vs, zeta, marks, rules, q_offset)[0]


def _unwrap(tree):
    """A primal of the custom VJP (with symbolic zeros) as its value, and whether any of its
    leaves is differentiated."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
    value = jax.tree.map(lambda p: p.value, tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
    return value, any(p.perturbed for p in leaves)


def _fwd(cfg, energy, q, ks, vs, zeta, marks, rules, q_offset):
    (energy, w_e), (q, w_q), (ks, w_k), (vs, w_v), (zeta, w_z) = map(
        _unwrap, (energy, q, ks, vs, zeta)
    )
    marks, rules, q_offset = (_unwrap(x)[0] for x in (marks, rules, q_offset))
    f, (merged, states) = _forward(cfg, energy, q, ks, vs, zeta, marks, rules, q_offset)
    # Which of (energy, q, k, v, zeta) are differentiated (Python bools, fixed at trace time):
    # the backward computes only their cotangents (e.g. the energy's alone, for diagnostics).
    wanted = (w_e, w_q, w_k, w_v, w_z)
    return f, (energy, q, ks, vs, zeta, marks, rules, q_offset, merged, states, wanted)


def _bwd(cfg, res, ct):
    energy, q, ks, vs, zeta, marks, rules, q_offset, merged, states, wanted = res
    if isinstance(ct, SymbolicZero):  # F [q_seq, heads] not used: its cotangent is 0
        ct = jnp.zeros((cfg.dims.q_seq, cfg.dims.heads), compute_dtype(q.dtype))
    monoid = energy.monoid
    ctx = _context(cfg, q_offset)
    # Cotangents for the energy's inexact arrays only; its integer ones (a position) get float0.
    fixed = eqx.filter(energy, eqx.is_inexact_array, inverse=True)
    energy = eqx.filter(energy, eqx.is_inexact_array)
    _, pull_readout = jax.vjp(lambda e, m: readout(eqx.combine(e, fixed), m, ctx), energy, merged)
    d_energy, d_merged = pull_readout(ct)
    _, pull_fold = jax.vjp(functools.partial(_fold, monoid), states)
    (d_states,) = pull_fold(d_merged)

    def only_wanted(values):
        return tuple(x if w else None for x, w in zip(values, wanted, strict=True))

    def step(carry, xs):
        k_b, v_b, mark_b, b, d_s = xs

        def body(vis, k_b, v_b, d_s):
            primals = (energy, q, k_b, v_b, zeta)

            def block(*diff):
                it = iter(diff)
                e, q_, k_, v_, z = (
                    next(it) if w else x for x, w in zip(primals, wanted, strict=True)
                )
                e = eqx.combine(e, fixed)
                return _block_state(cfg, e, q_, k_, v_, z, vis, q_offset, b)

            diff = [x for x, w in zip(primals, wanted, strict=True) if w]
            cts = iter(jax.vjp(block, *diff)[1](d_s))
            return tuple(next(cts) if w else None for w in wanted)

        def skipped(k_b, v_b, *_):
            return only_wanted(_zeros_like_tree((d_energy, q, k_b, v_b, zeta)))

        operands = (k_b, v_b, d_s)
        d_e, d_q, d_k, d_v, d_z = _on_tile(
            cfg, mark_b, rules, q_offset, b, body, skipped, *operands
        )
        carry = jax.tree.map(jnp.add, carry, (d_e, d_q, d_z))
        return carry, (d_k, d_v)

    w_e, w_q, _, _, w_z = wanted
    zeros = jax.tree.map(jnp.zeros_like, (d_energy if w_e else None, q if w_q else None))
    zeros += (jnp.zeros_like(zeta) if w_z else None,)
    xs = (ks, vs, marks, jnp.arange(cfg.blocks), d_states)
    (d_e, d_q, d_z), (d_ks, d_vs) = lax.scan(jax.checkpoint(step), zeros, xs)
    if w_e:
        d_energy = eqx.combine(jax.tree.map(jnp.add, d_energy, d_e), zero_cotangents(fixed))
    return d_energy if w_e else None, d_q, d_ks, d_vs, d_z, None, None, None


def zero_cotangents(tree):
    """Zero cotangents of inputs nothing differentiates: masks, segment ids, positions (and
    the arrays a mask function closes over)."""

    def zero(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return jnp.zeros_like(x)
        return np.zeros(np.shape(x), jax.dtypes.float0)

    return jax.tree.map(zero, tree)


blockwise_terms.defvjp(_fwd, _bwd, symbolic_zeros=True)


def _kv_segments(masking: Masking | None, blocks: int):
    if masking is None or masking.kv_segments is None:
        return None
    return _split(masking.kv_segments, blocks, 0)


def blockwise(
    energy,
    q,
    k,
    v,
    zeta,
    mask,
    q_offset,
    dims: Dims,
    *,
    block,
    causal,
    scale,
    at_zero,
    window: Window | None = None,
    masking: Masking | None = None,
):
    """F `[q_seq, heads]` of the whole problem, evaluated in blocks of `block` keys (`window`:
    a sliding window by absolute position; `masking`: the other rules of visibility). A block
    that no query sees is skipped, forward and backward.

    The queries are cut into chunks as attention's are (tiles of at most `TILE_ELEMENTS`
    logits, which stay in cache), each chunk's F its own `blockwise_terms`: F of a row does not
    depend on the other rows."""
    blocks = -(-dims.kv_seq // block)
    size = -(-dims.kv_seq // blocks)
    rows = max(1, TILE_ELEMENTS // max(dims.heads * size, 1))
    chunks = -(-dims.q_seq // min(rows, dims.q_seq))
    chunk = -(-dims.q_seq // chunks)
    local = dataclasses.replace(dims, q_seq=chunk, kv_seq=size)
    s = default_scale(dims.qk, scale)
    cfg = Blocks(local, blocks, dims.kv_seq, s, causal, at_zero, window)
    ks, vs = _split(k, blocks, 0), _split(v, blocks, 0)
    kv_segments = _kv_segments(masking, blocks)
    rules = None if masking is None else masking.keys(None).queries(None)
    ct = compute_dtype(q.dtype)
    if zeta is None:
        zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), ct)
    q_offset = as_position(q_offset)
    if mask is not None:
        mask = jnp.asarray(mask)
    if chunks == 1:
        masks = None if mask is None else _split(mask, blocks, mask.ndim - 1)
        rules_q = None if rules is None or masking is None else rules.queries(masking.q_segments)
        marks = (masks, kv_segments)
        return blockwise_terms(cfg, energy, q, ks, vs, zeta, marks, rules_q, q_offset)
    # Per chunk: its queries, tilts, position, query segment ids and rows of the mask (a mask
    # broadcast over the queries is every chunk's).
    per_chunk: dict[str, Any] = {"q": _split(q, chunks, 0), "zeta": _split(zeta, chunks, 0)}
    per_chunk["offset"] = q_offset + chunk * jnp.arange(chunks, dtype=jnp.int32)
    if masking is not None and masking.q_segments is not None:
        per_chunk["segments"] = _split(masking.q_segments, chunks, 0)
    by_rows = mask is not None and mask.shape[-2] != 1
    if by_rows:
        per_chunk["mask"] = _split_mask(mask, chunks, blocks)
    shared = None if mask is None or by_rows else _split(mask, blocks, mask.ndim - 1)

    def one(c):
        masks = c["mask"] if by_rows else shared
        rules_c = None if rules is None else rules.queries(c.get("segments"))
        marks = (masks, kv_segments)
        return blockwise_terms(cfg, energy, c["q"], ks, vs, c["zeta"], marks, rules_c, c["offset"])

    f = lax.map(one, per_chunk)  # [chunks, chunk, heads]
    return f.reshape(chunks * chunk, dims.heads)[: dims.q_seq]


# ---------------------------------------------------------------------------------------------
# Attention itself: o = dF/dzeta at 0, with a custom VJP that reverse mode never differentiates
# ---------------------------------------------------------------------------------------------


def _fold(monoid, states):
    """The states `[blocks, ...]` combined in block order."""
    leaf = jax.tree.leaves(states)[0]
    init = monoid.identity(leaf.shape[1:], leaf.dtype)
    return lax.scan(lambda c, s: (monoid.combine(c, s), None), init, states)[0]


def _zeros_like_tree(x):
    return jax.tree.map(jnp.zeros_like, x)


def _chunk_states(cfg: Blocks, energy, q_c, ks, vs, marks, rules, off_c):
    """Every key block's monoid state for one chunk of queries, `[blocks, kv_heads, rows]`."""
    monoid = energy.monoid
    ct = compute_dtype(q_c.dtype)
    identity = monoid.identity((cfg.dims.kv_heads, cfg.dims.rows), ct)

    def step(_, xs):
        k_b, v_b, mark_b, b = xs

        def body(vis, k_b, v_b):
            return _block_state(cfg, energy, q_c, k_b, v_b, None, vis, off_c, b)

        return None, _on_tile(cfg, mark_b, rules, off_c, b, body, lambda *_: identity, k_b, v_b)

    return lax.scan(jax.checkpoint(step), None, (ks, vs, marks, jnp.arange(cfg.blocks)))[1]


def _chunk_attention(cfg: Blocks, energy, q_c, ks, vs, marks, rules, off_c):
    """o `[chunk, heads, dv]` of one chunk of queries, and its blocks' states."""
    ct = compute_dtype(q_c.dtype)
    states = _chunk_states(cfg, energy, q_c, ks, vs, marks, rules, off_c)
    ctx = _context(cfg, off_c)
    f, pull = jax.vjp(lambda s: readout(energy, _fold(energy.monoid, s), ctx), states)
    (d_states,) = pull(jnp.ones_like(f))
    zeta = jnp.zeros((cfg.dims.q_seq, cfg.dims.heads, cfg.dims.dv), ct)

    def step(o, xs):
        k_b, v_b, mark_b, b, d_s = xs

        def body(vis, k_b, v_b, d_s):
            def block(z):
                return _block_state(cfg, energy, q_c, k_b, v_b, z, vis, off_c, b)

            return jax.vjp(block, zeta)[1](d_s)[0]

        skipped = lambda *_: jnp.zeros_like(zeta)  # noqa: E731
        return o + _on_tile(cfg, mark_b, rules, off_c, b, body, skipped, k_b, v_b, d_s), None

    xs = (ks, vs, marks, jnp.arange(cfg.blocks), d_states)
    o = lax.scan(jax.checkpoint(step), jnp.zeros_like(zeta), xs)[0]
    return o, states


def _chunk_pullback(cfg: Blocks, energy, q_c, ks, vs, marks, rules, off_c, states, o_bar):
    r"""Cotangents (energy, q chunk, every key block's k, v) of $H = \langle\bar o, o\rangle$
    for one chunk of queries: $H$ is the derivative of $F$ along $\bar o$ in $\zeta$, so each
    block contributes its state $s_b$ and tangent $\dot s_b$ (a JVP in $\zeta$), their
    cotangents come from the fold and readout on `[blocks, kv_heads, rows]` arrays, and one
    more pass pulls them back through each block's recomputed logits."""
    monoid = energy.monoid
    ct = compute_dtype(q_c.dtype)
    zeta = jnp.zeros((cfg.dims.q_seq, cfg.dims.heads, cfg.dims.dv), ct)
    o_bar = o_bar.astype(ct)
    blocks = jnp.arange(cfg.blocks)

    def pair(e, q, k_b, v_b, vis, b):
        def block(z):
            return _block_state(cfg, e, q, k_b, v_b, z, vis, off_c, b)

        return jax.jvp(block, (zeta,), (o_bar,))

    def tangent(_, xs):
        k_b, v_b, mark_b, b, s_b = xs

        def body(vis, k_b, v_b):
            return pair(energy, q_c, k_b, v_b, vis, b)[1]

        skipped = lambda *_: _zeros_like_tree(s_b)  # noqa: E731
        return None, _on_tile(cfg, mark_b, rules, off_c, b, body, skipped, k_b, v_b)

    xs = (ks, vs, marks, blocks, states)
    tangents = lax.scan(jax.checkpoint(tangent), None, xs)[1]
    ctx = _context(cfg, off_c)

    def along(e, s, t):
        f = lambda s: readout(e, _fold(monoid, s), ctx)  # noqa: E731
        return jnp.sum(jax.jvp(f, (s,), (t,))[1])

    h, pull = jax.vjp(along, energy, states, tangents)
    d_energy, d_states, d_tangents = pull(jnp.ones_like(h))

    def step(carry, xs):
        k_b, v_b, mark_b, b, d_s, d_t = xs

        def body(vis, k_b, v_b, d_s, d_t):
            def tile(e, q, k, v):
                return pair(e, q, k, v, vis, b)

            return jax.vjp(tile, energy, q_c, k_b, v_b)[1]((d_s, d_t))

        def skipped(k_b, v_b, *_):
            return _zeros_like_tree((d_energy, q_c, k_b, v_b))

        operands = (k_b, v_b, d_s, d_t)
        d_e, d_q, d_k, d_v = _on_tile(cfg, mark_b, rules, off_c, b, body, skipped, *operands)
        carry = jax.tree.map(jnp.add, carry, (d_e, d_q))
        return carry, (d_k, d_v)

    init = (d_energy, jnp.zeros_like(q_c))
    xs = (ks, vs, marks, blocks, d_states, d_tangents)
    (d_energy, d_q), (d_ks, d_vs) = lax.scan(jax.checkpoint(step), init, xs)
    return d_energy, d_q, d_ks, d_vs


def _chunk_offsets(cfg: Blocks, chunks: int, q_offset):
    return q_offset + cfg.dims.q_seq * jnp.arange(chunks, dtype=jnp.int32)


def _chunk_inputs(cfg: Blocks, qs, marks, rules, q_offset):
    """Per chunk of queries: its masks' tiles and its rules (its own query segment ids)."""
    masks, kv_segments, q_segments = marks
    offsets = _chunk_offsets(cfg, qs.shape[0], q_offset)
    return (masks, q_segments, offsets), lambda m_c, seg_c: (
        (m_c, kv_segments),
        None if rules is None else rules.queries(seg_c),
    )


def _attention_forward(cfg: Blocks, energy, qs, ks, vs, marks, rules, q_offset):
    per_chunk, tile_marks = _chunk_inputs(cfg, qs, marks, rules, q_offset)

    def chunk(_, xs):
        q_c, (m_c, seg_c, off_c) = xs
        marks_c, rules_c = tile_marks(m_c, seg_c)
        return None, _chunk_attention(cfg, energy, q_c, ks, vs, marks_c, rules_c, off_c)

    return lax.scan(chunk, None, (qs, per_chunk))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def blockwise_attention_tiles(cfg: Blocks, energy, qs, ks, vs, marks, rules, q_offset):
    """o `[chunks, chunk, heads, dv]` of query chunks `qs[chunks, chunk, heads, qk]` against
    blocked keys `ks[blocks, block, kv_heads, qk]`; `marks`: mask tiles `[chunks, blocks, ...,
    chunk, block]`, key segment ids `[blocks, block]` and query segment ids `[chunks, chunk]`
    (each None when absent), `rules` the rest of the masking."""
    return _attention_forward(cfg, energy, qs, ks, vs, marks, rules, q_offset)[0]


def _attention_fwd(cfg, energy, qs, ks, vs, marks, rules, q_offset):
    o, states = _attention_forward(cfg, energy, qs, ks, vs, marks, rules, q_offset)
    return o, (energy, qs, ks, vs, marks, rules, q_offset, states)


def _attention_bwd(cfg, res, o_bar):
    energy, qs, ks, vs, marks, rules, q_offset, states = res
    per_chunk, tile_marks = _chunk_inputs(cfg, qs, marks, rules, q_offset)

    # Chunk by chunk: the key cotangents add up in the carry, which nothing differentiates
    # in first-order training, so the memory stays that of the arguments.
    def chunk(carry, xs):
        q_c, (m_c, seg_c, off_c), s_c, o_bar_c = xs
        marks_c, rules_c = tile_marks(m_c, seg_c)
        d_e, d_q, d_ks, d_vs = _chunk_pullback(
            cfg, energy, q_c, ks, vs, marks_c, rules_c, off_c, s_c, o_bar_c
        )
        return jax.tree.map(jnp.add, carry, (d_e, d_ks, d_vs)), d_q

    init = _zeros_like_tree((energy, ks, vs))
    xs = (qs, per_chunk, states, o_bar)
    (d_energy, d_ks, d_vs), d_qs = lax.scan(chunk, init, xs)
    return d_energy, d_qs, d_ks, d_vs, *zero_cotangents((marks, rules, q_offset))


blockwise_attention_tiles.defvjp(_attention_fwd, _attention_bwd)


def _int_scalar_as_float(dtype):
    def cast(x):
        if isinstance(x, bool) or not isinstance(x, int | jax.Array | np.ndarray | np.generic):
            return x
        x = jnp.asarray(x)
        return x.astype(dtype) if x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer) else x

    return cast


def _split_mask(mask, chunks: int, blocks: int):
    """`mask[..., q_seq, kv_seq]` as tiles `[chunks, blocks, ..., chunk, block]` (padded False)."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    by_chunk = _split(mask, chunks, mask.ndim - 2)  # [chunks, ..., chunk, kv_seq]
    return jnp.moveaxis(_split(by_chunk, blocks, by_chunk.ndim - 1), 0, 1)


def blockwise_attention(
    energy,
    q,
    k,
    v,
    mask,
    q_offset,
    dims: Dims,
    *,
    block: int,
    causal: bool,
    scale,
    window: Window | None = None,
    masking: Masking | None = None,
    tile: int = TILE_ELEMENTS,
):
    r"""Attention $\partial F/\partial\zeta|_0$ `[q_seq, heads, dv]`, in tiles of `block` keys
    and as many queries as `tile` logits (`heads * chunk * block`) allow, in the compute dtype.

    Memory: the arguments, the per-tile states (`[blocks, kv_heads, group * q_seq]` per leaf),
    and a few tiles of logits; the VJP adds the cotangents of q, k and v and nothing that grows
    with the number of blocks times the sequence.
    """
    ct = compute_dtype(q.dtype)
    blocks = -(-dims.kv_seq // block)
    size = -(-dims.kv_seq // blocks)
    if masking is not None and masking.q_segments is not None:
        # Packed documents: chunks of half the queries straddle fewer documents, so more tiles
        # are skipped (a row of 8 documents in 8K tokens: 12% faster, benchmarks/README.md).
        tile = max(1, tile // 2)
    rows = max(1, tile // max(dims.heads * size, 1))
    chunks = -(-dims.q_seq // min(rows, dims.q_seq))
    chunk = -(-dims.q_seq // chunks)
    local = dataclasses.replace(dims, q_seq=chunk, kv_seq=size)
    s = default_scale(dims.qk, scale)
    cfg = Blocks(local, blocks, dims.kv_seq, s, causal, True, window)
    # An integer scalar parameter (`Softmax(beta=2)`) enters as a float: the VJP then adds up
    # real cotangents, and the cast outside gives the integer its zero cotangent.
    energy = jax.tree.map(_int_scalar_as_float(ct), energy)
    # In the compute dtype: the cotangents of q, k and v add up over tiles in float32 or wider.
    qs = _split(q.astype(ct), chunks, 0)
    ks, vs = _split(k.astype(ct), blocks, 0), _split(v.astype(ct), blocks, 0)
    q_segments = None
    if masking is not None and masking.q_segments is not None:
        q_segments = _split(masking.q_segments, chunks, 0)
    marks = (_split_mask(mask, chunks, blocks), _kv_segments(masking, blocks), q_segments)
    rules = None if masking is None else masking.keys(None).queries(None)
    args = (cfg, energy, qs, ks, vs, marks, rules, as_position(q_offset))
    o = jnp.asarray(blockwise_attention_tiles(*args))
    return o.reshape(chunks * chunk, dims.heads, dims.dv)[: dims.q_seq]
