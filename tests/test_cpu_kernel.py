"""The C++ kernels of `treeattn/_cpu_kernel.cc` against float64 NumPy.

Decode attention: head dims that are a multiple of the vector width (16 floats with AVX-512, 8
with AVX2, 4 otherwise) take the tiled paths: query rows in tiles of up to 4 (AVX-512) or 2,
keys one at a time for head dims of 64 and 128 and otherwise 4 at a time plus a tail of 1-3
(keys of 32 by lanes on AVX-512; with AVX512-BF16, bfloat16 keys of 32 and 64 through its dot
products, 4 at a time), with more rows than a tile the tiles in turns over sub-blocks, value
columns in tiles of 8, 4, 3, 2 or 1 vectors (with AVX512-BF16, bfloat16 values of a multiple of
32 in pairs of keys through its dot products, where no weight of the tile is 0, a block of an
odd number of keys ending in half a pair; else widened); blocks of 512 keys that every row
sees end to end skip the per-key visibility test; a sequence with few kv heads has its keys
split over the threads and merged. The few-row products: rows in register groups, weights in
tiles, several weights per call. The shapes below cross each of these boundaries; the other
tests of the decode kernel (tests/test_decode.py) use head dims of 8 and 16.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TOL, to_layout

from treeattn._native import load_kernel
from treeattn.decode import flash_attention
from treeattn.models import PackedWeight
from treeattn.models._layers import _native


KV_SEQ = 1103  # blocks of 512, 512 and 79 keys: groups of 4 keys end in a tail of 3


# One sequence with one kv head: the keys it reads are split over the threads (ranges of at
# least 1024 keys: 3 splits causal, 2 in the window) and the splits merged. Shuffled positions
# (all 4,700 slots read, 4 splits) give every split keys every row sees and keys none sees.
SPLIT_SEQ = 4700


def inputs(seed, batch, q_seq, heads, kv_heads, qk, dv, dtype, *, sharp=3.0, kv_seq=KV_SEQ):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_seq, heads, qk))
    k = sharp * rng.standard_normal((batch, kv_seq, kv_heads, qk))  # peaked: rescaling matters
    v = rng.standard_normal((batch, kv_seq, kv_heads, dv))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def check(got, want, dtype):
    out, lse = got
    want_out, want_lse = want
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert ref_err(out, want_out) <= TOL[dtype]
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-4)


def ref_err(actual, expected):
    actual = np.asarray(actual, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


# (group, q_seq, qk, dv, dtype, layout, causal): rows = group * q_seq across 1..2 tiles and a
# remainder, qk = 64 and 128 (unrolled) and others, dv in tiles of 8, 4 and 1 vectors.
CASES = [
    (3, 1, 64, 64, jnp.float32, "bhsd", True),  # a small model's GQA decode step
    (1, 1, 128, 128, jnp.bfloat16, "bshd", True),
    (4, 1, 32, 32, jnp.float32, "bshd", False),
    (5, 1, 64, 64, jnp.bfloat16, "bhsd", True),
    (2, 3, 16, 48, jnp.float32, "bhsd", True),
    (1, 7, 64, 128, jnp.float32, "bshd", True),
    (2, 1, 64, 128, jnp.float32, "bhsd", True),  # whole value rows in one pass
    (3, 2, 128, 64, jnp.bfloat16, "bshd", False),
    (8, 1, 32, 32, jnp.bfloat16, "bhsd", True),  # bfloat16 dot products, 4 keys and a tail
    (3, 1, 64, 64, jnp.bfloat16, "bshd", False),  # the same, 3-row tiles, keys kv_heads apart
    (1, 1, 32, 256, jnp.bfloat16, "bshd", True),  # bfloat16 values in pairs of keys, one pass
    (2, 1, 64, 256, jnp.bfloat16, "bhsd", True),  # the same in two column tiles
    (7, 1, 32, 32, jnp.bfloat16, "bhsd", True),  # the same, tiles of 4 and 3 rows
    (6, 1, 32, 32, jnp.bfloat16, "bshd", False),  # tiles of 4 and 2 rows
    (1, 1, 32, 96, jnp.bfloat16, "bhsd", True),  # three column tiles of 32
    (3, 1, 64, 128, jnp.bfloat16, "bhsd", True),  # two column tiles of 64 for 3 rows
    (8, 1, 32, 32, jnp.float32, "bshd", True),  # keys by rows (8 rows), sub-blocks, a tail
    (4, 2, 32, 32, jnp.float32, "bhsd", True),  # the same, 8 rows of two queries
    (8, 2, 32, 64, jnp.float32, "bhsd", False),  # the same, two tiles of 8 rows
    (8, 1, 32, 32, jnp.float32, "bhsd", False),  # by rows, keys 32 apart, values 8 rows at once
    (8, 2, 32, 32, jnp.float32, "bhsd", False),  # the same, two tiles of 8 rows by sub-blocks
    (3, 2, 24, 20, jnp.float32, "bhsd", True),  # tiles in turns, with the scalar loops
    (7, 1, 32, 32, jnp.float32, "bhsd", True),  # keys by lanes in tiles of 4 and 3 rows
    (2, 1, 32, 32, jnp.float32, "bshd", False),  # in one tile of 2 rows
    (5, 1, 32, 256, jnp.float32, "bhsd", True),  # sub-blocks sized by the wider value rows
]


@pytest.mark.parametrize(
    "group, q_seq, qk, dv, dtype, layout, causal",
    CASES,
    ids=[f"g{c[0]}-q{c[1]}-{c[2]}x{c[3]}-{jnp.dtype(c[4]).name}-{c[5]}" for c in CASES],
)
def test_tiles_match_numpy(group, q_seq, qk, dv, dtype, layout, causal):
    """Two batch rows of different fill (the first block-aligned tail, the second mid-block),
    queries at the end of the fill, two kv heads."""
    kv_heads, batch = 2, 2
    q, k, v = inputs(group * 7 + qk + dv, batch, q_seq, group * kv_heads, kv_heads, qk, dv, dtype)
    kv_length = np.array([KV_SEQ, 600])
    q_offset = kv_length - q_seq
    got = flash_attention(
        q,
        to_layout(k, layout),
        to_layout(v, layout),
        kv_length=jnp.asarray(kv_length),
        q_offset=jnp.asarray(q_offset),
        causal=causal,
        kv_layout=layout,
        backend="cpu",
    )
    vis = ref.decode_visible(
        batch,
        q_seq,
        group * kv_heads,
        KV_SEQ,
        kv_length=kv_length,
        q_offset=q_offset,
        causal=causal,
        window=None,
        mask=None,
    )
    out, lse = ref.decode_attention(q, k, v, vis)
    check(got, (out, lse), dtype)


def windowed(q, k, v, *, kv_length, q_offset, window, shuffle):
    """(the cpu kernel's (out, lse), float64 NumPy's) for causal queries at `q_offset` over a
    bhsd cache of `kv_length` tokens (each an int, or one per batch row) and a sliding `window`
    (None: none); `shuffle`: the cache's slots hold the positions in a random order
    (`kv_positions`)."""
    batch, q_seq, heads = q.shape[:3]
    kv_seq = k.shape[1]
    kv_length = np.broadcast_to(np.asarray(kv_length), (batch,))
    q_offset = np.broadcast_to(np.asarray(q_offset), (batch,))
    vis = ref.decode_visible(
        batch,
        q_seq,
        heads,
        kv_seq,
        kv_length=kv_length,
        q_offset=q_offset,
        causal=True,
        window=window,
        mask=None,
    )
    want = ref.decode_attention(q, k, v, vis)
    kw = {}
    if shuffle:
        perm = np.random.default_rng(0).permutation(kv_seq)  # slot s holds position perm[s]
        k, v, kw = k[:, perm], v[:, perm], {"kv_positions": jnp.asarray(perm)}
    got = flash_attention(
        q,
        to_layout(k, "bhsd"),
        to_layout(v, "bhsd"),
        kv_length=jnp.asarray(kv_length),
        q_offset=jnp.asarray(q_offset),
        causal=True,
        local_window_size=window,
        kv_layout="bhsd",
        backend="cpu",
        **kw,
    )
    return got, want


@pytest.mark.parametrize("positions", [False, True], ids=["slots", "kv_positions"])
@pytest.mark.parametrize("window", [(100, 0), (700, 20)], ids=str)
def test_windows_in_tiles(window, positions):
    """Sliding windows cut blocks (whole blocks skipped, partial ones tested per key), also
    with the cache's slots in a shuffled order of positions."""
    group, q_seq, kv_heads, d = 3, 2, 2, 64
    q, k, v = inputs(5, 1, q_seq, group * kv_heads, kv_heads, d, d, jnp.float32)
    got, want = windowed(q, k, v, kv_length=1000, q_offset=900, window=window, shuffle=positions)
    check(got, want, jnp.float32)


# (kv_seq, filled length, NaN from this slot on in K and V, and in this one slot of K only)
NAN_CASES = {
    "tile": (KV_SEQ, 1001, 1000, None),  # slot 1000 and every slot past the fill
    "split": (SPLIT_SEQ, 4601, None, 4600),  # the last of 4 splits of the keys
    "whole-groups": (KV_SEQ, 1024, 1023, None),  # splits of whole groups of 8 keys, no tail
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("where", list(NAN_CASES))
@pytest.mark.parametrize(
    "group, d", [(2, 64), (3, 32), (4, 32)], ids=["one-tile", "sub-blocks", "by-rows"]
)
def test_nan_reaches_only_the_rows_that_see_it(where, dtype, group, d):
    """Causal queries at the last two positions: a NaN key (and value) seen by the second only.
    In a tile, the first row weighs the slot 0 and must not read it; over splits of the keys,
    the merge gives the second row NaN. The first row is the attention over its keys. With 6
    rows of 32 the tiles take turns over sub-blocks and the keys go by lanes; with 8 in float32,
    by rows (the NaN key in a whole group of 8 with a fill of 1,024, in the tail with 1,001)."""
    kv_seq, length, from_slot, one_slot = NAN_CASES[where]
    q_seq = 2
    q, k, v = inputs(6, 1, q_seq, group, 1, d, d, dtype, kv_seq=kv_seq)
    clean_k, clean_v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    if from_slot is not None:
        k, v = (x.at[:, from_slot:].set(jnp.nan) for x in (k, v))
    if one_slot is not None:
        k = k.at[:, one_slot].set(jnp.nan)
    out, lse = flash_attention(
        q,
        to_layout(k, "bhsd"),
        to_layout(v, "bhsd"),
        kv_length=jnp.asarray([length]),
        q_offset=jnp.asarray([length - q_seq]),
        causal=True,
        kv_layout="bhsd",
        backend="cpu",
    )
    vis = ref.decode_visible(
        1,
        q_seq,
        group,
        kv_seq,
        kv_length=length,
        q_offset=length - q_seq,
        causal=True,
        window=None,
        mask=None,
    )
    want, want_lse = ref.decode_attention(q, clean_k, clean_v, vis)
    assert ref_err(out[:, 0], want[:, 0]) <= TOL[dtype]
    np.testing.assert_allclose(np.asarray(lse)[:, 0], want_lse[:, 0], rtol=1e-5)
    assert np.isnan(np.asarray(out[:, 1])).all() and np.isnan(np.asarray(lse[:, 1])).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nan_past_an_odd_fill_stays_out(dtype):
    """One query per kv head at the end of a fill of 1,001: the last block has 489 keys, all
    weighed (bfloat16 values go in pairs of keys, the last pair half empty), and NaN in every
    slot past the fill must not reach the output."""
    group, d, length = 3, 64, 1001
    q, k, v = inputs(8, 1, 1, group, 1, d, d, dtype)
    clean_k, clean_v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    k, v = (x.at[:, length:].set(jnp.nan) for x in (k, v))
    got = flash_attention(
        q,
        to_layout(k, "bhsd"),
        to_layout(v, "bhsd"),
        kv_length=jnp.asarray([length]),
        q_offset=jnp.asarray([length - 1]),
        causal=True,
        kv_layout="bhsd",
        backend="cpu",
    )
    vis = ref.decode_visible(
        1,
        1,
        group,
        KV_SEQ,
        kv_length=length,
        q_offset=length - 1,
        causal=True,
        window=None,
        mask=None,
    )
    check(got, ref.decode_attention(q, clean_k, clean_v, vis), dtype)


def test_weights_that_underflow_do_not_read_values():
    """Visible keys whose weight is exactly 0 in float32 (logits 200 below the max): their value
    rows are not read, so NaN there does not reach the output (its weight in float64 is
    e^-200); the other keys of the tile are weighed as usual."""
    d = 64
    q, k, v = inputs(7, 1, 1, 4, 1, d, d, jnp.float32, sharp=0.1)
    # The first query row's logit against key a is 8 (s * q.k with k = e_0 * 8 / (s q_0)),
    # minus 200 for every third key.
    scale = 1.0 / np.sqrt(d)
    qn = np.asarray(q, np.float64)
    low = np.arange(KV_SEQ) % 3 == 1
    logit = np.where(low, -200.0, 8.0)
    kn = np.asarray(k, np.float64)
    kn[0, :, 0, :] = 0.0
    kn[0, :, 0, 0] = logit / (scale * qn[0, 0, 0, 0])
    vn = np.asarray(v, np.float64)
    vn[0, low] = np.nan
    out, lse = flash_attention(
        q, jnp.asarray(kn, jnp.float32), jnp.asarray(vn, jnp.float32), backend="cpu"
    )
    # Rows 1..3 see other logits; keep only the keys the float32 weights keep for row 0, and
    # check every row that gives those keys a weight of exactly 0 in float32.
    x = scale * np.einsum("hd,sd->hs", qn[0, 0], kn[0, :, 0])
    w32 = np.exp(np.float32(x - x.max(axis=1, keepdims=True)))
    rows = np.nonzero((w32[:, low] == 0).all(axis=1))[0]
    assert 0 in rows
    for r in rows:
        e = np.exp(x[r, ~low] - x[r, ~low].max())
        want = e @ vn[0, ~low, 0] / e.sum()
        assert ref_err(out[0, 0, r], want) <= TOL[jnp.float32]
        np.testing.assert_allclose(lse[0, 0, r], x[r, ~low].max() + np.log(e.sum()), rtol=1e-6)


def test_exp_over_the_logit_range():
    """The kernel's exp (a polynomial, exact 0 below -87.3) across logits 0 .. -100: with one-hot
    values, the output is the softmax weights themselves, each within 2e-6 (relative) of float64
    where it is a normal float32, and 0 (not denormal garbage) far below."""
    n, d = 1008, 16  # n keys; dv = n so value a is the one-hot e_a
    x = np.float32(-np.linspace(0.0, 100.0, n)).astype(np.float64)  # exact in float32
    q = np.zeros((1, 1, 1, d))
    q[..., 0] = 1.0
    k = np.zeros((1, n, 1, d))
    k[0, :, 0, 0] = x
    v = np.eye(n)[None, :, None, :]
    out, lse = flash_attention(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v)), scale=1.0, backend="cpu"
    )
    w = np.exp(x) / np.exp(x).sum()
    got = np.asarray(out[0, 0, 0], np.float64)
    normal = w > 1e-37
    np.testing.assert_allclose(got[normal], w[normal], rtol=2e-6)
    assert (got[x < -88.0] == 0.0).all()
    np.testing.assert_allclose(float(lse[0, 0, 0]), np.log(np.exp(x).sum()), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "window, positions",
    [(None, False), ((2600, 0), False), ((900, 30), True)],
    ids=["causal", "window", "window-positions"],
)
def test_split_keys_match_numpy(window, positions, dtype):
    group, q_seq, d = 3, 2, 64
    q, k, v = inputs(8, 1, q_seq, group, 1, d, d, dtype, kv_seq=SPLIT_SEQ)
    got, want = windowed(q, k, v, kv_length=4321, q_offset=4000, window=window, shuffle=positions)
    check(got, want, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_split_keys_of_uneven_rows(dtype):
    """Two rows share one split count (4 on two threads or more, from the 4,321 keys the longer
    row reads): the shorter row reads 3 keys, one in each of its first 3 splits, and its last
    split is empty, which the merge must pass over."""
    group, q_seq, d = 3, 2, 64
    q, k, v = inputs(9, 2, q_seq, group, 1, d, d, dtype, kv_seq=SPLIT_SEQ)
    lengths, offsets = [4321, 3], [4319, 1]
    got, want = windowed(q, k, v, kv_length=lengths, q_offset=offsets, window=None, shuffle=False)
    check(got, want, dtype)


# The few-row products: rows in register groups of up to 8 (AVX-512; 4 otherwise) split evenly,
# weight rows in tiles of 4, 3, 2 or 1 plus a remainder (packed: tiles of 1-4 panels of 16, a
# partial last panel), inputs of whole vectors and with a tail, several weights in one call (a
# layer's q, k and v). Packed bfloat16 takes an even number of inputs.
PRODUCT_ROWS = [1, 2, 5, 8, 12, 17, 32]
PRODUCT_CASES = [
    (n_in, dtype, packed)
    for n_in in (64, 37, 576)
    for dtype in (jnp.float32, jnp.bfloat16)
    for packed in (False, True)
    if not (packed and dtype == jnp.bfloat16 and n_in % 2)
]


def pack_if(ws, packed):
    return tuple(PackedWeight.of(w) for w in ws) if packed else ws


@pytest.fixture(autouse=True)
def _kernel_registered():
    """Every test here runs the C++ kernels (the products call theirs directly): the library
    built and its targets registered first. A failed build fails them."""
    reason = load_kernel()
    assert reason is None, reason


@pytest.mark.parametrize(
    ("n_in", "dtype", "packed"),
    PRODUCT_CASES,
    ids=[f"{n}-{jnp.dtype(d).name}-{'packed' if p else 'rows'}" for n, d, p in PRODUCT_CASES],
)
@pytest.mark.parametrize("rows", PRODUCT_ROWS)
def test_products_match_numpy(rows, n_in, dtype, packed):
    rng = np.random.default_rng(rows * 1000 + n_in)
    x = jnp.asarray(rng.standard_normal((rows, n_in)), dtype)
    outs = (5, 24, 130)
    ws = tuple(jnp.asarray(rng.standard_normal((o, n_in)), dtype) for o in outs)
    got = jax.jit(_native)(x, pack_if(ws, packed))
    for y, w, o in zip(got, ws, outs, strict=True):
        assert y.shape == (rows, o) and y.dtype == dtype
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        # One rounding of a float32 sum: bfloat16's half ulp, float32's over n_in terms.
        tol = 2.0**-8 if dtype == jnp.bfloat16 else 1e-6 * np.sqrt(n_in)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=tol * np.abs(want).max())


@pytest.mark.parametrize(
    ("rows", "n_in", "packed", "dtype"),
    [
        (3, 300, False, jnp.float32),
        (3, 300, True, jnp.float32),
        (40, 600, True, jnp.float32),
        (40, 1200, True, jnp.bfloat16),
    ],
    ids=["rows", "packed", "packed-blocks-f32", "packed-blocks-bf16"],
)
def test_products_of_a_large_weight_are_shared_by_the_threads(rows, n_in, packed, dtype):
    """Above 2^16 weight elements the rows of the weights are cut into chunks for the threads
    (whole 4-row tiles, or panels; a remainder in the last): every output element is written
    once. Packed, 40 rows (5 groups of 8) pass over blocks of 9 panels (345 KiB) in turn: with
    up to 8 threads a chunk of the 6,001-row weight's 376 panels holds several blocks, the
    last one partial."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, n_in)), dtype)
    ws = (
        jnp.asarray(rng.standard_normal((1001 if rows < 8 else 6001, n_in)), dtype),
        jnp.asarray(rng.standard_normal((7, n_in)), dtype),
    )
    for y, w in zip(jax.jit(_native)(x, pack_if(ws, packed)), ws, strict=True):
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        tol = 2.0**-8 if dtype == jnp.bfloat16 else 1e-6 * np.sqrt(n_in)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=tol * np.abs(want).max())


# The tests the narrow builds run: tiles, NaN, exp, splits, products.
EXPECTED_NARROW = len(CASES) + 18 + 1 + 6 + 2 + len(PRODUCT_ROWS) * len(PRODUCT_CASES) + 4
# -march for each target, and the registers its library must not use.
NARROW = {"avx2": ("x86-64-v3", ("%zmm",)), "sse4": ("x86-64-v2", ("%ymm", "%zmm"))}


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(NARROW))
def test_tiles_on_narrower_vector_units(target, tmp_path):
    """The same tiles built for AVX2 (8 lanes, 2-row tiles) and SSE4.2 (4 lanes) pass the tile
    tests in a child process, and the library holds no instruction on wider registers."""
    march, wider = NARROW[target]
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or " avx2" not in (
        cpuinfo.read_text() if cpuinfo.exists() else ""
    ):
        pytest.skip("needs an x86-64 host with AVX2")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or shutil.which("objdump") is None:
        pytest.skip("needs g++ and objdump")
    wrapper = tmp_path / "cxx"  # the host compiler, with -march=native replaced
    wrapper.write_text(
        '#!/usr/bin/env bash\nargs=()\nfor a in "$@"; do\n'
        f'  [[ $a == -march=native ]] && a=-march={march}\n  args+=("$a")\ndone\n'
        f'exec {cxx} "${{args[@]}}"\n'
    )
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    env = {**os.environ, "CXX": str(wrapper), "TREEATTN_CACHE_DIR": str(cache)}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist"]
        + ["-k", "tiles_match or nan_reaches or exp_over or split_keys or products", __file__],
        env=env,
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert f"{EXPECTED_NARROW} passed" in child.stdout, child.stdout[-1000:]
    (manifest,) = cache.glob("cpu_kernel_*.json")
    assert json.loads(manifest.read_text())["compiler"] == [str(wrapper)]
    asm = subprocess.run(
        ["objdump", "-d", str(manifest.with_suffix(".so"))], capture_output=True, text=True
    ).stdout
    assert "vfmadd" in asm or target == "sse4"  # the tiles' fused multiply-adds
    assert not [line for line in asm.splitlines() if any(r in line for r in wider)]
