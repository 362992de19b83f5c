"""Composite energies (Differential, Forgetting, Softpick) against float64 NumPy written from
their papers' formulas: materialised, blockwise and the reference twin, gradients in float64,
sharded over 1-8 devices, decoding through a cache, and in the model layer."""

import equinox as eqx
import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import HEADS, LAMS, TINY_CONFIG, TOL, make_qkv, mesh_of, tree, two_level_mesh
from hypothesis import given, strategies as st
from jax.test_util import check_grads

from treeattn.decode import flash_attention, tree_decode
from treeattn.energy import (
    PAIR_LOGSUMEXP,
    Differential,
    Forgetting,
    Softmax,
    Softpick,
    attention_reference,
    energy_attention,
    forgetting_inputs,
    multihead_free_energy,
    tree_energy_attention,
    tree_free_energy,
    value_moments,
)
from treeattn.models import MultiheadAttention, Transformer, generate
from treeattn.profiling import collective_stats


NAMES = ["differential", "forgetting", "softpick"]
# (q_seq, kv_seq, heads, kv_heads, qk, dv): GQA, MHA, MQA
SHAPES = [(5, 13, HEADS, 2, 8, 3), (4, 6, HEADS, 4, 4, 2), (3, 9, HEADS, 1, 6, 4)]


def log_gates(getkey, kv_seq, kv_heads, dtype=jnp.float32):
    """log f = log sigmoid(u + 1.5): forget gates mostly near 1, as trained FoX models have."""
    return jax.nn.log_sigmoid(jax.random.normal(getkey(), (kv_seq, kv_heads), dtype) + 1.5)


def problem(name, getkey, shape, dtype, *, lam=LAMS):
    """(energy, q, k, v, kwargs of the call, float64 expected attention and Hessian): causal,
    the queries the last positions, with a per-head mask (Differential, Softpick)."""
    q_seq, kv_seq, heads = shape[:3]
    q, k, v = make_qkv(getkey, shape, dtype)
    kw = {"causal": True, "q_offset": kv_seq - q_seq}
    if name == "forgetting":
        log_f = log_gates(getkey, kv_seq, shape[3])
        want = ref.forgetting_attention(q, k, v, log_f, q_offset=kw["q_offset"])
        q, k = forgetting_inputs(q, k, log_f)
        kw["scale"] = shape[4] ** -0.5  # the paper's scale: of the leading channels
        return Forgetting(), q, k, v, kw, want
    kw["mask"] = jax.random.bernoulli(getkey(), 0.8, (heads, q_seq, kv_seq))
    vis = {**kw, "mask": np.asarray(kw["mask"])}
    if name == "differential":
        kw["scale"] = (shape[4] // 2) ** -0.5  # the paper's 1/sqrt(d) of a half
        want = ref.differential_attention(q, k, v, lam, scale=kw["scale"], **vis)
        return Differential(lam=jnp.asarray(lam, jnp.float32)), q, k, v, kw, want
    return Softpick(), q, k, v, kw, ref.softpick_attention(q, k, v, **vis)


@pytest.mark.fast(name="differential", shape=SHAPES[0], dtype=jnp.float32)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("name", NAMES)
def test_every_local_path_matches_the_paper(name, shape, dtype, getkey):
    """Materialised, blockwise (blocks of 4 keys, so several per row) and the reference twin."""
    energy, q, k, v, kw, (want, _) = problem(name, getkey, shape, dtype)
    for path in ({"block_size": None}, {"block_size": 4}, None):
        if path is None:
            out = attention_reference(q, k, v, energy=energy, **kw)
        else:
            out = energy_attention(q, k, v, energy=energy, **kw, **path)
        assert out.dtype == dtype
        assert ref.rel_err(out, want) <= TOL[dtype], path


@pytest.mark.fast(name="softpick")
@pytest.mark.parametrize("name", NAMES)
def test_hessian_and_blockwise_free_energy(name, getkey):
    """value_covariance is the Hessian of the paper's free energy; F and its gradient in
    (q, k, v, zeta) blockwise equal the materialised ones."""
    from treeattn.energy import value_covariance

    shape = SHAPES[0]
    energy, q, k, v, kw, (_, hessian) = problem(name, getkey, shape, jnp.float32)
    cov = value_covariance(q, k, v, energy=energy, **kw)
    assert ref.rel_err(cov, hessian) <= 5 * TOL[jnp.float32]
    zeta = 0.3 * jax.random.normal(getkey(), (shape[0], HEADS, shape[5]))

    def f(block_size):
        fn = lambda *a: multihead_free_energy(*a, energy=energy, block_size=block_size, **kw)  # noqa: E731
        return jax.value_and_grad(fn, argnums=(0, 1, 2, 3))(q, k, v, zeta)

    (f0, g0), (f1, g1) = f(None), f(4)
    np.testing.assert_allclose(f1, f0, rtol=2e-5, atol=1e-5)
    for a, b in zip(g1, g0, strict=True):
        assert ref.rel_err(a, b) <= 2e-5


@pytest.mark.fast(name="differential", block_size=None)
@pytest.mark.parametrize("block_size", [None, 2], ids=["materialised", "blockwise"])
@pytest.mark.parametrize("name", NAMES)
def test_check_grads(name, block_size, getkey):
    """Order 1 in q, k, v and the learnable parameters (lambda; the log forget gates through
    forgetting_inputs), float64, materialised and blockwise."""
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (3, 6, HEADS, 2, 4, 2), jnp.float64)
        kw = {"causal": True, "q_offset": 3, "block_size": block_size}
        if name == "differential":

            def f(q, k, v, lam):
                return energy_attention(q, k, v, energy=Differential(lam=lam), **kw)

            args = (q, k, v, jnp.asarray(LAMS, jnp.float64))
        elif name == "forgetting":

            def f(q, k, v, log_f):
                q, k = forgetting_inputs(q, k, log_f)
                return energy_attention(q, k, v, energy=Forgetting(), **kw)

            args = (q, k, v, log_gates(getkey, 6, 2, jnp.float64))
        else:

            def f(q, k, v):
                return energy_attention(q, k, v, energy=Softpick(), **kw)

            args = (q, k, v)
        check_grads(f, args, order=1, modes=["rev"], atol=1e-5, rtol=1e-5)


TREE_CASES = [(n, p, "allreduce") for n in NAMES for p in (1, 2, 3, 4, 8)]
TREE_CASES += [("differential", 4, "butterfly"), ("differential", 4, "hierarchical")]


@pytest.mark.fast(name="differential", p=3, reduction="allreduce")
@pytest.mark.parametrize("name, p, reduction", TREE_CASES, ids=str)
def test_tree_equals_one_device(name, p, reduction, getkey):
    """F, its gradient in (q, k, v, zeta) and attention, sharded over p devices (21 keys:
    padded on 2, 4 and 8; uneven on 3), equal one device."""
    shape = (3, 21, HEADS, 2, 8, 3)
    energy, q, k, v, kw, (want, _) = problem(name, getkey, shape, jnp.float32)
    zeta = 0.3 * jax.random.normal(getkey(), (shape[0], HEADS, shape[5]))
    if reduction == "hierarchical":
        on = {"mesh": two_level_mesh(2, p // 2), "kv_axis": ("node", "local")}
    else:
        on = {"mesh": mesh_of(p), "kv_axis": "kv"}
    on |= {"reduction": reduction, "energy": energy, **kw}

    @jax.jit
    def sharded(q, k, v, zeta):
        fn = lambda *a: tree_free_energy(*a, **on)  # noqa: E731
        f, grads = jax.value_and_grad(fn, argnums=(0, 1, 2, 3))(q, k, v, zeta)
        return f, grads, tree_energy_attention(q, k, v, **on)

    @jax.jit
    def single(q, k, v, zeta):
        fn = lambda *a: multihead_free_energy(*a, energy=energy, **kw)  # noqa: E731
        f, grads = jax.value_and_grad(fn, argnums=(0, 1, 2, 3))(q, k, v, zeta)
        return f, grads, energy_attention(q, k, v, energy=energy, **kw)

    f, grads, out = jax.block_until_ready(sharded(q, k, v, zeta))
    f0, grads0, out0 = jax.block_until_ready(single(q, k, v, zeta))
    np.testing.assert_allclose(f, f0, rtol=2e-5, atol=1e-5)
    for g, g0 in zip(grads, grads0, strict=True):
        assert ref.rel_err(g, g0) <= 2e-5
    assert ref.rel_err(out, out0) <= 2e-5
    assert ref.rel_err(out, want) <= TOL[jnp.float32]


def test_tree_gradient_in_lambda(getkey):
    """The per-head lambda's gradient through attention sharded over 4 devices."""
    shape = (3, 16, HEADS, 2, 8, 3)
    energy, q, k, v, kw, _ = problem("differential", getkey, shape, jnp.float32)

    def tree_attn(q, k, v, **a):
        return tree_energy_attention(q, k, v, mesh=mesh_of(4), kv_axis="kv", **a)

    def loss(energy, attend):
        return jnp.sum(attend(q, k, v, energy=energy, **kw) ** 2)

    g = jax.jit(jax.grad(loss), static_argnums=1)(energy, tree_attn)
    g0 = jax.jit(jax.grad(loss), static_argnums=1)(energy, energy_attention)
    assert ref.rel_err(g.lam, g0.lam) <= 1e-4 and np.abs(np.asarray(g0.lam)).min() > 0


def test_tree_collectives_of_a_pair_state():
    """Differential's pair of log-sum-exps across 4 devices costs what softmax does: XLA packs
    the two maxima into one all-reduce and the two sums into another (forward 2; with the
    gradient, or for attention, one more)."""
    tree = {"mesh": mesh_of(4), "kv_axis": "kv", "energy": Differential(lam=jnp.asarray(LAMS))}
    q, z = jnp.zeros((2, HEADS, 16)), jnp.zeros((2, HEADS, 16))
    k = v = jnp.zeros((64, 2, 16))

    def count(fn, *args):
        return collective_stats(jax.jit(fn).lower(*args).compile()).count()

    def f(q, k, v, z):
        return tree_free_energy(q, k, v, z, **tree)

    assert count(f, q, k, v, z) == 2
    assert count(jax.value_and_grad(f, (0, 3)), q, k, v, z) == 3
    assert count(lambda q, k, v: tree_energy_attention(q, k, v, **tree), q, k, v) == 3


def decode_problem(name, getkey, batch_lengths, q_seq, kv_seq, kv_heads=2, dim=8):
    """A batch of caches of `kv_seq` slots filled to `batch_lengths`, `q_seq` new queries at
    the last filled positions of each row: (energy, q, k, v, scale, expected)."""
    batch = len(batch_lengths)
    q = jax.random.normal(getkey(), (batch, q_seq, HEADS, dim))
    k = jax.random.normal(getkey(), (batch, kv_seq, kv_heads, dim))
    v = jax.random.normal(getkey(), (batch, kv_seq, kv_heads, dim))
    want, qs, ks = [], [], []
    for b, n in enumerate(batch_lengths):
        off = n - q_seq
        if name == "forgetting":
            log_f = log_gates(getkey, kv_seq, kv_heads)
            want.append(ref.forgetting_attention(q[b], k[b, :n], v[b, :n], log_f[:n], q_offset=off))
            q_b, k_b = forgetting_inputs(q[b], k[b, :n], log_f[:n])
            qs.append(q_b)
            ks.append(jnp.concatenate([k_b, jnp.zeros((kv_seq - n, kv_heads, dim + 1))]))
        elif name == "differential":
            want.append(
                ref.differential_attention(
                    q[b], k[b, :n], v[b, :n], LAMS, causal=True, q_offset=off
                )
            )
        else:
            want.append(ref.softpick_attention(q[b], k[b, :n], v[b, :n], causal=True, q_offset=off))
    energy = {"differential": Differential(lam=jnp.asarray(LAMS, jnp.float32)),
              "forgetting": Forgetting(), "softpick": Softpick()}[name]  # fmt: skip
    scale = None
    if name == "forgetting":
        q, k, scale = jnp.stack(qs), jnp.stack(ks), dim**-0.5
    return energy, q, k, v, scale, np.stack([w[0] for w in want])


@pytest.mark.fast(name="forgetting", q_seq=1)
@pytest.mark.parametrize("q_seq", [1, 3], ids=["step", "chunk"])
@pytest.mark.parametrize("name", NAMES)
def test_decode_through_a_cache(name, q_seq, getkey):
    """flash_attention(backend="energy") and tree_decode over 4 devices against a cache of
    rows filled to different lengths: a decode step, and a causal chunk."""
    lengths = np.array([11, 19])
    energy, q, k, v, scale, want = decode_problem(name, getkey, lengths, q_seq, 19)
    kw = {"kv_length": jnp.asarray(lengths), "causal": True, "energy": energy, "scale": scale}
    out, f = flash_attention(q, k, v, backend="energy", q_offset=jnp.asarray(lengths - q_seq), **kw)
    assert ref.rel_err(out, want) <= TOL[jnp.float32]
    assert np.isfinite(np.asarray(f)).all()
    out = tree_decode(q, k, v, mesh=mesh_of(4), kv_axis="kv", **kw)
    assert ref.rel_err(jax.block_until_ready(out), want) <= TOL[jnp.float32]


@pytest.mark.fast(name="differential")
@pytest.mark.parametrize("name", NAMES)
def test_model_layer(name, getkey):
    """MultiheadAttention(energy=...) is the energy's attention of its projections on every
    backend, and the energy's parameters receive a gradient through the layer."""
    energy = {"differential": Differential(lam=jnp.asarray([0.3, 0.6])),
              "forgetting": Forgetting(), "softpick": Softpick()}[name]  # fmt: skip
    layer = MultiheadAttention(
        2, 16, num_kv_heads=1, causal=True, energy=energy, backend="flash", key=getkey()
    )
    x = jax.random.normal(getkey(), (7, 16))
    q = jax.vmap(layer.query_proj)(x).reshape(7, 2, 8)
    k = jax.vmap(layer.key_proj)(x).reshape(7, 1, 8)
    v = jax.vmap(layer.value_proj)(x).reshape(7, 1, 8)
    want = jax.vmap(layer.output_proj)(
        energy_attention(q, k, v, causal=True, energy=energy).reshape(7, 16)
    )
    for backend in ("energy", "reference", "flash", tree(2)):
        got = layer(x, x, x, backend=backend)
        assert not isinstance(got, tuple)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    if name == "differential":
        grad = eqx.filter_grad(lambda m: jnp.sum(m(x, x, x, backend="energy") ** 2))(layer)
        assert np.all(np.isfinite(grad.energy.lam)) and np.abs(grad.energy.lam).min() > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_tree_generate_gives_the_reference_tokens(name, getkey):
    """A small decoder with the energy generates, through a KV cache sharded over 2 devices,
    the tokens of the reference path."""
    energy = {"differential": Differential(lam=jnp.asarray(0.5)),
              "forgetting": Forgetting(), "softpick": Softpick()}[name]  # fmt: skip
    model = Transformer(TINY_CONFIG, energy=energy, key=getkey())
    prompt = jax.random.randint(getkey(), (5,), 0, TINY_CONFIG.vocab_size)
    want = generate(model, prompt, max_new_tokens=4, backend="reference", max_len=16)
    be = tree(2)
    got = generate(
        model, prompt, max_new_tokens=4, backend=be, mesh=be.mesh, kv_axis="kv", max_len=16
    )
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Properties and numerics
# ---------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**16), kv=st.sampled_from([3, 5, 8]), heads=st.sampled_from([1, 4]))
def test_reductions_to_softmax(seed, kv, heads):
    """Differential with lambda = 0 is softmax over the first halves; Forgetting with every
    gate open (log f = 0) is softmax over the leading channels."""
    key = iter(jax.random.split(jax.random.key(seed), 4))
    q = jax.random.normal(next(key), (3, heads, 6))
    k = jax.random.normal(next(key), (kv, 1, 6))
    v = jax.random.normal(next(key), (kv, 1, 2))
    kw = {"causal": True, "q_offset": kv - 3, "scale": 0.4}  # the queries: the last positions
    diff = energy_attention(q, k, v, energy=Differential(lam=0.0), **kw)
    soft = energy_attention(q[..., :3], k[..., :3], v, energy=Softmax(), **kw)
    np.testing.assert_allclose(diff, soft, rtol=1e-5, atol=1e-6)
    q_f, k_f = forgetting_inputs(q[..., :5], k[..., :5], jnp.zeros((kv, 1)))
    fox = energy_attention(q_f, k_f, v, energy=Forgetting(), **kw)
    soft = energy_attention(q[..., :5], k[..., :5], v, energy=Softmax(), **kw)
    np.testing.assert_allclose(fox, soft, rtol=1e-5, atol=1e-6)


def test_softpick_extreme_logits_and_rows_that_attend_to_nothing(getkey):
    """Logits up to ~400 (e^x overflows float32 above 88.7) match float64, blockwise too;
    rows whose logits are all negative attend to nothing (exactly 0) with finite gradients;
    the weights of a row never sum above 1."""
    shape = (4, 7, HEADS, 2, 8, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    q_big, k_pos = 100 * jnp.abs(q), jnp.abs(k)  # every logit positive, most of them huge
    want, _ = ref.softpick_attention(q_big, k_pos, v)
    for block_size in (None, 3):
        out = energy_attention(q_big, k_pos, v, energy=Softpick(), block_size=block_size)
        assert np.isfinite(np.asarray(out)).all()
        assert ref.rel_err(out, want) <= TOL[jnp.float32]

    def attend(q):
        return energy_attention(q, k_pos, v, energy=Softpick())

    np.testing.assert_array_equal(np.asarray(attend(-jnp.abs(q))), 0)  # every logit negative
    g = jax.grad(lambda q: jnp.sum(attend(q) ** 2))(-jnp.abs(q))
    assert np.isfinite(np.asarray(g)).all()
    total = energy_attention(q, k, jnp.ones_like(v), energy=Softpick(), causal=True)
    assert float(jnp.max(total)) <= 1 + 1e-6


def test_pair_monoid_shape():
    """The product of two log-sum-exps: a pair state, identity (-inf, -inf), commutative."""
    ident = PAIR_LOGSUMEXP.identity((2, 3), jnp.float32)
    assert len(ident) == 2 and all(np.isneginf(np.asarray(s)).all() for s in ident)
    assert PAIR_LOGSUMEXP.commutative and PAIR_LOGSUMEXP.reductions == 4
    a = (jnp.array([0.0, 1.0]), jnp.array([2.0, -jnp.inf]))
    b = (jnp.array([1.0, -jnp.inf]), jnp.array([0.5, 3.0]))
    ab, ba = PAIR_LOGSUMEXP.combine(a, b), PAIR_LOGSUMEXP.combine(b, a)
    for x, y in zip(ab, ba, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(ab[0], np.logaddexp([0.0, 1.0], [1.0, -np.inf]))


def test_softpick_third_cumulant_precision_and_no_keys():
    """At zeta = 0 softpick is lifted from its weights: the third cumulant equals float64
    autodiff of log sum_a |e^x_a - 1| e^([x_a > 0] zeta.v_a); small weights beside a large one
    keep float32 precision (8K logits in [0, 2] and one at 12, against float64 NumPy), and so
    do logits near 0; a problem with no keys attends to nothing."""
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        q, k = jnp.asarray(rng.normal(size=(2, 1, 4))), jnp.asarray(rng.normal(size=(5, 1, 4)))
        v = jnp.asarray(rng.normal(size=(5, 1, 2)))
        third = value_moments(q, k, v, order=3, energy=Softpick())
        x = jnp.einsum("qhd,khd->qk", q, k) / 2.0

        def free_energy(z, i):
            tilt = (x[i] > 0).astype(z.dtype) * (v[:, 0] @ z)
            return jnp.log(jnp.sum(jnp.abs(jnp.expm1(x[i])) * jnp.exp(tilt)))

        for i in range(2):
            want = jax.jacfwd(jax.jacfwd(jax.grad(free_energy)))(jnp.zeros(2), i)
            np.testing.assert_allclose(third[i, 0], want, rtol=1e-10, atol=1e-12)
    x = rng.uniform(0, 2, 8192)
    x[5] = 12.0
    v = rng.normal(size=(8192, 1, 3))
    q, k = jnp.ones((1, 1, 1)), jnp.asarray(x.reshape(-1, 1, 1), jnp.float32)
    out = energy_attention(q, k, jnp.asarray(v, jnp.float32), energy=Softpick(), scale=1.0)
    w = np.where(x > 0, np.expm1(x), 0.0) / np.sum(np.abs(np.expm1(x)))
    want = w @ v[:, 0]
    assert np.max(np.abs(np.asarray(out[0, 0], np.float64) - want)) < 1e-5 * np.max(np.abs(want))
    # Logits near 0: |e^x - 1| ~ |x| keeps float32's relative precision (e^x - 1 formed by a
    # subtraction would keep about 3 digits of these weights).
    x = rng.uniform(-2e-4, 2e-4, 16)
    v = rng.normal(size=(16, 1, 3))
    k = jnp.asarray(x.reshape(-1, 1, 1), jnp.float32)
    out = energy_attention(q, k, jnp.asarray(v, jnp.float32), energy=Softpick(), scale=1.0)
    w = np.where(x > 0, np.expm1(x), 0.0) / np.sum(np.abs(np.expm1(x)))
    want = w @ v[:, 0]
    assert np.max(np.abs(np.asarray(out[0, 0], np.float64) - want)) < 1e-5 * np.max(np.abs(want))
    none = energy_attention(q, k[:0], jnp.zeros((0, 1, 3)), energy=Softpick())
    np.testing.assert_array_equal(none, 0.0)
