r"""Blockwise evaluation of any energy in O(N·d) memory, with its exact gradient.

The keys are cut into blocks of `block_size`; a scan lifts each block to its monoid state and
folds it into the running state (in key order, so ordered monoids hold too), never holding more
than one block of logits. The gradient is a custom VJP that keeps only the per-block states
(`[blocks, kv_heads, rows]`): it pulls the cotangent of $F$ back through the readout and the
fold to each block's state, then recomputes each block's logits once more and pulls back through
them (FlashAttention's recomputation, for any monoid).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._numerics import Dims, compute_dtype, default_scale, visibility
from ._energies import make_context
from ._generic import local_state, readout


AUTO_BLOCK = 512
"""The block size chosen automatically."""
AUTO_ELEMENTS = 1 << 24
"""Above this many logits (`kv_heads * rows * kv_seq`, 64 MiB in float32) the general path
evaluates blockwise."""


def choose_block(dims: Dims, block_size: int | None) -> int | None:
    """The block size to use: `block_size` if given (0: never), else `AUTO_BLOCK` above
    `AUTO_ELEMENTS` logits."""
    if block_size == 0:
        return None
    if block_size is not None:
        return block_size if block_size < dims.kv_seq else None
    if dims.kv_heads * dims.rows * dims.kv_seq > AUTO_ELEMENTS:
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


def _split(x, blocks: int, axis: int):
    """`x` padded along `axis` to `blocks` equal blocks, the block axis moved to the front."""
    n = x.shape[axis]
    size = -(-n // blocks)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size * blocks - n)
    x = jnp.pad(x, widths)
    shape = x.shape[:axis] + (blocks, size) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _block_state(cfg: Blocks, energy, q, k_b, v_b, zeta, mask_b, q_offset, b):
    start = b * cfg.dims.kv_seq
    slots = start + jnp.arange(cfg.dims.kv_seq) < cfg.kv_total
    vis = visibility(
        cfg.dims, causal=cfg.causal, mask=mask_b, q_offset=q_offset, kv_offset=start, slots=slots
    )
    ctx = make_context(cfg.dims, cfg.scale, q_offset, start, cfg.kv_total)
    return local_state(energy, q, k_b, v_b, zeta, vis, ctx, cfg.at_zero)


def _context(cfg: Blocks, q_offset):
    return make_context(cfg.dims, cfg.scale, q_offset, 0, cfg.kv_total)


def _forward(cfg: Blocks, energy, q, ks, vs, zeta, masks, q_offset):
    monoid = energy.monoid
    shape = (cfg.dims.kv_heads, cfg.dims.rows)
    init = monoid.identity(shape, compute_dtype(q.dtype))

    def step(state, xs):
        k_b, v_b, mask_b, b = xs
        s = _block_state(cfg, energy, q, k_b, v_b, zeta, mask_b, q_offset, b)
        return monoid.combine(state, s), s

    xs = (ks, vs, masks, jnp.arange(cfg.blocks))
    # Checkpointed bodies: differentiating this scan (training through attention, a second
    # derivative of F) recomputes a block's logits instead of storing every block's.
    merged, states = lax.scan(jax.checkpoint(step), init, xs)
    return readout(energy, merged, _context(cfg, q_offset)), (merged, states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def blockwise_terms(cfg: Blocks, energy, q, ks, vs, zeta, masks, q_offset):
    """F `[q_seq, heads]` of blocked keys `ks[blocks, size, kv_heads, qk]`."""
    return _forward(cfg, energy, q, ks, vs, zeta, masks, q_offset)[0]


def _fwd(cfg, energy, q, ks, vs, zeta, masks, q_offset):
    f, (merged, states) = _forward(cfg, energy, q, ks, vs, zeta, masks, q_offset)
    return f, (energy, q, ks, vs, zeta, masks, q_offset, merged, states)


def _bwd(cfg, res, ct):
    energy, q, ks, vs, zeta, masks, q_offset, merged, states = res
    monoid = energy.monoid
    ctx = _context(cfg, q_offset)
    _, pull_readout = jax.vjp(lambda e, m: readout(e, m, ctx), energy, merged)
    d_energy, d_merged = pull_readout(ct)

    def fold(states):
        leaf = jax.tree.leaves(states)[0]
        init = monoid.identity(leaf.shape[1:], leaf.dtype)
        return lax.scan(lambda c, s: (monoid.combine(c, s), None), init, states)[0]

    _, pull_fold = jax.vjp(fold, states)
    (d_states,) = pull_fold(d_merged)

    def step(carry, xs):
        k_b, v_b, mask_b, b, d_s = xs

        def block(e, q, k_b, v_b, z):
            return _block_state(cfg, e, q, k_b, v_b, z, mask_b, q_offset, b)

        _, pull = jax.vjp(block, energy, q, k_b, v_b, zeta)
        d_e, d_q, d_k, d_v, d_z = pull(d_s)
        carry = jax.tree.map(jnp.add, carry, (d_e, d_q, d_z))
        return carry, (d_k, d_v)

    zeros = jax.tree.map(jnp.zeros_like, (d_energy, q, zeta))
    xs = (ks, vs, masks, jnp.arange(cfg.blocks), d_states)
    (d_e, d_q, d_z), (d_ks, d_vs) = lax.scan(jax.checkpoint(step), zeros, xs)
    d_energy = jax.tree.map(jnp.add, d_energy, d_e)
    return d_energy, d_q, d_ks, d_vs, d_z, _float0(masks), _float0(q_offset)


def _float0(x):
    return None if x is None else np.zeros(np.shape(x), jax.dtypes.float0)


blockwise_terms.defvjp(_fwd, _bwd)


def blockwise(energy, q, k, v, zeta, mask, q_offset, dims: Dims, *, block, causal, scale, at_zero):
    """F `[q_seq, heads]` of the whole problem, evaluated in blocks of `block` keys."""
    blocks = -(-dims.kv_seq // block)
    local = dataclasses.replace(dims, kv_seq=-(-dims.kv_seq // blocks))
    cfg = Blocks(local, blocks, dims.kv_seq, default_scale(dims.qk, scale), causal, at_zero)
    ks, vs = _split(k, blocks, 0), _split(v, blocks, 0)
    masks = None if mask is None else _split(jnp.asarray(mask), blocks, mask.ndim - 1)
    if zeta is None:
        zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))
    return blockwise_terms(cfg, energy, q, ks, vs, zeta, masks, q_offset)
