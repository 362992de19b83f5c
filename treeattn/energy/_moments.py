r"""Higher cumulants of the values: repeated derivatives of the free energy in ζ (eq. 12).

$F_{i,h}(\zeta)$ is the cumulant-generating function of the values under query $(i, h)$'s
attention distribution $p$, so its $n$-th derivative at 0 is the $n$-th cumulant:
the mean (attention), the covariance $\sum_a p_a (v_a-\mu)(v_a-\mu)^\top$, the third central
moment, and so on.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Int

from .._numerics import as_position
from ._checks import check_multihead, check_q_offset
from ._energies import SOFTMAX, Energy, check_energy
from ._generic import cumulant


def value_moments(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    order: int,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads *dv"]:
    r"""The `order`-th cumulant tensor of the values, for every query and head.

    $$\kappa^{(n)}_{i,h} = \frac{\partial^n F_{i,h}}{\partial\zeta^n}\Big|_{\zeta=0},$$

    computed by differentiating the free energy `order` times (reverse mode once, then forward
    mode). Because $F_\mathrm{tot}$ is a sum of independent per-query terms, its derivative tensor
    is block diagonal; differentiating along a source shared by all queries,
    $\zeta_{i,h} = u$, yields every block at once for the cost of $dv^{n-1}$ gradients, so this
    is meant for small `dv`.

    **Arguments:** as [`energy_attention`][treeattn.energy.energy_attention], plus `order >= 1`.
    With another `energy`, the derivatives of that energy's $F$ (see its docstring for what
    they mean).

    **Returns:** `[q_seq, heads, dv, ..., dv]` (`order` trailing `dv` axes) in the dtype of the
    inputs: `order=1` is attention, `order=2` the covariance, `order=3` the third central moment.
    A query with no visible key gets 0.
    """
    if not isinstance(order, int) or isinstance(order, bool) or order < 1:
        raise ValueError(f"value_moments: order must be an integer >= 1, got {order!r}")
    return _cumulant("value_moments", q, k, v, order, causal, mask, scale, q_offset, energy)


def _cumulant(fn, q, k, v, order, causal, mask, scale, q_offset, energy) -> Array:
    check_multihead(fn, q, k, v, mask=mask, scale=scale)
    check_q_offset(fn, q_offset)
    check_energy(fn, energy)
    q_pos = as_position(q_offset)
    return cumulant(energy, q, k, v, mask, q_pos, order=order, causal=causal, scale=scale)


def value_covariance(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads dv dv"]:
    r"""The covariance of the values under each query's attention distribution.

    $$\Sigma_{i,h} = \frac{\partial^2 F_{i,h}}{\partial\zeta^2}\Big|_{\zeta=0}
      = \sum_a p_a (v_a - \mu)(v_a - \mu)^\top, \qquad \mu = \sum_a p_a v_a,$$

    the Hessian of the free energy in the source (the second cumulant of eq. 12). Its trace says
    how spread out the values a head averages are: 0 when attention picks one key (or all the
    keys it sees carry the same value), large when it mixes distant values.

    **Arguments:** as [`energy_attention`][treeattn.energy.energy_attention]. With another
    `energy`, its Hessian in $\zeta$ (for [`Sigmoid`][treeattn.energy.Sigmoid]
    $\sum_a \sigma(1-\sigma)\,v_a v_a^\top$).

    **Returns:** `[q_seq, heads, dv, dv]`, symmetric positive semi-definite, in the dtype of the
    inputs; 0 for a query with no visible key.
    """
    return _cumulant("value_covariance", q, k, v, 2, causal, mask, scale, q_offset, energy)
