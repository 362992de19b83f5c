"""Masking rules beyond causality and windows: packed sequences (segment ids), prefix-LM,
chunked attention and FlexAttention's `mask_mod` and `score_mod`, on every path, against
float64 NumPy; blocks that no query sees are skipped."""

import functools

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import (
    ALIBI,
    GRID,
    HEADS,
    TOL,
    backend_of,
    energy_reference,
    make_energy,
    make_qkv,
    mesh_of,
)
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

from treeattn.decode import (
    BackendUnavailable,
    dot_product_attention,
    flash_attention,
    ring_decode,
    tree_decode,
)
from treeattn.energy import (
    Energy,
    ScoreMod,
    Softmax,
    attention_reference,
    energy_attention,
    multihead_free_energy,
    tree_energy_attention,
    tree_free_energy,
)
from treeattn.models import LlamaConfig, MultiheadAttention, Transformer
from treeattn.training import lm_loss


SHAPE = (29, 29, HEADS, 2, 8, 6)  # q_seq, kv_seq, heads, kv_heads (GQA), qk, dv
DOCS = (7, 3, 12, 7)  # a packed row of four documents


def documents(lengths=DOCS):
    return np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lengths)])


def every_third(b, h, q_idx, kv_idx):
    """A mask function that reads every argument: in batch row 0, head 1 skips the keys 1, 4,
    7, ... positions back."""
    return (h != 1) | (b == 1) | ((q_idx - kv_idx) % 3 != 1)


# Each rule, alone and together: (treeattn keywords, np_reference keywords).
RULES = {
    "segments": (
        {"q_segment_ids": documents(), "kv_segment_ids": documents()},
        {"q_segments": documents(), "kv_segments": documents()},
    ),
    "causal_segments": (
        {"causal": True, "q_segment_ids": documents(), "kv_segment_ids": documents()},
        {"causal": True, "q_segments": documents(), "kv_segments": documents()},
    ),
    "prefix_lm": ({"causal": True, "prefix_length": 9}, {"causal": True, "prefix": 9}),
    "chunked": ({"causal": True, "chunk_size": 8}, {"causal": True, "chunk": 8}),
    "mask_mod": ({"mask_mod": every_third}, {"mask_mod": every_third}),
    "all": (
        {
            "causal": True,
            "local_window_size": (10, 0),
            "prefix_length": 4,
            "chunk_size": 16,
            "q_segment_ids": documents((20, 9)),
            "kv_segment_ids": documents((20, 9)),
            "mask_mod": every_third,
        },
        {
            "causal": True,
            "window": (10, 0),
            "prefix": 4,
            "chunk": 16,
            "q_segments": documents((20, 9)),
            "kv_segments": documents((20, 9)),
            "mask_mod": every_third,
        },
    ),
}


def dense_mask(rule, q_seq=SHAPE[0], kv_seq=SHAPE[1], heads=HEADS, batch=0):
    """The float64 reference's boolean mask `[heads, q_seq, kv_seq]` of `RULES[rule]` (the
    queries are the last `q_seq` positions)."""
    np_rules = dict(RULES[rule][1])
    if "q_segments" in np_rules:
        np_rules["q_segments"] = np_rules["q_segments"][kv_seq - q_seq :]
    q_pos = np.arange(kv_seq - q_seq, kv_seq)
    return ref.rules_visible(q_pos, np.arange(kv_seq), heads, batch=batch, **np_rules)


@pytest.mark.fast(rule="all", block_size=None, dtype=jnp.float32)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size", [None, 8])
@pytest.mark.parametrize("rule", list(RULES))
def test_softmax_against_numpy(rule, block_size, dtype, getkey):
    q, k, v = make_qkv(getkey, SHAPE, dtype)
    kw = RULES[rule][0]
    out = energy_attention(q, k, v, **kw, block_size=block_size)
    expected = ref.attention(q, k, v, mask=dense_mask(rule))
    assert out.dtype == dtype
    assert ref.rel_err(out, expected) <= TOL[dtype]
    twin = attention_reference(q, k, v, **kw)
    assert ref.rel_err(twin, expected) <= TOL[dtype]


@pytest.mark.fast(name="stick", rule="all")
@pytest.mark.parametrize("rule", ["causal_segments", "all"])
@pytest.mark.parametrize("name", GRID)
def test_every_energy_against_numpy(name, rule, getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    energy = make_energy(name)
    kw = RULES[rule][0]
    expected, _ = energy_reference(name, q, k, v, mask=dense_mask(rule))
    for block_size in (None, 8):
        out = energy_attention(q, k, v, **kw, energy=energy, block_size=block_size)
        assert ref.rel_err(out, expected) <= TOL[jnp.float32], block_size


@pytest.mark.fast(rule="causal_segments")
@pytest.mark.parametrize("rule", ["causal_segments", "prefix_lm", "all"])
def test_gradients(rule, getkey):
    """Blockwise gradients (the custom VJPs, tiles skipped) equal those of the dense mask, and
    the float64 gradients match finite differences."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    kw, mask = RULES[rule][0], jnp.asarray(dense_mask(rule))
    zeta = 0.3 * jax.random.normal(getkey(), (SHAPE[0], HEADS, SHAPE[5]))

    def with_rules(q, k, v, zeta):
        f = multihead_free_energy(q, k, v, zeta, **kw, block_size=8)
        o = energy_attention(q, k, v, **kw, block_size=8)
        return f + jnp.sum(jnp.sin(o))

    def with_mask(q, k, v, zeta):
        f = multihead_free_energy(q, k, v, zeta, mask=mask)
        return f + jnp.sum(jnp.sin(energy_attention(q, k, v, mask=mask)))

    got = jax.grad(with_rules, argnums=(0, 1, 2, 3))(q, k, v, zeta)
    want = jax.grad(with_mask, argnums=(0, 1, 2, 3))(q, k, v, zeta)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    with jax.enable_x64(True):
        q64, k64, v64 = (x.astype(jnp.float64)[:12] for x in (q, k, v))

        def small(q, k, v):
            rules = {
                "causal": True,
                "prefix_length": 3,
                "q_segment_ids": documents((5, 7)),
                "kv_segment_ids": documents((5, 7)),
            }
            return energy_attention(q, k, v, **rules, block_size=4)

        check_grads(small, (q64, k64, v64), order=1, modes=("rev",))


@pytest.mark.fast(p=4)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_tree_equals_one_device(p, getkey):
    """Sharded over p devices (the key segment ids split with the keys), attention and the
    gradient of F equal one device's."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    kw = RULES["all"][0]
    mesh = mesh_of(p)
    for energy in (Softmax(), make_energy("stick")):
        out = tree_energy_attention(q, k, v, mesh=mesh, kv_axis="kv", **kw, energy=energy)
        one = energy_attention(q, k, v, **kw, energy=energy)
        np.testing.assert_allclose(out, one, rtol=1e-5, atol=2e-6)
    zeta = 0.3 * jax.random.normal(getkey(), (SHAPE[0], HEADS, SHAPE[5]))
    sharded = jax.grad(lambda k: tree_free_energy(q, k, v, zeta, mesh=mesh, kv_axis="kv", **kw))
    local = jax.grad(lambda k: multihead_free_energy(q, k, v, zeta, **kw))
    np.testing.assert_allclose(sharded(k), local(k), rtol=1e-5, atol=2e-6)


@pytest.mark.fast(backend="auto")
@pytest.mark.parametrize("backend", ["auto", "energy", "reference"])
def test_flash_attention_rows(backend, getkey):
    """Batched: each row its own segments and prefix, `mask_mod` reads the row's index."""
    q_seq, kv_seq = 5, SHAPE[1]
    q = jax.random.normal(getkey(), (2, q_seq, HEADS, 8))
    k = jax.random.normal(getkey(), (2, kv_seq, 2, 8))
    v = jax.random.normal(getkey(), (2, kv_seq, 2, 8))
    segs = np.stack([documents(), documents((20, 9))])
    prefixes = np.array([3, 11], np.int32)
    kw = {"causal": True, "q_offset": kv_seq - q_seq, "mask_mod": every_third}
    out, lse = flash_attention(
        q,
        k,
        v,
        **kw,
        q_segment_ids=segs[:, -q_seq:],
        kv_segment_ids=segs,
        prefix_length=prefixes,
        backend=backend,
    )
    for b in range(2):
        mask = ref.rules_visible(
            np.arange(kv_seq - q_seq, kv_seq),
            np.arange(kv_seq),
            HEADS,
            causal=True,
            prefix=prefixes[b],
            q_segments=segs[b, -q_seq:],
            kv_segments=segs[b],
            mask_mod=every_third,
            batch=b,
        )
        expected = ref.attention(q[b], k[b], v[b], mask=mask)
        assert ref.rel_err(out[b], expected) <= TOL[jnp.float32]
        assert lse.shape == (2, q_seq, HEADS) and np.isfinite(lse).all()


@pytest.mark.fast(p=4)
@pytest.mark.parametrize("p", [1, 3, 4, 8])
def test_tree_and_ring_decode(p, getkey):
    """A chunk of queries after a cache sharded over p devices (37 slots: padded), with every
    rule per row: tree and ring decoding equal one device's `flash_attention`."""
    q_seq, kv_seq = 5, 37
    q = jax.random.normal(getkey(), (2, q_seq, HEADS, 8))
    k = jax.random.normal(getkey(), (2, kv_seq, 2, 8))
    v = jax.random.normal(getkey(), (2, kv_seq, 2, 8))
    segs = np.stack([documents((10, 7, 15, 5)), documents((20, 17))])
    kw = {
        "causal": True,
        "q_offset": kv_seq - q_seq,
        "q_segment_ids": segs[:, -q_seq:],
        "kv_segment_ids": segs,
        "prefix_length": np.array([2, 6], np.int32),
        "mask_mod": every_third,
    }
    mesh = mesh_of(p)
    for energy in (Softmax(), make_energy("stick")):
        one, _ = flash_attention(q, k, v, **kw, energy=energy)
        for decode in (tree_decode, ring_decode):
            out = decode(q, k, v, mesh=mesh, kv_axis="kv", **kw, energy=energy)
            np.testing.assert_allclose(out, one, rtol=1e-5, atol=2e-6, err_msg=decode.__name__)
    with pytest.raises(BackendUnavailable, match="takes no segment ids"):
        tree_decode(q, k, v, mesh=mesh, kv_axis="kv", **kw, backend="xla")


def test_fused_kernels_refuse_rules(getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    seg = documents()
    for backend in ("xla", "cpu", "pallas"):
        with pytest.raises(BackendUnavailable, match="segment ids"):
            flash_attention(
                q[None], k[None], v[None], q_segment_ids=seg, kv_segment_ids=seg, backend=backend
            )


def test_dot_product_attention_segments(getkey):
    """jax's signature, with segment ids as an extension: the same as jax's own call with the
    dense document mask, which it never builds."""
    q, k, v = (x[None] for x in make_qkv(getkey, (*SHAPE[:5], 8), jnp.float32))  # jax: dv = qk
    seg = documents()
    out = dot_product_attention(q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    mask = jnp.asarray(dense_mask("causal_segments"))[None]
    expected = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"q_segment_ids": np.zeros(29, np.int32)}, "needs its twin"),
        (
            {"q_segment_ids": np.zeros(28, np.int32), "kv_segment_ids": np.zeros(29, np.int32)},
            r"q_segment_ids must be an integer array of shape \[q_seq\] = \(29,\)",
        ),
        (
            {"q_segment_ids": np.zeros(29), "kv_segment_ids": np.zeros(29)},
            "got dtype float",
        ),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"prefix_length": -1}, "prefix_length must be >= 0"),
        ({"mask_mod": 3}, "mask_mod must be callable"),
    ],
)
def test_errors_name_the_argument(kw, match, getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    with pytest.raises(ValueError, match=match):
        energy_attention(q, k, v, **kw)


def test_new_rules_do_not_recompile(getkey):
    """Segment ids and the prefix are traced: new values run the compiled program."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    calls = []

    @jax.jit
    def attend(seg, prefix):
        calls.append(1)
        kw = {"q_segment_ids": seg, "kv_segment_ids": seg, "prefix_length": prefix}
        return energy_attention(q, k, v, causal=True, **kw, block_size=8)

    for lengths, prefix in ((DOCS, 3), ((20, 9), 5), ((29,), 0)):
        seg = documents(lengths)
        out = attend(jnp.asarray(seg), jnp.asarray(prefix, jnp.int32))
        mask = ref.rules_visible(
            np.arange(29), np.arange(29), HEADS, causal=True, prefix=prefix,
            q_segments=seg, kv_segments=seg,
        )  # fmt: skip
        assert ref.rel_err(out, ref.attention(q, k, v, mask=mask)) <= TOL[jnp.float32]
    assert len(calls) == 1


class Counted(Energy):
    """Softmax that counts, on the host, how many tiles of keys it scores."""

    def elements(self, x, tilt, ctx):
        jax.debug.callback(TILES.append, 1)
        return x + tilt


TILES: list = []


@pytest.mark.fast(rule="packed")
@pytest.mark.parametrize(
    "rule, seen",
    [("full", 32), ("causal", 20), ("packed", 8), ("packed_dense_mask", 8)],
)
def test_tiles_no_query_sees_are_skipped(rule, seen, getkey):
    """2,048 tokens, 8 heads, blocks of 256 keys and chunks of 512 queries: 32 tiles. Causal
    attention scores the 20 that reach the diagonal, 8 packed documents of 256 tokens 8 (each
    chunk sees the two blocks of its own documents), whether they come as segment ids or as a
    dense mask."""
    n = 2048
    q = jax.random.normal(getkey(), (n, 8, 16))
    k = v = jax.random.normal(getkey(), (n, 2, 16))
    seg = np.repeat(np.arange(8, dtype=np.int32), n // 8)
    kw = {
        "full": {},
        "causal": {"causal": True},
        "packed": {"q_segment_ids": seg, "kv_segment_ids": seg},
        "packed_dense_mask": {"mask": jnp.asarray(seg[:, None] == seg[None, :])},
    }[rule]
    TILES.clear()
    out = energy_attention(q, k, v, **kw, energy=Counted(), block_size=256)
    jax.block_until_ready(out)
    jax.effects_barrier()
    # Each scored tile is scored twice: once for its state, once for its output.
    assert len(TILES) == 2 * seen
    expected = energy_attention(q, k, v, **kw, block_size=n)  # materialised: every key
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


def test_tiles_are_skipped_under_vmap(getkey):
    """A batch of packed rows (`vmap`, as the model layer batches): a tile is skipped when no
    row sees it, so the branch stays a branch. Row 0 holds 8 documents of 256 tokens, row 1 four
    of 512: chunks of 256 queries (segment ids halve the tile) see 8 and 16 blocks, 16 in all,
    each scored twice forward and twice more in the gradient."""
    n = 2048
    q = jax.random.normal(getkey(), (2, n, 8, 16))
    k = v = jax.random.normal(getkey(), (2, n, 2, 16))
    seg = jnp.asarray(
        np.stack([np.repeat(np.arange(8), n // 8), np.repeat(np.arange(4), n // 4)]), jnp.int32
    )

    counted = Counted()

    def attend(q, k, v, seg, energy=counted, block_size=256):
        kw = {"q_segment_ids": seg, "kv_segment_ids": seg}
        return energy_attention(q, k, v, **kw, energy=energy, block_size=block_size)

    def loss(q, k, v, **kw):
        return jnp.sum(jax.vmap(functools.partial(attend, **kw))(q, k, v, seg) ** 2)

    TILES.clear()
    out = jax.vmap(attend)(q, k, v, seg)
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert len(TILES) == 2 * 16
    TILES.clear()
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jax.block_until_ready(grads)
    jax.effects_barrier()
    assert len(TILES) == 4 * 16
    dense = functools.partial(loss, energy=Softmax(), block_size=n)  # materialised
    expected = jax.grad(dense, argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@settings(deadline=None, max_examples=20)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
    block=st.sampled_from([None, 3, 8]),
)
def test_packed_documents_are_independent(lengths, seed, block):
    """Property: with causal segment ids, each document's output is that of the document
    alone, blockwise or not."""
    seg = documents(lengths)
    n = len(seg)
    keys = iter(jax.random.split(jax.random.key(seed), 3))
    q, k, v = make_qkv(lambda: next(keys), (n, n, 2, 1, 4, 3), jnp.float32)
    out = energy_attention(
        q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, block_size=block
    )
    start = 0
    for length in lengths:
        doc = slice(start, start + length)
        alone = energy_attention(q[doc], k[doc], v[doc], causal=True)
        np.testing.assert_allclose(out[doc], alone, rtol=1e-5, atol=2e-6)
        start += length


# ---------------------------------------------------------------------------------------------
# FlexAttention's score_mod as an energy
# ---------------------------------------------------------------------------------------------


def test_score_mod_alibi_and_softcap_equal_the_shipped_energies(getkey):
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    slopes = jnp.asarray(ALIBI, jnp.float32)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(score.dtype)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * jnp.tanh(score / 20.0)

    pairs = [
        (ScoreMod(alibi), Softmax(alibi_slopes=slopes)),
        (ScoreMod(softcap), Softmax(softcap=20.0)),
    ]
    for mod, shipped in pairs:
        for block_size in (None, 8):
            got = energy_attention(q, k, v, causal=True, energy=mod, block_size=block_size)
            want = energy_attention(q, k, v, causal=True, energy=shipped)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
        out, _ = flash_attention(q[None], k[None], v[None], causal=True, energy=mod)
        np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=2e-6)
        tree = tree_energy_attention(
            q, k, v, mesh=mesh_of(4), kv_axis="kv", causal=True, energy=mod
        )
        np.testing.assert_allclose(tree, want, rtol=1e-5, atol=2e-6)


def test_score_mod_table_is_learnable(getkey):
    """A relative-position bias table held by a `Partial`: its gradient is, per (head,
    distance), the attention the queries give keys at that distance (∂ΣF/∂bias), summing to
    one per query row, on every path."""
    q, k, v = make_qkv(getkey, SHAPE, jnp.float32)
    n = SHAPE[1]

    def relative(table, score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + n - 1]

    def total(table, **kw):
        energy = ScoreMod(jax.tree_util.Partial(relative, table))
        zeta = jnp.zeros((n, HEADS, SHAPE[5]))
        return multihead_free_energy(q, k, v, zeta, causal=True, energy=energy, **kw)

    table = 0.1 * jax.random.normal(getkey(), (HEADS, 2 * n - 1))
    grads = [
        jax.grad(lambda t: total(t))(table),
        jax.grad(lambda t: total(t, block_size=8))(table),
    ]
    logits = ref.logits(q, k) + np.asarray(table)[:, (np.arange(n)[:, None] - np.arange(n) + n - 1)]
    logits = np.where(np.tril(np.ones((n, n), bool))[None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.zeros((HEADS, 2 * n - 1))
    for i in range(n):
        for a in range(i + 1):
            want[:, i - a + n - 1] += w[:, i, a]
    for g in grads:
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[0].sum(), n * HEADS, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Packed training in the models
# ---------------------------------------------------------------------------------------------

PACKED = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.fast(backend="energy")
@pytest.mark.parametrize("backend", ["energy", "flash", "reference", "tree"])
def test_packed_row_equals_documents_alone(backend):
    """Each document of a packed row gets the logits it gets alone (rotary positions restart,
    no attention across documents), for a stacked and an unstacked model."""
    backend = backend_of(backend)
    model = Transformer(PACKED, key=jax.random.key(0))
    lengths = (5, 9, 4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, sum(lengths)))
    seg = documents(lengths)
    for m in (model, model.unstack_layers()):
        packed = m(tokens, segment_ids=seg, backend=backend)
        start = 0
        for length in lengths:
            alone = m(tokens[start : start + length], backend=backend)
            np.testing.assert_allclose(packed[start : start + length], alone, rtol=1e-4, atol=1e-5)
            start += length


def test_packed_loss_is_the_documents_loss():
    """`lm_loss` with segment ids: the mean over the targets within documents, each document
    as if alone; its gradient is finite and reaches every weight."""
    import equinox as eqx
    import optax

    model = Transformer(PACKED, key=jax.random.key(1))
    lengths = (6, 10, 5)
    row = jnp.asarray(np.random.default_rng(1).integers(0, 64, sum(lengths)))
    seg = documents(lengths)
    loss = lm_loss(model, row[None, :-1], row[None, 1:], segment_ids=seg[None, :-1])
    terms, start = [], 0
    for length in lengths:
        doc = row[start : start + length]
        logits = model(doc[:-1])
        terms.append(optax.softmax_cross_entropy_with_integer_labels(logits, doc[1:]))
        start += length
    want = np.concatenate([np.asarray(t) for t in terms]).mean()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    grads = eqx.filter_grad(
        lambda m: lm_loss(m, row[None, :-1], row[None, 1:], segment_ids=seg[None, :-1])
    )(model)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert all(np.isfinite(g).all() for g in leaves)


def test_layer_segment_ids_errors():
    layer = MultiheadAttention(2, 8, key=jax.random.key(0))
    x = jnp.ones((6, 8))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[seq\] = \(6,\)"):
        layer(x, x, x, segment_ids=jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match="q_seq == kv_seq"):
        layer(x[:3], x, x, segment_ids=jnp.zeros(3, jnp.int32))


@settings(deadline=None, max_examples=300)
@given(
    seed=st.integers(0, 2**16),
    rules=st.fixed_dictionaries(
        {
            "causal": st.booleans(),
            "window": st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(0, 9))),
            "chunk": st.one_of(st.none(), st.integers(1, 8)),
            "prefix": st.one_of(st.none(), st.integers(0, 12)),
            "segments": st.booleans(),
        }
    ),
    tile=st.tuples(st.integers(0, 24), st.integers(1, 6), st.integers(0, 24), st.integers(1, 6)),
    valid=st.integers(1, 6),
)
def test_tile_coverage_bounds_visibility(seed, rules, tile, valid):
    """Property: the bounds that decide whether a tile is skipped, partial or covered agree
    with the rules pair by pair — skipped: no real key is visible; covered: every key is."""
    from treeattn._numerics import COVERED, SKIPPED, Dims, Masking, tile_coverage

    q0, nq, k0, nk = tile
    valid = min(valid, nk)
    rng = np.random.default_rng(seed)
    # Sorted document ids, as packing makes them, over positions 0..31.
    seg = np.sort(rng.integers(0, 4, 32)).astype(np.int32) if rules["segments"] else None
    q_seg = None if seg is None else seg[q0 : q0 + nq]
    kv_seg = None if seg is None else seg[k0 : k0 + nk]
    prefix = rules["prefix"]
    masking = Masking(
        q_segments=None if q_seg is None else jnp.asarray(q_seg),
        kv_segments=None if kv_seg is None else jnp.asarray(kv_seg),
        prefix=None if prefix is None else jnp.asarray(prefix, jnp.int32),
        chunk=rules["chunk"],
    )
    dims = Dims(q_seq=nq, kv_seq=nk, heads=1, kv_heads=1, qk=1, dv=1)
    coverage = tile_coverage(
        dims,
        causal=rules["causal"],
        q_offset=q0,
        kv_offset=k0,
        kv_valid=valid,
        window=rules["window"],
        masking=masking,
    )
    seen = ref.rules_visible(
        np.arange(q0, q0 + nq),
        np.arange(k0, k0 + nk),
        1,
        causal=rules["causal"],
        window=rules["window"],
        chunk=rules["chunk"],
        prefix=prefix,
        q_segments=q_seg,
        kv_segments=kv_seg,
    )[0]
    seen[:, valid:] = False  # padding slots
    if coverage is None:  # no rule: only the padding hides keys, every tile is computed
        assert not (rules["causal"] or rules["segments"]) and rules["window"] is None
        assert rules["chunk"] is None and prefix is None
        return
    if int(coverage) == SKIPPED:
        assert not seen.any()
    if int(coverage) == COVERED:
        assert seen.all()
    if not (rules["segments"] or rules["chunk"]) and seen.any():
        # Positions alone: their bounds are exact.
        assert int(coverage) != SKIPPED
