"""Tree and ring decoding told each shard's fill length (`shard_lengths`) instead of key
positions: checked against float64 NumPy, shards empty, partly filled and full; the
arguments refused with it."""

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TOL, mesh_of

from treeattn.decode import ring_decode, tree_decode


def np_fills(q, k, v, fills, *, devices_):
    """float64 attention [batch, q_seq, heads, dv] of each row over the first `fills[b, d]`
    slots of every shard d (k, v in bshd, shards contiguous along the sequence)."""
    batch, q_seq = q.shape[:2]
    kv_seq = k.shape[1]
    shard = kv_seq // devices_
    slot = np.arange(kv_seq)
    outs = []
    for b in range(batch):
        seen = slot % shard < np.repeat(fills[b], shard)
        outs.append(ref.attention(q[b], k[b], v[b], mask=np.broadcast_to(seen, (q_seq, kv_seq))))
    return np.stack(outs)


def random_fills(rng, batch, p, shard):
    """Fill lengths per (row, shard) with an empty shard and a full one in every row."""
    fills = rng.integers(0, shard + 1, size=(batch, p))
    for row in fills:
        row[rng.permutation(p)[:2]] = (0, shard)
    return fills.astype(np.int32)


# Every device count of the tree and the ring in some dtype, and both dtypes on each decoder.
@pytest.mark.parametrize(
    "dtype, p, decode",
    [
        (jnp.float32, 2, tree_decode),
        (jnp.bfloat16, 4, tree_decode),
        (jnp.float32, 8, tree_decode),
        (jnp.float32, 4, ring_decode),
        (jnp.bfloat16, 4, ring_decode),
    ],
    ids=["f32-tree-2", "bf16-tree-4", "f32-tree-8", "f32-ring-4", "bf16-ring-4"],
)
def test_shard_lengths_match_numpy(dtype, p, decode, getkey):
    """One query per row after the cache (causal, a decode step), GQA, a head-major cache, a
    fill per row and shard."""
    batch, heads, kv_heads, shard, dim = 2, 4, 2, 6, 16
    kv_seq = p * shard
    q = jax.random.normal(getkey(), (batch, 1, heads, dim), dtype)
    k = jax.random.normal(getkey(), (batch, kv_seq, kv_heads, dim), dtype)
    v = jax.random.normal(getkey(), (batch, kv_seq, kv_heads, dim), dtype)
    # Unfilled slots hold NaN: they must not reach any row.
    slot = jnp.arange(kv_seq) % shard
    fills = random_fills(np.random.default_rng(p), batch, p, shard)
    unfilled = (slot[None, :] >= jnp.repeat(jnp.asarray(fills), shard, axis=1))[..., None, None]
    k_nan = jnp.where(unfilled, jnp.nan, k).astype(dtype)
    v_nan = jnp.where(unfilled, jnp.nan, v).astype(dtype)
    out = decode(
        q,
        jnp.swapaxes(k_nan, 1, 2),
        jnp.swapaxes(v_nan, 1, 2),
        mesh=mesh_of(p),
        kv_axis="kv",
        kv_layout="bhsd",
        causal=True,
        shard_lengths=fills,
    )
    assert out.dtype == dtype
    expected = np_fills(q, k, v, fills, devices_=p)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert ref.rel_err(out, expected) <= TOL[dtype]


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_shared_shard_lengths_with_several_queries(backend, getkey):
    """Not causal: every query of a chunk sees every filled key; one fill vector for all rows;
    a row-independent cache length that shards evenly (bshd)."""
    p, batch, q_seq, heads, shard, dim = 4, 2, 3, 2, 5, 8
    kv_seq = p * shard
    q = jax.random.normal(getkey(), (batch, q_seq, heads, dim))
    k = jax.random.normal(getkey(), (batch, kv_seq, heads, dim))
    v = jax.random.normal(getkey(), (batch, kv_seq, heads, dim))
    fills = jnp.asarray([5, 0, 2, 1], jnp.int32)
    out = tree_decode(q, k, v, mesh=mesh_of(p), kv_axis="kv", shard_lengths=fills, backend=backend)
    expected = np_fills(q, k, v, np.broadcast_to(np.asarray(fills), (batch, p)), devices_=p)
    assert ref.rel_err(out, expected) <= TOL[jnp.float32]


def test_all_shards_empty_give_zero(getkey):
    q = jax.random.normal(getkey(), (1, 1, 2, 8))
    k = jnp.full((1, 8, 2, 8), jnp.nan)
    out = tree_decode(q, k, k, mesh=mesh_of(2), kv_axis="kv", shard_lengths=jnp.zeros(2, int))
    np.testing.assert_array_equal(out, 0.0)


def test_traced_shard_lengths_do_not_recompile(getkey):
    p, shard = 2, 4
    q = jax.random.normal(getkey(), (1, 1, 2, 8))
    k = jax.random.normal(getkey(), (1, p * shard, 2, 8))
    traces = []

    @jax.jit
    def step(fills):
        traces.append(None)
        return tree_decode(q, k, k, mesh=mesh_of(p), kv_axis="kv", shard_lengths=fills)

    for fills in ([1, 0], [4, 3], [4, 4]):
        out = step(jnp.asarray(fills, jnp.int32)).block_until_ready()
        expected = np_fills(q, k, k, np.asarray([fills]), devices_=p)
        assert ref.rel_err(out, expected) <= TOL[jnp.float32]
    assert len(traces) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_length=3), "kv_length cannot be combined with shard_lengths"),
        (dict(q_offset=2), "q_offset cannot be combined with shard_lengths"),
        (dict(kv_positions=jnp.arange(8)), "kv_positions and shard_lengths are mutually"),
        (dict(shard_lengths=jnp.zeros(3, jnp.int32)), r"shape \[devices\] = \(2,\)"),
        (dict(shard_lengths=jnp.zeros((3, 2), jnp.int32)), r"\[batch, devices\] = \(1, 2\)"),
        (dict(shard_lengths=jnp.zeros(2)), "must be integer"),
        (dict(shard_lengths=np.array([5, 0])), r"in \[0, kv_seq / devices = 4\], got \[5, 0\]"),
        (dict(shard_lengths=np.array([-1, 0])), r"in \[0, kv_seq / devices = 4\]"),
    ],
)
def test_bad_shard_lengths(kwargs, match):
    q, k = jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 8, 2, 8))
    kw = dict(shard_lengths=np.array([1, 1], np.int32)) | kwargs
    with pytest.raises(ValueError, match=match):
        tree_decode(q, k, k, mesh=mesh_of(2), kv_axis="kv", **kw)


def test_shard_lengths_refuse_causal_chunks_and_uneven_caches():
    mesh = mesh_of(2)
    k = jnp.zeros((1, 8, 2, 8))
    fills = jnp.ones(2, jnp.int32)
    with pytest.raises(ValueError, match="causal=True with shard_lengths needs one query per row"):
        tree_decode(
            jnp.zeros((1, 3, 2, 8)), k, k, mesh=mesh, kv_axis="kv", causal=True, shard_lengths=fills
        )
    k = jnp.zeros((1, 7, 2, 8))
    with pytest.raises(ValueError, match="split evenly over the 2 devices.*kv_seq=7"):
        ring_decode(jnp.zeros((1, 1, 2, 8)), k, k, mesh=mesh, kv_axis="kv", shard_lengths=fills)
