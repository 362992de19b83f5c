r"""The one merge of partial attention results, and the schedules that apply it across devices.

A *partial* is what one block of keys contributes for a query: its free energy at $\zeta = 0$,
$\mathrm{lse} = \log\sum_{a \in \mathrm{block}} e^{x_a}$, and (optionally) its normalised output
$o = \sum_{a\in\mathrm{block}} e^{x_a - \mathrm{lse}} v_a$. Because log-sum-exp is associative, two
partials merge into the partial of the union (paper, section 5.1), and the order does not matter.
Every path in treeattn that combines blocks — the sharded energy, tree decoding, the ring
baseline, the blockwise local kernel — uses `merge_partials` or its p-ary form here.

Partials travel as `(out, lse)` with `out[..., d]` and `lse[...]` on the same leading axes: for
attention `out[batch, q_seq, heads, dv]` and `lse[batch, q_seq, heads]`, the convention of
`jax.nn.dot_product_attention`'s residual, used throughout treeattn.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float


Reduction = Literal["allreduce", "butterfly", "hierarchical"]
"""How partials are merged across devices (see `allreduce_partials`)."""
REDUCTIONS: tuple[Reduction, ...] = get_args(Reduction)
AxisName = str | tuple[str, ...]
T = TypeVar("T")


def merge_partials(
    out_a: Float[Array, "*batch d"] | None,
    lse_a: Float[Array, "*batch"],
    out_b: Float[Array, "*batch d"] | None,
    lse_b: Float[Array, "*batch"],
) -> tuple[Float[Array, "*batch d"] | None, Float[Array, "*batch"]]:
    r"""Merge two partial attention results over disjoint blocks of keys.

    $$\mathrm{lse} = \log\big(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}\big), \qquad
      o = e^{\mathrm{lse}_a - \mathrm{lse}}\, o_a + e^{\mathrm{lse}_b - \mathrm{lse}}\, o_b.$$

    `lse` is the free energy at $\zeta = 0$ of the keys a partial covers; an empty block has
    $\mathrm{lse} = -\infty$ (and any `out`) and is the identity of the merge. Computed with the
    shift $m = \max(\mathrm{lse}_a, \mathrm{lse}_b)$, never $e^{\mathrm{lse}}$ itself (which
    overflows float32 above 88.7). Commutative bit for bit, so devices that merge the same two
    partials in either order hold identical results. `out` may be None (energies only).

    **Returns:** `(out, lse)` of the union, in the dtypes of the inputs.
    """
    batch = jnp.shape(lse_a)
    outs = [jnp.shape(o) for o in (out_a, out_b) if o is not None]
    if jnp.shape(lse_b) != batch or len(set(outs)) > 1 or any(o[:-1] != batch for o in outs):
        raise ValueError(
            "merge_partials: lse_a and lse_b must share one shape [*batch] and out_a, out_b one "
            f"shape [*batch, d]; got lse_a {batch}, lse_b {jnp.shape(lse_b)}, outs {outs}"
        )
    m = jnp.maximum(lse_a, lse_b)
    finite = jnp.isfinite(m)
    m_safe = jnp.where(finite, m, 0.0)
    w_a = jnp.exp(lse_a - m_safe)
    w_b = jnp.exp(lse_b - m_safe)
    total = w_a + w_b
    lse = jnp.where(finite, m_safe + jnp.log(jnp.where(finite, total, 1.0)), m)
    if out_a is None or out_b is None:
        return None, lse
    denom = jnp.where(finite, total, 1.0)[..., None]
    # An empty partial's `out` is ignored outright (`where`, not a 0 weight times it).
    part_a = jnp.where(w_a[..., None] == 0, 0.0, out_a * w_a[..., None])
    part_b = jnp.where(w_b[..., None] == 0, 0.0, out_b * w_b[..., None])
    out = (part_a + part_b) / denom
    return out.astype(out_a.dtype), lse


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def axis_size(axis_name: AxisName) -> int:
    """Number of devices along `axis_name` (a name or a tuple of names), inside `shard_map`."""
    return math.prod(lax.axis_size(a) for a in _axes(axis_name))


def check_reduction(fn: str, reduction: str, axis_name: AxisName) -> None:
    """`reduction` is a known schedule that fits `axis_name` (checked once, at the boundary)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "hierarchical" and len(_axes(axis_name)) != 2:
        raise ValueError(
            f"{fn}: reduction='hierarchical' needs two mesh axes (slow, fast), e.g. "
            f"('node', 'local'); got axis_name={axis_name!r}"
        )


def check_bound_axes(fn: str, axis_name: AxisName) -> None:
    """Inside `shard_map`: every name in `axis_name` is a bound mesh axis."""
    for a in _axes(axis_name):
        try:
            lax.axis_size(a)
        except NameError:
            raise ValueError(
                f"{fn}: axis_name {a!r} is not a mesh axis bound here; call inside "
                f"jax.shard_map over a mesh that has an axis named {a!r}"
            ) from None


def _psum_merge(out, lse, axis_name: AxisName):
    """The p-ary form of `merge_partials` as two all-reduces: a max, then one packed sum."""
    m = lax.pmax(lax.stop_gradient(lse), axis_name)  # the shift; pmax has no derivative rule
    finite = jnp.isfinite(m)
    m_safe = jnp.where(finite, m, 0.0)
    w = jnp.exp(lse - m_safe)
    if out is None:
        total = lax.psum(w, axis_name)
        num = None
    else:
        num, total = lax.psum((out * w[..., None], w), axis_name)
    # An all-reduce max may skip a NaN (XLA:CPU's does) and leave m = -inf; the NaN still
    # reaches the sum, and gives NaN, never the -inf of "sees no key" (NaN in, NaN out).
    ok = finite | jnp.isnan(total)
    lse = jnp.where(ok, m_safe + jnp.log(jnp.where(ok, total, 1.0)), m)
    if num is None:
        return None, lse
    out = num / jnp.where(ok, total, 1.0)[..., None]
    return out, lse


def _butterfly(x: T, combine: Callable[[T, T], T], axis_name: AxisName) -> T:
    """All-reduce `x` with `combine` in ceil(log2 p) rounds of `lax.ppermute` (recursive doubling).

    For p not a power of two, the p devices are the real ranks of P = 2^ceil(log2 p) virtual
    ranks. After the first round (distance P/2), the upper half of the virtual ranks mirrors the
    lower half exactly, so a missing upper rank is stood in for by its lower twin: in the later
    rounds that twin also sends to the missing rank's partner (a second, concurrent ppermute).
    Every device receives once per round, and all rounds stay ceil(log2 p).
    """
    n = axis_size(axis_name)
    if n == 1:
        return x
    rounds = math.ceil(math.log2(n))
    half = 2 ** (rounds - 1)
    idx = lax.axis_index(axis_name)

    def permute(value, pairs: Sequence[tuple[int, int]]):
        return jax.tree.map(lambda leaf: lax.ppermute(leaf, axis_name, perm=list(pairs)), value)

    def select(flags: np.ndarray, a, b):
        pick = jnp.asarray(flags)[idx]
        return jax.tree.map(lambda u, w: jnp.where(pick, u, w), a, b)

    # Round 0: distance `half`; a lower rank whose twin i + half does not exist keeps its value.
    pairs = [(i, i + half) for i in range(half) if i + half < n]
    pairs += [(j, i) for i, j in pairs]
    received = permute(x, pairs)
    has_partner = np.array([i >= half or i + half < n for i in range(n)])
    x = select(has_partner, combine(x, received), x)
    for r in range(1, rounds):
        distance = half >> r
        direct, via_twin = [], []
        for i in range(n):
            j = i ^ distance
            if j < n:
                direct.append((j, i))
            else:  # j is a missing upper rank: its lower twin j - half holds the same value
                via_twin.append((j - half, i))
        received = permute(x, direct)
        if via_twin:
            from_twin = np.zeros(n, bool)
            from_twin[[i for _, i in via_twin]] = True
            received = select(from_twin, permute(x, via_twin), received)
        x = combine(x, received)
    return x


def allreduce_partials(
    out: Float[Array, "*batch d"] | None,
    lse: Float[Array, "*batch"],
    *,
    axis_name: AxisName,
    reduction: Reduction = "allreduce",
) -> tuple[Float[Array, "*batch d"] | None, Float[Array, "*batch"]]:
    r"""Merge every device's partial `(out, lse)` along `axis_name`; call inside `shard_map`.

    Schedules (paper, sections 5.1 and 5.3):

    - `"allreduce"`: `lax.pmax` of lse, then one `lax.psum` of the packed numerator and
      denominator $(o\, e^{\mathrm{lse}-m},\ e^{\mathrm{lse}-m})$ — two all-reduces; XLA or NCCL
      chooses the topology.
    - `"butterfly"`: an explicit tree, $\lceil\log_2 p\rceil$ rounds of `lax.ppermute`, each
      exchanging the partial and merging it with [`merge_partials`][treeattn.energy.merge_partials].
      The result is the same on every device, but JAX's replication checker cannot see that:
      call inside `shard_map(..., check_vma=False)`.
    - `"hierarchical"`: `axis_name = (slow, fast)`, e.g. `("node", "local")`: all-reduce over
      the fast axis first, then over the slow one, so only one merged partial per device
      crosses the slow links.

    **Returns:** the merged `(out, lse)`, the same on every device.
    """
    check_reduction("allreduce_partials", reduction, axis_name)
    check_bound_axes("allreduce_partials", axis_name)
    return merge_across(out, lse, axis_name=axis_name, reduction=reduction)


def merge_across(out, lse, *, axis_name: AxisName, reduction: Reduction):
    """`allreduce_partials` without its argument checks, for callers that checked them."""
    if reduction == "allreduce":
        return _psum_merge(out, lse, axis_name)
    if reduction == "hierarchical":
        slow, fast = _axes(axis_name)
        out, lse = _psum_merge(out, lse, fast)
        return _psum_merge(out, lse, slow)

    if out is None:
        return None, _butterfly(lse, lambda a, b: merge_partials(None, a, None, b)[1], axis_name)
    # One buffer per round: the output with its lse as one more feature.
    d = out.shape[-1]
    packed = jnp.concatenate([out.astype(lse.dtype), lse[..., None]], axis=-1)

    def combine(a, b):
        o, lse_ab = merge_partials(a[..., :d], a[..., d], b[..., :d], b[..., d])
        assert o is not None
        return jnp.concatenate([o, lse_ab[..., None]], axis=-1)

    merged = _butterfly(packed, combine, axis_name)
    return merged[..., :d].astype(out.dtype), merged[..., d]


def allreduce_sum(x: Any, *, axis_name: AxisName, reduction: Reduction = "allreduce") -> Any:
    """Sum a pytree over `axis_name` with the same schedule (Algorithm 2, line 5).

    `"allreduce"` is one `lax.psum` of the whole pytree (a single all-reduce); `"butterfly"`
    uses ceil(log2 p) ppermute rounds; `"hierarchical"` sums over the fast axis, then the slow.
    """
    check_reduction("allreduce_sum", reduction, axis_name)
    check_bound_axes("allreduce_sum", axis_name)
    return sum_across(x, axis_name=axis_name, reduction=reduction)


def sum_across(x: Any, *, axis_name: AxisName, reduction: Reduction) -> Any:
    """`allreduce_sum` without its argument checks, for callers that checked them."""
    if reduction == "allreduce":
        return lax.psum(x, axis_name)
    if reduction == "hierarchical":
        slow, fast = _axes(axis_name)
        return lax.psum(lax.psum(x, fast), slow)
    return _butterfly(x, lambda a, b: jax.tree.map(jnp.add, a, b), axis_name)


# ---------------------------------------------------------------------------------------------
# Monoids: how the per-key contributions of an energy reduce
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Monoid:
    r"""How an energy's per-key contributions reduce to the free energy $F$.

    A *state* is a pytree whose leaves have the shape of the reduced axes (one entry per query
    row). The fields:

    - `lift(elements, visible)`: a block of keys (the last axis of every leaf of `elements`, in
      key order) to its state; a key that is not visible contributes the identity.
    - `combine(a, b)`: the state of block `a` followed by block `b` (associative; when
      `commutative` is False the order is the key order).
    - `identity(shape, dtype)`: the state of an empty block, by a stated rule (0 for a sum,
      $-\infty$ for a log-sum-exp), never NaN.
    - `across(state, axis_name, reduction, rank)`: inside `shard_map`, the state of the union of
      every device's block — the collective schedule of the monoid — and a residual for
      `pullback`. `rank` is the position of the device's block in the sequence (its first key),
      which an ordered monoid folds by.
    - `pullback(local, merged, residual, ct)`: the cotangent of a device's own state, given the
      cotangent `ct` of the merged one. It needs no communication (paper, Algorithm 2): for a
      log-sum-exp it is $e^{\mathrm{lse}_d - \mathrm{lse}}\,\bar c$, for a sum $\bar c$.
    - `readout(state)`: the scalar $F$ of every row (an energy may change it).
    """

    name: str
    lift: Callable[[Any, Any], Any]
    combine: Callable[[Any, Any], Any]
    identity: Callable[[tuple[int, ...], Any], Any]
    commutative: bool
    across: Callable[[Any, AxisName, Reduction, Array], tuple[Any, Any]]
    pullback: Callable[[Any, Any, Any, Any], Any]
    readout: Callable[[Any], Array]
    reductions: int = 1
    """Collectives of the forward across devices with the `"allreduce"` schedule."""
    lift_after: Callable[[Any, Any, Any], Any] | None = None
    """Optional `lift_after(first, elements, visible)` = `combine(first, lift(elements,
    visible))` in one pass (a sink folded into the block's own reduction)."""
    lift_unit: Callable[[Any, Any], Any] | None = None
    r"""Optional `lift` for elements whose weights are known to be at most 1 (log-weights
    $\le 0$, as stick-breaking's at $\zeta = 0$): the same state without a running maximum."""


def _lse_pullback(local, merged, residual, ct):
    del residual
    finite = jnp.isfinite(merged)
    w = jnp.exp(local - jnp.where(finite, merged, 0.0))
    return jnp.where(finite, w, 0.0) * ct


def _lse_parts(x: Array, visible: Array, first: Array):
    """The shift, the shifted weights and their sum of a masked log-sum-exp over the last
    axis, preceded by one more entry `first` per row (-inf: none).

    Guarded with `maximum` alone (no select on the reduced rows): an all-masked row has the
    shift -max_float and z = 0, and the weights, the reduction and the product with the values
    stay one fusion for XLA."""
    y = jnp.where(visible, x, jnp.asarray(-jnp.inf, x.dtype))
    big = jnp.finfo(x.dtype).max
    m = jnp.maximum(jnp.max(y, axis=-1, initial=-jnp.inf), first)
    shift = jnp.maximum(lax.stop_gradient(m), -big)
    p = jnp.exp(y - shift[..., None])
    return shift, p, jnp.sum(p, axis=-1) + jnp.exp(first - shift)


@jax.custom_jvp
def _lse_lift(x: Array, visible: Array, first: Array) -> Array:
    shift, _, z = _lse_parts(x, visible, first)
    # log(0) = -inf: an all-masked row reads out -inf; a NaN among visible entries gives NaN.
    return shift + jnp.log(z)


@_lse_lift.defjvp
def _lse_lift_jvp(primals, tangents):
    r"""$dF = \sum_a w_a\,dx_a + w_0\,dx_0$ with the weights $w = e^{x - m} / z$ of the visible
    entries (and of `first`, $x_0$), $z = \sum e^{x - m}$.

    Written out rather than left to autodiff through the logarithm, and without a select on
    the rows: under `jax.grad` the reduction, the weights and what contracts them (attention's
    product with V) then form one fusion. A hidden entry has weight exactly 0 and a finite
    tangent (the caller gives hidden entries finite elements), so it adds exactly 0; an
    all-masked row has $z = 0$, F = -inf and tangent 0. Differentiable again (second order,
    cumulants): the primal is this function itself.
    """
    x, visible, first = primals
    dx, _, d_first = tangents
    shift, p, z = _lse_parts(x, visible, first)
    dz = jnp.sum(p * dx, axis=-1) + jnp.exp(first - shift) * d_first
    # A nonempty row has z >= 1 (its maximum contributes e^0); an empty one z = 0 and dz = 0.
    return _lse_lift(x, visible, first), dz / jnp.maximum(z, 0.5)


def _lse_lift_masked(x: Array, visible: Array | None) -> Array:
    """`masked_logsumexp` (in `_numerics`) with the derivative of `_lse_lift_jvp`."""
    return _lse_lift_after(jnp.full(x.shape[:-1], -jnp.inf, x.dtype), x, visible)


def _lse_lift_after(first: Array, x: Array, visible: Array | None) -> Array:
    """`combine(first, lift(x, visible))` for the log-sum-exp, in one pass over `x`."""
    visible = jnp.ones((), bool) if visible is None else visible
    return _lse_lift(x, visible, jnp.broadcast_to(first, x.shape[:-1]).astype(x.dtype))


def _pair_parts(a: Array, b: Array):
    big = jnp.finfo(jnp.result_type(a, b)).max
    shift = jnp.maximum(lax.stop_gradient(jnp.maximum(a, b)), -big)
    p_a, p_b = jnp.exp(a - shift), jnp.exp(b - shift)
    return shift, p_a, p_b, p_a + p_b


@jax.custom_jvp
def _safe_logaddexp(a: Array, b: Array) -> Array:
    """log(e^a + e^b) with -inf as its identity, never NaN (the lse of `merge_partials`),
    commutative bit for bit; computed and differentiated as `_lse_lift` over the pair, with
    arithmetic alone (no select), so that it fuses with what reads it."""
    shift, _, _, z = _pair_parts(a, b)
    return shift + jnp.log(z)


@_safe_logaddexp.defjvp
def _safe_logaddexp_jvp(primals, tangents):
    (a, b), (da, db) = primals, tangents
    _, p_a, p_b, z = _pair_parts(a, b)
    # z >= 1 unless both are -inf (then z = 0 and the tangent is 0).
    return _safe_logaddexp(a, b), (p_a * da + p_b * db) / jnp.maximum(z, 0.5)


LOGSUMEXP = Monoid(
    name="logsumexp",
    lift=_lse_lift_masked,
    combine=_safe_logaddexp,
    identity=lambda shape, dtype: jnp.full(shape, -jnp.inf, dtype),
    commutative=True,
    across=lambda s, axis_name, reduction, rank: (
        merge_across(None, s, axis_name=axis_name, reduction=reduction)[1],
        None,
    ),
    pullback=_lse_pullback,
    readout=lambda s: s,
    reductions=2,
    lift_after=_lse_lift_after,
)
r"""$\log\sum_a e^{x_a}$: the monoid of softmax (today's `merge_partials`, without outputs).
Identity $-\infty$; across devices a max, then a sum (`"allreduce"`), or the butterfly."""


def _sum_lift(x: Array, visible: Array | None) -> Array:
    if visible is not None:
        x = jnp.where(visible, x, jnp.zeros((), x.dtype))
    return jnp.sum(x, axis=-1)


SUM = Monoid(
    name="sum",
    lift=_sum_lift,
    combine=jnp.add,
    identity=lambda shape, dtype: jnp.zeros(shape, dtype),
    commutative=True,
    across=lambda s, axis_name, reduction, rank: (
        sum_across(s, axis_name=axis_name, reduction=reduction),
        None,
    ),
    pullback=lambda local, merged, residual, ct: ct,
    readout=lambda s: s,
)
r"""$\sum_a x_a$: identity 0, one all-reduce (or the butterfly) across devices, no running max."""


def _unit_weights(x: Array, visible: Array | None) -> Array:
    if visible is not None:
        x = jnp.where(visible, x, jnp.asarray(-jnp.inf, x.dtype))
    return jnp.exp(x)


@jax.custom_jvp
def _lse_unit(x: Array, visible: Array | None) -> Array:
    r"""$\log\sum_a e^{x_a}$ over the visible entries of the last axis, for entries known to
    be $\le 0$: no shift, so no pass for a running maximum. The weights are at most 1, so
    nothing overflows; an all-masked row reads out $\log 0 = -\infty$ (the identity)."""
    return jnp.log(jnp.sum(_unit_weights(x, visible), axis=-1))


@_lse_unit.defjvp
def _lse_unit_jvp(primals, tangents):
    r"""$dF = \sum_a e^{x_a}\,dx_a / z$, $z = \sum_a e^{x_a}$, as `_lse_lift_jvp`, and
    differentiable again (cumulants, training through attention). An all-masked row has
    $z = 0$ and tangent 0; a row whose weights sum below the smallest normal number (a share of
    a stick of length 1) is divided by that number instead, and so moves by less than it."""
    x, visible = primals
    dx, _ = tangents
    p = _unit_weights(x, visible)
    z = jnp.maximum(jnp.sum(p, axis=-1), jnp.finfo(x.dtype).tiny)
    # Numerator and divisor scaled by a power of two that brings z near 1 (exact): the powers
    # of the divisor in the higher derivatives (cumulants) then neither underflow nor overflow.
    s = lax.stop_gradient(jnp.exp2(-jnp.floor(jnp.log2(z))))
    return _lse_unit(x, visible), (jnp.sum(p * dx, axis=-1) * s) / (z * s)


def _damping(log_r, visible):
    r"""$\log r_a$ of the visible keys (0 for hidden ones), its inclusive suffix sum
    $\sum_{b \ge a}\log r_b$ and $\log R$, the block's total."""
    if visible is not None:
        log_r = jnp.where(visible, log_r, jnp.zeros((), log_r.dtype))
    suffix = lax.cumsum(log_r, axis=log_r.ndim - 1, reverse=True)
    log_total = suffix[..., 0] if log_r.shape[-1] else jnp.sum(log_r, axis=-1)
    return log_r, suffix, log_total


def _affine_parts(elements, visible):
    r"""The log-weights of the block's keys (damped by every later key) and $\log R$."""
    log_w, log_r = elements
    # Each key's weight is damped by every later key of the block: the exclusive suffix sum.
    # The log-sum-exp masks the weights itself (no select in their derivative).
    log_r, suffix, log_total = _damping(log_r, visible)
    return log_w + (suffix - log_r), log_total


def affine_lift_unit_damped(log_u: Array, log_r: Array, visible: Array | None):
    r"""The `LOG_AFFINE` state of a block, with weights at most 1, from $(\log u_a, \log r_a)$
    where each key's own factor damps it too: $w_a = u_a r_a$, so that
    $\log Z = \log\sum_a u_a\prod_{b \ge a} r_b$ by an inclusive suffix sum. Equal to
    `lift_unit` of the elements $(\log u_a + \log r_a, \log r_a)$, without adding $\log r_a$
    to every key and subtracting it again (stick-breaking's $u_a = e^{x_a}$)."""
    _, suffix, log_total = _damping(log_r, visible)
    return _lse_unit(log_u + suffix, visible), log_total


def _affine_lift(elements, visible):
    log_w, log_total = _affine_parts(elements, visible)
    return _lse_lift_masked(log_w, visible), log_total


def _affine_lift_unit(elements, visible):
    log_w, log_total = _affine_parts(elements, visible)
    return _lse_unit(log_w, visible), log_total


def _affine_combine(a, b):
    """Block `a`, then block `b`: (Z, R) = (Z_a R_b + Z_b, R_a R_b) in logarithms."""
    (log_z_a, log_r_a), (log_z_b, log_r_b) = a, b
    return _safe_logaddexp(log_z_a + log_r_b, log_z_b), log_r_a + log_r_b


def _fold_by_rank(gathered, rank):
    """Fold the states of every device (leading axis) in the order of `rank`."""
    order = jnp.argsort(rank, stable=True)
    states = jax.tree.map(lambda x: jnp.take(x, order, axis=0), gathered)
    out = jax.tree.map(lambda x: x[0], states)
    for i in range(1, rank.shape[0]):
        out = _affine_combine(out, jax.tree.map(lambda x, i=i: x[i], states))
    return out


def _affine_across(state, axis_name, reduction, rank):
    del reduction  # an ordered fold: one all-gather of the states and the ranks, packed
    log_z, log_r = state
    width = jnp.dtype(log_z.dtype).itemsize
    int_type = {4: jnp.int32, 8: jnp.int64}[width]
    # The rank travels as the bits of one more float (moved, never computed with).
    rank_bits = lax.bitcast_convert_type(jnp.asarray(rank).astype(int_type), log_z.dtype)
    packed = jnp.concatenate([log_z.ravel(), log_r.ravel(), rank_bits[None]])
    gathered = lax.all_gather(packed, axis_name)
    n = log_z.size
    states = (
        gathered[:, :n].reshape(-1, *log_z.shape),
        gathered[:, n : 2 * n].reshape(-1, *log_z.shape),
    )
    ranks = lax.bitcast_convert_type(lax.stop_gradient(gathered[:, 2 * n]), int_type)
    me = lax.axis_index(axis_name)
    return _fold_by_rank(states, ranks), (states, ranks, me)


def _affine_pullback(local, merged, residual, ct):
    states, ranks, me = residual
    _, vjp = jax.vjp(lambda s: _fold_by_rank(s, ranks), states)
    (ct_states,) = vjp(ct)
    return jax.tree.map(lambda x: jnp.take(x, me, axis=0), ct_states)


LOG_AFFINE = Monoid(
    name="log_affine",
    lift=_affine_lift,
    combine=_affine_combine,
    identity=lambda shape, dtype: (jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype)),
    commutative=False,
    across=_affine_across,
    pullback=_affine_pullback,
    readout=lambda s: _safe_logaddexp(*s),
    lift_unit=_affine_lift_unit,
)
r"""Ordered products: a block is the affine map $y \mapsto R\,y + Z$ with $Z = \sum_a w_a
\prod_{b > a} r_b$ and $R = \prod_a r_b$, kept as $(\log Z, \log R)$ from per-key elements
$(\log w_a, \log r_a)$. Composition is associative but not commutative (stick-breaking). Across
devices the states and block positions are gathered once and folded locally in position order,
so a permuted placement of the blocks is folded by rank, not by device index. Identity
$(-\infty, 0)$; the default readout is $\log(Z + R)$."""


def product(*monoids: Monoid) -> Monoid:
    r"""The product of monoids: a state is the tuple of one state per factor, each part of the
    elements reduces with its own monoid, and every operation acts part by part.

    Associative (commutative when every factor is); across devices each factor runs its own
    schedule, and XLA packs the factors' all-reduces of one kind into one (two log-sum-exps
    cost a max and a sum, as one does; `reductions` counts them unpacked, an upper bound).
    The default readout is the sum of the
    factors' readouts, $\log(Z_1 Z_2\cdots)$ for log-partition functions; an energy over a
    product (e.g. `Differential`, $F_1 - \lambda F_2$) reads out its own combination.
    """
    if not monoids:
        raise ValueError("product: needs at least one monoid")

    def lift(elements, visible):
        return tuple(m.lift(e, visible) for m, e in zip(monoids, elements, strict=True))

    def combine(a, b):
        return tuple(m.combine(x, y) for m, x, y in zip(monoids, a, b, strict=True))

    def across(state, axis_name, reduction, rank):
        parts = [
            m.across(s, axis_name, reduction, rank) for m, s in zip(monoids, state, strict=True)
        ]
        return tuple(p[0] for p in parts), tuple(p[1] for p in parts)

    def pullback(local, merged, residual, ct):
        parts = zip(monoids, local, merged, residual, ct, strict=True)
        return tuple(m.pullback(lo, me, r, c) for m, lo, me, r, c in parts)

    def readout(state):
        out = monoids[0].readout(state[0])
        for m, s in zip(monoids[1:], state[1:], strict=True):
            out = out + m.readout(s)
        return out

    def unit(elements, visible):
        parts = zip(monoids, elements, strict=True)
        return tuple(m.lift_unit(e, visible) for m, e in parts)  # pyright: ignore[reportOptionalCall]

    return Monoid(
        name="product(" + ", ".join(m.name for m in monoids) + ")",
        lift=lift,
        combine=combine,
        identity=lambda shape, dtype: tuple(m.identity(shape, dtype) for m in monoids),
        commutative=all(m.commutative for m in monoids),
        across=across,
        pullback=pullback,
        readout=readout,
        reductions=sum(m.reductions for m in monoids),
        lift_unit=unit if all(m.lift_unit is not None for m in monoids) else None,
    )
