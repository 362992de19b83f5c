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

import functools
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from .._numerics import (
    as_position,
    compute_dtype,
    default_scale,
    from_rows,
    masked_logsumexp,
    nonempty,
    rows_visibility,
    to_rows,
    visibility,
)
from ._checks import check_multihead, check_q_offset, check_source, dims_of
from ._energies import SOFTMAX
from ._generic import free_energy_terms
from ._local import bad_logits, finite_kv, scaled_logits


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
    dims = check_multihead(fn, q, k, v, zeta=zeta, mask=mask, scale=scale)
    check_source(fn, z, dims, name="z")
    check_q_offset(fn, q_offset)
    return _log_likelihood(
        zeta, z, q, k, v, mask, as_position(q_offset), causal=causal, scale=scale
    )


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _log_likelihood(zeta, z, q, k, v, mask, q_offset, *, causal, scale) -> Array:
    dims = dims_of(q, k, v)
    vis = visibility(dims, causal=causal, mask=mask, q_offset=q_offset)
    ct = compute_dtype(q.dtype)
    live = nonempty(dims, vis)
    f = free_energy_terms(SOFTMAX, q, k, v, zeta, mask, q_offset, causal, scale, False)
    zeta_c, z_c = zeta.astype(ct), z.astype(ct)
    return jnp.sum(jnp.where(live, jnp.sum(z_c * zeta_c, axis=-1) - f, 0.0))


class TiltedSource(eqx.Module):
    r"""The result of [`tilted_source`][treeattn.energy.tilted_source], per query and head.

    - `zeta`: the source $\zeta^*$, `[q_seq, heads, dv]`, in float32 (float64 for float64
      inputs).
    - `kl`: $\mathrm{KL}(p_{\zeta^*}\,\|\,p_0)$, `[q_seq, heads]`: how far the attention
      weights must move for the head to output `z`.
    - `residual`: $\max |\partial F/\partial\zeta(\zeta^*) - z|$, `[q_seq, heads]`.
    - `num_steps`: solver iterations taken (L-BFGS, plus the Newton polishing steps kept),
      `[q_seq, heads]`.
    - `converged`: whether `residual` met the tolerance, `[q_seq, heads]`; `z` outside the
      convex hull of the visible values shows up here as False.
    """

    zeta: Float[Array, "q_seq heads dv"]
    kl: Float[Array, "q_seq heads"]
    residual: Float[Array, "q_seq heads"]
    num_steps: Int[Array, "q_seq heads"]
    converged: Bool[Array, "q_seq heads"]


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
    max_steps: int = 200,
    rtol: float = 1e-5,
    atol: float = 0.0,
) -> TiltedSource:
    r"""The source $\zeta^*$ that tilts attention to output `z`: solves
    $\partial F/\partial\zeta(\zeta^*) = z$.

    $$\zeta^* = \arg\max_\zeta\, \Gamma(\zeta, z) = \arg\min_\zeta\, \sum_{i,h}
      F_{i,h}(\zeta_{i,h}) - z_{i,h}\cdot\zeta_{i,h}$$

    a smooth convex problem that separates over queries: each (query, head) is solved on its own
    from $\zeta = 0$ by L-BFGS (`optax.lbfgs` with a zoom line search) or any optax `solver`,
    all of them vectorised. `z` = attention gives $\zeta^* = 0$ at step 0.

    A solution exists when each $z_{i,h}$ lies in the relative interior of the convex hull of the
    values the query sees; it is unique up to directions in which those values do not vary, and
    starting from 0 the solver returns the minimum-norm one. For an unreachable `z` the supremum
    is not attained: the solver stops at `max_steps` (or once a step makes no progress) with
    `converged=False`.

    **Arguments:**

    - `z`: target outputs `[q_seq, heads, dv]`; `q`, `k`, `v`, `causal`, `mask`, `scale`,
      `q_offset` as in [`multihead_free_energy`][treeattn.energy.multihead_free_energy].
    - `solver`: an optax transformation; default `optax.lbfgs()`. Up to 3 Newton steps with the
      exact Hessian (the value covariance) follow it, for when float32 cannot resolve the
      objective's last decrease and the line search stalls.
    - `max_steps`: iteration cap per query. A query stops when
      $\max|\partial F/\partial\zeta - z| \le \mathrm{atol} + \mathrm{rtol}\cdot\max_a|v_a|$
      (over the values it sees).

    **Returns:** a [`TiltedSource`][treeattn.energy.TiltedSource]. Queries with no visible key
    get $\zeta^* = 0$ and KL 0.
    """
    fn = "tilted_source"
    check_multihead(fn, q, k, v, zeta=z, zeta_name="z", mask=mask, scale=scale)
    check_q_offset(fn, q_offset)
    if not isinstance(max_steps, int) or max_steps < 0:
        raise ValueError(f"{fn}: max_steps must be an integer >= 0, got {max_steps!r}")
    return _tilted_source(
        z,
        q,
        k,
        v,
        mask,
        as_position(q_offset),
        jnp.asarray(rtol),
        jnp.asarray(atol),
        causal=causal,
        scale=scale,
        solver=solver,
        max_steps=max_steps,
    )


@functools.partial(jax.jit, static_argnames=("causal", "scale", "solver", "max_steps"))
def _tilted_source(
    z, q, k, v, mask, q_offset, rtol, atol, *, causal, scale, solver, max_steps
) -> TiltedSource:
    dims = dims_of(q, k, v)
    vis = visibility(dims, causal=causal, mask=mask, q_offset=q_offset)
    ct = compute_dtype(q.dtype)
    # The problem separates over queries: solve each (query, head) on its own, so that every one
    # gets its own line search and curvature memory (one joint L-BFGS converges at the pace of
    # the worst-conditioned query). Logits are computed once.
    k, v, bad = finite_kv(k, v)
    logits = scaled_logits(q, k, dims, default_scale(dims.qk, scale))  # [kh, g*t, kv]
    logits = bad_logits(logits, bad)
    rows = (dims.kv_heads, dims.rows, dims.kv_seq)
    vis_rows = rows_visibility(vis, dims)
    vis_rows = jnp.ones(rows, bool) if vis_rows is None else jnp.broadcast_to(vis_rows, rows)
    opt = optax.with_extra_args_support(optax.lbfgs() if solver is None else solver)
    solve = functools.partial(_solve_one, opt=opt, max_steps=max_steps, rtol=rtol, atol=atol)
    v_heads = jnp.swapaxes(v.astype(ct), 0, 1)  # [kv_heads, kv_seq, dv]
    per_head = jax.vmap(solve, in_axes=(0, 0, None, 0))  # over the query rows of one kv head
    with jax.named_scope("tilted_source"):
        zeta, kl, res, steps, ok = jax.vmap(per_head)(
            logits, vis_rows, v_heads, to_rows(z.astype(ct), dims)
        )
    per_query = lambda x: from_rows(x[..., None], dims)[..., 0]  # noqa: E731
    return TiltedSource(
        zeta=from_rows(zeta, dims),
        kl=per_query(kl),
        residual=per_query(res),
        num_steps=per_query(steps),
        converged=per_query(ok),
    )


NEWTON_STEPS = 3  # polishing steps after L-BFGS, each kept only if it helps


def _solve_one(x, visible, v, z, *, opt, max_steps, rtol, atol):
    """One query: minimise F(ζ) - z·ζ with F(ζ) = log Σ_visible exp(x_a + ζ·v_a), from ζ = 0.
    Returns (ζ*, KL, residual, steps, converged); ζ* (and the KL through it) is
    differentiable in the logits, the values and the target (`_source`)."""
    empty = ~jnp.any(visible)
    z = jnp.where(empty, 0.0, z)
    zeta, (res, steps, ok) = _source(opt, max_steps, x, visible, v, z, rtol, atol)  # type: ignore[misc]
    energy = functools.partial(_tilted_energy, x=x, visible=visible, v=v)
    # KL(p_ζ || p_0) = z·ζ - F(ζ) + F(0), with z = ∂F/∂ζ(ζ) at the solution.
    kl = jnp.where(empty, 0.0, z @ zeta - energy(zeta) + energy(jnp.zeros_like(zeta)))
    return zeta, kl, res, steps, ok


def _tilted_energy(zeta: Array, *, x, visible, v) -> Array:
    """F(ζ) = log Σ_visible exp(x_a + ζ·v_a) of one query; 0 when it sees no key."""
    f = masked_logsumexp(x + v @ zeta, visible)
    return jnp.where(jnp.any(visible), f, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _source(opt, max_steps, x, visible, v, z, rtol, atol):
    r"""ζ* with ∇F(ζ*) = z, and (residual, steps, converged) beside it.

    Its derivative is that of the root, not of the solver's iterations (implicit function
    theorem): with $G(\zeta, \theta) = \nabla F(\zeta; x, v) - z$ and
    $H = \nabla^2 F(\zeta^*)$ (the covariance of the values under the tilted distribution),
    $d\zeta^* = -H^{+}\,\partial_\theta G\, d\theta$, so $\partial\zeta^*/\partial z = H^{+}$.
    The pseudo-inverse keeps the minimum-norm solution the solver returns where the values do
    not vary."""
    return _iterate(opt, max_steps, x, visible, v, z, rtol, atol)


def _source_fwd(opt, max_steps, x, visible, v, z, rtol, atol):
    zeta, stats = _iterate(opt, max_steps, x, visible, v, z, rtol, atol)
    return (zeta, stats), (x, visible, v, z, zeta)


def _source_bwd(opt, max_steps, saved, cts):
    x, visible, v, z, zeta = saved
    ct_zeta = cts[0]

    def gradient(x, v, z):
        return jax.grad(_tilted_energy)(zeta, x=x, visible=visible, v=v) - z

    hessian = jax.hessian(_tilted_energy)(zeta, x=x, visible=visible, v=v)
    u = jnp.linalg.lstsq(hessian, ct_zeta)[0]
    _, pull = jax.vjp(gradient, x, v, z)
    d_x, d_v, d_z = pull(-u)
    return d_x, None, d_v, d_z, None, None


_source.defvjp(_source_fwd, _source_bwd)


def _iterate(opt, max_steps, x, visible, v, z, rtol, atol):
    """The solver: L-BFGS (or `opt`) from ζ = 0, then Newton polishing; see `tilted_source`."""
    tol = atol + rtol * jnp.max(jnp.where(visible[:, None], jnp.abs(v), 0.0), initial=0.0)
    energy = functools.partial(_tilted_energy, x=x, visible=visible, v=v)

    def objective(zeta: Array) -> Array:
        return energy(zeta) - z @ zeta

    value_and_grad = jax.value_and_grad(objective)

    def residual(grad: Array) -> Array:
        return jnp.max(jnp.abs(grad), initial=0.0)

    def cond(carry):
        _, _, step, _, grad, stalled = carry
        return (step < max_steps) & (residual(grad) > tol) & ~stalled

    def body(carry):
        zeta, state, step, value, grad, _ = carry
        updates, state = opt.update(grad, state, zeta, value=value, grad=grad, value_fn=objective)
        new = cast(Array, optax.apply_updates(zeta, updates))
        value, grad = value_and_grad(new)
        return new, state, step + 1, value, grad, jnp.all(new == zeta)

    zeta0 = jnp.zeros_like(z)
    value0, grad0 = value_and_grad(zeta0)
    no = jnp.asarray(False)
    init = (zeta0, opt.init(zeta0), jnp.asarray(0, jnp.int32), value0, grad0, no)
    zeta, _, steps, _, grad, _ = lax.while_loop(cond, body, init)

    # Near the solution the decrease of the objective can fall below float32's resolution of
    # its value: the line search then stalls (zero step) a little above the tolerance. Newton
    # steps need only the gradient: H = Cov_p(v) (the Hessian of F), step = -H⁺ ∇ (least
    # squares, so an underdetermined source stays minimum-norm); a step is kept only if it
    # lowers the residual.
    def newton_cond(carry):
        _, grad, tries, stop = carry
        return (tries < NEWTON_STEPS) & (residual(grad) > tol) & ~stop

    def newton_body(carry):
        zeta, grad, tries, _ = carry
        new = zeta - jnp.linalg.lstsq(jax.hessian(energy)(zeta), grad)[0]
        new_grad = value_and_grad(new)[1]
        better = residual(new_grad) < residual(grad)
        return (
            jnp.where(better, new, zeta),
            jnp.where(better, new_grad, grad),
            tries + better.astype(jnp.int32),  # only kept steps count
            ~better,
        )

    zeta, grad, tries, _ = lax.while_loop(
        newton_cond, newton_body, (zeta, grad, jnp.asarray(0, jnp.int32), no)
    )
    res = residual(grad)
    return zeta, (res, steps + tries, res <= tol)
