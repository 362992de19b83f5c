"""Energies as values: every shipped energy (and a user-defined one, helpers.ReLU2) against
float64 NumPy, on one device and sharded over 1-8, with its gradients and its communication."""

import functools
import re

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import (
    GRID,
    HEADS,
    TOL,
    ReLU2,
    energy_reference,
    make_energy,
    make_masking,
    make_qkv,
    mesh_of,
    np_kw,
    two_level_mesh,
)
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from treeattn.energy import (
    LinearKernel,
    Sigmoid,
    Softmax,
    SoftmaxWithSink,
    StickBreaking,
    attention_reference,
    energy_attention,
    multihead_free_energy,
    sharded_energy_attention,
    sharded_free_energy,
    tree_energy_attention,
    tree_free_energy,
    value_covariance,
)
from treeattn.profiling import collective_stats


SHAPES = [(5, 13, HEADS, 2, 8, 3), (4, 6, HEADS, 4, 4, 2)]  # GQA, MHA


@functools.partial(jax.jit, static_argnames=("fn", "causal"))
def _call(fn, energy, q, k, v, mask, q_offset, causal):
    return fn(q, k, v, causal=causal, mask=mask, q_offset=q_offset, energy=energy)


def call(fn, energy, q, k, v, **kw):
    args = (kw.get("mask"), kw.get("q_offset", 0), kw.get("causal", False))
    return _call(fn, energy, q, k, v, *args)


@pytest.mark.parametrize(
    "shape, masking", [(SHAPES[0], "causal_mask3d"), (SHAPES[1], "causal_cache")], ids=str
)
@pytest.mark.parametrize("case", GRID)
def test_attention_and_hessian_match_numpy(case, shape, masking, getkey):
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw = make_masking(getkey, shape, masking)
    energy = make_energy(case)
    expected, hessian = energy_reference(case, q, k, v, **np_kw(kw))
    out = call(energy_attention, energy, q, k, v, **kw)
    assert out.dtype == jnp.float32
    assert ref.rel_err(out, expected) <= TOL[jnp.float32]
    cov = call(value_covariance, energy, q, k, v, **kw)
    assert ref.rel_err(cov, hessian) <= 5 * TOL[jnp.float32]


@pytest.mark.parametrize("case", GRID)
def test_bfloat16(case, getkey):
    shape = SHAPES[0]
    q, k, v = make_qkv(getkey, shape, jnp.bfloat16)
    kw = {"causal": True, "q_offset": shape[1] - shape[0]}
    out = call(energy_attention, make_energy(case), q, k, v, **kw)
    assert out.dtype == jnp.bfloat16
    assert ref.rel_err(out, energy_reference(case, q, k, v, **kw)[0]) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("case", GRID)
def test_free_energy_gradient_is_attention_and_rows_without_keys(case, getkey):
    """dF/dzeta at 0 is attention; a row that sees no key gives 0 and finite gradients."""
    shape = SHAPES[0]
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    mask = jax.random.bernoulli(getkey(), 0.6, (shape[2], shape[0], shape[1]))
    mask = mask.at[1, 2].set(False).at[:, 0].set(False)  # empty rows
    energy = make_energy(case)
    zeta = jnp.zeros((shape[0], shape[2], shape[5]))
    g = jax.grad(multihead_free_energy, argnums=3)(q, k, v, zeta, mask=mask, energy=energy)
    out = energy_attention(q, k, v, mask=mask, energy=energy)
    np.testing.assert_allclose(g, out, rtol=2e-5, atol=2e-6)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(out)[2, 1] == 0)

    def loss(q, k, v):
        return jnp.sum(energy_attention(q, k, v, mask=mask, energy=energy) ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(x)).all() for x in grads)


def _reduces_max(f, *args) -> bool:
    """Whether a `reduce_max` appears in the jaxpr of `f` (nested jaxprs are printed too)."""
    return "reduce_max" in str(jax.make_jaxpr(f)(*args))


def test_stick_breaking_attention_has_no_running_max(getkey):
    """At zeta = 0 stick-breaking's weights are at most 1: attention and its cumulants lift
    them without a pass for a running maximum; F at another zeta keeps it (exact for any tilt)."""
    shape = SHAPES[0]
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    zeta = jnp.ones((shape[0], shape[2], shape[5]))
    kw = {"causal": True, "energy": StickBreaking()}
    assert not _reduces_max(lambda q, k, v: energy_attention(q, k, v, **kw), q, k, v)
    assert not _reduces_max(lambda q, k, v: value_covariance(q, k, v, **kw), q, k, v)
    assert _reduces_max(lambda *a: multihead_free_energy(*a, **kw), q, k, v, zeta)


class _StickBreakingByElements(StickBreaking):
    """Stick-breaking lifted from its elements at zeta = 0 too (no inclusive suffix sum)."""

    def _lift_at_zero(self, x, tilt, visible, ctx):
        return None


@pytest.mark.parametrize("sharp", [1.0, 4.0], ids=["logits~1", "logits~16"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_stick_breaking_lift_at_zero_matches_its_elements(block_size, sharp, getkey):
    """At zeta = 0 stick-breaking lifts a block from its logits with an inclusive suffix sum;
    attention, covariance and the gradient of a loss in q, k, v equal those lifted from its
    elements (log w_a = x_a + log r_a, exclusive sum), with masked keys and a row of none, and
    with logits of order 16 (beta near 0 or 1, where the two round differently)."""
    shape = (6, 11, HEADS, 2, 8, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    q, k = q * sharp, k * sharp
    mask = jax.random.bernoulli(getkey(), 0.6, (HEADS, shape[0], shape[1])).at[:, 0].set(False)
    kw = {"causal": True, "q_offset": 5, "mask": mask}
    ours, by_elements = StickBreaking(), _StickBreakingByElements()
    for fn, extra in ((energy_attention, {"block_size": block_size}), (value_covariance, {})):
        a = jax.jit(functools.partial(fn, energy=ours, **kw, **extra))(q, k, v)
        b = jax.jit(functools.partial(fn, energy=by_elements, **kw, **extra))(q, k, v)
        np.testing.assert_allclose(a, b, atol=2e-6)
    kw["block_size"] = block_size

    def loss(energy, q, k, v):
        return jnp.sum(jnp.sin(energy_attention(q, k, v, energy=energy, **kw)))

    a = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    b = jax.grad(functools.partial(loss, by_elements), argnums=(0, 1, 2))(q, k, v)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=2e-5)


def test_stick_breaking_with_vanishing_weights(getkey):
    """Logits near -60 (every weight about 1e-26, a stick almost all left over) and rows
    without keys: attention, its covariance and a tilted F match float64 NumPy, NaN-free."""
    shape = (5, 13, HEADS, 2, 8, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    q, k = q * 0.05 + 4.6, k * 0.05 - 4.6  # s q.k about -4.6^2 * 8 / sqrt(8) ~ -60
    mask = jax.random.bernoulli(getkey(), 0.7, (HEADS, shape[0], shape[1])).at[:, 0].set(False)
    kw = {"causal": True, "q_offset": 8, "mask": mask}
    expected, hessian = ref.energy_attention("stick", {}, q, k, v, **np_kw(kw))
    assert 1e-30 < np.abs(expected).max() < 1e-20
    out = call(energy_attention, StickBreaking(), q, k, v, **kw)
    cov = call(value_covariance, StickBreaking(), q, k, v, **kw)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(cov)).all()
    assert ref.rel_err(out, expected) <= TOL[jnp.float32]
    assert ref.rel_err(cov, hessian) <= 5 * TOL[jnp.float32]


def test_default_is_todays_softmax(getkey):
    q, k, v = make_qkv(getkey, SHAPES[0], jnp.float32)
    a = energy_attention(q, k, v, causal=True)
    b = energy_attention(q, k, v, causal=True, energy=Softmax())
    c = energy_attention(q, k, v, causal=True, energy=Softmax(beta=jnp.float32(1.0)))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)  # the general path, same result


@pytest.mark.parametrize("case", [*GRID, "default"])
def test_attention_reference_matches_numpy(case, getkey):
    """The float32 twin, written from each energy's definition key by key, against float64."""
    shape = SHAPES[0]
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw = make_masking(getkey, shape, "causal_mask3d")
    mask = np.asarray(kw["mask"]).copy()
    mask[1, 2] = False  # a row with no visible key gives 0
    kw["mask"] = jnp.asarray(mask)
    energy = Softmax() if case == "default" else make_energy(case)
    if case == "default":
        expected = ref.energy_attention("softmax", {}, q, k, v, **np_kw(kw))[0]
    else:
        expected = energy_reference(case, q, k, v, **np_kw(kw))[0]
    out = call(attention_reference, energy, q, k, v, **kw)
    assert out.dtype == jnp.float32
    assert ref.rel_err(out, expected) <= TOL[jnp.float32]
    assert np.all(np.asarray(out)[2, 1] == 0)


def _optimised_hlo(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    assert cost is not None
    # The instructions, without their metadata (source lines, which name the lambdas).
    text = compiled.as_text() or ""
    ops = [re.sub(r", metadata=\{[^}]*\}", "", line) for line in text.splitlines()]
    return cost["flops"], [line for line in ops if " = " in line]


def test_default_and_softmax_compile_to_one_program(getkey):
    """`energy=Softmax()` and the default are one path: the same optimised program."""
    q, k, v = make_qkv(getkey, SHAPES[0], jnp.float32)
    kw = {"causal": True, "q_offset": 8}
    default = _optimised_hlo(lambda q, k, v: energy_attention(q, k, v, **kw), q, k, v)
    softmax = _optimised_hlo(
        lambda q, k, v: energy_attention(q, k, v, energy=Softmax(), **kw), q, k, v
    )
    assert default == softmax
    zeta = jnp.zeros(q.shape[:2] + v.shape[-1:])
    default = _optimised_hlo(lambda *a: multihead_free_energy(*a, **kw), q, k, v, zeta)
    softmax = _optimised_hlo(
        lambda *a: multihead_free_energy(*a, energy=Softmax(), **kw), q, k, v, zeta
    )
    assert default == softmax


@pytest.mark.skipif(
    jax.__version_info__ < (0, 9),
    reason="jax 0.8's XLA:CPU does not move the row scaling out (3 logits-sized operations)",
)
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="counts XLA:CPU's fusions")
@pytest.mark.parametrize(("case", "passes"), [("linear", 2), ("cosformer", 2), ("softpick", 3)])
def test_row_scaling_leaves_the_product_with_v(case, passes):
    """Attention at 1,024 tokens, 8 heads of 64, of the energies whose rows are a plain sum
    read out by a logarithm (`LinearKernel`, `CosFormer`; softpick's lift at zeta = 0): XLA
    moves the row scaling 1/max(s, floor) out of the product of the weights with V, so no pass
    over the logits scales them (counted: top-level operations with a logits-sized result). A
    mask or a select on 1/s adds one (CosFormer's attention then takes 1.5x the time)."""
    n, heads, dim = 1024, 8, 64
    x = jax.ShapeDtypeStruct((n, heads, dim), jnp.float32)
    energy = make_energy(case)
    fn = jax.jit(lambda q, k, v: energy_attention(q, k, v, causal=True, energy=energy))
    text = fn.lower(x, x, x).compile().as_text() or ""
    assert "\nENTRY" in text
    entry = text[text.index("\nENTRY") :]
    # A result, `= f32[8,1024,1024]{2,1,0} op(` or a tuple `= (f32[...]{...}, ...) op(`.
    result = re.compile(r" = (\(.*?\)|\S+) [\w-]+\(")
    logits = [
        line
        for line in entry.splitlines()
        if (m := result.search(line))
        and any(_elements(d) == heads * n * n for d in re.findall(r"\[([\d,]*)\]", m.group(1)))
    ]
    assert 1 <= len(logits) <= passes, "\n".join(logits)


def _elements(dims: str) -> int:
    """Elements of an HLO shape's dimensions, e.g. `8,1024,1024`."""
    return int(np.prod([int(d) for d in dims.split(",") if d]))


# ---------------------------------------------------------------------------------------------
# Gradient checks, orders 1 and 2, in q, k, v and in the energy's parameters
# ---------------------------------------------------------------------------------------------


PARAMETERS = {
    "beta": lambda p: Softmax(beta=p),
    "softcap": lambda p: Softmax(softcap=p),
    "alibi": lambda p: Softmax(alibi_slopes=jnp.stack([p, 0.5 * p])),
    "sink": lambda p: SoftmaxWithSink(sink=jnp.stack([p, -p])),
    "bias": lambda p: Sigmoid(bias=p),
}


@pytest.mark.parametrize(
    "case",
    ["softmax_softcap_alibi", "sink", "sigmoid", "linear", "stick", "cosformer"],
)
def test_check_grads_qkv(case, getkey):
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (2, 5, HEADS, 2, 3, 2), jnp.float64)
        # Feature maps (ELU + 1, ReLU) bend at 0: a coordinate near it puts the bend within
        # reach of the second-order finite differences, which then err by O(step) (1e-4 at
        # 0.02 from it, seed 1800357299), not the derivative's error. |q|, |k| >= 0.1.
        q, k = (x + jnp.copysign(jnp.float64(0.1), x) for x in (q, k))
        energy = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), make_energy(case))

        def f(q, k, v):
            return energy_attention(q, k, v, causal=True, q_offset=3, energy=energy)

        check_grads(f, (q, k, v), order=2, modes=["rev"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", PARAMETERS)
def test_check_grads_parameters(name, getkey):
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (2, 5, 2, 1, 3, 2), jnp.float64)

        def f(p):
            energy = PARAMETERS[name](p)
            return energy_attention(q, k, v, causal=True, q_offset=3, energy=energy)

        check_grads(f, (jnp.float64(0.7),), order=2, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Batched with vmap, differentiated in q, k, v and the energy's parameters
# ---------------------------------------------------------------------------------------------


# Every shipped energy, its parameters (NumPy's names) as arrays so that they are learnable.
BATCHED = {
    "softmax": {"beta": 1.3, "softcap": 1.5, "alibi": [0.5, 0.25, 0.125, 0.0625]},
    "sink": {"sink": [0.3, -1.0, 2.0, 0.0]},
    "sigmoid": {"bias": -0.4},
    "linear": {},
    "stick": {},
}


def _energy_of(name, p):
    if name == "softmax":
        return Softmax(beta=p["beta"], softcap=p["softcap"], alibi_slopes=p["alibi"])
    if name == "sink":
        return SoftmaxWithSink(sink=p["sink"])
    if name == "sigmoid":
        return Sigmoid(bias=p["bias"])
    return {"linear": LinearKernel, "stick": StickBreaking}[name]()


@pytest.mark.parametrize("name", BATCHED)
def test_vmap_gradient_matches_unbatched_and_numpy(name, getkey):
    """jax.grad through jax.vmap of energy_attention, in q, k, v and the energy's parameters:
    the unbatched gradients, and float64 central differences of the NumPy reference."""
    batch, shape, q_offset = 2, (3, 5, HEADS, 2, 4, 3), 2
    qkv = [make_qkv(getkey, shape, jnp.float32) for _ in range(batch)]
    q, k, v = (jnp.stack(x) for x in zip(*qkv, strict=True))
    params = {n: jnp.asarray(x, jnp.float32) for n, x in BATCHED[name].items()}
    w = jax.random.normal(getkey(), (batch, shape[0], HEADS, shape[5]))

    def attend(q, k, v, p):
        return energy_attention(q, k, v, causal=True, q_offset=q_offset, energy=_energy_of(name, p))

    def batched(q, k, v, p):
        return jnp.sum(w * jax.vmap(attend, in_axes=(0, 0, 0, None))(q, k, v, p))

    grads = jax.grad(batched, argnums=(0, 1, 2, 3))(q, k, v, params)
    unbatched = [
        jax.grad(lambda *a, b=b: jnp.sum(w[b] * attend(*a)), argnums=(0, 1, 2, 3))(
            q[b], k[b], v[b], params
        )
        for b in range(batch)
    ]
    for i in range(3):  # q, k, v: one gradient per batch element
        want = jnp.stack([g[i] for g in unbatched])
        np.testing.assert_allclose(grads[i], want, rtol=1e-5, atol=1e-6)
    for n in params:  # the shared parameters: the sum over the batch
        want = sum(g[3][n] for g in unbatched)
        np.testing.assert_allclose(grads[3][n], want, rtol=1e-5, atol=1e-6)

    def numpy_loss(q, k, v, p):
        out = [
            ref.energy_attention(name, p, q[b], k[b], v[b], causal=True, q_offset=q_offset)[0]
            for b in range(batch)
        ]
        return float(np.sum(ref.f64(w) * np.stack(out)))

    args = [ref.f64(q), ref.f64(k), ref.f64(v), {n: ref.f64(a) for n, a in params.items()}]
    eps = 1e-4
    for i, g in enumerate(grads):  # the derivative along a random direction of argument i
        rng = np.random.default_rng(i)
        d = jax.tree.map(lambda a, rng=rng: rng.normal(size=np.shape(a)), args[i])
        if not jax.tree.leaves(d):
            continue  # an energy without parameters

        def moved(t, i=i, d=d):
            a = list(args)
            a[i] = jax.tree.map(lambda x, y: x + t * y, args[i], d)
            return numpy_loss(*a)

        want = (moved(eps) - moved(-eps)) / (2 * eps)
        got = sum(
            np.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(d), strict=True)
        )
        assert abs(got - want) <= 1e-5 * (abs(want) + 1), (i, got, want)


# ---------------------------------------------------------------------------------------------
# Sharded and on a mesh: the same numbers, the monoid's collectives
# ---------------------------------------------------------------------------------------------


TREE_CASES = ["softmax_beta", "sink", "sigmoid", "linear", "cosformer", "stick", "relu2"]


SCHEDULES = [(1, "allreduce"), (2, "butterfly"), (4, "hierarchical"), (8, "allreduce")]


@jax.jit
def single_device(q, k, v, zeta, energy):
    """(F, dF/d(q, k, v, zeta), attention) on one device, causal with the queries at 18..: one
    compilation per energy, shared by every schedule it is checked against."""
    kw = {"causal": True, "q_offset": 18}
    f, grads = jax.value_and_grad(
        lambda *a: multihead_free_energy(*a, energy=energy, **kw), argnums=(0, 1, 2, 3)
    )(q, k, v, zeta)
    return f, grads, energy_attention(q, k, v, energy=energy, **kw)


# Each energy against two schedules (one of them across several devices); each schedule
# against three energies.
TREE_SCHEDULE_CASES = [
    (case, *SCHEDULES[(i + j) % len(SCHEDULES)])
    for i, case in enumerate(TREE_CASES)
    for j in (0, 2)
]


@pytest.mark.fast(case="sink", p=8, reduction="allreduce")
@pytest.mark.parametrize("case, p, reduction", TREE_SCHEDULE_CASES, ids=str)
def test_tree_matches_unsharded(case, p, reduction, getkey):
    shape = (3, 21, HEADS, 2, 8, 3)  # 21 keys: padded on 2, 4 and 8 devices
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    zeta = 0.3 * jax.random.normal(getkey(), (shape[0], HEADS, shape[5]))
    energy = make_energy(case)
    kw = {"causal": True, "q_offset": 18}
    if reduction == "hierarchical":
        mesh = two_level_mesh(2, p // 2)
        tree = {"mesh": mesh, "kv_axis": ("node", "local")}
    else:
        tree = {"mesh": mesh_of(p), "kv_axis": "kv"}
    tree |= {"reduction": reduction, "energy": energy}

    @jax.jit
    def sharded(q, k, v, zeta):
        f, grads = jax.value_and_grad(
            lambda *a: tree_free_energy(*a, **tree, **kw), argnums=(0, 1, 2, 3)
        )(q, k, v, zeta)
        return f, grads, tree_energy_attention(q, k, v, **tree, **kw)

    f, grads, out = jax.block_until_ready(sharded(q, k, v, zeta))
    f0, grads0, out0 = single_device(q, k, v, zeta, energy)
    np.testing.assert_allclose(f, f0, rtol=2e-5, atol=1e-5)
    for g, g0 in zip(grads, grads0, strict=True):
        assert ref.rel_err(g, g0) <= 2e-5
    assert ref.rel_err(out, energy_reference(case, q, k, v, **kw)[0]) <= TOL[jnp.float32]


@pytest.mark.parametrize("case", ["sink", "sigmoid_bias", "softmax_softcap_alibi"])
def test_tree_gradient_in_parameters(case, getkey):
    """The gradient in an energy's parameters over 4 devices equals one device's, in float64: a
    parameter's gradient sums terms of both signs over every (query, key), and in float32 it can
    cancel to a thousandth of them (a softcap's, at one seed: one device's float32 gradient
    1.6e-4 from float64, the tree's 3.9e-5), which no float32 tolerance separates from a fault."""
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (3, 16, HEADS, 2, 8, 3), jnp.float64)
        kw = {"causal": True, "q_offset": 13}

        def loss(energy, attend):
            return jnp.sum(attend(q, k, v, energy=energy, **kw) ** 2)

        tree = functools.partial(tree_energy_attention, mesh=mesh_of(4), kv_axis="kv")
        energy = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), make_energy(case))
        g = jax.jit(jax.grad(loss), static_argnums=1)(energy, tree)
        g0 = jax.jit(jax.grad(loss), static_argnums=1)(energy, energy_attention)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
            assert a.dtype == jnp.float64
            assert ref.rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("case", ["softmax_beta", "sigmoid", "stick"])
def test_permuted_shard_order(case, getkey):
    """Device d holds block order[d] of the sequence (its position is its kv_offset): every
    monoid, the ordered one included, gives the result of the sequence in order."""
    p, n = 4, 5
    order = [2, 0, 3, 1]
    q, k, v = make_qkv(getkey, (3, p * n, HEADS, 2, 8, 3), jnp.float32)
    zeta = 0.3 * jax.random.normal(getkey(), (3, HEADS, 3))
    blocks = np.concatenate([np.arange(b * n, (b + 1) * n) for b in order])
    offsets = jnp.asarray([b * n for b in order], jnp.int32)
    energy = make_energy(case)
    kw = {"causal": True, "q_offset": p * n - 3}

    def local(q, k, v, zeta, offset):
        args = {"axis_name": "kv", "kv_offset": offset[0], "energy": energy, **kw}
        return sharded_free_energy(q, k, v, zeta, **args), sharded_energy_attention(q, k, v, **args)

    specs = (P(), P("kv"), P("kv"), P(), P("kv"))
    # An ordered fold's result is replicated by construction; the checker cannot see it.
    check = energy.monoid.commutative
    mapped = jax.shard_map(
        local, mesh=mesh_of(p), in_specs=specs, out_specs=(P(), P()), check_vma=check
    )
    mapped = jax.jit(mapped)
    f, out = mapped(q, k[blocks], v[blocks], zeta, offsets)
    f_one = multihead_free_energy(q, k, v, zeta, energy=energy, **kw)
    np.testing.assert_allclose(f, f_one, rtol=2e-5, atol=1e-5)  # F can be near 0 (a sum)
    assert ref.rel_err(out, energy_reference(case, q, k, v, **kw)[0]) <= TOL[jnp.float32]


@pytest.mark.parametrize(
    "case, forward, both, attention",
    [("softmax_beta", 2, 3, 3), ("sigmoid", 1, 1, 1), ("stick", 1, 2, 2)],
)
def test_collectives(case, forward, both, attention):
    """Forward: the monoid's reductions; with its gradient one more, the same for every sequence
    length. A sum's pullback does not read the merged state, so the gradient's all-reduce does
    not wait for the forward's and XLA packs the two into one (sigmoid: one in all)."""
    energy = make_energy(case)
    mesh = mesh_of(4)
    tree = {"mesh": mesh, "kv_axis": "kv", "energy": energy}
    sent = set()
    for kv_seq in (64, 512):
        q, z = jnp.zeros((2, HEADS, 16)), jnp.zeros((2, HEADS, 16))
        k = v = jnp.zeros((kv_seq, 2, 16))

        def stats(fn, *args):
            return collective_stats(jax.jit(fn).lower(*args).compile())

        fwd = stats(lambda q, k, v, z: tree_free_energy(q, k, v, z, **tree), q, k, v, z)
        assert fwd.count() == forward
        grad = stats(
            jax.value_and_grad(lambda q, k, v, z: tree_free_energy(q, k, v, z, **tree), (0, 3)),
            q,
            k,
            v,
            z,
        )
        assert grad.count() == both
        att = stats(lambda q, k, v: tree_energy_attention(q, k, v, **tree), q, k, v)
        assert att.count() == attention
        sent.add((fwd.bytes_sent(), grad.bytes_sent(), att.bytes_sent()))
    assert len(sent) == 1


def test_user_energy_everywhere(getkey):
    """A user-defined energy (helpers.ReLU2: its elements and monoid) gets attention, covariance
    and the tree form with no other code."""
    shape = SHAPES[0]
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw = {"causal": True, "q_offset": shape[1] - shape[0]}
    out, hess = ref.energy_attention("relu2", {}, q, k, v, **kw)
    assert ref.rel_err(energy_attention(q, k, v, energy=ReLU2(), **kw), out) <= TOL[jnp.float32]
    assert ref.rel_err(value_covariance(q, k, v, energy=ReLU2(), **kw), hess) <= 1e-4
    tree = tree_energy_attention(q, k, v, mesh=mesh_of(4), kv_axis="kv", energy=ReLU2(), **kw)
    assert ref.rel_err(tree, out) <= TOL[jnp.float32]


def test_errors(getkey):
    q, k, v = make_qkv(getkey, SHAPES[0], jnp.float32)
    with pytest.raises(ValueError, match="energy must be a treeattn.energy.Energy"):
        energy_attention(q, k, v, energy="softmax")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Blockwise: O(N d) memory, the same numbers and gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["softmax_softcap_alibi", "sink", "sigmoid", "linear", "stick"])
def test_blockwise_matches_materialised(case, getkey):
    shape = (9, 37, HEADS, 2, 8, 3)  # 37 keys in blocks of 8: the last block is padded
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    zeta = 0.3 * jax.random.normal(getkey(), (shape[0], HEADS, shape[5]))
    mask = jax.random.bernoulli(getkey(), 0.7, (HEADS, shape[0], shape[1]))
    kw = {"causal": True, "q_offset": 28, "mask": mask, "energy": make_energy(case)}

    @functools.partial(jax.jit, static_argnames="block_size")
    def run(q, k, v, zeta, block_size):
        f, g = jax.value_and_grad(
            lambda *a: multihead_free_energy(*a, block_size=block_size, **kw), (0, 1, 2, 3)
        )(q, k, v, zeta)
        out, pull = jax.vjp(lambda *a: energy_attention(*a, block_size=block_size, **kw), q, k, v)
        return f, g, out, pull(out)

    blocked, whole = run(q, k, v, zeta, 8), run(q, k, v, zeta, None)
    for a, b in zip(jax.tree.leaves(blocked), jax.tree.leaves(whole), strict=True):
        # F (a scalar sum of rows of either sign) against a floor of 1; arrays normwise.
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.max(np.abs(b))
        if b.ndim == 0 or scale == 0:
            scale = max(scale, 1.0)
        assert np.max(np.abs(a - b)) <= 2e-5 * scale
    expected = energy_reference(case, q, k, v, causal=True, q_offset=28, mask=np.asarray(mask))
    assert ref.rel_err(blocked[2], expected[0]) <= TOL[jnp.float32]


@pytest.mark.slow
def test_blockwise_check_grads(getkey):
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (2, 7, 2, 1, 3, 2), jnp.float64)

        def f(q, k, v):
            kw = {"causal": True, "q_offset": 5, "block_size": 3}
            return energy_attention(q, k, v, energy=StickBreaking(), **kw)

        check_grads(f, (q, k, v), order=2, modes=["rev"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["sigmoid", "stick"])
def test_blockwise_memory(case):
    """Training through attention (a loss on it, its gradient in q, k, v): the compiled
    temporaries of the blockwise form are a fraction of the materialised form's."""
    n, heads, dim = 1024, 4, 32
    x = jax.ShapeDtypeStruct((n, heads, dim), jnp.float32)

    def temp(block_size):
        def loss(q, k, v):
            kw = {"causal": True, "energy": make_energy(case), "block_size": block_size}
            return jnp.sum(energy_attention(q, k, v, **kw) ** 2)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, blocked = temp(None), temp(128)
    print(f"temporaries: materialised {whole / 2**20:.1f} MiB, blockwise {blocked / 2**20:.1f} MiB")
    # The materialised form keeps a few logits-sized arrays (its gradient recomputes the
    # weights where they are used), the blockwise form a few blocks of them.
    assert blocked < whole / 3


@pytest.mark.parametrize("kv_layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("case", ["sigmoid_bias", "stick", "sink"])
def test_tree_decode(case, kv_layout, getkey):
    """tree_decode(energy=...) over a sharded cache of rows filled to different lengths."""
    from treeattn.decode import tree_decode

    q, k, v = make_qkv(getkey, (2, 32, HEADS, 2, 8, 3), jnp.float32)
    q = jnp.stack([q[:1], q[1:2]])  # [batch 2, q_seq 1, heads, qk]
    k, v = jnp.stack([k, k[::-1]]), jnp.stack([v, v[::-1]])  # [batch 2, 32, kv_heads, d]
    lengths = [20, 32]
    energy = make_energy(case)
    layout = (lambda x: x.transpose(0, 2, 1, 3)) if kv_layout == "bhsd" else (lambda x: x)
    kw = {"mesh": mesh_of(4), "kv_axis": "kv", "kv_layout": kv_layout, "energy": energy}
    out = tree_decode(q, layout(k), layout(v), kv_length=jnp.asarray(lengths), **kw)
    for b, n in enumerate(lengths):
        expected = energy_reference(case, q[b], k[b, :n], v[b, :n], causal=True, q_offset=n - 1)
        assert ref.rel_err(out[b], expected[0]) <= TOL[jnp.float32]
