"""Blockwise attention of every energy: the same values and gradients as the materialised form
(and float64 NumPy), in tiles of queries and keys, with memory that does not hold the logits."""

import functools

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import HEADS, TOL, energy_reference, make_energy, make_qkv
from jax.test_util import check_grads

from treeattn.energy import (
    CosFormer,
    LinearKernel,
    Sigmoid,
    Softmax,
    SoftmaxWithSink,
    StickBreaking,
    energy_attention,
)
from treeattn.energy._blockwise import blockwise_attention
from treeattn.energy._checks import dims_of


SHAPE = (9, 37, HEADS, 2, 8, 3)  # GQA; 37 keys in blocks of 8 (the last one padded)
CAUSAL = {"causal": True, "q_offset": 28}


def _mask(getkey):
    """A random mask with one (head, query) row that sees nothing."""
    mask = jax.random.bernoulli(getkey(), 0.7, (HEADS, SHAPE[0], SHAPE[1]))
    return mask.at[1, 4].set(False)


def _tiled_fn(energy, q, k, v, mask, q_offset, *, block, tile, causal=True, window=None):
    """Blockwise attention with small query chunks too (`tile` logits per tile)."""
    kw = {"block": block, "causal": causal, "scale": None, "window": window, "tile": tile}
    return blockwise_attention(energy, q, k, v, mask, q_offset, dims_of(q, k, v), **kw)


_tiled = jax.jit(_tiled_fn, static_argnames=("block", "tile", "causal", "window"))


def _pullback(fn, energy, q, k, v):
    """The output and its VJP in (energy, q, k, v) with a fixed random cotangent."""
    out, pull = jax.vjp(fn, energy, q, k, v)
    o_bar = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
    return out, pull(o_bar)


def _close(a, b, tol):
    """Leaf by leaf, finite and within `tol` of the larger of max|b| and 1 (a scalar gradient,
    such as one in beta, may be near 0 by cancellation)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.all(np.isfinite(x))
        assert np.max(np.abs(x - y)) <= tol * max(np.max(np.abs(y)), 1.0)


@pytest.mark.parametrize(
    "case",
    ["softmax_softcap_alibi", "sink", "sigmoid_bias", "linear", "stick", "relu2", "cosformer"],
)
def test_matches_materialised_and_numpy(case, getkey):
    """Values and the VJP in (energy parameters, q, k, v): causal with an offset, a 3-d mask
    and a row that sees no key; key blocks of 8 and query chunks of 2 (both padded)."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    mask = _mask(getkey)

    @jax.jit
    def run(energy, q, k, v, mask):
        def whole(e, q, k, v):
            return energy_attention(q, k, v, mask=mask, energy=e, **CAUSAL)

        def tiled(e, q, k, v):
            return _tiled_fn(e, q, k, v, mask, jnp.int32(28), block=8, tile=64)

        return _pullback(whole, energy, q, k, v), _pullback(tiled, energy, q, k, v)

    (out, grads), (out_b, grads_b) = run(make_energy(case), q, k, v, mask)
    expected, _ = energy_reference(case, q, k, v, mask=np.asarray(mask), **CAUSAL)
    assert ref.rel_err(out, expected) <= TOL[jnp.float32]
    assert ref.rel_err(out_b, expected) <= TOL[jnp.float32]
    assert np.all(np.asarray(out_b[4, 1]) == 0)  # the row that sees nothing
    _close(out_b, out, 2e-5)
    _close(grads_b, grads, 5e-5)


def _with_params(name):
    """Each shipped energy with its parameters as float64 arrays (so check_grads moves them)."""
    f64 = functools.partial(jnp.asarray, dtype=jnp.float64)
    slopes = f64([0.5, 0.25, 0.125, 0.0625])
    return {
        "softmax": Softmax(beta=f64(1.3), softcap=f64(2.0), alibi_slopes=slopes),
        "sink": SoftmaxWithSink(beta=f64(0.8), sink=f64([0.3, -1.0, 2.0, 0.0])),
        "stick": StickBreaking(),
    }[name]


@pytest.mark.parametrize("name", ["softmax", "sink", "stick"])
def test_check_grads(name, getkey):
    """First-order gradients in q, k, v and the energy's parameters, against finite
    differences, in float64 with query chunks of 2 and key blocks of 3."""
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (5, 8, HEADS, 2, 3, 2), jnp.float64)
        mask = jax.random.bernoulli(getkey(), 0.8, (HEADS, 5, 8))

        def f(e, q, k, v):
            return _tiled(e, q, k, v, mask, jnp.int32(3), block=3, tile=2 * HEADS * 3)

        check_grads(f, (_with_params(name), q, k, v), order=1, modes=["rev"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["relu_linear", "cosformer"])
def test_rows_of_no_weight(name, getkey):
    """A query whose ReLU features meet no visible key's (every weight 0, though keys are
    visible) reads out 0 with zero, finite derivatives on both paths, to second order: its
    1/s is 1/floor, 1e292 in float64, not 1/tiny, at which the cotangent times values of 100
    overflows (and 0 * inf is NaN)."""
    energy = {"relu_linear": LinearKernel(feature_map=jax.nn.relu), "cosformer": CosFormer(64)}
    energy = energy[name]
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (5, 8, HEADS, 2, 3, 2), jnp.float64)
        # |q|, |k| >= 0.1: ReLU's bend at 0 out of the second-order finite differences' reach.
        q, k = (x + jnp.copysign(jnp.float64(0.1), x) for x in (q, k))
        # Query 1 of head 0 has one positive coordinate, which every key of kv head 0 lacks.
        q = q.at[1, 0].set(jnp.array([1.0, -1.0, -1.0]))
        k = k.at[:, 0, 0].set(-jnp.abs(k[:, 0, 0]) - 0.1)
        v = v.at[:, 0].set(100.0)  # a cotangent times these overflows at 1/tiny, not at 1/floor

        def whole(e, q, k, v):
            return energy_attention(q, k, v, causal=True, q_offset=3, energy=e)

        def tiled(e, q, k, v):
            return _tiled(e, q, k, v, None, jnp.int32(3), block=3, tile=2 * HEADS * 3)

        out, grads = _pullback(whole, energy, q, k, v)
        out_b, grads_b = _pullback(tiled, energy, q, k, v)
        assert np.all(np.asarray(out[1, 0]) == 0) and np.all(np.asarray(out_b[1, 0]) == 0)
        _close(out_b, out, 1e-12)
        _close(grads_b, grads, 1e-12)
        assert np.all(np.asarray(grads[1][1, 0]) == 0)  # the row's q gets nothing
        check_grads(
            functools.partial(whole, energy),
            (q, k, v),
            order=2,
            modes=["rev"],
            atol=1e-5,
            rtol=1e-5,
            eps=1e-5,  # 1e-4's second differences missed by 4e-4 for some seeds (values of 100)
        )


def test_window_and_no_causal(getkey):
    """The public path with `block_size` for the default energy: a causal sliding window (tiles
    outside it are skipped) and a two-sided one without causality, against the materialised."""
    q, k, v = make_qkv(getkey, (12, 40, HEADS, 2, 8, 3), jnp.float32)

    @jax.jit
    def run(q, k, v):
        out = []
        for kw in ({"causal": True, "local_window_size": (6, 0)}, {"local_window_size": 5}):
            for block_size in (8, None):
                call = functools.partial(energy_attention, q_offset=20, block_size=block_size, **kw)
                fn = lambda e, q, k, v, call=call: call(q, k, v, energy=e)  # noqa: E731
                out.append(_pullback(fn, Softmax(), q, k, v))
        return out

    causal_b, causal, window_b, window = run(q, k, v)
    _close(causal_b, causal, 5e-5)
    _close(window_b, window, 5e-5)


def test_vmap(getkey):
    """Blockwise attention and its gradient under vmap = one example at a time."""
    shape = (6, 20, HEADS, 2, 4, 3)
    qkv = [
        jnp.stack(x)
        for x in zip(*(make_qkv(getkey, shape, jnp.float32) for _ in range(3)), strict=True)
    ]
    energy = StickBreaking()

    def loss(q, k, v):
        out = energy_attention(q, k, v, energy=energy, block_size=6, causal=True, q_offset=14)
        return jnp.sum(jnp.sin(out))

    step = jax.value_and_grad(loss, argnums=(0, 1, 2))

    @jax.jit
    def run(q, k, v):
        one = [step(q[i], k[i], v[i]) for i in range(q.shape[0])]
        return jax.vmap(step)(q, k, v), jax.tree.map(lambda *x: jnp.stack(x), *one)

    batched, one = run(*qkv)
    _close(batched, one, 2e-5)


def _training_temporaries(energy, n, heads, dim, block_size):
    x = jax.ShapeDtypeStruct((n, heads, dim), jnp.float32)

    def loss(q, k, v):
        out = energy_attention(q, k, v, causal=True, energy=energy, block_size=block_size)
        return jnp.sum(out**2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None
    return analysis.temp_size_in_bytes


@pytest.mark.parametrize(
    "energy, block_size",
    [(Softmax(), None), (StickBreaking(), 256), (Sigmoid(), 256)],
    ids=["default-softmax-auto", "stick-256", "sigmoid-256"],
)
def test_training_memory(energy, block_size):
    """The compiled training step (loss on attention, gradient in q, k, v) at 4096 tokens holds
    far less than one materialised logits array; the default energy goes blockwise by itself
    at this size."""
    n, heads, dim = 4096, 8, 16
    logits = heads * n * n * 4
    temp = _training_temporaries(energy, n, heads, dim, block_size)
    print(f"temporaries {temp / 2**20:.1f} MiB, one logits array {logits / 2**20:.0f} MiB")
    assert temp < logits / 3


@pytest.mark.parametrize(
    "n, heads, causal, blockwise",
    [
        (2048, 4, True, True),
        (2048, 3, True, True),
        (2048, 2, True, False),
        (1024, 4, True, False),
        (2048, 4, False, False),
    ],
    ids=["causal-2^24", "causal-1.5x2^23", "causal-2^23", "causal-2^22", "full-2^24"],
)
def test_causal_self_attention_goes_blockwise_sooner(n, heads, causal, blockwise):
    """Causal self-attention goes blockwise by itself above 2^23 logits (half of its tiles
    skipped there) and stays materialised at 2^23; without a mask a call stays materialised up
    to 2^26. Read from the compiled forward: the blockwise form is a loop over blocks of keys,
    the materialised one has none."""
    x = jax.ShapeDtypeStruct((n, heads, 8), jnp.float32)
    attend = functools.partial(energy_attention, causal=causal)
    text = jax.jit(attend).lower(x, x, x).compile().as_text()
    assert (" while(" in text) == blockwise


def test_integer_parameter(getkey):
    """An integer parameter (`Softmax(beta=2)`) trains blockwise like materialised; its own
    cotangent is the zero of an integer."""
    q, k, v = make_qkv(getkey, (6, 20, HEADS, 2, 4, 3), jnp.float32)

    @jax.jit
    def run(q, k, v):
        def loss(q, block_size):
            out = energy_attention(q, k, v, energy=Softmax(beta=2), block_size=block_size)
            return jnp.sum(jnp.sin(out))

        return jax.grad(loss)(q, 5), jax.grad(loss)(q, None)

    blocked, whole = run(q, k, v)
    _close(blocked, whole, 2e-5)
