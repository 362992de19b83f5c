r"""Any energy over keys at absolute positions with a given visibility: locally, merged across
devices with the monoid's schedule (a tree), or with the keys passed around a ring; and its
reference twin, folded key by key.

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

from .._numerics import (
    LAYOUTS,
    Dims,
    Layout,
    as_position,
    check_choice,
    compute_dtype,
    default_scale,
)
from .._partials import AxisName, Reduction, axis_size, check_reduction
from ._energies import Context, Energy, check_energy, make_context
from ._generic import Sharded, sharded_terms
from ._local import readout, reference_terms


Schedule = Literal["tree", "ring"]
"""How the keys of several devices meet: their monoid states merge (`"tree"`), or the keys
themselves travel around the ring of devices (`"ring"`, the baseline)."""
SCHEDULES: tuple[Schedule, ...] = ("tree", "ring")


def _setup(fn, q, k, v, energy, kv_positions, q_offset, kv_total, kv_layout, scale):
    check_energy(fn, energy)
    check_choice(fn, "kv_layout", kv_layout, LAYOUTS)
    head_major = kv_layout == "bhsd"
    (q_seq, heads, qk), dv = q.shape, v.shape[-1]
    kv_heads, kv = (k.shape[0], k.shape[1]) if head_major else (k.shape[1], k.shape[0])
    dims = Dims(q_seq=q_seq, kv_seq=kv, heads=heads, kv_heads=kv_heads, qk=qk, dv=dv)
    s = default_scale(dims.qk, scale)
    positions = as_position(kv_positions)
    if positions.shape != (dims.kv_seq,):
        raise ValueError(
            f"{fn}: kv_positions must have shape [kv] = ({dims.kv_seq},), got {positions.shape}"
        )
    ctx = make_context(dims, s, q_offset, 0, kv_total)._replace(k_pos=positions)
    return dims, s, ctx, head_major


def energy_partial(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv kv_heads qk"] | Float[Array, "kv_heads kv qk"],
    v: Float[Array, "kv kv_heads dv"] | Float[Array, "kv_heads kv dv"],
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
    kv_layout: Layout = "bshd",
    kv_finite: bool = False,
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

    `kv_layout="bhsd"` takes K and V head-major, `[kv_heads, kv, d]` (a KV cache), and reads
    them where they lie: per kv head one product for the logits and one for the values.
    `kv_finite=True` says every key and value is finite (a zero-initialised cache): the pass
    that keeps a non-finite key or value that a row does not see from reaching it — a read and
    a write of K and V — is then skipped. `kv_total` is the number of key slots of the whole
    sequence (the default bias of [`Sigmoid`][treeattn.energy.Sigmoid] reads it).
    Differentiable in q, k, v and the energy's parameters.

    **Returns:** `(out[q_seq, heads, dv]` in the input dtype, `F[q_seq, heads]` float32 or
    float64`)`; a row that sees no key gets `out = 0` and the readout of the monoid's identity
    (`-inf` for a log-sum-exp).
    """
    fn = "energy_partial"
    check_choice(fn, "schedule", schedule, SCHEDULES)
    if axis_name is not None:
        check_reduction(fn, reduction, axis_name)
    args = (q, k, v, energy, kv_positions, q_offset, kv_total, kv_layout, scale)
    dims, s, ctx, head_major = _setup(fn, *args)
    zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))
    first = jnp.min(ctx.k_pos) if rank is None else as_position(rank)
    cfg = Sharded(dims, s, kv_total, axis_name or "", reduction, True, head_major, kv_finite)
    if axis_name is not None and schedule == "ring":
        # The source is this device's own copy: its gradient is complete on every device (each
        # folds every block), so no reduction of it may be inserted.
        zeta = zeta + jnp.sum(jnp.zeros_like(k[:1, :1, :1])).astype(zeta.dtype)

    def terms(zeta) -> Array:
        if axis_name is None:
            return readout(energy, cfg.local_state(energy, q, k, v, zeta, visible, ctx), ctx)
        if schedule == "ring":
            return _ring(cfg, energy, q, k, v, zeta, visible, ctx, first, axis_name)
        offset = as_position(q_offset)
        return sharded_terms(cfg, energy, q, k, v, zeta, visible, offset, first, ctx.k_pos)

    f, pull = jax.vjp(terms, zeta)
    (out,) = pull(jnp.ones_like(f))
    return out.astype(q.dtype), f


def energy_partial_reference(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv kv_heads qk"] | Float[Array, "kv_heads kv qk"],
    v: Float[Array, "kv kv_heads dv"] | Float[Array, "kv_heads kv dv"],
    **kwargs,
) -> tuple[Float[Array, "q_seq heads dv"], Float[Array, "q_seq heads"]]:
    r"""The twin of [`energy_partial`][treeattn.energy.energy_partial] on one device, with
    its arguments `energy`, `kv_positions`, `q_offset`, `kv_total`, `visible`, `scale` and
    `kv_layout`: the energy's definition folded key by key in the order given (after the
    once-only term), each key's weight $w_a = \partial F/\partial t_a$ at a tilt $t = 0$, and
    $o = \sum_a w_a v_a$ — no `tilt_at_zero`, no blockwise lift, nothing shared with the fast
    path but the energy itself. Non-finite keys and values that a row does not see never reach
    it. For small shapes (the fold is sequential in the keys).

    **Returns:** `(out, F)` as `energy_partial`.
    """
    return _reference_partial("energy_partial_reference", q, k, v, **kwargs)


def _reference_partial(
    fn, q, k, v, *, energy, kv_positions, q_offset, kv_total, visible=None, scale=None, **layout
):
    args = (q, k, v, energy, kv_positions, q_offset, kv_total, layout.pop("kv_layout", "bshd"))
    if layout:
        raise TypeError(f"{fn}: unexpected arguments {sorted(layout)}")
    _, _, ctx, head_major = _setup(fn, *args, scale)
    return reference_terms(energy, q, k, v, visible, ctx, head_major=head_major)


def _ring(cfg: Sharded, energy: Energy, q, k, v, zeta, visible, ctx: Context, rank, axis_name):
    """F of every block of the ring: each hop brings the previous device's block."""
    p = axis_size(axis_name)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def state(keys):
        k, v, pos, vis, _ = keys
        return cfg.local_state(energy, q, k, v, zeta, vis, ctx._replace(k_pos=pos))

    def hop(keys, _):
        keys = lax.ppermute(keys, axis_name, perm=ring)
        return keys, (state(keys), keys[-1])

    keys = (k, v, ctx.k_pos, visible, rank)
    _, (states, ranks) = lax.scan(hop, keys, None, length=p - 1)
    states = jax.tree.map(lambda s0, s: jnp.concatenate([s0[None], s]), state(keys), states)
    ranks = jnp.concatenate([rank[None], ranks])
    monoid = energy.monoid
    if not monoid.commutative:  # fold by position, whatever device each block started on
        order = jnp.argsort(ranks, stable=True)
        states = jax.tree.map(lambda x: jnp.take(x, order, axis=0), states)
    merged = jax.tree.map(lambda x: x[0], states)
    for i in range(1, p):
        merged = monoid.combine(merged, jax.tree.map(lambda x, i=i: x[i], states))
    return readout(energy, merged, ctx)
