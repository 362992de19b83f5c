"""treeattn.decode with energy=: flash_attention, tree_decode and ring_decode of every shipped
energy against float64 NumPy (np_reference.energy_attention), over a KV cache (filled
lengths, causal chunks, windows, masks, GQA, a round-robin cache's positions), on 1-8 devices."""

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import HEADS, TOL, energy_reference, make_energy, mesh_of, two_level_mesh

from treeattn.decode import (
    BackendUnavailable,
    flash_attention,
    flash_attention_reference,
    ring_decode,
    tree_decode,
)
from treeattn.energy import (
    Energy,
    Sigmoid,
    Softmax,
    StickBreaking,
    energy_attention,
    tree_energy_attention,
)


CASES = ["softmax_beta", "softmax_softcap_alibi", "sink", "sigmoid_bias", "linear", "stick"]
KV_HEADS, DIM = 2, 8  # GQA: two query heads per key/value head


def make_cache(getkey, batch, q_seq, kv_seq, dtype=jnp.float32):
    q = jax.random.normal(getkey(), (batch, q_seq, HEADS, DIM), dtype)
    k = jax.random.normal(getkey(), (batch, kv_seq, KV_HEADS, DIM), dtype)
    v = jax.random.normal(getkey(), (batch, kv_seq, KV_HEADS, DIM), dtype)
    return q, k, v


def expected(case, q, k, v, lengths, offsets, *, causal=True, mask=None, window=None):
    """float64 attention of every row over its filled keys, in position order."""
    outs = []
    for b, (n, offset) in enumerate(zip(lengths, offsets, strict=True)):
        q_seq = q.shape[1]
        vis = np.ones((HEADS, q_seq, n), bool)
        if mask is not None:
            vis &= np.broadcast_to(np.asarray(mask[b])[..., :n], vis.shape)
        if window is not None:
            i = offset + np.arange(q_seq)[:, None]
            j = np.arange(n)[None, :]
            vis &= ((i - j <= window[0]) & (j - i <= window[1]))[None]
        kw = {"causal": causal, "q_offset": int(offset), "mask": vis}
        outs.append(energy_reference(case, q[b], k[b, :n], v[b, :n], **kw)[0])
    return np.stack(outs)


def decode(kind, p, q, k, v, **kw):
    if kind == "flash":
        return flash_attention(q, k, v, **kw)[0]
    fn = tree_decode if kind == "tree" else ring_decode
    return fn(q, k, v, mesh=mesh_of(p), kv_axis="kv", **kw)


STEP_CASES = [  # (energy, devices, layout): every device count and layout, few compilations
    ("softmax_beta", 1, "bshd"),
    ("softmax_softcap_alibi", 2, "bhsd"),
    ("sink", 8, "bshd"),
    ("sigmoid_bias", 4, "bhsd"),
    ("linear", 2, "bshd"),
    ("cosformer", 8, "bhsd"),
    ("stick", 4, "bhsd"),
]


@pytest.mark.fast(case="sigmoid_bias", p=4, kv_layout="bhsd")
@pytest.mark.parametrize("case, p, kv_layout", STEP_CASES)
def test_decode_step(case, p, kv_layout, getkey):
    """One query after a cache of rows filled to different lengths, with a mask: flash, tree
    and ring agree with NumPy (19 slots: padded to the device count)."""
    q, k, v = make_cache(getkey, 2, 1, 19)
    lengths = np.array([11, 19])
    mask = jax.random.bernoulli(getkey(), 0.8, (2, HEADS, 1, 19))
    want = expected(case, q, k, v, lengths, lengths - 1, mask=mask)
    energy = make_energy(case)
    layout = (lambda x: jnp.swapaxes(x, 1, 2)) if kv_layout == "bhsd" else (lambda x: x)
    kw = {"kv_length": jnp.asarray(lengths), "causal": True, "mask": mask, "energy": energy}
    kw |= {"kv_layout": kv_layout}
    for kind in ("flash", "tree", "ring"):
        extra = {"q_offset": jnp.asarray(lengths - 1)} if kind == "flash" else {}
        out = jax.block_until_ready(decode(kind, p, q, layout(k), layout(v), **kw, **extra))
        assert out.shape == q.shape[:3] + (DIM,) and out.dtype == jnp.float32
        assert ref.rel_err(out, want) <= TOL[jnp.float32], kind


@pytest.mark.parametrize("case", ["softmax_softcap_alibi", "sigmoid_bias", "stick"])
def test_causal_chunk_with_window(case, getkey):
    """A causal chunk of 3 queries at per-row offsets with a sliding window (positions are
    absolute on every shard), on 4 devices; the reference twin of flash_attention agrees."""
    q, k, v = make_cache(getkey, 2, 3, 16)
    lengths, offsets = np.array([10, 16]), np.array([7, 13])
    window = (4, 0)
    want = expected(case, q, k, v, lengths, offsets, window=window)
    kw = {"kv_length": jnp.asarray(lengths), "q_offset": jnp.asarray(offsets), "causal": True}
    kw |= {"local_window_size": window, "energy": make_energy(case)}
    for kind in ("flash", "tree", "ring"):
        out = jax.block_until_ready(decode(kind, 4, q, k, v, **kw))
        assert ref.rel_err(out, want) <= TOL[jnp.float32], kind
    if case == "softmax_softcap_alibi":
        out, _ = flash_attention_reference(q, k, v, **kw)
        assert ref.rel_err(out, want) <= TOL[jnp.float32]


def round_robin(kv_seq, p):
    """Slot -> position of a cache appended round-robin over p shards: position j sits in shard
    j % p, at slot j // p of it."""
    n = kv_seq // p
    return np.array([(s % n) * p + s // n for s in range(kv_seq)], np.int32)


@pytest.mark.parametrize("case", CASES)
def test_round_robin_cache(case, getkey):
    """kv_positions of a round-robin cache over 4 shards, a causal chunk of 2 queries with a
    window: flash folds an ordered monoid in position order (whatever slot holds a key); tree
    and ring give the same attention for every energy whose monoid is commutative, and refuse
    the ordered one on 4 devices."""
    q, k, v = make_cache(getkey, 2, 2, 16)
    lengths = np.array([9, 14])
    perm = round_robin(16, 4)
    ks, vs = k[:, perm], v[:, perm]  # slot s holds position perm[s]
    want = expected(case, q, k, v, lengths, lengths - 2, window=(6, 0))
    energy = make_energy(case)
    kw = {"kv_length": jnp.asarray(lengths), "causal": True, "kv_positions": jnp.asarray(perm)}
    kw |= {"energy": energy, "local_window_size": (6, 0)}
    out, _ = flash_attention(q, ks, vs, q_offset=jnp.asarray(lengths - 2), **kw)
    assert ref.rel_err(out, want) <= TOL[jnp.float32]
    if energy.monoid.commutative:
        for kind in ("tree", "ring"):
            out = jax.block_until_ready(decode(kind, 4, q, ks, vs, **kw))
            assert ref.rel_err(out, want) <= TOL[jnp.float32], kind
    else:
        for kind in ("tree", "ring"):
            with pytest.raises(ValueError, match="round-robin cache, whose shards interleave"):
                decode(kind, 4, q, ks, vs, **kw)
        out = decode("tree", 1, q, ks, vs, **kw)  # one device: one shard, sorted by position
        assert ref.rel_err(out, want) <= TOL[jnp.float32]


@pytest.mark.parametrize("case", ["sink", "sigmoid_bias"])
def test_shard_lengths(case, getkey):
    """A round-robin cache told by each shard's fill length (one decode step)."""
    p, kv_seq = 4, 16
    q, k, v = make_cache(getkey, 2, 1, kv_seq)
    lengths = np.array([7, 13])
    perm = round_robin(kv_seq, p)
    n = kv_seq // p
    fills = np.array(
        [[int(np.sum(perm[d * n : (d + 1) * n] < m)) for d in range(p)] for m in lengths]
    )
    want = expected(case, q, k, v, lengths, lengths - 1)
    kw = {"shard_lengths": jnp.asarray(fills), "causal": True, "energy": make_energy(case)}
    for kind in ("tree", "ring"):
        out = jax.block_until_ready(decode(kind, p, q, k[:, perm], v[:, perm], **kw))
        assert ref.rel_err(out, want) <= TOL[jnp.float32], kind


@pytest.mark.parametrize(
    "case, kinds", [("softmax_softcap_alibi", ("flash", "tree")), ("stick", ("ring",))]
)
def test_bfloat16(case, kinds, getkey):
    q, k, v = make_cache(getkey, 2, 1, 16, jnp.bfloat16)
    lengths = np.array([12, 16])
    want = expected(case, q, k, v, lengths, lengths - 1)
    kw = {"kv_length": jnp.asarray(lengths), "causal": True, "energy": make_energy(case)}
    for kind in kinds:
        extra = {"q_offset": jnp.asarray(lengths - 1)} if kind == "flash" else {}
        out = jax.block_until_ready(decode(kind, 2, q, k, v, **kw, **extra))
        assert out.dtype == jnp.bfloat16
        assert ref.rel_err(out, want) <= TOL[jnp.bfloat16], kind


def test_gradients_and_lse(getkey):
    """The general path is differentiable (tree = flash = energy_attention, in q, k, v and the
    energy's parameters); its second result is F at zeta = 0; a row seeing nothing is 0."""
    q, k, v = make_cache(getkey, 1, 1, 12)
    energy = make_energy("sink")
    lengths = jnp.asarray([12])

    def loss(energy, q, k, v, kind):
        out = decode(
            kind,
            4,
            q,
            k,
            v,
            kv_length=lengths,
            causal=True,
            energy=energy,
            **({"q_offset": lengths - 1} if kind == "flash" else {}),
        )
        return jnp.sum(out**2)

    def loss0(energy, q, k, v):
        out = energy_attention(q[0], k[0], v[0], causal=True, q_offset=11, energy=energy)
        return jnp.sum(out**2)

    g0 = jax.grad(loss0, argnums=(0, 1, 2, 3))(energy, q, k, v)
    for kind in ("flash", "tree"):
        g = jax.grad(loss, argnums=(0, 1, 2, 3))(energy, q, k, v, kind)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
            assert ref.rel_err(a, b) <= 1e-4, kind
    _, f = flash_attention(q, k, v, energy=Softmax(beta=1.0, softcap=1e4))
    _, lse = flash_attention(q, k, v)
    assert f.dtype == jnp.float32 and f.shape == (1, 1, HEADS)
    np.testing.assert_allclose(f, lse, rtol=1e-5)  # a soft-cap far above the logits
    out, f = flash_attention(q, k, v, kv_length=0, energy=StickBreaking())
    assert np.all(np.asarray(out) == 0) and np.all(np.isfinite(np.asarray(f)))


def test_default_energy_is_the_kernels(getkey):
    q, k, v = make_cache(getkey, 2, 1, 16)
    kw = {"kv_length": jnp.asarray([5, 16]), "causal": True}
    for kind, energy in (("flash", Softmax()), ("tree", None), ("ring", Softmax())):
        a = decode(kind, 4, q, k, v, **kw)
        np.testing.assert_array_equal(a, decode(kind, 4, q, k, v, energy=energy, **kw))


def test_window_on_a_mesh(getkey):
    """tree_energy_attention with a window and a non-default energy (absolute positions)."""
    q, k, v = make_cache(getkey, 1, 5, 21)
    kw = {"causal": True, "q_offset": 16, "local_window_size": (6, 0)}
    for case in ("sigmoid_bias", "stick"):
        energy = make_energy(case)
        out = tree_energy_attention(
            q[0], k[0], v[0], mesh=mesh_of(4), kv_axis="kv", energy=energy, **kw
        )
        want = expected(case, q, k, v, [21], [16], window=(6, 0))[0]
        assert ref.rel_err(out, want) <= TOL[jnp.float32]
        assert ref.rel_err(out, energy_attention(q[0], k[0], v[0], energy=energy, **kw)) <= 2e-5


def test_errors(getkey):
    q, k, v = make_cache(getkey, 2, 1, 16)
    sig = make_energy("sigmoid_bias")
    with pytest.raises(BackendUnavailable, match=r"softmax only, not energy=Sigmoid"):
        flash_attention(q, k, v, backend="xla", energy=sig)
    with pytest.raises(BackendUnavailable, match=r"softmax only, not energy=StickBreaking"):
        tree_decode(q, k, v, mesh=mesh_of(2), kv_axis="kv", backend="cpu", energy=StickBreaking())
    flash_attention(q, k, v, backend=("pallas", "auto"), energy=sig)  # auto: the energy kernel
    with pytest.raises(ValueError, match="takes no bias"):
        flash_attention(q, k, v, bias=jnp.zeros((1, 1, 1, 16)), energy=sig)
    with pytest.raises(ValueError, match="energy must be a treeattn.energy.Energy"):
        ring_decode(q, k, v, mesh=mesh_of(2), kv_axis="kv", energy="sigmoid")  # type: ignore[arg-type]
    fills = jnp.asarray([4, 4])
    for energy, why in (
        (StickBreaking(), "their order"),
        (make_energy("softmax_softcap_alibi"), "their positions"),
        (DistanceDecay(), "their positions"),
    ):
        with pytest.raises(ValueError, match=f"reads the keys' {why}"):
            tree_decode(q, k, v, mesh=mesh_of(2), kv_axis="kv", shard_lengths=fills, energy=energy)


class DistanceDecay(Energy):
    """A user's energy whose logits read the keys' positions: softmax with a penalty on the
    distance between query and key, $x_a - |i - j_a| / 4$."""

    def logits(self, q, k, ctx):
        x = super().logits(q, k, ctx)
        distance = jnp.abs(ctx.q_pos[:, None] - ctx.k_pos[None, :]).astype(x.dtype)
        return x - distance / 4

    def elements(self, x, tilt, ctx):
        return x + tilt


def test_a_user_energy_reading_positions_is_decoded_at_its_true_positions(getkey):
    """An energy whose own logits read key positions (`reads_positions`, True by default for a
    subclass's logits) decoded over a cache filled round-robin: with each slot's position it
    equals the float64 reference over the cache in position order; with per-shard fill counts
    (which carry no position) it is refused rather than given the wrong positions."""
    p, block, shard = 2, 4, 16
    b, n = 1, p * shard
    q, k, v = make_cache(getkey, b, 1, n)
    length = 11
    # Slot a of a round-robin cache (blocks of 4 over 2 shards) holds this position.
    s = np.arange(n)
    d, j = s // shard, s % shard
    positions = ((j // block) * p + d) * block + j % block
    energy = DistanceDecay()
    assert energy.reads_positions and not Sigmoid().reads_positions
    got = tree_decode(
        q,
        k,
        v,
        mesh=mesh_of(p),
        kv_axis="kv",
        kv_positions=jnp.asarray(positions),
        kv_length=length,
        causal=True,
        energy=energy,
    )
    # float64: softmax of s q.k - |i - j| / 4 over the filled positions 0..length-1, query at
    # position length - 1 (the cache's slots sorted into position order first).
    order = np.argsort(positions)[:length]
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q[0, 0], k[0][order], v[0][order]))
    group = HEADS // KV_HEADS
    want = np.zeros((HEADS, DIM))
    for h in range(HEADS):
        x = kf[:, h // group] @ qf[h] / np.sqrt(DIM) - np.abs(length - 1 - np.arange(length)) / 4
        w = np.exp(x - x.max())
        want[h] = (w / w.sum()) @ vf[:, h // group]
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-5, atol=1e-5)
    fills = jnp.asarray([8, 3])  # the same 11 tokens, counted per shard
    with pytest.raises(ValueError, match="reads the keys' their positions"):
        tree_decode(q, k, v, mesh=mesh_of(p), kv_axis="kv", shard_lengths=fills, energy=energy)


@pytest.mark.parametrize("reduction", ["butterfly", "hierarchical"])
def test_every_schedule(reduction, getkey):
    """tree_decode of every energy with the other reduction schedules (4 devices)."""
    q, k, v = make_cache(getkey, 2, 1, 16)
    lengths = np.array([6, 16])
    if reduction == "hierarchical":
        tree = {"mesh": two_level_mesh(2, 2), "kv_axis": ("node", "local")}
    else:
        tree = {"mesh": mesh_of(4), "kv_axis": "kv"}
    for case in CASES:
        kw = {"kv_length": jnp.asarray(lengths), "causal": True, "energy": make_energy(case)}
        out = jax.block_until_ready(tree_decode(q, k, v, reduction=reduction, **tree, **kw))
        want = expected(case, q, k, v, lengths, lengths - 1)
        assert ref.rel_err(out, want) <= TOL[jnp.float32], case
