"""The sharded free energy (Algorithms 1-2) on simulated CPU devices, against float64 NumPy."""

import functools
import math

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TOL, make_masking, make_qkv, mesh_of, np_kw, two_level_mesh
from hypothesis import given, strategies as st
from jax.sharding import PartitionSpec as P

from treeattn.energy import (
    allreduce_partials,
    energy_attention,
    merge_partials,
    multihead_free_energy,
    sharded_energy_attention,
    sharded_free_energy,
    tree_energy_attention,
    tree_free_energy,
)
from treeattn.profiling import collective_stats


SCHEDULES = [(p, "allreduce") for p in (1, 2, 3, 4, 8)] + [
    (p, "butterfly") for p in (1, 2, 3, 4, 5, 8)
]
# kv_seq = 37 divides by none of p > 1: every case pads with masked keys.
SHAPE = (5, 37, 4, 2, 8, 6)


def jit_tree(fn, **static):
    """`fn` with its static configuration bound, under `jax.jit` (eager shard_map is slow)."""
    return jax.jit(functools.partial(fn, **static))


def tree_kw(p, reduction):
    if reduction == "hierarchical":
        return {
            "mesh": two_level_mesh(2, p // 2),
            "kv_axis": ("node", "local"),
            "reduction": reduction,
        }
    return {"mesh": mesh_of(p), "kv_axis": "kv", "reduction": reduction}


@pytest.mark.fast(p=4, reduction="allreduce")
@pytest.mark.parametrize("p, reduction", SCHEDULES + [(4, "hierarchical"), (8, "hierarchical")])
def test_matches_unsharded_and_numpy(p, reduction, getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    kw = {"causal": True, "q_offset": SHAPE[1] - SHAPE[0]}
    zeta = 0.3 * jax.random.normal(getkey(), (SHAPE[0], SHAPE[2], SHAPE[5]))
    tk = tree_kw(p, reduction)
    f = jit_tree(tree_free_energy, **tk, **kw)(q, k, v, zeta)
    np.testing.assert_allclose(f, ref.free_energy_terms(q, k, v, zeta, **kw).sum(), rtol=1e-5)
    np.testing.assert_allclose(f, multihead_free_energy(q, k, v, zeta, **kw), rtol=1e-6)
    out = jit_tree(tree_energy_attention, **tk, **kw)(q, k, v)
    assert out.shape == (SHAPE[0], SHAPE[2], SHAPE[5]) and out.dtype == jnp.float32
    assert ref.rel_err(out, ref.attention(q, k, v, **kw)) <= TOL[jnp.float32]
    np.testing.assert_allclose(out, energy_attention(q, k, v, **kw), rtol=4e-6, atol=2e-6)


@pytest.mark.fast(reduction="allreduce", masking="causal_mask3d", dtype=jnp.float32)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("masking", ["none", "causal", "mask2d", "mask3d", "causal_mask3d"])
@pytest.mark.parametrize("reduction", ["allreduce", "butterfly"])
def test_masks_gqa_dtypes(reduction, masking, dtype, getkey):
    shape = (4, 21, 6, 2, 8, 4)  # GQA: 3 query heads per kv head
    q, k, v = make_qkv(getkey, shape, dtype)
    kw = make_masking(getkey, shape, masking)
    mask = kw.pop("mask", None)
    out = jit_tree(tree_energy_attention, **tree_kw(4, reduction), **kw)(q, k, v, mask=mask)
    assert out.dtype == dtype
    if mask is not None:
        kw["mask"] = mask
    assert ref.rel_err(out, ref.attention(q, k, v, **np_kw(kw))) <= TOL[dtype]
    zeta = jnp.zeros((4, 6, 4))
    f = jax.jit(lambda *a: tree_free_energy(*a, **tree_kw(4, reduction), **kw))(q, k, v, zeta)
    terms = ref.free_energy_terms(q, k, v, zeta, **np_kw(kw))
    if np.isneginf(terms).any():
        assert f == -jnp.inf
    else:
        np.testing.assert_allclose(f, terms.sum(), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["allreduce", "butterfly", "hierarchical"])
def test_empty_and_fully_masked_shards(reduction, getkey):
    """3 keys over 8 devices (5 shards hold only padding), a mask that empties whole shards,
    and a query that sees nothing: correct, and no NaN in values or gradients."""
    tk = tree_kw(8, reduction)
    attention = jit_tree(tree_energy_attention, **tk)
    q, k, v = make_qkv(getkey, (3, 3, 2, 2, 4, 3), jnp.float32)
    out = attention(q, k, v)
    np.testing.assert_allclose(out, ref.attention(q, k, v), rtol=1e-5, atol=1e-6)

    q, k, v = make_qkv(getkey, (3, 32, 2, 2, 4, 3), jnp.float32)
    mask = jnp.zeros((3, 32), bool).at[:, 26:30].set(True).at[1].set(False)
    out = attention(q, k, v, mask=mask)
    assert np.isfinite(out).all() and np.all(out[1] == 0)
    np.testing.assert_allclose(
        out, ref.attention(q, k, v, mask=np.asarray(mask)), rtol=4e-6, atol=2e-6
    )

    def loss(q, k, v, zeta):
        f = tree_free_energy(q, k, v, zeta, mask=mask.at[1, 0].set(True), **tk)
        return f + jnp.sum(tree_energy_attention(q, k, v, mask=mask, **tk) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, jnp.zeros((3, 2, 3)))
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    "p, reduction", [(3, "allreduce"), (4, "butterfly"), (3, "butterfly"), (8, "hierarchical")]
)
def test_gradients_match_unsharded(p, reduction, getkey):
    """Gradients of F in q, k, v, ζ (Algorithm 2) and of attention (second derivatives of F)."""
    shape = (3, 13, 4, 2, 8, 5)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    zeta = 0.3 * jax.random.normal(getkey(), (3, 4, 5))
    kw = {"causal": True, "q_offset": 9}
    tk = tree_kw(p, reduction)
    sharded = jax.jit(jax.grad(lambda *a: tree_free_energy(*a, **tk, **kw), argnums=(0, 1, 2, 3)))
    plain = jax.jit(jax.grad(lambda *a: multihead_free_energy(*a, **kw), argnums=(0, 1, 2, 3)))
    for a, b in zip(sharded(q, k, v, zeta), plain(q, k, v, zeta), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    target = jax.random.normal(getkey(), (3, 4, 5))

    def loss(fn, q, k, v):
        return jnp.sum((fn(q, k, v) - target) ** 2)

    ga = jax.jit(
        jax.grad(
            lambda *a: loss(lambda *b: tree_energy_attention(*b, **tk, **kw), *a), argnums=(0, 1, 2)
        )
    )(q, k, v)
    gb = jax.jit(
        jax.grad(lambda *a: loss(lambda *b: energy_attention(*b, **kw), *a), argnums=(0, 1, 2))
    )(q, k, v)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_meshes_from_make_mesh(axis_type, getkey):
    """jax.make_mesh's axis types (Explicit is the default from jax 0.9), inputs sharded on them."""
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((4,), ("kv",), axis_types=(kind,))
    q, k, v = make_qkv(getkey, (2, 16, 4, 2, 8, 4), jnp.float32)
    ks = jax.device_put(k, jax.sharding.NamedSharding(mesh, P("kv")))
    vs = jax.device_put(v, jax.sharding.NamedSharding(mesh, P("kv")))
    out = jax.jit(lambda q, k, v: tree_energy_attention(q, k, v, mesh=mesh, kv_axis="kv"))(
        q, ks, vs
    )
    np.testing.assert_allclose(out, ref.attention(q, k, v), rtol=1e-5, atol=1e-6)
    zeta = jnp.zeros((2, 4, 4))
    gk = jax.jit(jax.grad(lambda k: tree_free_energy(q, k, vs, zeta, mesh=mesh, kv_axis="kv")))(ks)
    gk_ref = jax.grad(multihead_free_energy, argnums=1)(q, k, v, zeta)
    np.testing.assert_allclose(gk, gk_ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Properties: shard order and uneven splits do not matter
# ---------------------------------------------------------------------------------------------

P_DEVICES, SEQ = 4, 12
_KEYS = jax.random.split(jax.random.key(7), 3)
Q = jax.random.normal(_KEYS[0], (3, 4, 8))
K = jax.random.normal(_KEYS[1], (SEQ, 2, 8))
V = jax.random.normal(_KEYS[2], (SEQ, 2, 5))


@jax.jit
def _blocks_energy_and_attention(k, v, mask, offsets, zeta):
    """Each device holds a padded block of keys starting at absolute position offsets[d]."""

    def local(q, k, v, mask, offsets, zeta):
        kw = dict(axis_name="kv", causal=True, mask=mask, q_offset=SEQ - 3, kv_offset=offsets[0])
        f = sharded_free_energy(q, k, v, zeta, **kw)
        return f, sharded_energy_attention(q, k, v, **kw)

    specs = (P(), P("kv"), P("kv"), P(None, "kv"), P("kv"), P())
    mapped = jax.shard_map(local, mesh=mesh_of(P_DEVICES), in_specs=specs, out_specs=(P(), P()))
    return mapped(Q, k, v, mask, offsets, zeta)


def _layout(cuts, order):
    """Blocks [b_i, b_{i+1}) of the sequence, block order[d] on device d, each padded to SEQ."""
    bounds = [0, *sorted(cuts), SEQ]
    blocks = [(bounds[i], bounds[i + 1]) for i in range(P_DEVICES)]
    k = np.zeros((P_DEVICES * SEQ, 2, 8), np.float32)
    v = np.zeros((P_DEVICES * SEQ, 2, 5), np.float32)
    mask = np.zeros((3, P_DEVICES * SEQ), bool)
    offsets = np.zeros(P_DEVICES, np.int32)
    for d, b in enumerate(order):
        start, end = blocks[b]
        n = end - start
        k[d * SEQ : d * SEQ + n] = K[start:end]
        v[d * SEQ : d * SEQ + n] = V[start:end]
        mask[:, d * SEQ : d * SEQ + n] = True
        offsets[d] = start
    return k, v, mask, offsets


@given(
    cuts=st.lists(st.integers(0, SEQ), min_size=P_DEVICES - 1, max_size=P_DEVICES - 1),
    order=st.permutations(range(P_DEVICES)),
)
def test_shard_order_and_uneven_splits_do_not_matter(cuts, order):
    zeta = 0.2 * jnp.ones((3, 4, 5))
    f, out = _blocks_energy_and_attention(*_layout(cuts, order), zeta)
    kw = {"causal": True, "q_offset": SEQ - 3}
    np.testing.assert_allclose(f, multihead_free_energy(Q, K, V, zeta, **kw), rtol=1e-5)
    np.testing.assert_allclose(out, energy_attention(Q, K, V, **kw), rtol=1e-5, atol=1e-6)


@given(
    lse=st.lists(st.one_of(st.floats(-1e4, 1e4), st.just(-np.inf)), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_merge_is_associative_and_commutative(lse, seed):
    outs = np.random.default_rng(seed).normal(size=(3, 4)).astype(np.float32)
    lse = np.asarray(lse, np.float32)
    a, b, c = ((jnp.asarray(outs[i]), jnp.asarray(lse[i])) for i in range(3))
    ab_c = merge_partials(*merge_partials(*a, *b), *c)
    a_bc = merge_partials(*a, *merge_partials(*b, *c))
    ba = merge_partials(*b, *a)
    ab = merge_partials(*a, *b)
    np.testing.assert_array_equal(ab[1], ba[1])
    np.testing.assert_array_equal(ab[0], ba[0])  # bit for bit
    # A weight e^(lse_i - lse) is off by about eps32 |lse_i| (the rounding of the difference),
    # so the two orders agree to a few eps32 |lse_i| of the partials that carry weight (those
    # within 20 of the merged lse; e^-20 is below float32's resolution of 1), times max|out|
    # for the outputs.
    finite = np.isfinite(lse)
    expected = np.logaddexp.reduce(lse.astype(np.float64)) if finite.any() else -np.inf
    carry = np.abs(lse[finite & (lse > expected - 20)])
    tol = 8 * np.finfo(np.float32).eps * max(float(carry.max()) if carry.size else 0.0, 1.0)
    np.testing.assert_allclose(ab_c[1], a_bc[1], rtol=1e-6, atol=tol)
    np.testing.assert_allclose(ab_c[0], a_bc[0], rtol=1e-5, atol=tol * np.abs(outs).max())
    np.testing.assert_allclose(ab_c[1], expected, rtol=1e-6, atol=tol)
    assert np.isfinite(ab_c[0]).all()


@pytest.mark.parametrize("p", [2, 3, 5, 8])
@pytest.mark.parametrize("reduction", ["allreduce", "butterfly"])
def test_allreduce_partials_equals_sequential_merge(p, reduction, getkey):
    lse = 50.0 * jax.random.normal(getkey(), (p, 3)) + 60.0  # e^lse would overflow float32
    lse = lse.at[1].set(-jnp.inf)  # one empty device
    out = jax.random.normal(getkey(), (p, 3, 4))

    def local(out, lse):
        o, merged = allreduce_partials(out[0], lse[0], axis_name="kv", reduction=reduction)
        return o[None], merged[None]

    mapped = jax.shard_map(
        local,
        mesh=mesh_of(p),
        in_specs=(P("kv"), P("kv")),
        out_specs=(P("kv"), P("kv")),
        check_vma=False,
    )
    o_all, l_all = jax.jit(mapped)(out, lse)
    o_seq, l_seq = out[0], lse[0]
    for d in range(1, p):
        o_seq, l_seq = merge_partials(o_seq, l_seq, out[d], lse[d])
    lse64, out64 = np.asarray(lse, np.float64), np.asarray(out, np.float64)
    l_ref = np.logaddexp.reduce(lse64, axis=0)
    o_ref = np.sum(np.exp(lse64 - l_ref)[..., None] * out64, axis=0)
    # A float32 merge rounds lse_d - lse (|lse| up to ~260): its weights carry a relative error of
    # a few eps * |lse|, the outputs that times |out|. Orders of merging differ by as much.
    atol = 8 * np.finfo(np.float32).eps * np.abs(lse64[np.isfinite(lse64)]).max()
    atol *= np.abs(out64).max()
    np.testing.assert_allclose(o_seq, o_ref, rtol=0, atol=atol)
    for d in range(p):  # every device holds the same merged partial
        np.testing.assert_allclose(l_all[d], l_seq, rtol=1e-6)
        np.testing.assert_allclose(l_all[d], l_ref, rtol=1e-6)
        np.testing.assert_allclose(o_all[d], o_ref, rtol=0, atol=atol)


# ---------------------------------------------------------------------------------------------
# Communication, read off the compiled HLO
# ---------------------------------------------------------------------------------------------


def _stats(fn, *args):
    return collective_stats(jax.jit(fn).lower(*args).compile())


@pytest.mark.parametrize("p", [2, 4, 8])
def test_allreduce_communication(p):
    q_seq, heads, kv_heads, dim = 1, 16, 4, 32
    mesh = mesh_of(p)
    per_seq = {}
    for kv_seq in (64 * p, 512 * p):
        q = jnp.zeros((q_seq, heads, dim))
        k = v = jnp.zeros((kv_seq, kv_heads, dim))
        zeta = jnp.zeros((q_seq, heads, dim))
        fwd = _stats(
            lambda q, k, v, z: tree_free_energy(q, k, v, z, mesh=mesh, kv_axis="kv"), q, k, v, zeta
        )
        assert fwd.count("all-reduce") == 2 and fwd.count() == 2
        both = _stats(
            jax.grad(
                lambda q, k, v, z: tree_free_energy(q, k, v, z, mesh=mesh, kv_axis="kv"),
                argnums=(0, 3),
            ),
            q,
            k,
            v,
            zeta,
        )
        assert both.count("all-reduce") == 3 and both.count() == 3  # dζ and dq: one packed sum
        att = _stats(
            lambda q, k, v: tree_energy_attention(q, k, v, mesh=mesh, kv_axis="kv"), q, k, v
        )
        assert att.count("all-reduce") == 3 and att.count() == 3
        per_seq[kv_seq] = att.bytes_sent()
        # Paper eq. (33)-(35) with b = q_seq: 2 (p-1)/p (b d + 2 b n_h) elements of 4 bytes.
        expected = 2 * (p - 1) / p * (q_seq * heads * dim + 2 * q_seq * heads) * 4
        assert att.bytes_sent() == pytest.approx(expected)
    assert len(set(per_seq.values())) == 1  # independent of the sequence length


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_butterfly_rounds(p):
    q, k = jnp.zeros((2, 4, 16)), jnp.zeros((16 * p, 2, 16))
    mesh = mesh_of(p)
    rounds = math.ceil(math.log2(p))
    fwd = _stats(
        lambda q, k, v, z: tree_free_energy(
            q, k, v, z, mesh=mesh, kv_axis="kv", reduction="butterfly"
        ),
        q,
        k,
        k,
        jnp.zeros((2, 4, 16)),
    )
    assert fwd.count("all-reduce") == 0
    permutes = fwd.count("collective-permute")
    if p & (p - 1) == 0:
        assert permutes == rounds  # one exchange per round
    else:  # a missing rank's twin also sends in rounds after the first
        assert rounds < permutes <= 2 * rounds - 1
    att = _stats(
        lambda q, k, v: tree_energy_attention(
            q, k, v, mesh=mesh, kv_axis="kv", reduction="butterfly"
        ),
        q,
        k,
        k,
    )
    assert att.count("all-reduce") == 0
    assert att.count("collective-permute") == 2 * permutes  # the gradient: one more butterfly


def test_hierarchical_communication():
    mesh = two_level_mesh(2, 4)
    q, k = jnp.zeros((1, 8, 16)), jnp.zeros((64, 2, 16))
    att = _stats(
        lambda q, k, v: tree_energy_attention(
            q, k, v, mesh=mesh, kv_axis=("node", "local"), reduction="hierarchical"
        ),
        q,
        k,
        k,
    )
    # Forward: max and sum over the 4 local devices, then over the 2 nodes; gradient: both sums.
    groups = sorted(c.group_size for c in att.collectives)
    assert att.count() == att.count("all-reduce") == 6
    assert groups == [2, 2, 2, 4, 4, 4]


# ---------------------------------------------------------------------------------------------
# Bad configuration
# ---------------------------------------------------------------------------------------------


def test_errors():
    q, k = jnp.zeros((1, 2, 4)), jnp.zeros((8, 2, 4))
    with pytest.raises(ValueError, match=r"kv_axis 'seq' is not an axis of the mesh \(axes: "):
        tree_energy_attention(q, k, k, mesh=mesh_of(2), kv_axis="seq")
    with pytest.raises(ValueError, match=r"reduction must be one of"):
        tree_energy_attention(q, k, k, mesh=mesh_of(2), kv_axis="kv", reduction="ring")
    with pytest.raises(ValueError, match=r"'hierarchical' needs two mesh axes"):
        tree_energy_attention(q, k, k, mesh=mesh_of(2), kv_axis="kv", reduction="hierarchical")
    with pytest.raises(ValueError, match=r"tree_free_energy: zeta must have shape"):
        tree_free_energy(q, k, k, jnp.zeros((1, 2, 3)), mesh=mesh_of(2), kv_axis="kv")


@pytest.mark.parametrize("p, reduction", [(3, "allreduce"), (4, "butterfly")])
def test_local_window_across_shards(p, reduction, getkey):
    """A sliding window by absolute position over a sequence sharded on the mesh (37 keys,
    padded): each shard applies it to its own keys; same value and gradient as unsharded."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    q_seq, kv_seq = SHAPE[:2]
    window = (6, 0)
    kw = dict(causal=True, q_offset=kv_seq - q_seq, local_window_size=window)
    out = jit_tree(tree_energy_attention, **tree_kw(p, reduction), **kw)(q, k, v)
    at = kv_seq - q_seq + np.arange(q_seq)[:, None]
    j = np.arange(kv_seq)[None, :]
    vis = (at - window[0] <= j) & (j <= at)
    expected = ref.attention(q, k, v, causal=True, q_offset=kv_seq - q_seq, mask=vis)
    assert ref.rel_err(out, expected) <= TOL[jnp.float32]
    zeta = jax.random.normal(getkey(), (q_seq, SHAPE[2], SHAPE[5]))
    f = jax.jit(lambda *a: tree_free_energy(*a, **tree_kw(p, reduction), **kw))(q, k, v, zeta)
    terms = ref.free_energy_terms(q, k, v, zeta, causal=True, q_offset=kv_seq - q_seq, mask=vis)
    np.testing.assert_allclose(f, terms.sum(), rtol=1e-5)
    grads = jax.grad(
        lambda q, k, v: jnp.sum(
            jnp.sin(tree_energy_attention(q, k, v, **tree_kw(p, reduction), **kw))
        )
    )(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(energy_attention(q, k, v, **kw))))(q, k, v)
    for a, b in zip(grads, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # Inside shard_map, with this device's shard and its absolute offset.
    mesh = mesh_of(2)
    k2, v2 = k[:36], v[:36]

    def local(q, k, v):
        return sharded_energy_attention(q, k, v, axis_name="kv", **kw)

    inside = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("kv"), P("kv")), out_specs=P(), check_vma=False
        )
    )(q, k2, v2)
    expected2 = ref.attention(q, k2, v2, causal=True, q_offset=kv_seq - q_seq, mask=vis[:, :36])
    assert ref.rel_err(inside, expected2) <= TOL[jnp.float32]


@pytest.mark.parametrize("reduction", ["allreduce", "butterfly", "hierarchical"])
def test_nan_query_gives_nan_on_every_schedule(reduction, getkey):
    """NaN in, NaN out: a query holding NaN gets a NaN free energy across devices too (an
    all-reduce max may skip the NaN; the merged sum still carries it), never the -inf of a
    query that sees no key."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    q = q.at[1, 0, 0].set(jnp.nan)
    zeta = jnp.zeros((SHAPE[0], SHAPE[2], SHAPE[5]))
    kw = tree_kw(4, reduction)
    assert np.isnan(float(multihead_free_energy(q, k, v, zeta)))
    assert np.isnan(float(tree_free_energy(q, k, v, zeta, **kw)))
    out = tree_energy_attention(q, k, v, **kw)
    assert np.all(np.isnan(out[1, 0])) and np.all(np.isfinite(out[0]))


def test_empty_key_sequence_gives_the_empty_answer(getkey):
    """No key on any device: every query attends to nothing (output 0, F = -inf), as the
    unsharded functions answer, inside shard_map and on a mesh."""
    q, _, _ = make_qkv(getkey, SHAPE, jnp.float32)
    no_k, no_v = jnp.zeros((0, SHAPE[3], SHAPE[4])), jnp.zeros((0, SHAPE[3], SHAPE[5]))
    zeta = jnp.zeros((SHAPE[0], SHAPE[2], SHAPE[5]))
    mesh = mesh_of(4)

    def local(q, k, v):
        f = sharded_free_energy(q, k, v, zeta, axis_name="kv")
        return sharded_energy_attention(q, k, v, axis_name="kv"), f

    spec = P(None, None, None)
    run = jax.shard_map(
        local, mesh=mesh, in_specs=(spec, P("kv"), P("kv")), out_specs=(spec, P()), check_vma=False
    )
    out, f = run(q, no_k, no_v)
    want_f = multihead_free_energy(q, no_k, no_v, zeta)
    assert float(want_f) == -np.inf and float(f) == -np.inf
    np.testing.assert_array_equal(out, energy_attention(q, no_k, no_v))
    np.testing.assert_array_equal(out, 0.0)
    assert float(tree_free_energy(q, no_k, no_v, zeta, mesh=mesh, kv_axis="kv")) == -np.inf
    np.testing.assert_array_equal(tree_energy_attention(q, no_k, no_v, mesh=mesh, kv_axis="kv"), 0)


def test_concrete_negative_offsets_are_refused_by_name(getkey):
    """A negative q_offset or kv_offset held in a concrete array is refused like a Python int,
    inside shard_map and out."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    k, v = k[:32], v[:32]
    mesh = mesh_of(4)
    for name in ("q_offset", "kv_offset"):
        kw = {name: jnp.asarray(-3)}

        def local(q, k, v, kw=kw):
            return sharded_energy_attention(q, k, v, axis_name="kv", causal=True, **kw)

        spec = P(None, None, None)
        run = jax.shard_map(
            local, mesh=mesh, in_specs=(spec, P("kv"), P("kv")), out_specs=spec, check_vma=False
        )
        with pytest.raises(ValueError, match=f"sharded_energy_attention: {name} must be >= 0"):
            run(q, k, v)
    with pytest.raises(ValueError, match="energy_attention: q_offset must be >= 0"):
        energy_attention(q, k, v, causal=True, q_offset=jnp.asarray(-1))
