"""The likelihood Γ of eq. (21) and the tilted source: solving ∂F/∂ζ(ζ*) = z."""

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import optax
import pytest
from helpers import make_masking, make_qkv, np_kw
from jax.test_util import check_grads

from treeattn.energy import (
    TiltedSource,
    energy_attention,
    log_likelihood,
    multihead_free_energy,
    tilted_source,
)


SHAPE = (4, 9, 4, 2, 8, 3)  # kv_seq > dv + 1: a reachable z has a unique source


def _np_kl(q, k, v, zeta, **kw):
    """KL(p_ζ || p_0) per query, from the float64 free energies."""
    f_zeta = ref.free_energy_terms(q, k, v, zeta, **kw)
    f_zero = ref.free_energy_terms(q, k, v, np.zeros_like(zeta), **kw)
    mean = ref.tilted_mean(q, k, v, zeta, **kw)
    return np.sum(mean * ref.f64(zeta), axis=-1) - f_zeta + f_zero


@pytest.mark.parametrize("masking", ["none", "causal", "mask3d"])
def test_attention_output_has_zero_source(masking, getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    kw = make_masking(getkey, SHAPE, masking)
    z = energy_attention(q, k, v, **kw)
    sol = tilted_source(z, q, k, v, **kw)
    assert isinstance(sol, TiltedSource)
    assert (
        sol.converged.shape == sol.num_steps.shape == sol.residual.shape == SHAPE[:1] + SHAPE[2:3]
    )
    assert np.all(sol.converged) and np.all(sol.num_steps == 0)
    np.testing.assert_allclose(sol.zeta, 0.0, atol=1e-4)
    np.testing.assert_allclose(sol.kl, 0.0, atol=1e-5)


@pytest.mark.parametrize("masking", ["none", "causal_cache", "mask2d"])
def test_recovers_a_reachable_source(masking, getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    kw = make_masking(getkey, SHAPE, masking)
    if "mask" in kw:
        # A row that sees fewer than two keys has a mean that no tilt moves (no source to
        # find): every row sees the first two keys.
        kw["mask"] = kw["mask"].at[:, :2].set(True)
    zeta_true = jax.random.normal(getkey(), (SHAPE[0], SHAPE[2], SHAPE[5]))
    z = jnp.asarray(ref.tilted_mean(q, k, v, zeta_true, **np_kw(kw)), jnp.float32)
    sol = tilted_source(z, q, k, v, **kw)
    assert np.all(sol.converged), (sol.residual, sol.num_steps)
    assert np.all(sol.num_steps > 0) and np.all(sol.num_steps < 100)
    # The defining equation, checked in float64: ∂F/∂ζ(ζ*) = z.
    reached = ref.tilted_mean(q, k, v, sol.zeta, **np_kw(kw))
    tol = 1e-5 * float(jnp.max(jnp.abs(v)))
    assert np.max(np.abs(reached - ref.f64(z))) <= 2 * tol
    np.testing.assert_allclose(sol.kl, _np_kl(q, k, v, sol.zeta, **np_kw(kw)), atol=1e-4)
    assert np.all(np.asarray(sol.kl) >= -1e-5)


def test_underdetermined_source_is_minimum_norm(getkey):
    """Two visible keys and dv = 3: only the direction v_1 - v_0 matters."""
    q, k, v = make_qkv(getkey, (1, 2, 1, 1, 4, 3), jnp.float32)
    z = (0.3 * v[0, 0] + 0.7 * v[1, 0])[None, None]
    sol = tilted_source(z, q, k, v)
    assert np.all(sol.converged)
    direction = np.asarray(v[1, 0] - v[0, 0], np.float64)
    zeta = np.asarray(sol.zeta[0, 0], np.float64)
    # ζ* is parallel to v_1 - v_0 ...
    cos = abs(zeta @ direction) / (np.linalg.norm(zeta) * np.linalg.norm(direction))
    np.testing.assert_allclose(cos, 1.0, atol=1e-5)
    # ... and tilts the logit gap to log(0.7 / 0.3).
    logit = np.asarray(k[:, 0] @ q[0, 0], np.float64) / 2.0
    gap = (logit[1] + zeta @ v[1, 0]) - (logit[0] + zeta @ v[0, 0])
    # The solver stops once |mean - z| <= 1e-5 max|v| per coordinate; the mean moves along
    # v_1 - v_0 at p (1 - p) |v_1 - v_0| per unit of gap (p = 0.3), so the gap is known to
    # sqrt(3) 1e-5 max|v| / (0.21 |v_1 - v_0|), plus float32 rounding.
    vmax = float(np.max(np.abs(np.asarray(v, np.float64))))
    solver_gap = np.sqrt(3) * 1e-5 * vmax / (0.21 * np.linalg.norm(direction))
    np.testing.assert_allclose(gap, np.log(0.7 / 0.3), rtol=1e-5, atol=2 * solver_gap + 1e-5)


def test_unreachable_target_does_not_converge(getkey):
    q, k, v = make_qkv(getkey, (2, 3, 1, 1, 4, 2), jnp.float32)
    z = energy_attention(q, k, v)
    z = z.at[1].set(10.0 * jnp.max(jnp.abs(v)))  # outside the convex hull of the values
    sol = tilted_source(z, q, k, v, max_steps=30)
    assert bool(sol.converged[0, 0]) and int(sol.num_steps[0, 0]) == 0
    # It gives up at max_steps, or earlier once a step makes no progress.
    assert not bool(sol.converged[1, 0]) and 0 < int(sol.num_steps[1, 0]) <= 30
    assert np.isfinite(sol.zeta).all()


def test_empty_queries_get_zero_source(getkey):
    q, k, v = make_qkv(getkey, (3, 6, 2, 1, 4, 2), jnp.float32)
    mask = jnp.ones((3, 6), bool).at[1].set(False)
    zeta_true = jax.random.normal(getkey(), (3, 2, 2))
    z = jax.grad(multihead_free_energy, argnums=3)(q, k, v, zeta_true, mask=mask)
    z = z.at[1].set(5.0)  # whatever is asked of an empty query, there is nothing to tilt
    sol = tilted_source(z, q, k, v, mask=mask)
    assert np.all(sol.converged)
    assert np.all(sol.zeta[1] == 0) and np.all(sol.kl[1] == 0) and np.all(sol.num_steps[1] == 0)
    rows = np.array([0, 2])
    np.testing.assert_allclose(sol.zeta[rows], zeta_true[rows], atol=5e-3)


def test_other_optax_solver(getkey):
    q, k, v = make_qkv(getkey, (2, 5, 1, 1, 4, 2), jnp.float32)
    zeta_true = 0.5 * jax.random.normal(getkey(), (2, 1, 2))
    z = jax.grad(multihead_free_energy, argnums=3)(q, k, v, zeta_true)
    # optax.adam mixes its integer step count with floats, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        sol = tilted_source(z, q, k, v, solver=optax.adam(0.05), max_steps=3000, rtol=1e-4)
    assert np.all(sol.converged)
    # The defining equation, in float64: dF/dzeta(zeta*) = z to the solver's tolerance.
    reached = ref.tilted_mean(q, k, v, sol.zeta)
    tol = 1e-4 * float(jnp.max(jnp.abs(v)))
    assert np.max(np.abs(reached - ref.f64(z))) <= 2 * tol
    # zeta* itself is pinned only as well as the curvature allows: the means at zeta* and
    # zeta_true differ by H (zeta* - zeta_true), H the covariance of v averaged on the segment,
    # so |zeta* - zeta_true| <= |mean gap| / lambda_min(H) (with 5 keys and dv = 2 a direction of
    # small value variance can leave zeta* 0.1 from zeta_true at this residual).
    delta = ref.f64(sol.zeta) - ref.f64(zeta_true)
    lam = np.min(
        [
            np.linalg.eigvalsh(ref.tilted_covariance(q, k, v, ref.f64(zeta_true) + t * delta))[
                ..., 0
            ]
            for t in np.linspace(0.0, 1.0, 9)
        ],
        axis=0,
    )
    gap = 2 * tol * np.sqrt(z.shape[-1]) + np.linalg.norm(
        ref.f64(z) - ref.tilted_mean(q, k, v, zeta_true), axis=-1
    )
    assert np.all(np.linalg.norm(delta, axis=-1) <= 1.5 * gap / lam + 1e-6)


def test_jit_and_float64(getkey):
    # optax.lbfgs mixes int32 and int64 counters under x64, which strict promotion rejects.
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        q, k, v = make_qkv(getkey, SHAPE, jnp.float64)
        zeta_true = jax.random.normal(getkey(), (SHAPE[0], SHAPE[2], SHAPE[5]), jnp.float64)
        # Every query sees at least dv + 1 keys, so the source is unique.
        kw = {"causal": True, "q_offset": SHAPE[1] - SHAPE[0]}
        z = jnp.asarray(ref.tilted_mean(q, k, v, zeta_true, **kw))
        # The residual bounds the error of zeta only through the inverse value covariance, which
        # is large for a query whose values are nearly degenerate: solve to float64 precision.
        sol = jax.jit(lambda z, q, k, v: tilted_source(z, q, k, v, rtol=1e-13, **kw))(z, q, k, v)
        assert sol.zeta.dtype == jnp.float64
        assert np.all(sol.converged), (sol.residual, sol.num_steps)
        np.testing.assert_allclose(sol.zeta, zeta_true, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("masking", ["none", "causal", "mask3d"])
def test_log_likelihood_value_and_stationarity(masking, getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    kw = make_masking(getkey, SHAPE, masking)
    zeta = jax.random.normal(getkey(), (SHAPE[0], SHAPE[2], SHAPE[5]))
    z = jax.random.normal(getkey(), zeta.shape)
    terms = ref.free_energy_terms(q, k, v, zeta, **np_kw(kw))
    live = np.isfinite(terms)
    expected = np.sum(np.where(live, np.sum(ref.f64(z) * ref.f64(zeta), -1) - terms, 0.0))
    # Γ sums terms of either sign (tens in all): an absolute tolerance for a Γ near 0.
    np.testing.assert_allclose(
        log_likelihood(zeta, z, q, k, v, **kw), expected, rtol=1e-5, atol=1e-4
    )
    # ∂Γ/∂ζ = z - ∂F/∂ζ and ∂Γ/∂z = ζ (on queries that see something).
    d_zeta, d_z = jax.grad(log_likelihood, argnums=(0, 1))(zeta, z, q, k, v, **kw)
    mean = ref.tilted_mean(q, k, v, zeta, **np_kw(kw))
    np.testing.assert_allclose(d_zeta, np.where(live[..., None], z - mean, 0.0), atol=1e-5)
    np.testing.assert_allclose(d_z, np.where(live[..., None], zeta, 0.0), atol=1e-6)
    # Stationary at (0, attention).
    att = energy_attention(q, k, v, **kw)
    d_zeta, d_z = jax.grad(log_likelihood, argnums=(0, 1))(jnp.zeros_like(zeta), att, q, k, v, **kw)
    np.testing.assert_allclose(d_zeta, 0.0, atol=1e-6)
    np.testing.assert_allclose(d_z, 0.0, atol=0)


def test_source_maximises_likelihood(getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    zeta_true = jax.random.normal(getkey(), (SHAPE[0], SHAPE[2], SHAPE[5]))
    z = jax.grad(multihead_free_energy, argnums=3)(q, k, v, zeta_true, causal=True)
    sol = tilted_source(z, q, k, v, causal=True)
    best = log_likelihood(sol.zeta, z, q, k, v, causal=True)
    for _ in range(5):
        other = sol.zeta + 0.1 * jax.random.normal(getkey(), sol.zeta.shape)
        assert log_likelihood(other, z, q, k, v, causal=True) < best


def test_bad_target_shape():
    q, k, v = jnp.zeros((2, 2, 4)), jnp.zeros((3, 1, 4)), jnp.zeros((3, 1, 5))
    with pytest.raises(ValueError, match=r"tilted_source: z must have shape \[q_seq, heads, dv\]"):
        tilted_source(jnp.zeros((2, 2, 4)), q, k, v)
    with pytest.raises(ValueError, match=r"log_likelihood: z must have shape"):
        log_likelihood(jnp.zeros((2, 2, 5)), jnp.zeros((2, 5)), q, k, v)


def test_source_is_differentiated_at_the_root(getkey):
    """ζ* is differentiable (implicit function theorem, not the solver's loop): in the target,
    dζ*/dz is the inverse of the covariance of the values under the tilted distribution
    (float64 NumPy); in q, k and v the gradient matches finite differences (float64)."""
    # optax.lbfgs mixes int32 and int64 counters under x64, which strict promotion rejects.
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        q, k, v = make_qkv(getkey, SHAPE, jnp.float64)
        zeta_true = 0.5 * jax.random.normal(getkey(), (SHAPE[0], SHAPE[2], SHAPE[5]), jnp.float64)
        z = jnp.asarray(ref.tilted_mean(q, k, v, zeta_true))

        def source(z, q, k, v):
            return tilted_source(z, q, k, v, rtol=1e-13).zeta

        jac = jax.jacrev(source)(z, q, k, v)  # [q, h, dv, q, h, dv]
        cov = ref.tilted_covariance(q, k, v, zeta_true)
        for i in range(SHAPE[0]):
            for h in range(SHAPE[2]):
                np.testing.assert_allclose(
                    jac[i, h, :, i, h, :], np.linalg.inv(cov[i, h]), rtol=1e-6, atol=1e-8
                )
        # One query's source does not depend on another query's target.
        off = np.array(jac).copy()
        for i in range(SHAPE[0]):
            for h in range(SHAPE[2]):
                off[i, h, :, i, h, :] = 0
        np.testing.assert_array_equal(off, 0.0)
        # Central differences err by eps^2 f''' (large where the covariance is ill-conditioned)
        # and by the solver's 1e-13 / eps: eps = 1e-6 keeps both below rtol 1e-5.
        check_grads(
            lambda q, k, v: source(z, q, k, v),
            (q, k, v),
            order=1,
            modes=["rev"],
            atol=1e-6,
            eps=1e-6,
        )
        # The KL is differentiable through ζ*: d KL / dz = ζ* at the root.
        grad_kl = jax.grad(lambda z: jnp.sum(tilted_source(z, q, k, v, rtol=1e-13).kl))(z)
        np.testing.assert_allclose(grad_kl, zeta_true, rtol=1e-6, atol=1e-8)
