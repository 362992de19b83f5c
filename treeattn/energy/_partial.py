r"""Any energy over keys at absolute positions with a given visibility: locally, merged across
devices with the monoid's schedule (a tree), or with the keys passed around a ring.

This is the general path of `treeattn.decode` (a KV cache whose slots carry positions, filled
lengths, windows and masks decided by `treeattn._numerics.visibility`); the softmax kernels
are its fast path for `Softmax()`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from .._numerics import as_position, check_choice, compute_dtype, default_scale
from .._partials import AxisName, Reduction, axis_size, check_reduction
from ._checks import dims_of
from ._energies import Context, Energy, check_energy, make_context
from ._generic import Sharded, local_state, readout, sharded_terms


Schedule = Literal["tree", "ring"]
"""How the keys of several devices meet: their monoid states merge (`"tree"`), or the keys
themselves travel around the ring of devices (`"ring"`, the baseline)."""
SCHEDULES: tuple[Schedule, ...] = ("tree", "ring")


def energy_partial(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv kv_heads qk"],
    v: Float[Array, "kv kv_heads dv"],
    *,
    energy: Energy,
    kv_positions: Int[Array, " kv"],
    q_offset: int | Int[Array, ""],
    kv_total: int,
    visible: Bool[Array, "#kv_heads #group #q_seq kv"] | None = None,
    scale: float | None = None,
    axis_name: AxisName | None = None,
    reduction: Reduction = "allreduce",
    schedule: Schedule = "tree",
    rank: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "q_seq heads dv"], Float[Array, "q_seq heads"]]:
    r"""Attention and free energy at $\zeta = 0$ of a block of keys at absolute positions.

    Query $i$ sits at position `q_offset + i`, key $a$ at `kv_positions[a]` (what an energy's
    logits read: ALiBi distances; an ordered monoid folds the keys in the order given, so pass
    them in position order). `visible` is the grouped visibility of
    `treeattn._numerics.visibility` (`[#kv_heads, #group, #q_seq, kv]`, None: every key).
    Returns $o = \partial F/\partial\zeta|_0$ and $F(0)$ per (query, head), with

    $$F(\zeta) = \mathrm{readout}\Big(\mathrm{once}\oplus\bigoplus_{a\ \mathrm{visible}}
      \mathrm{lift}\big(e(x_a, \zeta\cdot v_a)\big)\Big).$$

    - `axis_name=None`: these keys only.
    - `axis_name` (inside `shard_map`, the keys being this device's shard), `schedule="tree"`:
      the states merge with the monoid's collective schedule `reduction` (a log-sum-exp: a max
      and a sum; a sum: one all-reduce; an ordered monoid: one all-gather folded by `rank`,
      default the block's first position); the output costs one more reduction (Algorithm 2).
    - `schedule="ring"`: the keys (with their positions, visibility and rank) travel around
      the ring with `lax.ppermute`, p - 1 hops; each device folds every block's state, by
      rank for an ordered monoid. No reduction; the result is replicated by construction (run
      it in a `shard_map` with `check_vma=False`).

    `kv_total` is the number of key slots of the whole sequence (the default bias of
    [`Sigmoid`][treeattn.energy.Sigmoid] reads it). Differentiable in q, k, v and the energy's
    parameters.

    **Returns:** `(out[q_seq, heads, dv]` in the input dtype, `F[q_seq, heads]` float32 or
    float64`)`; a row that sees no key gets `out = 0` and the readout of the monoid's identity
    (`-inf` for a log-sum-exp).
    """
    fn = "energy_partial"
    check_energy(fn, energy)
    check_choice(fn, "schedule", schedule, SCHEDULES)
    if axis_name is not None:
        check_reduction(fn, reduction, axis_name)
    dims = dims_of(q, k, v)
    s = default_scale(dims.qk, scale)
    positions = as_position(kv_positions)
    if positions.shape != (dims.kv_seq,):
        raise ValueError(
            f"{fn}: kv_positions must have shape [kv] = ({dims.kv_seq},), got {positions.shape}"
        )
    ctx = make_context(dims, s, q_offset, 0, kv_total)._replace(k_pos=positions)
    zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))
    first = jnp.min(positions) if rank is None else as_position(rank)
    cfg = Sharded(dims, s, kv_total, axis_name or "", reduction, True)
    if axis_name is not None and schedule == "ring":
        # The source is this device's own copy: its gradient is complete on every device (each
        # folds every block), so no reduction of it may be inserted.
        zeta = zeta + jnp.sum(jnp.zeros_like(k[:1, :1, :1])).astype(zeta.dtype)

    def terms(zeta) -> Array:
        if axis_name is None:
            return readout(energy, local_state(energy, q, k, v, zeta, visible, ctx, True), ctx)
        if schedule == "ring":
            return _ring(energy, q, k, v, zeta, visible, ctx, first, axis_name)
        offset = as_position(q_offset)
        return sharded_terms(cfg, energy, q, k, v, zeta, visible, offset, first, ctx.k_pos)

    f, pull = jax.vjp(terms, zeta)
    (out,) = pull(jnp.ones_like(f))
    return out.astype(q.dtype), f


def _ring(energy: Energy, q, k, v, zeta, visible, ctx: Context, rank, axis_name: AxisName):
    """F of every block of the ring: each hop brings the previous device's block."""
    p = axis_size(axis_name)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def state(block):
        k, v, pos, vis, _ = block
        return local_state(energy, q, k, v, zeta, vis, ctx._replace(k_pos=pos), True)

    def hop(block, _):
        block = lax.ppermute(block, axis_name, perm=ring)
        return block, (state(block), block[-1])

    block = (k, v, ctx.k_pos, visible, rank)
    _, (states, ranks) = lax.scan(hop, block, None, length=p - 1)
    states = jax.tree.map(lambda s0, s: jnp.concatenate([s0[None], s]), state(block), states)
    ranks = jnp.concatenate([rank[None], ranks])
    monoid = energy.monoid
    if not monoid.commutative:  # fold by position, whatever device each block started on
        order = jnp.argsort(ranks, stable=True)
        states = jax.tree.map(lambda x: jnp.take(x, order, axis=0), states)
    merged = jax.tree.map(lambda x: x[0], states)
    for i in range(1, p):
        merged = monoid.combine(merged, jax.tree.map(lambda x, i=i: x[i], states))
    return readout(energy, merged, ctx)
