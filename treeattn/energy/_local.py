r"""One block of keys: its logits, elements and monoid state, and the readout of $F$.

Everything that evaluates an energy — materialised, blockwise, sharded, on a mesh, per row of
a KV cache — lifts its keys here (`local_state`) and reads the merged state out here
(`readout`). `reference_terms` is the independent twin: the energy's definition folded key by
key, for the reference functions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

from .._numerics import (
    Dims,
    compute_dtype,
    finite_rows,
    from_rows,
    lse_from_rows,
    poison,
    rows_visibility,
    tilt as tilt_of,
    tilt_at_zero,
    to_rows,
)
from ._energies import Context, Energy, combine_once


def finite_kv(
    k: Float[Array, "kv kv_heads qk"],
    v: Float[Array, "kv kv_heads dv"],
    head_major: bool = False,
    rows: int = 0,
) -> tuple[Array, Array, Bool[Array, "kv_heads kv"]]:
    """K and V with their non-finite rows set to 0, and which (kv head, key) those were: the
    logits of those keys become NaN (`bad_logits`), so a query that does not see them is
    untouched and one that does gets NaN (see `finite_rows`). With `head_major`, K and V are
    `[kv_heads, kv, d]`. `rows` (the query rows per kv head whose logits the flags will
    poison) chooses only where the flags are reduced, not what they are; it is ignored with
    `head_major`."""
    k0, bad_k = finite_rows(k)
    v0, bad_v = finite_rows(v)
    if head_major:
        return k0, v0, bad_k | bad_v
    if rows < k.shape[-1] + v.shape[-1]:
        return k0, v0, (bad_k | bad_v).T
    # More logits per key than elements of its key and value: the flags are reduced again in
    # the logits' layout. Transposed after the reduction, they are fused into every pass over
    # the logits that adds the NaN bias and read there with a stride, which keeps XLA:CPU from
    # vectorising those passes (stick-breaking's softplus pass took 2.7-3.1x as long). With few
    # rows (decoding) reading K and V in the transposed order costs more than that.
    bad = jnp.any(~jnp.isfinite(jnp.swapaxes(k, 0, 1)), axis=-1)
    return k0, v0, bad | jnp.any(~jnp.isfinite(jnp.swapaxes(v, 0, 1)), axis=-1)


def bad_logits(x: Float[Array, "kv_heads rows kv"], bad: Bool[Array, "kv_heads kv"]):
    """Logits `x` with those of non-finite key/value rows set to NaN (see `finite_kv`)."""
    return poison(x, bad[:, None, :])


def scaled_logits(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    dims: Dims,
    scale: float,
) -> Float[Array, "kv_heads rows kv_seq"]:
    r"""$s\,q_{i,h}\cdot k_{a,g(h)}$ in the rows layout, in at least float32.

    The scale multiplies the queries, before the product: the logits are then one array that
    the max and the exponential both read. Scaling the product instead lets XLA recompute it in
    each fusion, rounded differently (contracted), which at a huge scale puts the maximum
    logit far from the max and turns the softmax into inf/inf.
    """
    ct = compute_dtype(q.dtype)
    qs = to_rows(q.astype(ct), dims) * jnp.asarray(scale, ct)
    return jnp.einsum("kmd,skd->kms", qs, k.astype(ct))


def block_logits(
    energy: Energy, q, k, v, vis, ctx: Context, *, head_major: bool = False, finite: bool = False
):
    """The energy's logits `[kv_heads, rows, kv]` (or a pytree of them) of a block of keys
    (hidden ones set to 0, so they never reach its elements nor their gradient), the visibility
    in the rows layout, and K, V in the compute dtype (non-finite rows zeroed unless
    `finite`)."""
    dims = ctx.dims
    ct = compute_dtype(q.dtype)
    bad = None
    if not finite:
        k, v, bad = finite_kv(k, v, head_major, rows=dims.rows)
    # A head-major block is read where it lies: the transposed view folds into the product.
    k_keys = jnp.swapaxes(k, 0, 1) if head_major else k
    x = energy.logits(to_rows(q.astype(ct), dims), k_keys.astype(ct), ctx)
    if bad is not None:
        x = jax.tree.map(lambda x: bad_logits(x, bad), x)
    vis_rows = rows_visibility(vis, dims)
    if vis_rows is not None:
        x = jax.tree.map(lambda x: jnp.where(vis_rows, x, jnp.zeros((), x.dtype)), x)
    return x, vis_rows, v.astype(ct)


def local_state(
    energy: Energy,
    q,
    k,
    v,
    zeta,
    vis,
    ctx: Context,
    at_zero: bool,
    once: bool = False,
    *,
    head_major: bool = False,
    finite: bool = False,
) -> Any:
    """The monoid state `[kv_heads, rows]` of this block of keys (visible ones only); with
    `once`, preceded by the energy's once-only term (when this block is the whole sequence).

    K and V are `[kv, kv_heads, d]`, or `[kv_heads, kv, d]` with `head_major` (a cache read
    where it lies). `finite`: the caller guarantees every key and value is finite, so the pass
    that zeroes non-finite rows (a read and a write of the whole block) is skipped."""
    dims = ctx.dims
    ct = compute_dtype(q.dtype)
    x, vis_rows, v = block_logits(energy, q, k, v, vis, ctx, head_major=head_major, finite=finite)
    scaled = energy._scaled_tilt(ctx, ct)
    if scaled is None:
        elements = lambda x, tilt: energy.elements(x, tilt, ctx)  # noqa: E731
    else:
        elements = scaled[1]
    if zeta is None:
        tilt = jnp.zeros((), ct)
    else:
        zeta = to_rows(zeta.astype(ct), dims)
        if scaled is not None:
            zeta = scaled[0][..., None] * zeta
        tilt = (tilt_at_zero if at_zero else tilt_of)(zeta, v, head_major)
    first = energy.once(ctx) if once else None
    if first is None and (at_zero or zeta is None):
        direct = energy._lift_at_zero(x, tilt, vis_rows, ctx)
        if direct is not None:
            return direct
    # At zeta = 0 an energy whose hidden elements are the identity is lifted without a mask.
    unmasked = at_zero and zeta is not None and energy._hides_itself()
    e, lift_vis = elements(x, tilt), None if unmasked else vis_rows
    if first is None:
        # At zeta = 0 weights known to be at most 1 need no running maximum.
        unit = (at_zero or zeta is None) and energy._unit_weights_at_zero()
        lift = energy.monoid.lift_unit if unit else None
        return (lift or energy.monoid.lift)(e, lift_vis)
    if energy.monoid.lift_after is None:
        return combine_once(energy, energy.monoid.lift(e, lift_vis), ctx)
    # The sink as one more entry of the block's own reduction: one pass, no separate merge.
    return energy.monoid.lift_after(first, e, lift_vis)


def readout(energy: Energy, state, ctx: Context):
    """F of every (query, head), `[q_seq, heads]`, from the merged state."""
    return lse_from_rows(energy.readout(combine_once(energy, state, ctx), ctx), ctx.dims)


def reference_terms(
    energy: Energy, q, k, v, vis, ctx: Context, *, head_major: bool = False
) -> tuple[Float[Array, "q_seq heads dv"], Float[Array, "q_seq heads"]]:
    r"""`(out, F)` from the energy's definition, key by key: its logits $x_a$ and elements
    $e(x_a, t_a)$ are materialised for a tilt $t_a$ per key, the monoid folds them one key at a
    time in key order (after the once-only term), and the weight of key $a$ is
    $w_a = \partial F/\partial t_a$ at $t = 0$, so that $o = \sum_a w_a v_a$. Shares nothing
    with `local_state` but the energy itself (meant for small shapes: the fold is sequential)."""
    dims = ctx.dims
    ct = compute_dtype(q.dtype)
    x, seen, v = block_logits(energy, q, k, v, vis, ctx, head_major=head_major)
    rows = (dims.kv_heads, dims.rows, dims.kv_seq)
    seen = jnp.ones(rows, bool) if seen is None else jnp.broadcast_to(seen, rows)
    monoid = energy.monoid

    def terms(tilt: Array) -> Array:
        e = energy.elements(x, tilt, ctx)
        empty = monoid.lift(jax.tree.map(lambda t: t[..., :0], e), None)

        def step(state, key):
            e_a, seen_a = key
            one = monoid.lift(jax.tree.map(lambda t: t[..., None], e_a), seen_a[..., None])
            return monoid.combine(state, one), None

        keys = (jax.tree.map(lambda t: jnp.moveaxis(t, -1, 0), e), jnp.moveaxis(seen, -1, 0))
        state, _ = lax.scan(step, combine_once(energy, empty, ctx), keys)
        return energy.readout(state, ctx)

    f, pull = jax.vjp(terms, jnp.zeros(rows, ct))
    (w,) = pull(jnp.ones_like(f))  # the weight of every key, [kv_heads, rows, kv]
    out = jnp.einsum("kms,ksv->kmv" if head_major else "kms,skv->kmv", w, v)
    return from_rows(out, dims).astype(q.dtype), lse_from_rows(f, dims)
