"""How the energy and decode layers treat bad input.

- NaN/inf in key/value slots that no query may see (masked out, causally in the future, at or
  past `kv_length`) influences nothing: outputs equal the float64 reference of the visible keys,
  gradients are finite, equal those with the slots zeroed, and are exactly 0 at the slots.
- A NaN query gives NaN, never the "sees no key" result (0 / -inf).
- A huge `scale` gives the hard argmax wherever `jax.nn.dot_product_attention` is finite.
- Meaningless static arguments, a non-hashable `scale`, unsupported shapes, unknown axis names
  and bad masks raise errors that name the argument.
"""

import re

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TOL, mesh_of
from jax.sharding import PartitionSpec as P

from treeattn import decode, energy
from treeattn.models import MultiheadAttention


POISONS = {"nan": np.nan, "inf": np.inf}

# Unbatched energy problems: q [T, H, D], k/v [S, HK, D].
T, S, H, HK, D = 4, 16, 4, 2, 8
CAUSAL_OFFSET = 8  # query i sits at 8 + i: keys 12..15 are in every query's future
MASK_HIDDEN = (3, 7, 12, 13)  # key slots the mask hides from every query and head


def hide(x, hidden, value):
    """`x` (`[..., seq, heads, dim]`) with the slots where `hidden` (`[..., seq]`) holds set to
    `value`."""
    return jnp.where(jnp.asarray(hidden)[..., None, None], jnp.asarray(value, x.dtype), x)


# For the costlier compilations: each masking and each poison once.
PAIRED = [("mask", "nan"), ("causal", "inf")]


def energy_problem(getkey, masking, dv=D, queries=T):
    """(q, k, v, kw for the library, kw for np_reference, hidden [S]) for `masking` in
    {"mask", "causal"}: the hidden slots are invisible to every query and head."""
    q = jax.random.normal(getkey(), (queries, H, D))
    k = jax.random.normal(getkey(), (S, HK, D))
    v = jax.random.normal(getkey(), (S, HK, dv))
    hidden = np.zeros(S, bool)
    if masking == "mask":
        hidden[list(MASK_HIDDEN)] = True
        mask = np.array(jax.random.bernoulli(getkey(), 0.7, (queries, S)))
        mask[:, 0] = True  # every query sees at least one key
        mask[:, hidden] = False
        kw = {"mask": jnp.asarray(mask)}
        ref_kw = {"mask": mask}
    else:
        assert queries == T, "causal: the queries sit at CAUSAL_OFFSET and after"
        hidden[CAUSAL_OFFSET + T :] = True
        kw = {"causal": True, "q_offset": CAUSAL_OFFSET}
        ref_kw = dict(kw)
    return q, k, v, kw, ref_kw, hidden


def _labelled_leaves(tree):
    return [
        (jax.tree_util.keystr(path) or "result", x)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
    ]


def check_blind(fn, q, k, v, hidden, poison, expected, *, tol=TOL[jnp.float32]):
    """`fn(q, k, v)` (a pytree of arrays) must not see the `hidden` key slots.

    With `poison` in those slots of K and V: every result is finite and equals `expected` (a
    pytree of float64 arrays computed without the slots); the gradient of a random linear
    function of the results in q, k, v is finite, equals the gradient with the slots zeroed
    instead, and is exactly 0 at the slots. All problems are reported together.
    """
    problems = []
    kp, vp = hide(k, hidden, poison), hide(v, hidden, poison)
    k0, v0 = hide(k, hidden, 0.0), hide(v, hidden, 0.0)
    got = fn(q, kp, vp)
    for (name, g), e in zip(_labelled_leaves(got), jax.tree.leaves(expected), strict=True):
        g = np.asarray(g)
        if not np.all(np.isfinite(g)):
            problems.append(f"{name}: {np.sum(~np.isfinite(g))} of {g.size} entries not finite")
        elif ref.rel_err(g, e) > tol:
            problems.append(f"{name}: relative error {ref.rel_err(g, e):.2e} > {tol}")
    rng = np.random.default_rng(0)
    weights = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x)), x.dtype), got)

    def loss(q, k, v):
        terms = jax.tree.map(lambda x, w: jnp.sum(x * w), fn(q, k, v), weights)
        return sum(jax.tree.leaves(terms))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    poisoned, zeroed = grad(q, kp, vp), grad(q, k0, v0)
    for name, a, b in zip("qkv", poisoned, zeroed, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if not np.all(np.isfinite(a)):
            problems.append(f"d{name}: {np.sum(~np.isfinite(a))} of {a.size} entries not finite")
            continue
        if not np.allclose(a, b, rtol=1e-5, atol=1e-6):
            problems.append(f"d{name}: differs from the gradient with zeroed hidden slots")
        if name != "q" and np.any(a[np.asarray(hidden)] != 0):
            problems.append(f"d{name}: nonzero at hidden slots")
    assert not problems, "; ".join(problems)


# ---------------------------------------------------------------------------------------------
# 1. Hidden NaN/inf keys and values: the energy layer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("energy_name", ["softmax", "stick"])
@pytest.mark.parametrize("queries", [4, 16])
def test_poison_reaches_only_the_rows_that_see_it(queries, energy_name, getkey):
    """A NaN key of kv head 0 and an inf value of kv head 1 make NaN exactly the (query, head)
    rows that see them, causally, and leave every other row equal to float64 NumPy. With 4
    queries (8 rows per kv head) and 16 (32 rows, more than a key's and value's elements) the
    flags of the bad keys are reduced in the two layouts `finite_kv` chooses between."""
    q = jax.random.normal(getkey(), (queries, H, D))
    k = jax.random.normal(getkey(), (S, HK, D))
    v = jax.random.normal(getkey(), (S, HK, D))
    offset, slots = S - queries, (S - queries + 1, S - 2)  # each seen by some queries only
    k_bad = k.at[slots[0], 0, 3].set(jnp.nan)
    v_bad = v.at[slots[1], 1, 0].set(jnp.inf)
    chosen = {"softmax": energy.Softmax(), "stick": energy.StickBreaking()}[energy_name]
    kw = {"causal": True, "q_offset": offset, "energy": chosen}
    out = np.asarray(
        jax.jit(lambda q, k, v: energy.energy_attention(q, k, v, **kw))(q, k_bad, v_bad)
    )
    clean = np.asarray(energy.energy_attention(q, k, v, **kw))
    position = offset + np.arange(queries)[:, None]
    kv_head = np.arange(H)[None, :] // (H // HK)
    sees = ((kv_head == 0) & (position >= slots[0])) | ((kv_head == 1) & (position >= slots[1]))
    assert sees.any() and (~sees).any()
    assert np.isnan(out[sees]).all()
    assert np.isfinite(out[~sees]).all()
    np.testing.assert_allclose(out[~sees], clean[~sees], rtol=1e-6, atol=1e-6)
    if energy_name == "softmax":
        expected = ref.attention(q, k, v, causal=True, q_offset=offset)
        np.testing.assert_allclose(out[~sees], expected[~sees], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("poison", POISONS)
def test_hidden_poison_energy_attention_many_rows(poison, getkey):
    """As `test_hidden_poison_energy_attention` with 16 queries: 32 rows per kv head, more than
    a key's and a value's elements, so the flags of bad keys are reduced in the logits'
    layout."""
    q, k, v, kw, ref_kw, hidden = energy_problem(getkey, "mask", queries=16)
    expected = ref.attention(q, hide(k, hidden, 0.0), hide(v, hidden, 0.0), **ref_kw)
    fn = jax.jit(lambda q, k, v: energy.energy_attention(q, k, v, **kw))
    check_blind(fn, q, k, v, hidden, POISONS[poison], expected)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("masking", ["mask", "causal"])
def test_hidden_poison_energy_attention(masking, poison, getkey):
    q, k, v, kw, ref_kw, hidden = energy_problem(getkey, masking)
    expected = ref.attention(q, hide(k, hidden, 0.0), hide(v, hidden, 0.0), **ref_kw)
    fn = jax.jit(lambda q, k, v: energy.energy_attention(q, k, v, **kw))
    check_blind(fn, q, k, v, hidden, POISONS[poison], expected)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("masking", ["mask", "causal"])
def test_hidden_poison_multihead_free_energy(masking, poison, getkey):
    q, k, v, kw, ref_kw, hidden = energy_problem(getkey, masking)
    zeta = 0.3 * jax.random.normal(getkey(), (T, H, D))
    terms = ref.free_energy_terms(q, hide(k, hidden, 0.0), hide(v, hidden, 0.0), zeta, **ref_kw)
    fn = jax.jit(lambda q, k, v: energy.multihead_free_energy(q, k, v, zeta, **kw))
    check_blind(fn, q, k, v, hidden, POISONS[poison], terms.sum())


@pytest.mark.parametrize("masking, poison", PAIRED)
def test_hidden_poison_value_covariance(masking, poison, getkey):
    q, k, v, kw, ref_kw, hidden = energy_problem(getkey, masking)
    expected = ref.cumulants(q, hide(k, hidden, 0.0), hide(v, hidden, 0.0), 2, **ref_kw)
    fn = jax.jit(lambda q, k, v: energy.value_covariance(q, k, v, **kw))
    check_blind(fn, q, k, v, hidden, POISONS[poison], expected)


@pytest.mark.parametrize("masking, poison", PAIRED)
def test_hidden_poison_tilted_source(masking, poison, getkey):
    """A reachable target (the tilted mean of a known source, dv=4 so that the visible values
    span it): the solver converges to the same source as with the hidden slots zeroed."""
    dv = 4
    q, k, v, kw, ref_kw, hidden = energy_problem(getkey, masking, dv=dv)
    k0, v0 = hide(k, hidden, 0.0), hide(v, hidden, 0.0)
    source = 0.5 * np.asarray(jax.random.normal(getkey(), (T, H, dv)), np.float64)
    z = jnp.asarray(ref.tilted_mean(q, k0, v0, source, **ref_kw), jnp.float32)
    clean = energy.tilted_source(z, q, k0, v0, **kw)
    assert np.all(clean.converged)  # the problem is well posed
    got = energy.tilted_source(
        z, q, hide(k, hidden, POISONS[poison]), hide(v, hidden, POISONS[poison]), **kw
    )
    assert np.all(np.isfinite(got.zeta)) and np.all(np.isfinite(got.kl))
    assert np.all(got.converged), f"residual {got.residual}, steps {got.num_steps}"
    np.testing.assert_allclose(got.zeta, clean.zeta, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got.kl, clean.kl, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ref.tilted_mean(q, k0, v0, got.zeta, **ref_kw), z, atol=1e-4)


SHARDED_CASES = [(2, "mask", "nan"), (2, "causal", "inf"), (4, "mask", "inf"), (4, "causal", "nan")]


@pytest.mark.parametrize("p, masking, poison", SHARDED_CASES)
def test_hidden_poison_sharded_energy(p, masking, poison, getkey):
    """`sharded_energy_attention` and `sharded_free_energy` inside `jax.shard_map` over p
    devices (with p=4 and causal masking, the last shard holds nothing but hidden slots)."""
    q, k, v, kw, ref_kw, hidden = energy_problem(getkey, masking)
    zeta = 0.3 * jax.random.normal(getkey(), (T, H, D))
    mask = kw.pop("mask", None)
    extra, extra_specs = ((), ()) if mask is None else ((mask,), (P(None, "kv"),))

    def local(q, k, v, zeta, *mask):
        kws = dict(kw, axis_name="kv", mask=mask[0] if mask else None)
        return {
            "attention": energy.sharded_energy_attention(q, k, v, **kws),
            "F": energy.sharded_free_energy(q, k, v, zeta, **kws),
        }

    mapped = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh_of(p),
            in_specs=(P(), P("kv"), P("kv"), P(), *extra_specs),
            out_specs=P(),
        )
    )
    k0, v0 = hide(k, hidden, 0.0), hide(v, hidden, 0.0)
    expected = {
        "F": ref.free_energy_terms(q, k0, v0, zeta, **ref_kw).sum(),
        "attention": ref.attention(q, k0, v0, **ref_kw),
    }
    check_blind(
        lambda q, k, v: mapped(q, k, v, zeta, *extra), q, k, v, hidden, POISONS[poison], expected
    )


@pytest.mark.parametrize("p, masking, poison", SHARDED_CASES)
def test_hidden_poison_tree_energy(p, masking, poison, getkey):
    q, k, v, kw, ref_kw, hidden = energy_problem(getkey, masking)
    zeta = 0.3 * jax.random.normal(getkey(), (T, H, D))
    tree = dict(kw, mesh=mesh_of(p), kv_axis="kv")

    def fn(q, k, v):
        return {
            "attention": energy.tree_energy_attention(q, k, v, **tree),
            "F": energy.tree_free_energy(q, k, v, zeta, **tree),
        }

    k0, v0 = hide(k, hidden, 0.0), hide(v, hidden, 0.0)
    expected = {
        "F": ref.free_energy_terms(q, k0, v0, zeta, **ref_kw).sum(),
        "attention": ref.attention(q, k0, v0, **ref_kw),
    }
    check_blind(jax.jit(fn), q, k, v, hidden, POISONS[poison], expected)


# ---------------------------------------------------------------------------------------------
# 1. Hidden NaN/inf keys and values: decoding past kv_length
# ---------------------------------------------------------------------------------------------

B = 2
KV_LENGTH = (11, 5)  # with 4 shards of 4 slots, row 1 leaves shards 2 and 3 entirely unfilled


def decode_problem(getkey, q_seq=1, qk=D, dv=D, kv_seq=S):
    q = jax.random.normal(getkey(), (B, q_seq, H, qk))
    k = jax.random.normal(getkey(), (B, kv_seq, HK, qk))
    v = jax.random.normal(getkey(), (B, kv_seq, HK, dv))
    return q, k, v


def _unfilled(kv_seq=S):
    return np.arange(kv_seq)[None, :] >= np.asarray(KV_LENGTH)[:, None]  # [B, S]


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize(
    "backend, block",
    [("xla", None), ("xla", 4), ("reference", None), ("pallas", None), ("cpu", None)],
)
def test_hidden_poison_flash_attention(backend, block, poison, getkey):
    q, k, v = decode_problem(getkey)
    hidden = _unfilled()
    kv_length = jnp.asarray(KV_LENGTH)
    kw = dict(kv_length=kv_length, backend=backend)
    if block is not None:
        kw["block_size"] = block
    fn = jax.jit(lambda q, k, v: decode.flash_attention(q, k, v, **kw))
    try:
        fn(q, k, v)
    except decode.BackendUnavailable as e:
        pytest.skip(str(e))
    out, lse = ref.decode(q, hide(k, hidden, 0.0), hide(v, hidden, 0.0), KV_LENGTH)
    check_blind(fn, q, k, v, hidden, POISONS[poison], (out, lse))


@pytest.mark.parametrize("p, poison", [(2, "nan"), (4, "inf")])
@pytest.mark.parametrize("backend", ["xla", "auto"])
@pytest.mark.parametrize("schedule", ["tree", "ring"])
def test_hidden_poison_tree_and_ring_decode(schedule, p, backend, poison, getkey):
    q, k, v = decode_problem(getkey)
    hidden = _unfilled()
    run = decode.tree_decode if schedule == "tree" else decode.ring_decode
    kw = dict(mesh=mesh_of(p), kv_axis="kv", kv_length=jnp.asarray(KV_LENGTH), backend=backend)
    fn = jax.jit(lambda q, k, v: run(q, k, v, **kw))
    out, _ = ref.decode(q, hide(k, hidden, 0.0), hide(v, hidden, 0.0), KV_LENGTH)
    check_blind(fn, q, k, v, hidden, POISONS[poison], out)


# ---------------------------------------------------------------------------------------------
# 2. A NaN query gives NaN
# ---------------------------------------------------------------------------------------------

NAN_ROW = 1  # the query (of batch row 0, for decoding) that is NaN in every head


def test_nan_query_multihead_free_energy(getkey):
    q, k, v, _, _, _ = energy_problem(getkey, "mask")
    q = q.at[NAN_ROW].set(jnp.nan)
    zeta = jnp.zeros((T, H, D))
    f = energy.multihead_free_energy(q, k, v, zeta)
    assert np.isnan(f), f"F = {f}, expected NaN"
    # With a mask that leaves the NaN query some visible key, too.
    mask = jnp.ones((T, S), bool).at[:, 5:].set(False)
    f = energy.multihead_free_energy(q, k, v, zeta, mask=mask)
    assert np.isnan(f), f"F = {f}, expected NaN"


@pytest.mark.parametrize("masking", [None, "mask", "causal"])
def test_nan_query_energy_attention(masking, getkey):
    q, k, v, kw, ref_kw, _ = energy_problem(getkey, masking or "mask")
    if masking is None:
        kw, ref_kw = {}, {}
    q_bad = q.at[NAN_ROW].set(jnp.nan)
    out = np.asarray(energy.energy_attention(q_bad, k, v, **kw))
    assert np.all(np.isnan(out[NAN_ROW])), f"NaN query gave {out[NAN_ROW, 0]}"
    others = np.arange(T) != NAN_ROW
    expected = ref.attention(q, k, v, **ref_kw)[others]
    assert np.all(np.isfinite(out[others]))
    assert ref.rel_err(out[others], expected) <= TOL[jnp.float32]


@pytest.mark.parametrize("backend", ["xla", "reference", "cpu"])
def test_nan_query_flash_attention(backend, getkey):
    q, k, v = decode_problem(getkey, q_seq=2)
    q_bad = q.at[0, NAN_ROW].set(jnp.nan)
    kv_length = jnp.asarray(KV_LENGTH)
    try:
        out, lse = decode.flash_attention(q_bad, k, v, kv_length=kv_length, backend=backend)
    except decode.BackendUnavailable as e:
        pytest.skip(str(e))
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(np.isnan(out[0, NAN_ROW])), f"out of a NaN query: {out[0, NAN_ROW, 0]}"
    assert np.all(np.isnan(lse[0, NAN_ROW])), f"lse of a NaN query: {lse[0, NAN_ROW]}"
    exp_out, exp_lse = ref.decode(q, k, v, KV_LENGTH)
    good = np.ones((B, 2), bool)
    good[0, NAN_ROW] = False
    assert ref.rel_err(out[good], exp_out[good]) <= TOL[jnp.float32]
    np.testing.assert_allclose(lse[good], exp_lse[good], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 3. A huge scale is a hard argmax
# ---------------------------------------------------------------------------------------------

HUGE = [1e20, 1e30]


def jax_attention(q, k, v, scale):
    """`jax.nn.dot_product_attention` in [B, T, N, H] with the kv heads repeated (GQA)."""
    group = q.shape[2] // k.shape[2]
    return np.asarray(
        jax.nn.dot_product_attention(
            q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), scale=scale
        )
    )


def check_like_jax(got, expected):
    finite = np.isfinite(expected)
    assert finite.mean() > 0.5  # the comparison below is not vacuous
    got = np.asarray(got)
    assert np.all(np.isfinite(got[finite])), f"{np.sum(~np.isfinite(got[finite]))} not finite"
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=1e-5)


@pytest.mark.parametrize("scale", HUGE)
def test_huge_scale_energy_attention(scale, getkey):
    q, k, v, _, _, _ = energy_problem(getkey, "mask")
    got = energy.energy_attention(q, k, v, scale=scale)
    check_like_jax(got, jax_attention(q[None], k[None], v[None], scale)[0])


@pytest.mark.parametrize("scale", HUGE)
@pytest.mark.parametrize("backend", ["xla", "reference", "cpu"])
def test_huge_scale_flash_attention(backend, scale, getkey):
    q, k, v = decode_problem(getkey, q_seq=2)
    try:
        out, lse = decode.flash_attention(q, k, v, scale=scale, backend=backend)
    except decode.BackendUnavailable as e:
        pytest.skip(str(e))
    check_like_jax(out, jax_attention(q, k, v, scale))
    assert np.all(np.isfinite(lse))


@pytest.mark.parametrize("p, scale", [(2, 1e30), (4, 1e20)])
def test_huge_scale_tree_decode(p, scale, getkey):
    q, k, v = decode_problem(getkey)
    out = decode.tree_decode(q, k, v, mesh=mesh_of(p), kv_axis="kv", scale=scale, backend="xla")
    check_like_jax(out, jax_attention(q, k, v, scale))


# ---------------------------------------------------------------------------------------------
# 4. Meaningless static arguments
# ---------------------------------------------------------------------------------------------


NEGATIVE = {
    "flash_attention(causal=True, q_offset=-1)": "q_offset",
    "flash_attention(kv_length=-1)": "kv_length",
    "tree_decode(kv_length=-1)": "kv_length",
    "energy_attention(causal=True, q_offset=-1)": "q_offset",
}


@pytest.mark.parametrize(
    "call, name",
    NEGATIVE.items(),
    ids=["flash-q_offset", "flash-kv_length", "tree-kv_length", "energy-q_offset"],
)
def test_negative_static_arguments_are_refused(call, name, getkey):
    """A negative Python int position or length means nothing: a ValueError names it."""
    q, k, v = decode_problem(getkey)
    with pytest.raises(ValueError, match=name):
        if call == "flash_attention(causal=True, q_offset=-1)":
            decode.flash_attention(q, k, v, causal=True, q_offset=-1)
        elif call == "flash_attention(kv_length=-1)":
            decode.flash_attention(q, k, v, kv_length=-1)
        elif call == "tree_decode(kv_length=-1)":
            decode.tree_decode(q, k, v, mesh=mesh_of(2), kv_axis="kv", kv_length=-1)
        else:
            energy.energy_attention(q[0], k[0], v[0], causal=True, q_offset=-1)


# ---------------------------------------------------------------------------------------------
# 5. Errors that help
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["energy_attention", "flash_attention", "tree_decode"])
def test_array_scale_error_names_scale(fn, getkey):
    scale = jnp.asarray(0.3)
    with pytest.raises((ValueError, TypeError)) as info:
        if fn == "energy_attention":
            q, k, v, _, _, _ = energy_problem(getkey, "mask")
            energy.energy_attention(q, k, v, scale=scale)
        else:
            q, k, v = decode_problem(getkey)
            if fn == "flash_attention":
                decode.flash_attention(q, k, v, scale=scale, backend="xla")
            else:
                decode.tree_decode(q, k, v, mesh=mesh_of(2), kv_axis="kv", scale=scale)
    assert re.search(r"\bscale\b", str(info.value)), str(info.value)


def test_value_dim_other_than_head_dim(getkey):
    """flash-attn-jax needs dv == qk: it says so, naming both; the Pallas decode kernel pads
    both to one power of two and serves it, as "auto" does with another kernel."""
    qk, dv = 16, 12
    q, k, v = decode_problem(getkey, qk=qk, dv=dv, kv_seq=32)
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with pytest.raises(decode.BackendUnavailable) as info:
        decode.flash_attention(*half, backend="flash_attn_jax")
    message = str(info.value)
    assert "flash_attn_jax" in message and re.search(rf"\bqk={qk}, dv={dv}\b", message), message
    kv_length = jnp.asarray([32, 9])
    exp_out, exp_lse = ref.decode(q, k, v, [32, 9])
    for backend in ("auto", "pallas"):
        out, lse = decode.flash_attention(q, k, v, kv_length=kv_length, backend=backend)
        assert out.shape == (B, 1, H, dv)
        assert ref.rel_err(out, exp_out) <= TOL[jnp.float32]
        np.testing.assert_allclose(lse, exp_lse, rtol=1e-5, atol=1e-5)


def test_unknown_axis_name_is_named(getkey):
    q, k, v, _, _, _ = energy_problem(getkey, "mask")

    def local(q, k, v):
        return energy.sharded_energy_attention(q, k, v, axis_name="nope")

    mapped = jax.shard_map(local, mesh=mesh_of(2), in_specs=(P(), P("kv"), P("kv")), out_specs=P())
    with pytest.raises(ValueError, match="nope"):
        jax.jit(mapped)(q, k, v)


def _attention_f64(q, k, v):
    """Independent softmax attention, [B, T, N, H] with repeated kv heads (for Jacobians)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def test_forward_mode_through_flash_attention(getkey):
    """jax.jacfwd either works, or says that flash_attention has no forward mode and points at
    jax.jacrev; jax.jacrev works. Both agree with a float64 Jacobian."""
    q, k, v = (x[:1] for x in decode_problem(getkey))  # batch 1
    args = (q, k, v)

    def f(q, k, v):
        return decode.flash_attention(q, k, v, backend="xla")[0]

    with jax.enable_x64(True):
        args64 = tuple(jnp.asarray(np.asarray(x), jnp.float64) for x in args)
        want = [np.asarray(j) for j in jax.jacfwd(_attention_f64, argnums=(0, 1, 2))(*args64)]

    def compare(jac):
        for a, b in zip(jac, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    compare(jax.jacrev(f, argnums=(0, 1, 2))(*args))
    try:
        jac = jax.jacfwd(f, argnums=(0, 1, 2))(*args)
    except Exception as e:  # the alternative outcome: a message that helps
        message = str(e)
        assert re.search(r"forward[- ]mode", message, re.IGNORECASE), message
        assert "flash_attention" in message and "jacrev" in message, message
    else:
        compare(jac)


# ---------------------------------------------------------------------------------------------
# 6. Masks on the layer
# ---------------------------------------------------------------------------------------------

LAYER_Q, LAYER_KV = 3, 5


def _layer(backend):
    return MultiheadAttention(num_heads=4, query_size=16, key=jax.random.key(0), backend=backend)


def _np_layer(layer, x, y, mask):
    """The layer's forward in float64 NumPy (no biases), with `mask` [heads, q, kv]."""

    def proj(lin, z, heads):
        return (ref.f64(z) @ ref.f64(lin.weight).T).reshape(z.shape[0], heads, -1)

    q = proj(layer.query_proj, x, 4)
    k, v = proj(layer.key_proj, y, 4), proj(layer.value_proj, y, 4)
    attn = ref.attention(q, k, v, mask=mask).reshape(x.shape[0], -1)
    return attn @ ref.f64(layer.output_proj.weight).T


def _layer_inputs(getkey):
    x = jax.random.normal(getkey(), (LAYER_Q, 16))
    y = jax.random.normal(getkey(), (LAYER_KV, 16))
    return x, y


@pytest.mark.parametrize("backend", ["energy", "reference"])
def test_layer_valid_masks(backend, getkey):
    """Masks [q, kv] and [heads, q, kv] work (what the refusals below must keep working)."""
    layer = _layer(backend)
    x, y = _layer_inputs(getkey)
    mask3 = np.array(jax.random.bernoulli(getkey(), 0.6, (4, LAYER_Q, LAYER_KV)))
    mask3[..., 0] = True
    got = layer(x, y, y, mask=jnp.asarray(mask3))
    assert ref.rel_err(got, _np_layer(layer, x, y, mask3)) <= 1e-4
    got = layer(x, y, y, mask=jnp.asarray(mask3[0]))
    assert ref.rel_err(got, _np_layer(layer, x, y, mask3[0])) <= 1e-4


@pytest.mark.parametrize("bad", ["shape", "dtype", "1-d"])
@pytest.mark.parametrize("backend", ["energy", "reference"])
def test_layer_bad_masks(backend, bad, getkey):
    """A mask of the wrong shape or dtype is a ValueError naming `mask` and what it should be
    (a 1-D mask too, as Equinox refuses it)."""
    layer = _layer(backend)
    x, y = _layer_inputs(getkey)
    mask = {
        "shape": jnp.ones((LAYER_Q, LAYER_KV + 1), bool),
        "dtype": jnp.ones((LAYER_Q, LAYER_KV), jnp.float32),
        "1-d": jnp.ones((LAYER_KV,), bool),
    }[bad]
    with pytest.raises(ValueError, match="mask") as info:
        layer(x, y, y, mask=mask)
    message = str(info.value)
    if bad == "shape":  # the expected [q_seq, kv_seq]
        assert re.search(rf"{LAYER_Q},\s*{LAYER_KV}\b", message), message
    if bad == "dtype":
        assert "bool" in message, message


# ---------------------------------------------------------------------------------------------
# 7. Edge sizes and arguments found beside the reported ones
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "xla", "reference"])
def test_no_keys_at_all_is_the_empty_partial(backend):
    q = jnp.ones((2, 3, 4, 8))
    k = v = jnp.ones((2, 0, 2, 8))
    out, lse = decode.flash_attention(q, k, v, backend=backend)
    assert out.shape == (2, 3, 4, 8) and lse.shape == (2, 3, 4)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("block_size", [0, -3, True])
def test_block_size_must_be_positive(block_size):
    q, k = jnp.ones((1, 1, 4, 8)), jnp.ones((1, 5, 2, 8))
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        decode.flash_attention(q, k, k, backend="xla", block_size=block_size)


def test_merge_partials_names_mismatched_shapes():
    with pytest.raises(ValueError, match=r"merge_partials: .* \[\(2, 3\), \(2, 4\)\]"):
        energy.merge_partials(jnp.ones((2, 3)), jnp.ones(2), jnp.ones((2, 4)), jnp.ones(2))
    with pytest.raises(ValueError, match=r"lse_a \(2,\), lse_b \(3,\)"):
        energy.merge_partials(None, jnp.ones(2), None, jnp.ones(3))
