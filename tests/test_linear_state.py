"""LinearState: the decoding state of normalised linear attention against a float64 NumPy
reference and against `energy_attention(energy=LinearKernel())`; a sum monoid (shards add,
in any order; one psum across devices); causal chunks after a state; no keys gives 0;
position-aware features (cosFormer) at the tokens' positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL, mesh_of
from hypothesis import given, strategies as st
from jax.sharding import PartitionSpec as P

from treeattn.energy import (
    CosFormer,
    LinearKernel,
    LinearState,
    allreduce_sum,
    energy_attention,
)
from treeattn.models import MultiheadAttention


def np_phi(x):
    x = np.asarray(x, np.float64)
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))  # elu + 1


def np_linear_attention(q, k, v, *, keep=None, causal_from=None):
    """Float64: o = sum_a w_a v_a / sum_a w_a, w_a = phi(q).phi(k_a), over the kept keys;
    `causal_from=c`: query i sees keys up to c + i."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    t, h, _ = q.shape
    n, hk, _ = k.shape
    g = h // hk
    out = np.zeros((t, h, v.shape[-1]))
    for i in range(t):
        for head in range(h):
            kh = head // g
            w = np_phi(k[:, kh]) @ np_phi(q[i, head])
            seen = np.ones(n, bool) if keep is None else np.asarray(keep).copy()
            if causal_from is not None:
                seen &= np.arange(n) <= causal_from + i
            w = np.where(seen, w, 0.0)
            if w.sum() > 0:
                out[i, head] = w @ v[:, kh] / w.sum()
    return out


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)


@pytest.mark.parametrize(
    "dtype,heads,kv_heads",
    [(jnp.float32, 2, 2), (jnp.float32, 6, 2), (jnp.bfloat16, 4, 1)],
)
def test_attend_is_linear_attention_over_the_keys(dtype, heads, kv_heads, getkey):
    n, t, d, dv = 11, 3, 8, 5
    q = jax.random.normal(getkey(), (t, heads, d), dtype)
    k = jax.random.normal(getkey(), (n, kv_heads, d), dtype)
    v = jax.random.normal(getkey(), (n, kv_heads, dv), dtype)
    keep = jax.random.bernoulli(getkey(), 0.7, (n,))
    state = LinearState.from_keys(k, v, mask=keep)
    assert state.S.shape == (kv_heads, d, dv) and state.z.shape == (kv_heads, d)
    assert state.S.dtype == jnp.float32  # accumulated in float32 whatever the keys' dtype
    out = state.attend(q)
    assert out.dtype == dtype and out.shape == (t, heads, dv)
    want = np_linear_attention(q, k, v, keep=np.asarray(keep))
    assert rel(out, want) < TOL[dtype]
    # the energy path over the same keys
    mask = jnp.broadcast_to(keep, (t, n))
    ref = energy_attention(q, k, v, mask=mask, energy=LinearKernel())
    assert rel(out, ref) < TOL[dtype]


def test_length_mask_and_update_agree(getkey):
    k = jax.random.normal(getkey(), (9, 2, 4))
    v = jax.random.normal(getkey(), (9, 2, 3))
    a = LinearState.from_keys(k, v, length=5)
    b = LinearState.from_keys(k[:5], v[:5])
    c = LinearState.empty(2, 4, 3).update(k, v, mask=jnp.arange(9) < 5)
    for s in (a, c):  # float32 sums in another order: a few ulps apart
        np.testing.assert_allclose(s.S, b.S, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s.z, b.z, rtol=1e-5, atol=1e-6)


def test_no_keys_gives_zero_and_masked_nan_never_enters(getkey):
    q = jax.random.normal(getkey(), (2, 4, 4))
    empty = LinearState.empty(2, 4, 3)
    np.testing.assert_array_equal(empty.attend(q), 0.0)
    k = jax.random.normal(getkey(), (3, 2, 4)).at[2].set(jnp.nan)
    v = jax.random.normal(getkey(), (3, 2, 3)).at[2].set(jnp.inf)
    state = LinearState.from_keys(k, v, mask=jnp.array([True, True, False]))
    out = state.attend(q)
    assert np.all(np.isfinite(out))
    assert rel(out, np_linear_attention(q, k[:2], v[:2])) < TOL[jnp.float32]
    none = LinearState.from_keys(k, v, mask=jnp.zeros(3, bool))
    np.testing.assert_array_equal(none.attend(q), 0.0)


_from_keys = jax.jit(lambda k, v: LinearState.from_keys(k, v))
K = jax.random.normal(jax.random.key(1), (4, 3, 2, 4))  # 4 blocks of 3 keys
V = jax.random.normal(jax.random.key(2), (4, 3, 2, 3))


@given(st.permutations(range(4)))
def test_states_of_blocks_add_in_any_order(order):
    whole = _from_keys(K.reshape(12, 2, 4), V.reshape(12, 2, 3))
    total = _from_keys(K[order[0]], V[order[0]])
    for i in order[1:]:
        total = total + _from_keys(K[i], V[i])
    np.testing.assert_allclose(total.S, whole.S, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(total.z, whole.z, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,before", [(1, 4), (3, 0), (64, 4)])
def test_causal_chunk_after_a_state(block_size, before, getkey):
    n, heads, kv_heads = 10, 4, 2
    q = jax.random.normal(getkey(), (before + n, heads, 8))
    k = jax.random.normal(getkey(), (before + n, kv_heads, 8))
    v = jax.random.normal(getkey(), (before + n, kv_heads, 6))
    keep = jnp.arange(n) < n - 2  # the last two tokens are padding: not absorbed
    state = LinearState.from_keys(k[:before], v[:before])
    out, new = state.attend_causal(
        q[before:], k[before:], v[before:], mask=keep, block_size=block_size
    )
    full_keep = np.concatenate([np.ones(before, bool), np.asarray(keep)])
    want = np_linear_attention(q[before:], k, v, keep=full_keep, causal_from=before)
    assert rel(out[: n - 2], want[: n - 2]) < TOL[jnp.float32]
    ref = energy_attention(q, k, v, causal=True, energy=LinearKernel())[before:]
    assert rel(out[: n - 2], ref[: n - 2]) < 2e-5
    whole = LinearState.from_keys(k, v, length=before + n - 2)
    np.testing.assert_allclose(new.S, whole.S, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.z, whole.z, rtol=1e-5, atol=1e-5)


def test_a_sharded_state_is_one_psum(getkey):
    p = 4
    mesh = mesh_of(p)
    k = jax.random.normal(getkey(), (8 * p, 2, 4))
    v = jax.random.normal(getkey(), (8 * p, 2, 3))
    q = jax.random.normal(getkey(), (1, 4, 4))

    def local(k, v):
        return allreduce_sum(LinearState.from_keys(k, v), axis_name="kv")

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("kv"), P("kv")), out_specs=P()))
    state = sharded(k, v)
    text = sharded.lower(k, v).compile().as_text() or ""
    assert text.count("all-reduce(") + text.count("all-reduce-start(") == 1
    want = np_linear_attention(q, k, v)
    assert rel(state.attend(q), want) < TOL[jnp.float32]


def test_a_custom_feature_map_and_argument_errors(getkey):
    def relu_features(x):
        return jnp.concatenate([jax.nn.relu(x), jax.nn.relu(-x)], axis=-1)  # 2x features

    energy = LinearKernel(feature_map=relu_features)
    q = jax.random.normal(getkey(), (2, 2, 4))
    k = jax.random.normal(getkey(), (7, 2, 4))
    v = jax.random.normal(getkey(), (7, 2, 3))
    state = LinearState.from_keys(k, v, energy=energy)
    assert state.S.shape == (2, 8, 3) and state.energy == energy
    ref = energy_attention(q, k, v, energy=energy)
    assert rel(state.attend(q), ref) < 2e-5
    with pytest.raises(ValueError, match="kv heads"):
        state.update(k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="multiple of kv_heads=2"):
        state.attend(q[:, :1].repeat(3, axis=1))
    with pytest.raises(ValueError, match="must be a LinearKernel"):
        LinearState.empty(2, 4, 3, energy="elu")  # pyright: ignore[reportArgumentType]


def np_cosformer(q, k, v, q_pos, k_pos, horizon):
    """Float64: o_i = sum_a w_ia v_a / sum_a w_ia with w_ia = relu(q_i).relu(k_a)
    cos(pi/2 (i - a) / M), over the keys at positions <= i."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    for i in range(q.shape[0]):
        for head in range(q.shape[1]):
            kh = head // g
            w = np.maximum(k[:, kh], 0) @ np.maximum(q[i, head], 0)
            w = w * np.cos(0.5 * np.pi * (q_pos[i] - np.asarray(k_pos)) / horizon)
            w = np.where(np.asarray(k_pos) <= q_pos[i], w, 0.0)
            if w.sum() > 0:
                out[i, head] = w @ v[:, kh] / w.sum()
    return out


def test_cosformer_state_reads_positions(getkey):
    """The state of keys at their positions, built in two blocks, attends as cosFormer does
    (NumPy, and `energy_attention` over the keys); a causal chunk after it too."""
    horizon, n, heads, kv_heads = 24, 20, 4, 2
    energy = CosFormer(horizon)
    q = jax.random.normal(getkey(), (n + 3, heads, 8))
    k = jax.random.normal(getkey(), (n, kv_heads, 8))
    v = jax.random.normal(getkey(), (n, kv_heads, 5))
    at = jnp.arange(n, dtype=jnp.int32)
    first = LinearState.from_keys(k[:7], v[:7], energy=energy, positions=at[:7])
    state = first + LinearState.from_keys(k[7:], v[7:], energy=energy, positions=at[7:])
    assert state.S.shape == (kv_heads, 16, 5)  # features [relu cos, relu sin]
    q_at = jnp.arange(n, n + 3, dtype=jnp.int32)  # three queries after the keys
    out = state.attend(q[n:], positions=q_at)
    want = np_cosformer(q[n:], k, v, np.asarray(q_at), np.arange(n), horizon)
    assert rel(out, want) < TOL[jnp.float32]
    ref = energy_attention(q[n:], k, v, causal=True, q_offset=n, energy=energy)
    assert rel(out, ref) < 2e-5
    # The same keys at other positions give other outputs: the positions are read.
    moved = LinearState.from_keys(k, v, energy=energy, positions=at + 3)
    assert rel(moved.attend(q[n:], positions=q_at), want) > 1e-3
    # A causal chunk of tokens 7..19 after the state of the first 7.
    chunk, new = first.attend_causal(q[7:n], k[7:], v[7:], positions=at[7:], block_size=4)
    want = np_cosformer(q[7:n], k, v, np.arange(7, n), np.arange(n), horizon)
    assert rel(chunk, want) < TOL[jnp.float32]
    np.testing.assert_allclose(new.S, state.S, rtol=1e-5, atol=1e-5)


def test_cosformer_errors(getkey):
    k = jax.random.normal(getkey(), (3, 1, 4))
    with pytest.raises(ValueError, match="positions=\\[3\\]"):
        LinearState.from_keys(k, k, energy=CosFormer(8))
    with pytest.raises(ValueError, match="positions must be integer"):
        LinearState.from_keys(k, k, energy=CosFormer(8), positions=jnp.zeros(3))
    with pytest.raises(ValueError, match="horizon must be a positive int"):
        CosFormer(0)
    # states under other features do not add
    a = LinearState.from_keys(k, k, energy=CosFormer(8), positions=jnp.arange(3))
    b = LinearState.from_keys(k, k, energy=CosFormer(9), positions=jnp.arange(3))
    with pytest.raises(TypeError):
        _ = a + b
    # a cache whose positions reach past the horizon is refused
    layer = MultiheadAttention(2, 8, causal=True, energy=CosFormer(8), key=getkey())
    assert layer.init_cache(8).max_len == 8  # distances up to 7: cos(pi/2 7/8) > 0
    with pytest.raises(ValueError, match="up to a distance of 7 tokens"):
        layer.init_cache(9)


def test_a_state_built_from_a_feature_map_still_works(getkey):
    """`LinearState(S, z, feature_map=f)` (the constructor before states held an energy)."""
    k = jax.random.normal(getkey(), (5, 2, 4))
    v = jax.random.normal(getkey(), (5, 2, 3))
    state = LinearState.from_keys(k, v)
    with pytest.warns(DeprecationWarning, match="energy=LinearKernel"):
        old = LinearState(state.S, state.z, feature_map=state.feature_map)
    with pytest.warns(DeprecationWarning, match="energy=LinearKernel"):
        assert LinearState(state.S, state.z, state.feature_map).serves(LinearKernel())
    assert old.serves(LinearKernel()) and (old + state).S.shape == state.S.shape
    with pytest.raises(ValueError, match="not both"):
        LinearState(state.S, state.z, LinearKernel(), feature_map=state.feature_map)
