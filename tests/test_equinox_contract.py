"""`treeattn.models.MultiheadAttention` holds `equinox.nn.MultiheadAttention`'s contract.

Equinox's own tests of its layer (shapes, known values, masks, dropout and inference, shared
nodes), restated here and run on every treeattn backend, plus what users rely on beyond them:
a dropout rate held as an array (traced too), Equinox's mixed precision and dtype promotion,
and weights moved from one layer to the other and back.
"""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backend_of

from treeattn.models import MultiheadAttention


BACKENDS = ["energy", "reference", "flash", "tree"]
MASK_BACKENDS = BACKENDS  # every backend takes an arbitrary boolean mask
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "output_proj")


def standard(fn, *args, **kwargs):
    """Call Equinox's layer as its users do: under standard dtype promotion (the test suite
    runs under strict promotion, which Equinox's mixed-dtype arithmetic does not pass)."""
    with jax.numpy_dtype_promotion("standard"):
        return fn(*args, **kwargs)


def transplant(target, source):
    """`target` with every projection weight and bias of `source`."""
    leaves = [
        getattr(getattr(source, n), a)
        for n in PROJECTIONS
        for a in ("weight", "bias")
        if getattr(getattr(source, n), a) is not None
    ]
    return eqx.tree_at(
        lambda m: [
            getattr(getattr(m, n), a)
            for n in PROJECTIONS
            for a in ("weight", "bias")
            if getattr(getattr(m, n), a) is not None
        ],
        target,
        leaves,
    )


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol, atol)


# ---------------------------------------------------------------------------------------------
# Equinox's tests of MultiheadAttention, on every backend
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_size_distinct(backend, getkey):
    """Query, key, value, output, qk and vo sizes all different, and two sequence lengths."""
    kw: dict[str, Any] = dict(
        num_heads=2, query_size=3, key_size=5, value_size=7, output_size=11, qk_size=13, vo_size=17
    )
    k = getkey()
    ours = MultiheadAttention(**kw, backend=backend_of(backend), key=k)
    theirs = eqx.nn.MultiheadAttention(**kw, key=k)
    for q_seq, kv_seq in ((19, 23), (23, 19)):  # fewer queries than keys, and more
        q = jax.random.uniform(getkey(), (q_seq, 3))
        kk = jax.random.uniform(getkey(), (kv_seq, 5))
        v = jax.random.uniform(getkey(), (kv_seq, 7))
        out = eqx.filter_jit(ours)(q, kk, v)
        assert not isinstance(out, tuple) and out.shape == (q_seq, 11)
        assert_close(out, eqx.filter_jit(theirs)(q, kk, v))


def integer_weights(backend):
    attn = MultiheadAttention(num_heads=2, query_size=4, backend=backend_of(backend), key=KEY)
    w = jnp.arange(16.0).reshape(4, 4)
    return eqx.tree_at(lambda m: [getattr(m, n).weight for n in PROJECTIONS], attn, [w] * 4)


KEY = jax.random.key(0)
ROW = jnp.array([[680.0, 1960.0, 3240.0, 4520.0]])  # W_o W_v (1, 2, 3, 4) for W = arange(16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_known_values_with_integer_weights(backend):
    """Every projection `arange(16).reshape(4, 4)`: one token attends to itself and comes out
    as `W_o W_v x`."""
    one = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    np.testing.assert_allclose(integer_weights(backend)(one, one, one), ROW, rtol=1e-6)


@pytest.mark.parametrize("backend", MASK_BACKENDS)
def test_known_values_with_integer_weights_masked(backend):
    """As above, with a mask (per head or shared) that shows only the first key: every query
    gets that same row."""
    attn, row = integer_weights(backend), ROW
    x = jnp.arange(1, 13, dtype=jnp.float32).reshape(3, 4)
    first = jnp.array([True, False, False])
    for mask in (jnp.broadcast_to(first, (2, 3, 3)), jnp.broadcast_to(first, (3, 3))):
        out = eqx.filter_jit(attn)(x, x, x, mask)
        np.testing.assert_allclose(out, jnp.broadcast_to(row, (3, 4)), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_weights_by_hand(backend):
    """One head, identity projections: $q = (0, \\sqrt2)$ over keys $e_1, e_2$ has logits
    $(0, 1)$, weights $(1, e) / (1 + e)$; values $(1, 0)$ give $1 / (1 + e)$, and masking the
    second key gives 1."""
    attn = MultiheadAttention(
        1, 2, key_size=2, value_size=1, output_size=1, qk_size=2, vo_size=1,
        backend=backend_of(backend), key=jax.random.key(0),
    )  # fmt: skip
    eye, one = jnp.eye(2), jnp.ones((1, 1))
    attn = eqx.tree_at(
        lambda m: [getattr(m, n).weight for n in PROJECTIONS], attn, [eye, eye, one, one]
    )
    q = jnp.array([[0.0, 2**0.5]])
    k = jnp.eye(2)
    v = jnp.array([[1.0], [0.0]])
    np.testing.assert_allclose(eqx.filter_jit(attn)(q, k, v), [[1 / (1 + np.e)]], rtol=1e-6)
    if backend in MASK_BACKENDS:
        out = eqx.filter_jit(attn)(q, k, v, jnp.array([[True, False]]))
        np.testing.assert_allclose(out, [[1.0]], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_softmax_does_not_overflow(backend):
    """float16 weights and inputs: the softmax runs in float32, so a dominant logit gives a
    weight below 1 (not a rounded 1 or an overflow), and the result stays float16."""
    attn = MultiheadAttention(
        1, 1, output_size=1, qk_size=1, vo_size=1, dtype=jnp.float16,
        backend=backend_of(backend), key=jax.random.key(0),
    )  # fmt: skip
    one = jnp.ones((1, 1), jnp.float16)
    attn = eqx.tree_at(lambda m: [getattr(m, n).weight for n in PROJECTIONS], attn, [one] * 4)
    out = attn(
        jnp.array([[1.0]], jnp.float16),
        jnp.array([[9.0], [1.0]], jnp.float16),
        jnp.array([[1.0], [0.0]], jnp.float16),
    )
    assert out.dtype == jnp.float16
    assert 0.99 < float(out[0, 0]) < 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_switch(backend, getkey):
    """Dropout 0.5: `inference=True` (per call or at construction) ignores the key; in
    training two keys give two results."""
    be = backend_of(backend)
    attn = MultiheadAttention(num_heads=2, query_size=10, dropout_p=0.5, backend=be, key=getkey())
    frozen = MultiheadAttention(2, 10, dropout_p=0.5, inference=True, backend=be, key=getkey())
    x = jax.random.normal(getkey(), (3, 10))
    # Compiled once per module and mode: eager calls of the sharded backend are slow.
    call = eqx.filter_jit(lambda m, key, inference: m(x, x, x, key=key, inference=inference))
    inference = call(attn, None, True)
    assert jnp.all(call(attn, getkey(), True) == inference)
    assert jnp.any(call(attn, getkey(), None) != call(attn, getkey(), None))
    assert jnp.all(call(frozen, getkey(), None) == call(frozen, getkey(), None))
    assert jnp.all(call(eqx.nn.inference_mode(attn), getkey(), None) == inference)
    with pytest.raises(RuntimeError, match="Dropout requires a key"):
        attn(x, x, x)


def test_deterministic_is_a_deprecated_inference(getkey):
    attn = MultiheadAttention(num_heads=2, query_size=10, dropout_p=0.5, key=getkey())
    x = jax.random.normal(getkey(), (3, 10))
    with pytest.warns(UserWarning, match="deprecated"):
        z1 = attn(x, x, x, key=getkey(), deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z2 = attn(x, x, x, deterministic=True)
    assert jnp.all(z1 == z2)


def test_inference_mode_sets_the_dropout_flag(getkey):
    attn = MultiheadAttention(2, 4, key=getkey())
    assert attn.dropout.inference is False
    assert eqx.nn.inference_mode(attn).dropout.inference is True
    assert attn.dropout.inference is False


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_projection_trains(backend, getkey):
    """A layer whose `key_proj` is shared (`eqx.nn.Shared`) with another linear map: gradients
    flow through both uses under `filter_jit`, and the two stay one after updates."""
    be = backend_of(backend)

    class Model(eqx.Module):
        shared: eqx.nn.Shared

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            attention = MultiheadAttention(num_heads=3, query_size=12, backend=be, key=k1)
            proj = eqx.nn.Linear(12, 12, use_bias=False, key=k2)
            self.shared = eqx.nn.Shared(
                (proj, attention), lambda pair: pair[1].key_proj, lambda pair: pair[0]
            )

        def __call__(self, x):
            proj, attention = self.shared()
            same = eqx.tree_equal(proj, attention.key_proj)
            return jax.vmap(proj)(attention(x, x, x)), same

    @eqx.filter_jit
    @eqx.filter_grad(has_aux=True)
    def grad(model, x):
        out, same = model(x)
        return jnp.sum(out), same

    model = Model(getkey())
    x = jax.random.normal(getkey(), (5, 12))
    d_model = model
    for _ in range(2):
        d_model, same = grad(model, x)
        assert same
        model = eqx.apply_updates(model, d_model)
    assert jnp.any(d_model.shared.pytree[0].weight != 0)


# ---------------------------------------------------------------------------------------------
# Beyond Equinox's tests: masks, dropout rates as arrays, dtypes, moving weights
# ---------------------------------------------------------------------------------------------


MASK_CASES = [
    (b, m) for b in BACKENDS for m in (None, "2d", "3d") if m is None or b in MASK_BACKENDS
]


@pytest.mark.fast(backend="energy", mask_kind="3d", biases=True)
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("backend, mask_kind", MASK_CASES)
def test_random_masks_and_biases_match_equinox(backend, biases, mask_kind, getkey):
    kw: dict[str, Any] = dict(
        num_heads=4, query_size=16, key_size=12, value_size=10, output_size=8, qk_size=6,
        vo_size=5, use_query_bias=biases, use_key_bias=biases, use_value_bias=biases,
        use_output_bias=biases,
    )  # fmt: skip
    k = getkey()
    theirs = eqx.nn.MultiheadAttention(**kw, key=k)
    ours = MultiheadAttention(**kw, backend=backend_of(backend), key=k)
    for name in PROJECTIONS:  # the same key gives the same weights
        np.testing.assert_array_equal(getattr(ours, name).weight, getattr(theirs, name).weight)
    q = jax.random.normal(getkey(), (7, 16))
    kk = jax.random.normal(getkey(), (9, 12))
    v = jax.random.normal(getkey(), (9, 10))
    mask = None
    if mask_kind == "2d":
        mask = jax.random.bernoulli(getkey(), 0.7, (7, 9)).at[:, 0].set(True)
    elif mask_kind == "3d":
        mask = jax.random.bernoulli(getkey(), 0.7, (4, 7, 9)).at[..., 0].set(True)
    assert_close(eqx.filter_jit(ours)(q, kk, v, mask), eqx.filter_jit(theirs)(q, kk, v, mask))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_rate_as_a_traced_array(backend, getkey):
    """`dropout.p` replaced by an array with `eqx.tree_at` and traced under `filter_jit`: the
    same dropped weights as Equinox for the same key; in inference the key is ignored."""
    k = getkey()
    theirs = eqx.nn.MultiheadAttention(2, 8, dropout_p=0.5, key=k)
    ours = MultiheadAttention(2, 8, dropout_p=0.5, backend=backend_of(backend), key=k)
    theirs, ours = (eqx.tree_at(lambda m: m.dropout.p, m, jnp.asarray(0.3)) for m in (theirs, ours))
    call = eqx.filter_jit(lambda m, x, key, inference: m(x, x, x, key=key, inference=inference))
    x = jax.random.normal(getkey(), (6, 8))
    dk = getkey()
    for inference in (False, True):
        assert_close(call(ours, x, dk, inference), call(theirs, x, dk, inference))
    # A rate of 0 held as an array keeps every weight.
    zero = eqx.tree_at(lambda m: m.dropout.p, ours, jnp.asarray(0.0))
    assert_close(call(zero, x, dk, False), call(zero, x, dk, True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_parameters_bfloat16_inputs(backend, getkey):
    """Equinox's mixed precision: heads, attention and output projection in the parameters'
    float32, and a float32 result — under strict promotion too."""
    k = getkey()
    theirs = eqx.nn.MultiheadAttention(4, 16, key=k)
    ours = MultiheadAttention(4, 16, backend=backend_of(backend), key=k)
    x = jax.random.normal(getkey(), (7, 16)).astype(jnp.bfloat16)
    out = ours(x, x, x)
    assert not isinstance(out, tuple) and out.dtype == jnp.float32
    assert_close(out, standard(theirs, x, x, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_and_key_value_of_different_dtypes(backend, getkey):
    """bfloat16 parameters, a float32 query and bfloat16 keys/values: the float32 query heads
    and bfloat16 key/value heads are promoted to float32, as in Equinox."""
    k = getkey()
    theirs = eqx.nn.MultiheadAttention(4, 16, dtype=jnp.bfloat16, key=k)
    ours = MultiheadAttention(4, 16, dtype=jnp.bfloat16, backend=backend_of(backend), key=k)
    q = jax.random.normal(getkey(), (5, 16))
    kv = jax.random.normal(getkey(), (8, 16)).astype(jnp.bfloat16)
    out = ours(q, kv, kv)
    expected = standard(theirs, q, kv, kv)
    assert not isinstance(out, tuple) and out.dtype == expected.dtype == jnp.float32
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_move_both_ways(backend, getkey):
    """An Equinox layer's weights and biases moved into treeattn's with `eqx.tree_at` give
    Equinox's outputs, with masks and `process_heads`; treeattn's moved into Equinox's give
    treeattn's."""
    kw: dict[str, Any] = dict(num_heads=4, query_size=16, use_query_bias=True, use_output_bias=True)
    theirs = eqx.nn.MultiheadAttention(**kw, key=getkey())
    ours = MultiheadAttention(**kw, backend=backend_of(backend), key=getkey())
    x = jax.random.normal(getkey(), (6, 16))
    mask = jnp.tril(jnp.ones((6, 6), bool)) if backend in MASK_BACKENDS else None

    def heads(q, k, v):  # Equinox's hook, e.g. for relative positions
        return q * 2.0, k, v

    into_ours = transplant(ours, theirs)
    assert_close(
        into_ours(x, x, x, mask, process_heads=heads), theirs(x, x, x, mask, process_heads=heads)
    )
    into_theirs = transplant(theirs, ours)
    assert_close(into_theirs(x, x, x, mask), ours(x, x, x, mask))
