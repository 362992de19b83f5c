"""treeattn.decode: fused local attention, tree decoding, the ring baseline — one answer."""

import functools

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import (
    TOL,
    check_out_lse,
    make_decode_qkv,
    mesh_of,
    to_layout,
    two_level_mesh,
)
from hypothesis import given, settings, strategies as st

from treeattn.decode import (
    BackendUnavailable,
    flash_attention,
    flash_attention_reference,
    ring_decode,
    select_backend,
    tree_decode,
)
from treeattn.energy import energy_attention
from treeattn.profiling import collective_stats


def flash_vs_numpy(q, k, v, *, kv_length, q_offset, causal, layout="bshd", dtype=jnp.float32, **kw):
    """`flash_attention` (k, v given in bshd, passed in `layout`) checked against float64 NumPy;
    returns its (out, lse)."""
    out, lse = flash_attention(
        q,
        to_layout(k, layout),
        to_layout(v, layout),
        causal=causal,
        q_offset=q_offset,
        kv_length=kv_length,
        kv_layout=layout,
        **kw,
    )
    exp_out, exp_lse = ref.decode(
        q, k, v, np.maximum(np.asarray(kv_length), 0), causal=causal, q_offset=np.asarray(q_offset)
    )
    check_out_lse(out, lse, exp_out, exp_lse, dtype)
    return out, lse


# (batch, q_seq, heads, kv_heads, kv_seq, dim)
SHAPES = [(2, 1, 8, 2, 37, 16), (1, 3, 4, 4, 20, 8), (3, 4, 6, 1, 45, 16)]
# The Pallas decode kernel takes one query per row (its refusal is tested below).
CASES = [
    (backend, block, shape)
    for backend, block in [
        ("xla", None),
        ("xla", 8),
        ("cpu", None),
        ("reference", None),
        ("pallas", None),
    ]
    for shape in SHAPES
    if backend != "pallas" or shape[1] == 1
]


# Every (backend, block, shape) in bhsd float32; the bshd layout and bfloat16 once per
# (backend, block), each on another shape (Pallas: its one-query shape).
BACKEND_BLOCKS = [("xla", None), ("xla", 8), ("cpu", None), ("reference", None), ("pallas", None)]
FLASH_CASES = [case + ("bhsd", jnp.float32) for case in CASES] + [
    (backend, block, SHAPES[0 if backend == "pallas" else (i + j) % len(SHAPES)], layout, dtype)
    for i, (backend, block) in enumerate(BACKEND_BLOCKS)
    for j, (layout, dtype) in enumerate([("bshd", jnp.float32), ("bhsd", jnp.bfloat16)])
]


@pytest.mark.fast(
    backend="xla", block=8, shape=SHAPES[2], layout="bhsd", dtype=jnp.float32, causal=True
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "backend, block, shape, layout, dtype",
    FLASH_CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{jnp.dtype(c[4]).name}" for c in FLASH_CASES],
)
def test_flash_attention_matches_numpy(backend, block, shape, causal, layout, dtype, getkey):
    batch, q_seq = shape[:2]
    q, k, v = make_decode_qkv(getkey, *shape, dtype=dtype)
    kv_length = jnp.asarray([shape[4], 7, 0][:batch])  # full, partial, and an empty cache
    q_offset = kv_length - q_seq  # the queries are the last filled positions
    out, lse = flash_vs_numpy(
        q,
        k,
        v,
        kv_length=kv_length,
        q_offset=q_offset,
        causal=causal,
        layout=layout,
        dtype=dtype,
        backend=backend,
        block_size=block,
    )
    assert out.shape == q.shape[:3] + (shape[5],) and out.dtype == dtype
    assert lse.shape == (batch, q_seq, shape[2])


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas"])
def test_gradients_match_reference(backend, getkey):
    """Fused backends differentiate through their shared blockwise backward, lse included."""
    q, k, v = make_decode_qkv(getkey, 2, 1, 4, 2, 24, 8)
    kv_length = jnp.asarray([24, 11])
    w = jax.random.normal(getkey(), (2, 1, 4, 8))

    def loss(backend, q, k, v):
        out, lse = flash_attention(
            q,
            k,
            v,
            causal=True,
            q_offset=kv_length - 1,
            kv_length=kv_length,
            backend=backend,
            block_size=5,
        )
        return jnp.sum(out * w) + jnp.sum(jnp.sin(lse))

    got = jax.grad(functools.partial(loss, backend), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, "reference"), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_check_grads_xla_float64(getkey):
    from jax.test_util import check_grads

    with jax.enable_x64(True):
        q, k, v = make_decode_qkv(getkey, 1, 2, 2, 1, 9, 3, dtype=jnp.float64)

        def f(q, k, v):
            out, lse = flash_attention(
                q, k, v, causal=True, q_offset=7, kv_length=9, backend="xla", block_size=4
            )
            return out, lse

        check_grads(f, (q, k, v), order=2, modes=("rev",), eps=1e-4)


@pytest.mark.parametrize("block", [2, None])
def test_second_derivative_with_a_large_bias_on_a_hidden_key(block, getkey):
    """Training through attention differentiates the fused backward again: a bias of 100 on a
    key that causality hides from some rows (e^100 overflows float32) leaves the second
    derivative finite and equal to the reference's."""
    q, k, v = make_decode_qkv(getkey, 1, 8, 2, 1, 8, 4)
    bias = jnp.zeros((1, 1, 1, 8)).at[..., 5].set(100.0)

    def second(backend):
        def loss(q, k, v, bias):
            kw = {"bias": bias, "causal": True, "backend": backend}
            out, _ = flash_attention(q, k, v, block_size=block if backend == "xla" else None, **kw)
            return jnp.sum(out**2)

        def first(*args):
            return sum(jnp.sum(g) for g in jax.grad(loss, argnums=(0, 1, 2, 3))(*args))

        return jax.grad(first, argnums=(0, 1, 2, 3))(q, k, v, bias)

    for got, want in zip(second("xla"), second("reference"), strict=True):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def query_chunks_of_3(monkeypatch):
    """The XLA kernel with `QUERY_CHUNK = 3`, traced afresh (jax's caches cleared on the way
    in and out, so that no trace of another chunk size is reused), counting its joins."""
    from treeattn.decode import _xla

    joins = []
    join = _xla._join_chunks
    monkeypatch.setattr(_xla, "QUERY_CHUNK", 3)
    monkeypatch.setattr(_xla, "_join_chunks", lambda *a, **kw: joins.append(1) or join(*a, **kw))
    jax.clear_caches()
    yield joins
    jax.clear_caches()


@pytest.mark.parametrize("block", [None, 4])
def test_xla_query_chunks_match_reference(block, query_chunks_of_3, getkey):
    """A causal or windowed call with more queries than `QUERY_CHUNK` runs in chunks of
    queries, each over the key blocks it sees (here 8 queries in chunks of 3, the last moved
    back over a row of the one before): out, lse and the gradients of q, k, v and the bias
    as the reference's, for rows of their own offsets and lengths, with and without a mask, a
    window, a bias per query or broadcast over them (one key's at 100: e^100 overflows float32
    unless taken against the row's lse), and NaN in the unfilled slots; differentiable twice."""
    from jax.test_util import check_grads

    q, k, v = make_decode_qkv(getkey, 2, 8, 4, 2, 20, 8)
    lengths = {"q_offset": jnp.asarray([12, 5]), "kv_length": jnp.asarray([20, 13])}
    filled = (jnp.arange(20) < lengths["kv_length"][:, None])[:, :, None, None]
    k_nan, v_nan = (jnp.where(filled, x, jnp.nan) for x in (k, v))
    k, v = (jnp.where(filled, x, 0.0) for x in (k, v))
    w = jax.random.normal(getkey(), (2, 8, 4, 8))
    mask = jax.random.bernoulli(getkey(), 0.8, (2, 1, 8, 20))
    large = jnp.zeros((1, 4, 1, 20)).at[..., 3].set(100.0)
    cases = (
        (jax.random.normal(getkey(), (2, 4, 8, 20)), mask, None),
        (large + jax.random.normal(getkey(), (1, 4, 1, 20)), None, (5, 0)),
        (large, None, None),
    )
    for bias, mask_, window in cases:

        def loss(backend, q, k, v, bias, mask=mask_, window=window):
            out, lse = flash_attention(
                q,
                k,
                v,
                bias=bias,
                mask=mask,
                causal=True,
                local_window_size=window,
                backend=backend,
                block_size=block,
                **lengths,
            )
            seen = jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0)
            return jnp.sum(out * w) + jnp.sum(seen), (out, lse)

        grad = functools.partial(jax.grad, argnums=(0, 1, 2, 3), has_aux=True)
        got, (out, lse) = grad(functools.partial(loss, "xla"))(q, k_nan, v_nan, bias)
        want, (out_r, lse_r) = grad(functools.partial(loss, "reference"))(q, k, v, bias)
        np.testing.assert_allclose(out, out_r, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, lse_r, rtol=1e-5, atol=1e-5)
        assert got[3].shape == bias.shape
        for a, b in zip(got, want, strict=True):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert query_chunks_of_3  # the queries were cut
    with jax.enable_x64(True):
        q, k, v = make_decode_qkv(getkey, 1, 7, 2, 1, 9, 3, dtype=jnp.float64)

        def f(q, k, v):
            kw = {"q_offset": 2, "kv_length": 9, "block_size": block}
            return flash_attention(q, k, v, causal=True, backend="xla", **kw)

        check_grads(f, (q, k, v), order=2, modes=("rev",), eps=1e-4)


def test_xla_query_chunks_under_shard_map(query_chunks_of_3, getkey):
    """The chunked kernel and its backward (whose skipped blocks are zeros) inside a
    `shard_map` that checks which values vary over the mesh: keys and their positions split
    over 2 devices, each with its queries and bias (a `custom_vjp` input must vary as its
    cotangent does); each device's gradients are those of its half of the keys taken alone."""
    from jax.sharding import PartitionSpec as P

    q, k, v = make_decode_qkv(getkey, 2, 8, 4, 2, 20, 8)
    q = jnp.stack([q, -q])
    bias = jax.random.normal(getkey(), (2, 1, 4, 8, 10))
    # Device d holds keys 10d .. 10d + 9: its queries sit 10d later in its own slots.
    offset = jnp.asarray([[12, 5], [2, -5]])
    length = jnp.asarray([[10, 10], [10, 3]])

    def loss(q, k, v, bias, offset, length):
        out, lse = flash_attention(
            q,
            k,
            v,
            bias=bias,
            causal=True,
            q_offset=offset,
            kv_length=length,
            backend="xla",
            block_size=4,
        )
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))

    def local(q, k, v, bias, offset, length):
        dq, dk, dv, db = grads(q[0], k, v, bias[0], offset[0], length[0])
        return dq[None], dk, dv, db[None]

    keys, device = P(None, "kv"), P("kv")
    sharded = jax.shard_map(
        local,
        mesh=mesh_of(2),
        in_specs=(device, keys, keys, device, device, device),
        out_specs=(device, keys, keys, device),
        check_vma=True,
    )
    got = jax.jit(sharded)(q, k, v, bias, offset, length)
    for d in range(2):
        half = slice(10 * d, 10 * d + 10)
        want = grads(q[d], k[:, half], v[:, half], bias[d], offset[d], length[d])
        mine = (got[0][d], got[1][:, half], got[2][:, half], got[3][d])
        for a, b in zip(mine, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert query_chunks_of_3


def test_flash_reference_twin_and_energy_agree(getkey):
    q, k, v = make_decode_qkv(getkey, 2, 3, 8, 2, 30, 16)
    out, _ = flash_attention(q, k, v, causal=True, q_offset=27)
    twin, _ = flash_attention_reference(q, k, v, causal=True, q_offset=27)
    np.testing.assert_allclose(out, twin, rtol=1e-5, atol=1e-6)
    for b in range(2):
        energy = energy_attention(q[b], k[b], v[b], causal=True, q_offset=27)
        np.testing.assert_allclose(out[b], energy, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Tree and ring across devices
# ---------------------------------------------------------------------------------------------


def decode_fn(kind, p, **kw):
    fn = tree_decode if kind == "tree" else ring_decode
    return jax.jit(functools.partial(fn, mesh=mesh_of(p), kv_axis="kv", **kw))


@pytest.mark.fast(p=4, dtype=jnp.float32, backend="xla")
@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas", "reference"])
@pytest.mark.parametrize(
    "p, dtype",
    [(1, jnp.float32), (2, jnp.float32), (4, jnp.float32), (8, jnp.float32)]
    + [(1, jnp.bfloat16), (8, jnp.bfloat16)],  # bfloat16 on one device and on the widest mesh
    ids=str,
)
def test_tree_equals_ring_equals_one_device(p, dtype, backend, getkey):
    q, k, v = make_decode_qkv(getkey, 2, 1, 8, 2, 64, 16, dtype=dtype)
    kv_length = jnp.asarray([64, 13])  # row 1: most shards hold no valid key
    layout = "bhsd"
    kk, vv = to_layout(k, layout), to_layout(v, layout)
    kw = dict(kv_length=kv_length, backend=backend, kv_layout=layout)
    tree = decode_fn("tree", p, **kw)(q, kk, vv)
    ring = decode_fn("ring", p, **kw)(q, kk, vv)
    one, _ = flash_attention(q, kk, vv, kv_length=kv_length, backend=backend, kv_layout=layout)
    expected, _ = ref.decode(q, k, v, np.asarray(kv_length))
    for got in (tree, ring, one):
        assert got.dtype == dtype
        assert ref.rel_err(got, expected) <= TOL[dtype]
    if dtype == jnp.float32:
        np.testing.assert_allclose(tree, ring, rtol=1e-5, atol=1e-6)
        for b in range(2):
            energy = energy_attention(q[b], k[b, : int(kv_length[b])], v[b, : int(kv_length[b])])
            np.testing.assert_allclose(tree[b], energy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["allreduce", "butterfly"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_chunked_decode_gqa_batch(layout, reduction, getkey):
    """Several queries per row (chunked / speculative decoding), GQA, uneven fill, p = 3
    (the cache of 50 is padded to 51)."""
    q, k, v = make_decode_qkv(getkey, 3, 4, 6, 2, 50, 8)
    kv_length = jnp.asarray([50, 21, 4])
    kw = dict(kv_length=kv_length, causal=True, kv_layout=layout, reduction=reduction)
    kk, vv = to_layout(k, layout), to_layout(v, layout)
    tree = decode_fn("tree", 3, **kw)(q, kk, vv)
    ring = decode_fn("ring", 3, **kw)(q, kk, vv)
    expected, _ = ref.decode(
        q, k, v, np.asarray(kv_length), causal=True, q_offset=np.asarray(kv_length) - 4
    )
    assert ref.rel_err(tree, expected) <= TOL[jnp.float32]
    assert ref.rel_err(ring, expected) <= TOL[jnp.float32]


def test_hierarchical_tree_decode(getkey):
    mesh = two_level_mesh(2, 4)
    q, k, v = make_decode_qkv(getkey, 1, 1, 4, 4, 64, 8)
    out = tree_decode(
        q, k, v, mesh=mesh, kv_axis=("node", "local"), reduction="hierarchical", kv_length=40
    )
    expected, _ = ref.decode(q, k, v, np.asarray([40]))
    assert ref.rel_err(out, expected) <= TOL[jnp.float32]


def test_decode_step_does_not_recompile(getkey):
    q, k, v = make_decode_qkv(getkey, 1, 1, 4, 2, 32, 8)
    step = decode_fn("tree", 4, kv_layout="bshd")
    traces = 0

    @jax.jit
    def run(q, k, v, n):
        nonlocal traces
        traces += 1
        return tree_decode(q, k, v, mesh=mesh_of(4), kv_axis="kv", kv_length=n)

    for n in (5, 9, 17, 32):
        out = run(q, k, v, jnp.asarray([n]))
        expected, _ = ref.decode(q, k, v, np.asarray([n]))
        assert ref.rel_err(out, expected) <= TOL[jnp.float32]
    assert traces == 1
    del step


# ---------------------------------------------------------------------------------------------
# Communication, from the compiled HLO
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
def test_tree_and_ring_communication(p):
    batch, heads, dim = 2, 8, 16
    q = jnp.zeros((batch, 1, heads, dim))
    sent = {}
    for kv_seq in (64 * p, 256 * p):
        k = jnp.zeros((batch, heads, kv_seq, dim))
        tree = collective_stats(decode_fn("tree", p, kv_layout="bhsd").lower(q, k, k).compile())
        # pmax of lse, then one packed psum of (out e^{lse-m}, e^{lse-m}): paper eq. (33)-(35).
        assert tree.count() == tree.count("all-reduce") == 2
        expected = 2 * (p - 1) / p * (batch * heads * dim + 2 * batch * heads) * 4
        assert tree.bytes_sent() == pytest.approx(expected)
        sent[kv_seq] = tree.bytes_sent()
        ring = collective_stats(decode_fn("ring", p, kv_layout="bhsd").lower(q, k, k).compile())
        assert ring.unknown_trip_counts == 0
        # K and V shards, p - 1 hops each: eq. (31) per device.
        assert ring.count() == ring.count("collective-permute") == 2 * (p - 1)
        shard = batch * heads * (kv_seq // p) * dim * 4
        assert ring.bytes_sent() == pytest.approx(2 * (p - 1) * shard)
    assert len(set(sent.values())) == 1


# ---------------------------------------------------------------------------------------------
# Backend selection and bad input
# ---------------------------------------------------------------------------------------------


def test_backend_selection_on_this_machine(getkey):
    q, k, v = make_decode_qkv(getkey, 1, 1, 4, 2, 16, 8, dtype=jnp.bfloat16)
    from treeattn.decode._checks import check_decode
    from treeattn.decode._registry import host_platform

    dims = check_decode("t", q, k, v, kv_layout="bshd")
    kw = dict(causal=False, has_length=False, q_offset=0)
    long = check_decode("t", jnp.zeros((1, 9, 4, 8), q.dtype), k, v, kv_layout="bshd")
    if host_platform() == "cpu":
        assert select_backend("auto", dims, q.dtype, **kw) == "cpu"
        # Prefill-sized rows (group * q_seq > CPU_MAX_ROWS) go to the blockwise XLA kernel.
        assert select_backend("auto", long, q.dtype, **kw) == "xla"
        with pytest.raises(BackendUnavailable, match=r"flash_attn_jax.*on cpu: it is a CUDA"):
            flash_attention(q, k, v, backend="flash_attn_jax")
        with pytest.raises(BackendUnavailable, match=r"cudnn.*on cpu: it is a cuDNN custom call"):
            flash_attention(q, k, v, backend="cudnn")
    # Whatever the host, the choice for another lowering platform can be asked for.
    assert select_backend("auto", dims, q.dtype, **kw, platform="rocm") == "xla"
    assert select_backend("auto", long, q.dtype, **kw, platform="tpu") == "xla"
    with pytest.raises(BackendUnavailable, match=r"pallas.*one query per row \(q_seq=2\)"):
        flash_attention(jnp.concatenate([q, q], 1), k, v, backend="pallas")
    with pytest.raises(ValueError, match=r"backend must be one of"):
        flash_attention(q, k, v, backend="triton")


def test_flash_attn_jax_import_is_lazy():
    import sys

    import treeattn.decode  # noqa: F401

    assert "flash_attn_jax" not in sys.modules


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_layout="bsdh"), r"kv_layout must be 'bshd' or 'bhsd'"),
        (
            dict(kv_length=jnp.zeros((3,), jnp.int32)),
            r"kv_length must be a scalar or have "
            r"shape \[batch\] = \(2,\), got \(3,\)",
        ),
        (dict(q_offset=1.5), r"q_offset must be an integer"),
    ],
)
def test_bad_arguments(kwargs, match, getkey):
    q, k, v = make_decode_qkv(getkey, 2, 1, 4, 2, 16, 8)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kwargs)


def test_bad_shapes_and_mesh(getkey):
    q, k, v = make_decode_qkv(getkey, 2, 1, 4, 2, 16, 8)
    with pytest.raises(ValueError, match=r"q must have shape \[batch, q_seq, heads, dim\]"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"num_heads=4 .* multiple of num_kv_heads=3"):
        flash_attention(q, jnp.zeros((2, 16, 3, 8)), jnp.zeros((2, 16, 3, 8)))
    with pytest.raises(ValueError, match=r"k \(2, 2, 16, 8\) and v .* must agree"):
        flash_attention(q, jnp.swapaxes(k, 1, 2), v, kv_layout="bhsd")
    with pytest.raises(ValueError, match=r"kv_axis 'seq' is not an axis of the mesh"):
        tree_decode(q, k, v, mesh=mesh_of(2), kv_axis="seq")
    with pytest.raises(ValueError, match=r"'hierarchical' needs two mesh axes"):
        tree_decode(q, k, v, mesh=mesh_of(2), kv_axis="kv", reduction="hierarchical")


@pytest.mark.fast(p=3)
@pytest.mark.parametrize("p", [1, 3, 4])
def test_kv_positions_out_of_order_cache(p, getkey):
    """A cache stored out of position order (e.g. round-robin over devices), described by
    kv_positions, gives the same attention as the ordered cache."""
    batch, q_seq, heads, kv_heads, kv_seq, dim = 2, 3, 4, 2, 24, 8
    q, k, v = make_decode_qkv(getkey, batch, q_seq, heads, kv_heads, kv_seq, dim)
    kv_length = jnp.asarray([24, 10])
    perm = np.random.default_rng(0).permutation(kv_seq)  # slot s holds position perm[s]
    ks, vs = to_layout(k[:, perm], "bhsd"), to_layout(v[:, perm], "bhsd")
    kw = dict(kv_length=kv_length, causal=True, kv_layout="bhsd", kv_positions=jnp.asarray(perm))
    expected, _ = ref.decode(
        q, k, v, np.asarray(kv_length), causal=True, q_offset=np.asarray(kv_length) - q_seq
    )
    one, _ = flash_attention(q, ks, vs, q_offset=kv_length - q_seq, block_size=5, **kw)
    assert ref.rel_err(one, expected) <= TOL[jnp.float32]
    for kind in ("tree", "ring"):
        out = decode_fn(kind, p, **kw)(q, ks, vs)
        assert ref.rel_err(out, expected) <= TOL[jnp.float32], kind
    for backend in ("xla", "cpu"):
        got, _ = flash_attention(q, ks, vs, q_offset=kv_length - q_seq, backend=backend, **kw)
        assert ref.rel_err(got, expected) <= TOL[jnp.float32], backend
    with pytest.raises(BackendUnavailable, match="kv_positions"):
        flash_attention(
            q[:, :1], ks, vs, backend="pallas", kv_layout="bhsd", kv_positions=jnp.asarray(perm)
        )


def test_cpu_kernel_without_a_compiler(monkeypatch, tmp_path):
    """Without a C++ compiler the build says what to do (set $CXX or install one)."""
    from treeattn import _native

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found \(set \$CXX"):
        _native._compiler()


@pytest.mark.slow
def test_cpu_kernel_cache_is_reused(monkeypatch, tmp_path):
    """The kernel is built once per (source, jax, compiler, flags, CPU) into the cache dir."""
    from treeattn import _native

    monkeypatch.setenv("TREEATTN_CACHE_DIR", str(tmp_path))
    first = _native._build()
    assert first.parent == tmp_path and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert _native._build() == first and first.stat().st_mtime_ns == stamp
    # The library, its manifest and its lock; no temporary left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        first.with_suffix(suffix).name for suffix in (".so", ".json", ".lock")
    )


def test_cpu_kernel_threads_over_batch_and_heads(getkey):
    """Many (batch row, kv head) items, shared between the caller and XLA's thread pool."""
    q, k, v = make_decode_qkv(getkey, 5, 2, 12, 3, 150, 16)
    kv_length = jnp.asarray([150, 1, 0, 77, 129])
    flash_vs_numpy(q, k, v, kv_length=kv_length, q_offset=kv_length - 2, causal=True, backend="cpu")


def test_cpu_kernel_under_vmap(getkey):
    """vmap over a batch of caches folds into the kernel's batch axis (one call, no loop); over
    queries that share one cache, calls run in turn. Both match the XLA kernel, gradients too."""
    q = jax.random.normal(getkey(), (3, 2, 1, 4, 8))  # [vmap, batch, q_seq, heads, dim]
    k = jax.random.normal(getkey(), (3, 2, 20, 2, 8))  # [vmap, batch, kv_seq, kv_heads, dim]
    v = jax.random.normal(getkey(), (3, 2, 20, 2, 8))
    lengths = jnp.asarray([[20, 5], [3, 0], [11, 17]])

    def batched(backend):
        return jax.vmap(lambda q, k, v, n: flash_attention(q, k, v, kv_length=n, backend=backend))

    def shared(backend):
        return jax.vmap(lambda q: flash_attention(q, k[0], v[0], kv_length=9, backend=backend))

    jaxpr = str(jax.make_jaxpr(batched("cpu"))(q, k, v, lengths))
    assert jaxpr.count("ffi_call") == 1 and "while" not in jaxpr
    for got, want in [
        (batched("cpu")(q, k, v, lengths), batched("xla")(q, k, v, lengths)),
        (shared("cpu")(q), shared("xla")(q)),
    ]:
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def loss(backend, q, k, v):
        return jnp.sum(jnp.sin(flash_attention(q, k, v, causal=True, backend=backend)[0]))

    for a, b in zip(
        jax.vmap(jax.grad(functools.partial(loss, "cpu"), (0, 1, 2)))(q, k, v),
        jax.vmap(jax.grad(functools.partial(loss, "xla"), (0, 1, 2)))(q, k, v),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# One C++ kernel compilation per example: at most 8, fewer where the profile asks for fewer.
@settings(max_examples=min(8, settings.default.max_examples))
@given(
    batch=st.integers(1, 3),
    q_seq=st.integers(1, 4),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    kv_seq=st.integers(1, 1100),  # across the kernel's 512-key blocks
    fill=st.floats(0.0, 1.0),
    causal=st.booleans(),
    layout=st.sampled_from(["bshd", "bhsd"]),
    seed=st.integers(0, 2**16),
)
def test_cpu_kernel_matches_numpy(
    batch, q_seq, kv_heads, group, kv_seq, fill, causal, layout, seed
):
    """The C++ kernel against float64 NumPy over random shapes, fills and masks."""
    keys = iter(jax.random.split(jax.random.key(seed), 3))
    q, k, v = make_decode_qkv(
        lambda: next(keys), batch, q_seq, kv_heads * group, kv_heads, kv_seq, 8
    )
    k = k * 3.0  # peaked softmax: rescaling across blocks matters
    kv_length = jnp.asarray([round(fill * kv_seq)] * batch) - jnp.arange(batch) % 2
    flash_vs_numpy(
        q,
        k,
        v,
        kv_length=kv_length,
        q_offset=kv_length - q_seq,
        causal=causal,
        layout=layout,
        backend="cpu",
    )


# ---------------------------------------------------------------------------------------------
# Sliding windows, boolean masks and additive biases
# ---------------------------------------------------------------------------------------------


WINDOWS = [(2, 1), (0, 0), (5, 0), (3, 30)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "backend, block", [("xla", None), ("xla", 4), ("cpu", None), ("reference", None)]
)
def test_local_window_matches_numpy(backend, block, causal, window, getkey):
    """A sliding window by absolute position (jax's local_window_size), with causality, a
    partly filled cache, queries after it and GQA; blockwise and dense XLA, C++ and reference."""
    batch, q_seq, heads, kv_heads, kv_seq, dim = 2, 3, 4, 2, 21, 8
    q, k, v = make_decode_qkv(getkey, batch, q_seq, heads, kv_heads, kv_seq, dim)
    kv_length = np.asarray([21, 12])
    q_offset = kv_length - q_seq
    # Each (backend, causal) sees both cache layouts, on alternate windows.
    for layout in [("bshd", "bhsd")[WINDOWS.index(window) % 2]]:
        out, lse = flash_attention(
            q,
            to_layout(k, layout),
            to_layout(v, layout),
            causal=causal,
            q_offset=jnp.asarray(q_offset),
            kv_length=jnp.asarray(kv_length),
            kv_layout=layout,
            local_window_size=window,
            backend=backend,
            block_size=block,
        )
        vis = ref.decode_visible(
            batch,
            q_seq,
            heads,
            kv_seq,
            kv_length=kv_length,
            q_offset=q_offset,
            causal=causal,
            window=window,
            mask=None,
        )
        check_out_lse(out, lse, *ref.decode_attention(q, k, v, vis), jnp.float32)


def test_local_window_int_is_symmetric_and_checked(getkey):
    q, k, v = make_decode_qkv(getkey, 1, 6, 2, 2, 6, 8)
    a, _ = flash_attention(q, k, v, local_window_size=2, backend="xla")
    b, _ = flash_attention(q, k, v, local_window_size=(2, 2), backend="xla")
    np.testing.assert_array_equal(a, b)
    for bad in ((-1, 0), (1, 2, 3), 1.5, True):
        with pytest.raises(ValueError, match="local_window_size"):
            flash_attention(q, k, v, local_window_size=bad)


MASK_SHAPES = [(2, 4, 5, 13), (1, 1, 5, 13), (4, 1, 13), (5, 13), (2, 1, 1, 13)]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("backend, block", [("xla", None), ("xla", 4), ("reference", None)])
def test_mask_and_bias_match_numpy(backend, block, mask_shape, getkey):
    """Boolean masks and additive biases broadcast to [batch, heads, q_seq, kv_seq] as jax's
    are, combined with causality, a partly filled cache and a window; a fully masked row
    gives (0, -inf)."""
    batch, q_seq, heads, kv_heads, kv_seq, dim = 2, 5, 4, 2, 13, 8
    q, k, v = make_decode_qkv(getkey, batch, q_seq, heads, kv_heads, kv_seq, dim)
    mask = jax.random.bernoulli(getkey(), 0.7, mask_shape)
    mask = mask.at[..., 0, :].set(False)  # query 0 sees no key at all
    bias = jax.random.normal(getkey(), mask_shape)
    kv_length, q_offset = np.asarray([13, 9]), np.asarray([8, 4])
    kw = dict(causal=True, q_offset=jnp.asarray(q_offset), kv_length=jnp.asarray(kv_length))
    out, lse = flash_attention(
        q, k, v, mask=mask, bias=bias, backend=backend, block_size=block, **kw
    )
    vis = ref.decode_visible(
        batch,
        q_seq,
        heads,
        kv_seq,
        kv_length=kv_length,
        q_offset=q_offset,
        causal=True,
        window=None,
        mask=mask,
    )
    check_out_lse(out, lse, *ref.decode_attention(q, k, v, vis, bias), jnp.float32)
    assert not np.any(np.asarray(out[:, 0])) and np.all(np.isneginf(lse[:, 0]))
    windowed, _ = flash_attention(
        q, k, v, mask=mask, local_window_size=(2, 0), backend=backend, block_size=block, **kw
    )
    vis_w = vis & ref.decode_visible(
        batch,
        q_seq,
        heads,
        kv_seq,
        kv_length=kv_length,
        q_offset=q_offset,
        causal=True,
        window=(2, 0),
        mask=None,
    )
    assert ref.rel_err(windowed, ref.decode_attention(q, k, v, vis_w)[0]) <= TOL[jnp.float32]


@pytest.mark.parametrize("bias_shape", [(2, 4, 3, 10), (1, 4, 1, 10), (3, 10)], ids=str)
@pytest.mark.parametrize("block", [None, 4])
def test_bias_gradient_matches_reference(block, bias_shape, getkey):
    """The bias is differentiable through the shared blockwise backward (summed over the axes
    it broadcasts along), as are q, k, v with a mask and a window."""
    q, k, v = make_decode_qkv(getkey, 2, 3, 4, 2, 10, 8)
    bias = jax.random.normal(getkey(), bias_shape)
    mask = jax.random.bernoulli(getkey(), 0.8, (2, 1, 3, 10))
    w = jax.random.normal(getkey(), (2, 3, 4, 8))

    def loss(backend, q, k, v, bias):
        out, lse = flash_attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            causal=True,
            q_offset=7,
            local_window_size=(4, 0),
            backend=backend,
            block_size=block,
        )
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0))

    got = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = jax.grad(functools.partial(loss, "reference"), argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert got[3].shape == bias_shape
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_mask_bias_checks_and_refusals(getkey):
    q, k, v = make_decode_qkv(getkey, 2, 1, 4, 2, 16, 8)
    with pytest.raises(ValueError, match=r"mask must broadcast to \[batch, heads, q_seq, kv_seq"):
        flash_attention(q, k, v, mask=jnp.ones((3, 16), bool))
    with pytest.raises(ValueError, match="mask must be boolean"):
        flash_attention(q, k, v, mask=jnp.ones((1, 16)))
    with pytest.raises(ValueError, match="bias must be a floating-point array"):
        flash_attention(q, k, v, bias=jnp.ones((1, 16), jnp.int32))
    mask = jnp.ones((1, 16), bool)
    for backend in ("cpu", "pallas"):
        with pytest.raises(BackendUnavailable, match="mask"):
            flash_attention(q, k, v, mask=mask, backend=backend)
    with pytest.raises(BackendUnavailable, match="local_window_size"):
        flash_attention(q, k, v, local_window_size=3, backend="pallas")
    # "auto" falls back to a kernel that takes them.
    dims_kw = dict(causal=False, has_length=False, q_offset=0)
    from treeattn._numerics import Dims

    dims = Dims(1, 16, 4, 2, 8, 8, batch=2)
    assert select_backend("auto", dims, jnp.float32, has_mask=True, **dims_kw) == "xla"
    assert select_backend("auto", dims, jnp.float32, has_bias=True, **dims_kw) == "xla"
    assert select_backend("auto", dims, jnp.float32, window=(3, 0), **dims_kw) == "cpu"


@pytest.mark.parametrize("kind", ["tree", "ring"])
@pytest.mark.parametrize("p", [3, 4])
def test_tree_and_ring_with_window_mask_and_bias(kind, p, getkey):
    """A sliding window, a mask and a bias over a sharded cache of 22 slots (padded to 24),
    queries at the end of each row's filled part: every shard applies the window by absolute
    position and its own slice of the mask and bias (the C++ kernel: the window only)."""
    batch, q_seq, heads, kv_heads, kv_seq, dim = 2, 2, 4, 2, 22, 8
    q, k, v = make_decode_qkv(getkey, batch, q_seq, heads, kv_heads, kv_seq, dim)
    kv_length = np.asarray([22, 15])
    mask = jax.random.bernoulli(getkey(), 0.8, (batch, 1, q_seq, kv_seq))
    bias = jax.random.normal(getkey(), (1, heads, q_seq, kv_seq))
    window = (6, 0)
    for backend in ("xla", "reference", "cpu"):
        kw = dict(kv_length=jnp.asarray(kv_length), causal=True, local_window_size=window)
        kw.update(backend=backend)
        if backend != "cpu":
            kw.update(mask=mask, bias=bias)
        out = decode_fn(kind, p, kv_layout="bhsd", **kw)(
            q, to_layout(k, "bhsd"), to_layout(v, "bhsd")
        )
        vis = ref.decode_visible(
            batch,
            q_seq,
            heads,
            kv_seq,
            kv_length=kv_length,
            q_offset=kv_length - q_seq,
            causal=True,
            window=window,
            mask=None if backend == "cpu" else mask,
        )
        expected, _ = ref.decode_attention(q, k, v, vis, None if backend == "cpu" else bias)
        assert ref.rel_err(out, expected) <= TOL[jnp.float32], backend
