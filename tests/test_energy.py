"""treeattn.energy: the free energies and attention as their gradient, against float64 NumPy."""

import functools

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TOL, make_masking, make_qkv, np_kw
from hypothesis import given, strategies as st
from jax.test_util import check_grads

from treeattn.energy import (
    attention_reference,
    causal_free_energy,
    energy_attention,
    free_energy,
    masked_logsumexp,
    multihead_free_energy,
)


# (q_seq, kv_seq, heads, kv_heads, qk, dv)
SHAPES = [
    (1, 1, 1, 1, 4, 4),
    (7, 7, 4, 4, 8, 8),  # MHA
    (5, 13, 8, 2, 16, 8),  # GQA, more keys than queries
    (3, 9, 6, 1, 8, 12),  # MQA, dv != qk
    (6, 4, 2, 2, 1, 3),  # more queries than keys
]
MASKINGS = ["none", "causal", "causal_cache", "mask2d", "mask3d", "causal_mask3d"]


@functools.partial(jax.jit, static_argnames=("fn", "causal"))
def _call(fn, q, k, v, mask, q_offset, causal):
    return fn(q, k, v, causal=causal, mask=mask, q_offset=q_offset)


def call(fn, q, k, v, **kw):
    return _call(fn, q, k, v, kw.get("mask"), kw.get("q_offset", 0), kw.get("causal", False))


# float32 over every shape and masking; each 16-bit dtype over every shape and every masking
# once (the rounding path does not depend on which mask is applied to which shape).
ATTENTION_CASES = [(shape, masking, jnp.float32) for shape in SHAPES for masking in MASKINGS] + [
    (SHAPES[i % len(SHAPES)], masking, dtype)
    for dtype in (jnp.bfloat16, jnp.float16)
    for i, masking in enumerate(MASKINGS)
]


@pytest.mark.fast(fn=energy_attention, shape=SHAPES[2], masking="causal_cache", dtype=jnp.float32)
@pytest.mark.parametrize(
    "shape, masking, dtype",
    ATTENTION_CASES,
    ids=[f"{s}-{m}-{jnp.dtype(d).name}" for s, m, d in ATTENTION_CASES],
)
@pytest.mark.parametrize("fn", [energy_attention, attention_reference], ids=lambda f: f.__name__)
def test_attention_matches_numpy(fn, shape, masking, dtype, getkey):
    q, k, v = make_qkv(getkey, shape, dtype)
    kw = make_masking(getkey, shape, masking)
    out = call(fn, q, k, v, **kw)
    assert out.shape == (shape[0], shape[2], shape[5])
    assert out.dtype == dtype
    expected = ref.attention(q, k, v, **np_kw(kw))
    assert ref.rel_err(out, expected) <= TOL[dtype]


@pytest.mark.parametrize("masking", MASKINGS)
def test_float64(masking, getkey):
    shape = SHAPES[2]
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, shape, jnp.float64)
        kw = make_masking(getkey, shape, masking)
        out = energy_attention(q, k, v, **kw)
        assert out.dtype == jnp.float64
        assert ref.rel_err(out, ref.attention(q, k, v, **np_kw(kw))) <= TOL[jnp.float64]
        zeta = jax.random.normal(getkey(), (shape[0], shape[2], shape[5]), jnp.float64)
        f = multihead_free_energy(q, k, v, zeta, **kw)
        assert f.dtype == jnp.float64
        np.testing.assert_allclose(
            f, ref.free_energy_terms(q, k, v, zeta, **np_kw(kw)).sum(), rtol=1e-12
        )


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=str)
def test_multihead_free_energy_and_its_gradient(shape, masking, getkey):
    """F_tot and dF/dzeta at a random source (the tilted mean), against NumPy."""
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw = make_masking(getkey, shape, masking)
    zeta = 0.5 * jax.random.normal(getkey(), (shape[0], shape[2], shape[5]))
    terms = ref.free_energy_terms(q, k, v, zeta, **np_kw(kw))
    value, grad = jax.value_and_grad(multihead_free_energy, argnums=3)(q, k, v, zeta, **kw)
    assert value.dtype == jnp.float32
    if np.isneginf(terms).any():
        assert value == -jnp.inf
    else:
        np.testing.assert_allclose(value, terms.sum(), rtol=1e-5)
    assert ref.rel_err(grad, ref.tilted_mean(q, k, v, zeta, **np_kw(kw))) <= 1e-5


def test_energy_attention_is_the_gradient_at_zero(getkey):
    """The specialised evaluation at ζ = 0 equals plain autodiff of the public free energy."""
    q, k, v = make_qkv(getkey, (9, 12, 4, 2, 8, 5), jnp.float32)
    for kw in ({}, {"causal": True, "q_offset": 3}):
        zeros = jnp.zeros((9, 4, 5))
        naive = jax.grad(multihead_free_energy, argnums=3)(q, k, v, zeros, **kw)
        np.testing.assert_allclose(energy_attention(q, k, v, **kw), naive, rtol=1e-6, atol=1e-6)


def test_single_query_free_energy(getkey):
    q = jax.random.normal(getkey(), (8,))
    k = jax.random.normal(getkey(), (11, 8))
    v = jax.random.normal(getkey(), (11, 3))
    zeta = jax.random.normal(getkey(), (3,))
    mask = jax.random.bernoulli(getkey(), 0.5, (11,)).at[0].set(True)
    for m in (None, mask):
        np_mask = None if m is None else np.asarray(m)[None]
        expected = ref.free_energy_terms(
            q[None, None], k[:, None], v[:, None], zeta[None, None], mask=np_mask
        )[0, 0]
        # F can be near 0 (few visible keys): float32's rounding of the logits is absolute.
        np.testing.assert_allclose(
            free_energy(q, k, v, zeta, mask=m), expected, rtol=1e-6, atol=1e-6
        )
        grad = jax.grad(free_energy, argnums=3)(q, k, v, jnp.zeros(3), mask=m)
        out = ref.attention(q[None, None], k[:, None], v[:, None], mask=np_mask)[0, 0]
        np.testing.assert_allclose(grad, out, rtol=1e-5, atol=1e-6)
    # The paper's eq. (1): the gradient in the logits is the softmax.
    x = jax.random.normal(getkey(), (6,))
    np.testing.assert_allclose(jax.grad(masked_logsumexp)(x, None), jax.nn.softmax(x), rtol=1e-6)


@pytest.mark.parametrize("q_offset", [0, 3, 8])
def test_causal_free_energy_bottom_right(q_offset, getkey):
    """Query i at absolute position q_offset + i sees keys 0..q_offset + i."""
    q_seq, kv_seq = 3, 11
    q = jax.random.normal(getkey(), (q_seq, 4))
    k = jax.random.normal(getkey(), (kv_seq, 4))
    v = jax.random.normal(getkey(), (kv_seq, 2))
    zeta = jax.random.normal(getkey(), (q_seq, 2))
    expected = ref.free_energy_terms(
        q[:, None], k[:, None], v[:, None], zeta[:, None], causal=True, q_offset=q_offset
    ).sum()
    f = causal_free_energy(q, k, v, zeta, q_offset=q_offset)
    # A sum of free energies may cancel to near 0: float32 rounding is absolute there.
    np.testing.assert_allclose(f, expected, rtol=1e-6, atol=1e-5)
    grad = jax.grad(causal_free_energy, argnums=3)(q, k, v, jnp.zeros_like(zeta), q_offset=q_offset)
    out = ref.attention(q[:, None], k[:, None], v[:, None], causal=True, q_offset=q_offset)
    np.testing.assert_allclose(grad, out[:, 0], rtol=1e-5, atol=1e-6)
    # The last query of a full cache sees every key; JAX's top-left is_causal would not.
    if q_offset == kv_seq - q_seq:
        full = ref.attention(q[-1:, None], k[:, None], v[:, None])
        np.testing.assert_allclose(grad[-1], full[0, 0], rtol=1e-5, atol=1e-6)


def test_traced_q_offset_does_not_recompile(getkey):
    q, k, v = make_qkv(getkey, (1, 16, 4, 2, 8, 8), jnp.float32)
    traces = 0

    @jax.jit
    def step(q, k, v, pos):
        nonlocal traces
        traces += 1
        return energy_attention(q, k, v, causal=True, q_offset=pos)

    for pos in range(5, 16, 3):
        out = step(q, k, v, jnp.asarray(pos))
        np.testing.assert_allclose(
            out, ref.attention(q, k, v, causal=True, q_offset=pos), rtol=1e-5, atol=1e-6
        )
    assert traces == 1


def test_eager_calls_compile_once_per_shape(getkey):
    """Public functions jit their core: a new Python-int q_offset reuses the compiled program."""
    q, k, v = make_qkv(getkey, (2, 9, 2, 1, 4, 3), jnp.float32)
    compiles = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    for pos in (3, 5, 7):
        if pos == 5:  # the first call may compile; the others reuse its program
            jax.monitoring.register_event_duration_secs_listener(listen)
        out = energy_attention(q, k, v, causal=True, q_offset=pos)
        np.testing.assert_allclose(
            out, ref.attention(q, k, v, causal=True, q_offset=pos), rtol=1e-5, atol=1e-6
        )
    jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_gqa_equals_mha_with_repeated_heads(getkey):
    q, k, v = make_qkv(getkey, (6, 10, 8, 2, 8, 4), jnp.float32)
    out = energy_attention(q, k, v, causal=True)
    k_rep, v_rep = jnp.repeat(k, 4, axis=1), jnp.repeat(v, 4, axis=1)
    np.testing.assert_allclose(
        out, energy_attention(q, k_rep, v_rep, causal=True), rtol=1e-5, atol=1e-6
    )


# ---------------------------------------------------------------------------------------------
# Numerics: empty rows, huge logits
# ---------------------------------------------------------------------------------------------


def test_all_masked_query_gives_zero_and_no_nan(getkey):
    q, k, v = make_qkv(getkey, (4, 6, 2, 1, 8, 3), jnp.float32)
    mask = jnp.ones((4, 6), bool).at[1].set(False)
    out = energy_attention(q, k, v, mask=mask)
    assert np.all(out[1] == 0) and np.isfinite(out).all()
    np.testing.assert_allclose(out, attention_reference(q, k, v, mask=mask), rtol=4e-6, atol=2e-6)
    # F of the empty query is log 0 = -inf, and so is F_tot; every derivative stays finite.
    zeta = jnp.zeros((4, 2, 3))
    assert multihead_free_energy(q, k, v, zeta, mask=mask) == -jnp.inf
    assert free_energy(q[1, 0], k[:, 0], v[:, 0], zeta[1, 0], mask=mask[1]) == -jnp.inf

    def loss(q, k, v):
        return jnp.sum(energy_attention(q, k, v, mask=mask) ** 2)

    for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v):
        assert np.isfinite(g).all()
    # No keys at all.
    empty = energy_attention(q, k[:0], v[:0])
    assert empty.shape == (4, 2, 3) and np.all(empty == 0)


@pytest.mark.parametrize("magnitude", [1e2, 1e3, 1e4])
def test_huge_logits_stay_finite_and_correct(magnitude, getkey):
    """Logits of ±magnitude: exp(logit) overflows float32 past ~88.7, the shifted form does not."""
    q, k, v = make_qkv(getkey, (5, 9, 2, 2, 4, 3), jnp.float32)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    scale = magnitude  # |s q.k| up to `magnitude`
    out = energy_attention(q, k, v, causal=True, scale=scale)
    assert np.isfinite(out).all()
    expected = ref.attention(q, k, v, causal=True, scale=scale)
    assert ref.rel_err(out, expected) <= 1e-4
    f = multihead_free_energy(q, k, v, jnp.zeros((5, 2, 3)), causal=True, scale=scale)
    assert np.isfinite(f)
    terms = ref.free_energy_terms(q, k, v, np.zeros((5, 2, 3)), causal=True, scale=scale)
    np.testing.assert_allclose(f, terms.sum(), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Cost: the gradient at ζ = 0 does not pay for the source term
# ---------------------------------------------------------------------------------------------


def _flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return cost["flops"]


def test_energy_attention_costs_what_attention_costs(getkey):
    q, k, v = make_qkv(getkey, (128, 128, 4, 4, 64, 64), jnp.float32)
    energy = _flops(lambda q, k, v: energy_attention(q, k, v, causal=True), q, k, v)
    reference = _flops(lambda q, k, v: attention_reference(q, k, v, causal=True), q, k, v)
    naive = _flops(
        lambda q, k, v: jax.grad(multihead_free_energy, argnums=3)(
            q, k, v, jnp.zeros((128, 4, 64)), causal=True
        ),
        q,
        k,
        v,
    )
    assert energy <= 1.05 * reference
    assert naive >= 1.3 * reference  # the product ζ·v that energy_attention skips


# ---------------------------------------------------------------------------------------------
# Differentiating attention: second derivatives of F
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"causal": True, "q_offset": 2}], ids=["full", "causal"])
def test_check_grads_energy_attention(kw, getkey):
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (3, 5, 4, 2, 3, 2), jnp.float64)
        f = functools.partial(energy_attention, **kw)
        check_grads(f, (q, k, v), order=2, modes=("fwd", "rev"), eps=1e-4)


@pytest.mark.parametrize("masking", ["none", "causal", "mask3d"])
def test_training_gradients_match_reference(masking, getkey):
    shape = (6, 8, 4, 2, 8, 5)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw = make_masking(getkey, shape, masking)
    target = jax.random.normal(getkey(), (6, 4, 5))

    def loss(fn, q, k, v):
        return jnp.sum((fn(q, k, v, **kw) - target) ** 2)

    ge = jax.grad(functools.partial(loss, energy_attention), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(functools.partial(loss, attention_reference), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ge, gr, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_vmap_over_batch(getkey):
    q = jax.random.normal(getkey(), (3, 5, 4, 8))
    k = jax.random.normal(getkey(), (3, 7, 2, 8))
    v = jax.random.normal(getkey(), (3, 7, 2, 6))
    out = jax.vmap(lambda q, k, v: energy_attention(q, k, v, causal=True, q_offset=2))(q, k, v)
    for b in range(3):
        expected = ref.attention(q[b], k[b], v[b], causal=True, q_offset=2)
        assert ref.rel_err(out[b], expected) <= TOL[jnp.float32]


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@given(
    shift=st.floats(-1e3, 1e3),
    seed=st.integers(0, 2**16),
    causal=st.booleans(),
)
def test_shift_invariance(shift, seed, causal):
    """Adding one constant to all of a query's logits changes F by it, attention not at all.

    The constant enters through an extra coordinate: q' = [q, c/s], k' = [k, 1].
    """
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (4, 2, 5))
    k = jax.random.normal(keys[1], (6, 2, 5))
    v = jax.random.normal(keys[2], (6, 2, 3))
    scale = 0.5
    q2 = jnp.concatenate([q, jnp.full((4, 2, 1), shift / scale)], axis=-1)
    k2 = jnp.concatenate([k, jnp.ones((6, 2, 1))], axis=-1)
    a = energy_attention(q, k, v, causal=causal, scale=scale)
    b = energy_attention(q2, k2, v, causal=causal, scale=scale)
    # Logits shifted to size |c| are rounded to |c| * eps: the weights move by that, relatively.
    rounding = 4 * abs(shift) * np.finfo(np.float32).eps * float(jnp.abs(v).max())
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 + rounding)
    zeta = jnp.zeros((4, 2, 3))
    f1 = multihead_free_energy(q, k, v, zeta, causal=causal, scale=scale)
    f2 = multihead_free_energy(q2, k2, v, zeta, causal=causal, scale=scale)
    np.testing.assert_allclose(f2 - f1, 4 * 2 * np.float32(shift), rtol=1e-4, atol=1e-2)


@given(perm_seed=st.integers(0, 2**16), seed=st.integers(0, 2**16))
def test_key_permutation_invariance(perm_seed, seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (3, 4, 8))
    k = jax.random.normal(keys[1], (9, 2, 8))
    v = jax.random.normal(keys[2], (9, 2, 4))
    mask = jax.random.bernoulli(keys[3], 0.7, (4, 3, 9))
    perm = np.random.default_rng(perm_seed).permutation(9)
    a = energy_attention(q, k, v, mask=mask)
    b = energy_attention(q, k[perm], v[perm], mask=mask[..., perm])
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

Q, K, V = jnp.zeros((4, 6, 8)), jnp.zeros((5, 3, 8)), jnp.zeros((5, 3, 2))


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((Q[0], K, V), {}, r"q must have shape \[q_seq, heads, qk\], got shape \(6, 8\)"),
        ((Q, K[0], V), {}, r"k must have shape .* got shape \(3, 8\)"),
        ((Q, K, V[..., None]), {}, r"v must have shape .* got shape \(5, 3, 2, 1\)"),
        ((Q, K[..., :7], V), {}, r"q \(4, 6, 8\) and k \(5, 3, 7\) disagree on the key size"),
        ((Q, K, V[:4]), {}, r"k \(5, 3, 8\) and v \(4, 3, 2\) must agree"),
        ((Q, jnp.zeros((5, 4, 8)), jnp.zeros((5, 4, 2))), {}, r"num_heads=6 .* of num_kv_heads=4"),
        ((Q, K, V), {"mask": jnp.ones((4, 5))}, r"mask must be boolean"),
        ((Q, K, V), {"mask": jnp.ones((4, 4), bool)}, r"mask must have shape .* got \(4, 4\)"),
        ((Q, K, V), {"mask": jnp.ones((3, 4, 5), bool)}, r"got \(3, 4, 5\)"),
        ((Q, K.astype(jnp.bfloat16), V), {}, r"share one dtype, got q=float32, k=bfloat16"),
        ((Q.astype(jnp.int32), K, V), {}, r"q must be a floating-point array"),
        ((Q, K, V), {"q_offset": 1.5}, r"q_offset must be an integer scalar"),
    ],
)
@pytest.mark.parametrize("fn", [energy_attention, attention_reference], ids=lambda f: f.__name__)
def test_bad_input_raises_at_trace_time(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda *a: fn(*a, **kwargs)).lower(*args)
    with pytest.raises(ValueError, match=fn.__name__):
        fn(*args, **kwargs)


def test_bad_source_shapes():
    with pytest.raises(ValueError, match=r"zeta must have shape \[q_seq, heads, dv\]"):
        multihead_free_energy(Q, K, V, jnp.zeros((4, 6, 3)))
    with pytest.raises(ValueError, match=r"zeta must have shape \[dv\]"):
        free_energy(Q[0, 0], K[:, 0], V[:, 0], jnp.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"causal_free_energy: zeta must have shape"):
        causal_free_energy(Q[:, 0], K[:, 0], V[:, 0], jnp.zeros(2))


def window_mask(q_seq, kv_seq, window, q_offset=0):
    """NumPy [q_seq, kv_seq]: query at position q_offset + i sees keys j with
    position - left <= j <= position + right."""
    at = q_offset + np.arange(q_seq)[:, None]
    j = np.arange(kv_seq)[None, :]
    return (at - window[0] <= j) & (j <= at + window[1])


@pytest.mark.parametrize("window", [(2, 1), (0, 0), (3, 0), 2], ids=str)
@pytest.mark.parametrize("causal, q_offset", [(False, 0), (True, 0), (True, 8)])
def test_local_window_matches_numpy(causal, q_offset, window, getkey):
    """`local_window_size` (jax's meaning) on the energies and their attention, combined with
    causality, a query offset and a user mask by "and"; the gradient in zeta is the attention."""
    shape = (5, 13, 4, 2, 8, 6)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    mask = jax.random.bernoulli(getkey(), 0.8, (4, 5, 13))
    pair = (window, window) if isinstance(window, int) else window
    vis = window_mask(5, 13, pair, q_offset) & np.asarray(mask)
    kw = dict(causal=causal, q_offset=q_offset, local_window_size=window, mask=mask)
    expected = ref.attention(q, k, v, causal=causal, q_offset=q_offset, mask=vis)
    for fn in (energy_attention, attention_reference):
        assert ref.rel_err(fn(q, k, v, **kw), expected) <= TOL[jnp.float32], fn.__name__
    zeta = jax.random.normal(getkey(), (5, 4, 6))
    terms = ref.free_energy_terms(q, k, v, zeta, causal=causal, q_offset=q_offset, mask=vis)
    f = multihead_free_energy(q, k, v, zeta, **kw)
    if np.isneginf(terms).any():
        assert f == -jnp.inf
    else:
        # A sum of terms of either sign can land near 0: float32's error is relative to the
        # terms, not to the sum.
        np.testing.assert_allclose(f, terms.sum(), rtol=1e-5, atol=1e-6 * np.abs(terms).sum())
    if causal:
        f1 = causal_free_energy(
            q[:, 0], k[:, 0], v[:, 0], zeta[:, 0], q_offset=q_offset, local_window_size=window
        )
        one = ref.free_energy_terms(
            q[:, :1],
            k[:, :1],
            v[:, :1],
            zeta[:, :1],
            causal=True,
            q_offset=q_offset,
            mask=window_mask(5, 13, pair, q_offset),
        )
        np.testing.assert_allclose(f1, one.sum(), rtol=1e-5, atol=1e-6 * np.abs(one).sum())
    with pytest.raises(ValueError, match="local_window_size"):
        energy_attention(q, k, v, local_window_size=(1, 2, 3))
