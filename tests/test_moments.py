"""Cumulants of the values as derivatives of the free energy, against float64 NumPy."""

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TOL, make_masking, make_qkv, np_kw

from treeattn.energy import energy_attention, multihead_free_energy, value_covariance, value_moments


MASKINGS = ["none", "causal", "causal_cache", "mask3d"]


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("shape", [(5, 7, 4, 2, 8, 3), (4, 6, 3, 3, 4, 5)], ids=str)
def test_covariance_matches_numpy(shape, masking, getkey):
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw = make_masking(getkey, shape, masking)
    cov = value_covariance(q, k, v, **kw)
    assert cov.shape == (shape[0], shape[2], shape[5], shape[5])
    assert cov.dtype == jnp.float32
    expected = ref.cumulants(q, k, v, 2, **np_kw(kw))
    assert ref.rel_err(cov, expected) <= TOL[jnp.float32]
    # Symmetric positive semi-definite, as a covariance must be.
    np.testing.assert_allclose(cov, jnp.swapaxes(cov, -1, -2), atol=1e-6)
    assert np.linalg.eigvalsh(np.asarray(cov, np.float64)).min() >= -1e-5


def test_covariance_is_the_hessian_of_f(getkey):
    """Full autodiff Hessian of F_tot in ζ: block diagonal, blocks equal value_covariance."""
    shape = (3, 5, 2, 1, 4, 2)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    zeros = jnp.zeros((3, 2, 2))
    hess = jax.hessian(multihead_free_energy, argnums=3)(q, k, v, zeros, causal=True)
    cov = value_covariance(q, k, v, causal=True)
    for i in range(3):
        for h in range(2):
            np.testing.assert_allclose(hess[i, h, :, i, h, :], cov[i, h], atol=1e-6)
            others = np.asarray(hess[i, h]).copy()  # [dv, q_seq, heads, dv]
            others[:, i, h, :] = 0.0
            assert np.all(others == 0)


@pytest.mark.parametrize("masking", ["none", "causal", "mask3d"])
def test_third_cumulant_matches_numpy(masking, getkey):
    shape = (4, 6, 2, 1, 4, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw = make_masking(getkey, shape, masking)
    k3 = value_moments(q, k, v, order=3, **kw)
    assert k3.shape == (4, 2, 3, 3, 3)
    expected = ref.cumulants(q, k, v, 3, **np_kw(kw))
    assert ref.rel_err(k3, expected) <= 5e-5
    # Fully symmetric.
    np.testing.assert_allclose(k3, jnp.transpose(k3, (0, 1, 3, 2, 4)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k3, jnp.transpose(k3, (0, 1, 4, 3, 2)), rtol=1e-5, atol=1e-5)


def test_fourth_cumulant_of_a_two_point_distribution():
    """Two keys with equal weight and values ±1: cumulants of a Rademacher variable,
    κ1 = 0, κ2 = 1, κ3 = 0, κ4 = -2."""
    q = jnp.zeros((1, 1, 2))
    k = jnp.zeros((2, 1, 2))
    v = jnp.array([[[1.0]], [[-1.0]]])
    expected = {1: 0.0, 2: 1.0, 3: 0.0, 4: -2.0}
    for order, value in expected.items():
        got = value_moments(q, k, v, order=order)
        np.testing.assert_allclose(got.reshape(()), value, atol=1e-6)


def test_first_moment_is_attention(getkey):
    q, k, v = make_qkv(getkey, (5, 9, 4, 2, 8, 6), jnp.float32)
    np.testing.assert_allclose(
        value_moments(q, k, v, order=1, causal=True),
        energy_attention(q, k, v, causal=True),
        rtol=1e-6,
        atol=1e-7,
    )


def test_covariance_of_empty_and_single_key_queries_is_zero(getkey):
    q, k, v = make_qkv(getkey, (4, 5, 2, 2, 4, 3), jnp.float32)
    mask = jnp.ones((4, 5), bool).at[0].set(False).at[1].set(False).at[1, 2].set(True)
    cov = value_covariance(q, k, v, mask=mask)
    assert np.all(cov[0] == 0)  # no visible key
    np.testing.assert_allclose(cov[1], 0.0, atol=1e-6)  # one visible key: no spread
    assert np.isfinite(cov).all()
    g = jax.grad(lambda v: jnp.sum(value_covariance(q, k, v, mask=mask)))(v)
    assert np.isfinite(g).all()


def test_bfloat16_covariance(getkey):
    q, k, v = make_qkv(getkey, (3, 8, 2, 1, 8, 4), jnp.bfloat16)
    cov = value_covariance(q, k, v, causal=True)
    assert cov.dtype == jnp.bfloat16
    assert ref.rel_err(cov, ref.cumulants(q, k, v, 2, causal=True)) <= TOL[jnp.bfloat16]


def test_covariance_gradient_matches_numpy_finite_differences(getkey):
    """d tr(Σ)/d v through the covariance (a third derivative of F), float64."""
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (2, 4, 1, 1, 3, 2), jnp.float64)

        def trace_cov(v):
            return jnp.trace(value_covariance(q, k, v, causal=True), axis1=-2, axis2=-1).sum()

        def np_trace_cov(v):
            return np.trace(ref.cumulants(q, k, v, 2, causal=True), axis1=-2, axis2=-1).sum()

        g = jax.grad(trace_cov)(v)
        eps = 1e-6
        vn = np.asarray(v)
        fd = np.zeros_like(vn)
        for idx in np.ndindex(vn.shape):
            dv = np.zeros_like(vn)
            dv[idx] = eps
            fd[idx] = (np_trace_cov(vn + dv) - np_trace_cov(vn - dv)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


def test_bad_order():
    q, k, v = jnp.zeros((1, 1, 2)), jnp.zeros((2, 1, 2)), jnp.zeros((2, 1, 2))
    for order in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="order must be an integer >= 1"):
            value_moments(q, k, v, order=order)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"value_covariance: q must have shape"):
        value_covariance(q[0], k, v)
