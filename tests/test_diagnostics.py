"""Diagnostics from the free energy: the entropy of each query's attention and the attention
each key receives, against float64 NumPy, blockwise, sharded over 1-8 devices, for every
shipped energy, with their communication and memory."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import ENERGIES, HEADS, TOL, make_energy, make_qkv, mesh_of
from hypothesis import given
from jax.test_util import check_grads

from treeattn.energy import (
    Softmax,
    Softpick,
    StickBreaking,
    attention_entropy,
    multihead_free_energy,
    received_attention,
    tree_attention_entropy,
    tree_energy_attention,
    tree_received_attention,
)
from treeattn.profiling import collective_stats


SHAPES = [(5, 13, 4, 2, 8, 3), (4, 6, 4, 4, 4, 2), (3, 9, 6, 1, 8, 2)]  # GQA, MHA, MQA


def _masking(getkey, shape, masking):
    """(treeattn's keyword arguments, NumPy's) for one masking configuration; "mask_empty" has
    a query that sees no key at all, "window" a sliding window after a cache."""
    q_seq, kv_seq, heads = shape[:3]
    if masking == "none":
        return {}, {}
    if masking == "causal":
        kw = {"causal": True, "q_offset": kv_seq - q_seq}
        return kw, dict(kw)
    if masking == "window":
        off, (left, right) = kv_seq - q_seq - 1, (3, 1)
        kw = {"q_offset": off, "local_window_size": (left, right)}
        i = off + np.arange(q_seq)[:, None]
        a = np.arange(kv_seq)[None, :]
        return kw, {"mask": (i - left <= a) & (a <= i + right)}
    if masking == "mask_empty":
        mask = np.array(jax.random.bernoulli(getkey(), 0.6, (heads, q_seq, kv_seq)))
        mask[1, 0] = False  # query 0 of head 1 sees nothing
        mask[:, :, 2] = False  # key 2 is seen by nobody
        return {"mask": jnp.asarray(mask), "causal": True, "q_offset": kv_seq - q_seq}, {
            "mask": mask,
            "causal": True,
            "q_offset": kv_seq - q_seq,
        }
    raise ValueError(masking)


@functools.partial(jax.jit, static_argnames=("fn", "causal", "window", "block_size"))
def _call(fn, energy, q, k, v, mask, q_offset, causal, window, block_size):
    kw = {"causal": causal, "mask": mask, "q_offset": q_offset, "local_window_size": window}
    return fn(q, k, v, energy=energy, block_size=block_size, **kw)


def call(fn, q, k, v, energy=None, block_size=None, **kw):
    energy = Softmax() if energy is None else energy
    args = (kw.get("mask"), kw.get("q_offset", 0), kw.get("causal", False))
    return _call(fn, energy, q, k, v, *args, kw.get("local_window_size"), block_size)


MASKINGS = ["none", "causal", "window", "mask_empty"]


@pytest.mark.fast(masking="mask_empty", dtype="float32")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_softmax_matches_numpy(shape, masking, dtype, getkey):
    dtype = jnp.dtype(dtype).type
    q, k, v = make_qkv(getkey, shape, dtype)
    kw, np_kw = _masking(getkey, shape, masking)
    h = call(attention_entropy, q, k, v, **kw)
    r = call(received_attention, q, k, v, **kw)
    assert h.dtype == r.dtype == jnp.float32
    assert h.shape == shape[:1] + shape[2:3] and r.shape == shape[1:3]
    assert np.isfinite(h).all() and np.isfinite(r).all()
    # The reference reads the inputs as rounded to `dtype`: the arithmetic is float32 in both.
    tol = TOL[jnp.float32] if dtype is jnp.float32 else 1e-5
    assert ref.rel_err(h, ref.attention_entropy(q, k, **np_kw)) <= 5 * tol
    assert ref.rel_err(r, ref.received_attention(q, k, **np_kw)) <= 5 * tol
    if masking == "mask_empty":
        assert h[0, 1] == 0 and (r[2] == 0).all()


@pytest.mark.fast(masking="mask_empty")
@pytest.mark.parametrize("masking", MASKINGS)
def test_bfloat16_against_float32_inputs(masking, getkey):
    """bfloat16 inputs against the float64 reference of the unrounded float32 inputs: within
    the bfloat16 tolerance."""
    shape = SHAPES[0]
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw, np_kw = _masking(getkey, shape, masking)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert (
        ref.rel_err(call(attention_entropy, *low, **kw), ref.attention_entropy(q, k, **np_kw))
        <= (TOL[jnp.bfloat16])
    )
    expected = ref.received_attention(q, k, **np_kw)
    assert ref.rel_err(call(received_attention, *low, **kw), expected) <= TOL[jnp.bfloat16]


ENERGY_CASES = ["softmax_beta", "softmax_softcap_alibi", "sink", "softmax1", "sigmoid_bias"]
ENERGY_CASES += ["sigmoid", "linear", "cosformer", "stick"]


@pytest.mark.fast(case="sink")
@pytest.mark.parametrize("case", ENERGY_CASES)
def test_energies_match_numpy(case, getkey):
    """Every shipped energy against its float64 reference (Shannon's entropy for the softmax
    family, the formula's value for the rest), materialised and blockwise."""
    shape = (5, 13, HEADS, 2, 8, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw, np_kw = _masking(getkey, shape, "mask_empty")
    energy = make_energy(case)
    expected = ref.energy_diagnostics(ENERGIES[case].family, ENERGIES[case].params, q, k, **np_kw)
    for block_size in (None, 4):
        h = call(attention_entropy, q, k, v, energy, block_size, **kw)
        r = call(received_attention, q, k, v, energy, block_size, **kw)
        assert np.abs(np.asarray(h) - expected[0]).max() <= 1e-5 * max(1, np.abs(expected[0]).max())
        assert ref.rel_err(r, expected[1]) <= 5 * TOL[jnp.float32]


class _StickBreakingByElements(StickBreaking):
    def _lift_at_zero(self, x, tilt, visible, ctx):
        return None


class _SoftpickByElements(Softpick):
    def _lift_at_zero(self, x, tilt, visible, ctx):
        return None


@pytest.mark.parametrize("case", ["stick", "softpick"])
def test_diagnostics_lift_at_zero_as_the_elements_do(case, getkey):
    """Entropy and received attention of the energies that lift a block straight from its
    logits at zeta = 0 (stick-breaking, softpick) equal those lifted from their elements, with
    a mask that leaves a query no key, materialised and blockwise."""
    shape = (5, 13, HEADS, 2, 8, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw, _ = _masking(getkey, shape, "mask_empty")
    ours, by_elements = {
        "stick": (StickBreaking(), _StickBreakingByElements()),
        "softpick": (Softpick(), _SoftpickByElements()),
    }[case]
    for block_size in (None, 4):
        for fn in (attention_entropy, received_attention):
            a = call(fn, q, k, v, ours, block_size, **kw)
            b = call(fn, q, k, v, by_elements, block_size, **kw)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.fast(case="softmax_softcap_alibi", masking="window")
@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("case", ["softmax_softcap_alibi", "sink", "sigmoid", "stick"])
def test_blockwise_equals_materialised(case, masking, getkey):
    shape = (9, 37, HEADS, 2, 8, 3)  # 37 keys in blocks of 8: the last block is padded
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw, _ = _masking(getkey, shape, masking)
    energy = make_energy(case)
    for fn in (attention_entropy, received_attention):
        whole = call(fn, q, k, v, energy, None, **kw)
        blocked = call(fn, q, k, v, energy, 8, **kw)
        np.testing.assert_allclose(blocked, whole, rtol=2e-5, atol=2e-5)


@pytest.fixture
def small_tiles(monkeypatch):
    """Blockwise F in tiles of 64 logits: 9 queries of 4 heads against blocks of 8 keys come
    in five chunks of two (the last padded)."""
    import treeattn.energy._blockwise as blockwise

    jax.clear_caches()  # compiled programs hold the tile size they were traced with
    monkeypatch.setattr(blockwise, "TILE_ELEMENTS", 64)
    yield
    jax.clear_caches()


@pytest.mark.fast(masking="mask_empty")
@pytest.mark.parametrize("masking", [*MASKINGS, "packed"])
def test_query_chunks_equal_one_chunk(masking, small_tiles, getkey):
    """Blockwise F cut into chunks of queries (each with its own position, rows of the mask
    and segment ids) gives the entropy (its temperature indexed by position), the received
    attention, F and F's gradient of one chunk, materialised."""
    shape = (9, 37, HEADS, 2, 8, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    if masking == "packed":
        seg = jnp.asarray(np.repeat(np.arange(3), [10, 20, 7]), jnp.int32)
        kw = {"causal": True, "q_offset": 28, "q_segment_ids": seg[28:], "kv_segment_ids": seg}
    else:
        kw, _ = _masking(getkey, shape, masking)
    for fn in (attention_entropy, received_attention):
        whole = fn(q, k, v, **kw)
        blocked = fn(q, k, v, **kw, block_size=8)
        np.testing.assert_allclose(blocked, whole, rtol=2e-5, atol=2e-5)
    zeta = 0.1 * jax.random.normal(getkey(), q.shape[:2] + v.shape[-1:])

    def f(q, k, v, zeta, block_size):
        return multihead_free_energy(q, k, v, zeta, **kw, block_size=block_size)

    for argnums in (None, (0, 1, 2, 3)):
        whole, blocked = (functools.partial(f, block_size=size) for size in (None, 8))
        if argnums is not None:
            whole, blocked = jax.grad(whole, argnums), jax.grad(blocked, argnums)
        expected, got = whole(q, k, v, zeta), blocked(q, k, v, zeta)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)


@pytest.mark.fast(p=4, case="softmax")
@pytest.mark.parametrize("case", ["softmax", "sink", "sigmoid", "stick"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_tree_equals_one_device(p, case, getkey):
    """Sharded over p devices (13 keys: padded for every p but 1) as on one device."""
    shape = (5, 13, HEADS, 2, 8, 3)
    q, k, v = make_qkv(getkey, shape, jnp.float32)
    kw, _ = _masking(getkey, shape, "mask_empty")
    energy = Softmax() if case == "softmax" else make_energy(case)
    tree = {"mesh": mesh_of(p), "kv_axis": "kv", "energy": energy, **kw}
    for one, sharded in (
        (attention_entropy, tree_attention_entropy),
        (received_attention, tree_received_attention),
    ):
        expected = call(one, q, k, v, energy, **kw)
        got = jax.block_until_ready(sharded(q, k, v, **tree))
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.fast(case="softmax")
@pytest.mark.parametrize("case", ["softmax", "sigmoid", "stick"])
def test_tree_collectives(case):
    """A diagnostic costs what attention does: F's reductions, then the gradient's one (in
    count). The entropy's traffic does not grow with the sequence; the received attention's
    gradient reduces a `[heads, kv_seq]` cotangent."""
    energy = Softmax() if case == "softmax" else make_energy(case)
    tree = {"mesh": mesh_of(4), "kv_axis": "kv", "energy": energy}
    forward = energy.monoid.reductions if case != "stick" else 1  # stick: one all-gather
    sent = {}
    for kv_seq in (64, 512):
        q, k = jnp.zeros((2, HEADS, 16)), jnp.zeros((kv_seq, 2, 16))

        def stats(fn, q=q, k=k):
            run = jax.jit(lambda q, k: fn(q, k, k, **tree))
            return collective_stats(run.lower(q, k).compile())

        att, ent, rec = map(
            stats, (tree_energy_attention, tree_attention_entropy, tree_received_attention)
        )
        # Sigmoid: the sum's gradient all-reduce does not wait for the forward's; XLA packs both.
        expected = forward if case == "sigmoid" else forward + 1
        assert att.count() == ent.count() == rec.count() == expected
        sent[kv_seq] = (ent.bytes_sent(), rec.bytes_sent())
    assert sent[64][0] == sent[512][0]
    assert sent[512][1] > sent[64][1]


@given(
    seed=st.integers(0, 2**16),
    q_seq=st.integers(1, 6),
    kv_seq=st.integers(1, 12),
    group=st.sampled_from([1, 2]),
    density=st.floats(0.0, 1.0),
    block=st.sampled_from([None, 3]),
)
def test_property_bounds_and_totals(seed, q_seq, kv_seq, group, density, block):
    """0 <= H <= log(#visible keys) for every row; the received attention adds up to the number
    of (query, head) rows that see a key."""
    keys = jax.random.split(jax.random.key(seed), 4)
    heads = 2 * group
    q = 2 * jax.random.normal(keys[0], (q_seq, heads, 4))
    k = v = jax.random.normal(keys[1], (kv_seq, 2, 4))
    mask = jax.random.bernoulli(keys[2], density, (heads, q_seq, kv_seq))
    h = call(attention_entropy, q, k, v, block_size=block, mask=mask)
    r = call(received_attention, q, k, v, block_size=block, mask=mask)
    seen = np.asarray(mask).sum(-1).T  # [q_seq, heads]
    bound = np.log(np.maximum(seen, 1))
    assert (np.asarray(h) >= -1e-5).all() and (np.asarray(h) <= bound + 1e-5).all()
    assert np.asarray(r).sum() == pytest.approx((seen > 0).sum(), rel=1e-5, abs=1e-5)
    assert (np.asarray(r) >= 0).all()


def test_memory_blockwise():
    """With `block_size`, the compiled temporaries grow linearly in the sequence (a few blocks
    of logits, `[heads, N, block]`, and the per-block states), not with the `[heads, N, N]`
    logits the materialised form holds."""
    heads, dim, block = 2, 16, 256

    def temp(fn, n):
        x = jax.ShapeDtypeStruct((n, heads, dim), jnp.float32)
        run = jax.jit(lambda q, k, v: fn(q, k, v, causal=True, block_size=block))
        return run.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    for fn in (attention_entropy, received_attention):
        small, large = temp(fn, 2048), temp(fn, 4096)
        logits = heads * 4096 * 4096 * 4
        mib = f"{small / 2**20:.1f} -> {large / 2**20:.1f} MiB (logits {logits >> 20} MiB)"
        print(f"{fn.__name__}: {mib}")
        assert large < 2.5 * small  # linear, where N^2 would be 4x
        assert large < logits / 4


def test_no_keys_and_errors(getkey):
    q, k, v = make_qkv(getkey, (3, 0, 4, 2, 8, 3), jnp.float32)
    assert (attention_entropy(q, k, v) == 0).all()
    assert received_attention(q, k, v).shape == (0, 4)
    assert tree_attention_entropy(q, k, v, mesh=mesh_of(2), kv_axis="kv").shape == (3, 4)
    q, k, v = make_qkv(getkey, (3, 5, 4, 2, 8, 3), jnp.float32)
    with pytest.raises(ValueError, match="attention_entropy: q must have shape"):
        attention_entropy(q[0], k, v)
    with pytest.raises(ValueError, match="received_attention: num_heads=3"):
        received_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="tree_received_attention: energy must be"):
        tree_received_attention(q, k, v, mesh=mesh_of(2), kv_axis="kv", energy="softmax")  # type: ignore[arg-type]


def test_entropy_is_differentiable(getkey):
    """An entropy penalty trains: its gradient in q matches finite differences (float64)."""
    with jax.enable_x64(True):
        q, k, v = make_qkv(getkey, (3, 7, 2, 1, 4, 2), jnp.float64)
        for block_size in (None, 3):

            def loss(q, block_size=block_size):
                return jnp.sum(
                    attention_entropy(q, k, v, causal=True, q_offset=4, block_size=block_size)
                )

            check_grads(loss, (q,), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
