r"""The likelihood view of attention (paper, section 4.2): exponential tilting.

The log-likelihood of eq. (21) is
$\Gamma(\zeta, z) = \sum_{i,h} z_{i,h}\cdot\zeta_{i,h} - F_{i,h}(\zeta_{i,h})$.
Its stationary point in $z$ is $\zeta = 0$ and the one in $\zeta$ is
$z = \partial F/\partial\zeta$: at the joint stationary point $z$ is the attention output.
For a given $z$, maximising $\Gamma$ over $\zeta$ (a concave problem, since $F$ is convex) finds
the source $\zeta^*$ whose tilted distribution $p_a \propto p^{(0)}_a e^{\zeta^*\cdot v_a}$ has
mean $z$; among all distributions over the visible keys with mean $z$ it is the closest to the
attention weights $p^{(0)}$ in KL divergence, and
$\max_\zeta\Gamma = \mathrm{KL}(p\,\|\,p^{(0)}) - F(0)$.
"""

from __future__ import annotations

from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._checks import (
    check_multihead,
    check_q_offset,
    check_source,
    compute_dtype,
    default_scale,
    nonempty,
    visibility,
)
from ._free_energy import energy_terms


def log_likelihood(
    zeta: Float[Array, "q_seq heads dv"],
    z: Float[Array, "q_seq heads dv"],
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
) -> Float[Array, ""]:
    r"""The attention log-likelihood $\Gamma$ of eq. (21).

    $$\Gamma(\zeta, z) = \sum_{i,h} \big(z_{i,h}\cdot\zeta_{i,h} - F_{i,h}(\zeta_{i,h})\big)$$

    Concave in $\zeta$, linear in $z$; $\partial\Gamma/\partial z = \zeta$ and
    $\partial\Gamma/\partial\zeta = z - \partial F/\partial\zeta$, so $(\zeta, z) = (0,
    \mathrm{attention})$ is its stationary point. Queries with no visible key have no
    distribution to tilt and are left out of the sum.

    **Arguments:** the sources `zeta` and outputs `z`, both `[q_seq, heads, dv]`, then as
    [`multihead_free_energy`][treeattn.energy.multihead_free_energy].

    **Returns:** the scalar $\Gamma$ in float32 (float64 for float64 inputs).
    """
    fn = "log_likelihood"
    dims = check_multihead(fn, q, k, v, zeta=zeta, mask=mask)
    check_source(fn, z, dims, name="z")
    check_q_offset(fn, q_offset)
    vis = visibility(dims, causal=causal, mask=mask, q_offset=q_offset)
    ct = compute_dtype(q.dtype)
    live = nonempty(dims, vis)
    f = energy_terms(q, k, v, zeta, vis, default_scale(dims.qk, scale), dims)
    zeta_c, z_c = zeta.astype(ct), z.astype(ct)
    return jnp.sum(jnp.where(live, jnp.sum(z_c * zeta_c, axis=-1) - f, 0.0))


class TiltedSource(eqx.Module):
    r"""The result of [`tilted_source`][treeattn.energy.tilted_source].

    - `zeta`: the source $\zeta^*$, `[q_seq, heads, dv]`, in float32 (float64 for float64
      inputs).
    - `kl`: $\mathrm{KL}(p_{\zeta^*}\,\|\,p_0)$ for each query and head, `[q_seq, heads]`: how
      far the attention weights must move for the head to output `z`.
    - `residual`: $\max |\partial F/\partial\zeta(\zeta^*) - z|$ over all queries (scalar).
    - `num_steps`: solver iterations taken.
    - `converged`: whether `residual` met the tolerance.
    """

    zeta: Float[Array, "q_seq heads dv"]
    kl: Float[Array, "q_seq heads"]
    residual: Float[Array, ""]
    num_steps: Int[Array, ""]
    converged: Bool[Array, ""]


def tilted_source(
    z: Float[Array, "q_seq heads dv"],
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    solver: optax.GradientTransformation | None = None,
    max_steps: int = 500,
    rtol: float = 1e-5,
    atol: float = 0.0,
) -> TiltedSource:
    r"""The source $\zeta^*$ that tilts attention to output `z`: solves
    $\partial F/\partial\zeta(\zeta^*) = z$.

    $$\zeta^* = \arg\max_\zeta\, \Gamma(\zeta, z) = \arg\min_\zeta\, \sum_{i,h}
      F_{i,h}(\zeta_{i,h}) - z_{i,h}\cdot\zeta_{i,h}$$

    a smooth convex problem, solved from $\zeta = 0$ by L-BFGS (`optax.lbfgs` with a zoom line
    search) or any optax `solver`. `z` = attention gives $\zeta^* = 0$ at step 0.

    A solution exists when each $z_{i,h}$ lies in the relative interior of the convex hull of the
    values the query sees; it is unique up to directions in which those values do not vary, and
    starting from 0 the solver returns the minimum-norm one. For an unreachable `z` the supremum
    is not attained: the solver stops at `max_steps` with `converged=False`.

    **Arguments:**

    - `z`: target outputs `[q_seq, heads, dv]`; `q`, `k`, `v`, `causal`, `mask`, `scale`,
      `q_offset` as in [`multihead_free_energy`][treeattn.energy.multihead_free_energy].
    - `solver`: an optax transformation; default `optax.lbfgs()`.
    - `max_steps`: iteration cap. Stops when
      $\max|\partial F/\partial\zeta - z| \le \mathrm{atol} + \mathrm{rtol}\cdot\max|v|$.

    **Returns:** a [`TiltedSource`][treeattn.energy.TiltedSource]. Queries with no visible key
    get $\zeta^* = 0$ and KL 0.
    """
    fn = "tilted_source"
    dims = check_multihead(fn, q, k, v, zeta=z, zeta_name="z", mask=mask)
    check_q_offset(fn, q_offset)
    if max_steps < 0:
        raise ValueError(f"{fn}: max_steps must be >= 0, got {max_steps}")
    vis = visibility(dims, causal=causal, mask=mask, q_offset=q_offset)
    live = nonempty(dims, vis)
    s = default_scale(dims.qk, scale)
    ct = compute_dtype(q.dtype)
    target = jnp.where(live[..., None], z.astype(ct), 0.0)
    tol = atol + rtol * jnp.max(jnp.abs(v.astype(ct)), initial=0.0)

    def per_query(zeta: Array) -> Array:
        return jnp.where(live, energy_terms(q, k, v, zeta, vis, s, dims), 0.0)

    def objective(zeta: Array) -> Array:
        # -Γ: F minus the linear term; convex in ζ.
        return jnp.sum(per_query(zeta)) - jnp.sum(target * zeta)

    value_and_grad = jax.value_and_grad(objective)
    opt = optax.with_extra_args_support(optax.lbfgs() if solver is None else solver)

    def residual(grad: Array) -> Array:
        return jnp.max(jnp.abs(grad), initial=0.0)

    def cond(carry):
        _, _, step, _, grad = carry
        return (step < max_steps) & (residual(grad) > tol)

    def body(carry):
        zeta, state, step, value, grad = carry
        updates, state = opt.update(grad, state, zeta, value=value, grad=grad, value_fn=objective)
        zeta = cast(Array, optax.apply_updates(zeta, updates))
        value, grad = value_and_grad(zeta)
        return zeta, state, step + 1, value, grad

    zeta0 = jnp.zeros((dims.q_seq, dims.heads, dims.dv), ct)
    value0, grad0 = value_and_grad(zeta0)
    init = (zeta0, opt.init(zeta0), jnp.asarray(0, jnp.int32), value0, grad0)
    with jax.named_scope("tilted_source"):
        zeta, _, steps, _, grad = lax.while_loop(cond, body, init)
    res = residual(grad)
    kl = jnp.sum(target * zeta, axis=-1) - per_query(zeta) + per_query(zeta0)
    return TiltedSource(
        zeta=zeta, kl=jnp.where(live, kl, 0.0), residual=res, num_steps=steps, converged=res <= tol
    )
