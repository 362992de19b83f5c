"""treeattn.models: layers, the Llama decoder, KV caches, every backend giving one answer."""

import contextlib
import dataclasses
import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import backend_of, mesh_of, tree

from treeattn.energy import LinearKernel
from treeattn.models import (
    AttentionBackend,
    KVCache,
    LlamaConfig,
    MultiheadAttention,
    RMSNorm,
    RotaryEmbedding,
    Transformer,
    decode_step,
    generate,
    prefill,
)


SMALL = LlamaConfig(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@functools.lru_cache
def small_model(dtype=jnp.float32):
    return Transformer(SMALL, dtype=dtype, key=jax.random.key(0))


@eqx.filter_jit
def full_pass(model, tokens):
    """One causal pass over `tokens`, no cache, on the reference backend (compiled once)."""
    return model(tokens, backend="reference")


# ---------------------------------------------------------------------------------------------
# MultiheadAttention as a drop-in for equinox.nn.MultiheadAttention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["energy", "reference", "flash"])
def test_gqa_causal_rotary_cache_equals_full_call(backend, getkey):
    """Feeding a sequence in chunks through a KV cache equals one causal call over all of it:
    bottom-right causality and rotary embeddings at absolute positions."""
    mha = MultiheadAttention(
        8, 32, num_kv_heads=2, causal=True, rotary=RotaryEmbedding(4), backend=backend, key=getkey()
    )
    x = jax.random.normal(getkey(), (11, 32))
    full = mha(x, x, x)
    cache = KVCache.create(2, 16, 4)
    outs = []
    for chunk in (x[:4], x[4:5], x[5:9], x[9:]):
        out, cache = mha(chunk, chunk, chunk, cache=cache)
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs), full, rtol=1e-5, atol=1e-6)
    assert int(cache.length) == 11


@pytest.mark.parametrize("backend", ["energy", "reference", "flash", "tree"])
def test_sliding_window_against_numpy_and_through_the_cache(backend, getkey):
    """`local_window_size=(left, right)`: query i sees keys j with i - left <= j <= i + right
    (and j <= i when causal), against float64 NumPy; fed through a KV cache in chunks (sharded
    round-robin for "tree"), a causal window gives the full call's outputs."""
    be = backend_of(backend)
    x = jax.random.normal(getkey(), (11, 16))
    i, j = np.arange(11)[:, None], np.arange(11)[None, :]
    for causal, window in ((True, (3, 0)), (False, (2, 1))):
        mha = MultiheadAttention(
            4, 16, num_kv_heads=2, causal=causal, local_window_size=window, backend=be,
            key=getkey(),
        )  # fmt: skip
        heads = [
            ref.f64(x) @ ref.f64(p.weight).T for p in (mha.query_proj, mha.key_proj, mha.value_proj)
        ]
        q, k, v = (h.reshape(11, -1, 4) for h in heads)
        seen = (i - j <= window[0]) & (j - i <= window[1]) & ((j <= i) | (not causal))
        expected = (
            ref.attention(q, k, v, mask=seen).reshape(11, 16) @ ref.f64(mha.output_proj.weight).T
        )
        assert ref.rel_err(eqx.filter_jit(mha)(x, x, x), expected) <= 1e-5, (causal, window)
    windowed = MultiheadAttention(
        4, 16, num_kv_heads=2, causal=True, local_window_size=(3, 0), rotary=RotaryEmbedding(4),
        backend=be, key=getkey(),
    )  # fmt: skip
    mesh = mesh_of(2) if backend == "tree" else None
    cache = KVCache.create(2, 16, 4, mesh=mesh, kv_axis="kv" if mesh else None, block=2)
    outs = []
    for chunk in (x[:4], x[4:5], x[5:]):  # a prefill, a step, a chunk across the window
        out, cache = eqx.filter_jit(windowed)(chunk, chunk, chunk, cache=cache)
        outs.append(out)
    full = eqx.filter_jit(windowed)(x, x, x)
    np.testing.assert_allclose(jnp.concatenate(outs), full, rtol=1e-5, atol=1e-6)


def test_dropout_is_refused_with_a_cache(getkey):
    """Attention dropout is for training; a KV cache is for inference."""
    mha = MultiheadAttention(2, 8, dropout_p=0.5, key=getkey())
    x = jax.random.normal(getkey(), (6, 8))
    with pytest.raises(ValueError, match="dropout"):
        mha(x, x, x, key=getkey(), cache=KVCache.create(2, 8, 4))


def test_cache_rejects_a_mask_and_keeps_its_dtype(getkey):
    mha = MultiheadAttention(4, 16, num_kv_heads=2, causal=True, key=getkey())
    x = jax.random.normal(getkey(), (3, 16))
    with pytest.raises(ValueError, match="mask= cannot be combined with cache="):
        mha(x, x, x, jnp.ones((3, 3), bool), cache=KVCache.create(2, 8, 4))
    # A bfloat16 layer over a float32 cache: attention runs in the cache's dtype.
    mha16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, mha)
    x16 = x.astype(jnp.bfloat16)
    out, cache = mha16(x16, x16, x16, cache=KVCache.create(2, 8, 4, dtype=jnp.float32))
    assert out.dtype == jnp.bfloat16 and cache.k.dtype == jnp.float32
    assert ref.rel_err(out, mha16(x16, x16, x16)) <= 2e-2


def test_rmsnorm_and_rotary_against_numpy(getkey):
    x = jax.random.normal(getkey(), (3, 8))
    norm = RMSNorm(8, eps=1e-6)
    xn = np.asarray(x, np.float64)
    np.testing.assert_allclose(
        norm(x), xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6), rtol=1e-5
    )
    rot = RotaryEmbedding(4, theta=100.0)
    h = jax.random.normal(getkey(), (3, 1, 4))
    out = rot(h, jnp.asarray([0, 5, 9]))
    inv = 1.0 / 100.0 ** (np.arange(0, 4, 2) / 4)
    for t, pos in enumerate((0, 5, 9)):
        ang = pos * inv
        x1, x2 = np.asarray(h[t, 0, :2], np.float64), np.asarray(h[t, 0, 2:], np.float64)
        expected = np.concatenate(
            [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)]
        )
        np.testing.assert_allclose(out[t, 0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dtype", "tol"), [(jnp.float32, 5e-5), (jnp.bfloat16, 2e-2)])
def test_rotary_over_heads_against_numpy_evaluates_each_angle_once(dtype, tol, getkey):
    """Rotary over several heads and positions against float64 NumPy; compiled for CPU, cos and
    sin are evaluated in an operation no larger than the `[positions, dim]` tables, not in the
    rotation of every head (fused there, XLA:CPU evaluated them once per rotated element)."""
    rot = RotaryEmbedding(128, theta=500.0)
    h = jax.random.normal(getkey(), (5, 8, 128)).astype(dtype)  # 5 positions, 8 heads
    positions = jnp.asarray([0, 1, 7, 64, 300])
    out = jax.jit(rot)(h, positions)
    assert out.dtype == dtype and out.shape == h.shape
    # The angles as the layer forms them, in float32 (at position 300 float64 angles differ
    # by ~3e-5); their cos, sin and the rotation in float64.
    inv = rot.inv_freq().astype(np.float32)
    ang = (np.asarray(positions, np.float32)[:, None, None] * inv).astype(np.float64)
    hn = np.asarray(h, np.float64)
    x1, x2 = hn[..., :64], hn[..., 64:]
    expected = np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1
    )
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tol, atol=tol)
    if jax.default_backend() == "cpu":
        text = jax.jit(rot).lower(h, positions).compile().as_text()
        computations = re.split(r"\n(?=\S)", text)
        for fn in ("cosine", "sine"):
            (where,) = [c for c in computations if re.search(rf" {fn}\(", c)]
            (root,) = [line for line in where.splitlines() if "ROOT " in line]
            # Every array the operation makes (one, or a tuple of several).
            made = re.match(r"\s*ROOT \S+ = (\([^)]*\)|\S+) ", root)
            assert made, root
            shapes = re.findall(r"\w+\[([\d,]*)\]", made.group(1))
            assert max(np.prod([int(n) for n in x.split(",") if n]) for x in shapes) <= 5 * 128


# ---------------------------------------------------------------------------------------------
# The decoder on every backend
# ---------------------------------------------------------------------------------------------

BACKENDS = [
    "energy",
    "reference",
    "flash",  # "auto": the C++ kernel for decode steps on CPU, the XLA kernel for prefill
    AttentionBackend("flash", flash_backend="xla"),
    AttentionBackend("flash", flash_backend="pallas"),
]
BACKEND_IDS = ["energy", "reference", "flash-auto", "flash-xla", "flash-pallas"]


def run_decoding(model, tokens, n_prompt, backend, cache):
    logits, cache = prefill(model, tokens[:n_prompt], cache, backend=backend)
    steps = []
    for t in range(n_prompt, len(tokens)):
        step_logits, cache = decode_step(model, tokens[t], cache, backend=backend)
        steps.append(step_logits)
    return logits, jnp.stack(steps)


@pytest.mark.parametrize(
    "backend",
    BACKENDS + [f"tree-{p}" for p in (1, 2, 4, 8)],
    ids=BACKEND_IDS + [f"tree-{p}" for p in (1, 2, 4, 8)],
)
def test_prefill_and_decode_logits_agree(backend, getkey):
    backend = backend_of(backend)
    model = small_model()
    tokens = jax.random.randint(getkey(), (20,), 0, SMALL.vocab_size)
    full = full_pass(model, tokens)  # one causal pass, no cache
    be = backend if isinstance(backend, AttentionBackend) else AttentionBackend(backend)
    mesh = be.mesh if be.name == "tree" else None
    cache = model.init_cache(24, mesh=mesh, kv_axis=be.kv_axis if mesh else None, block=2)
    pre, steps = run_decoding(model, tokens, 12, backend, cache)
    np.testing.assert_allclose(pre, full[:12], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(steps, full[12:], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bfloat16_logits_within_tolerance(getkey):
    model32 = small_model()
    model16 = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model32
    )
    tokens = jax.random.randint(getkey(), (16,), 0, SMALL.vocab_size)
    full = full_pass(model32, tokens)
    for backend in ("energy", "flash", tree(4)):
        mesh = backend.mesh if isinstance(backend, AttentionBackend) else None
        cache = model16.init_cache(16, mesh=mesh, kv_axis="kv" if mesh else None, block=2)
        pre, steps = run_decoding(model16, tokens, 10, backend, cache)
        got = jnp.concatenate([pre, steps]).astype(jnp.float32)
        # bf16 weights and activations: ~3 significant digits through 2 layers.
        assert ref.rel_err(got, full) <= 5e-2


@pytest.mark.slow
def test_greedy_generation_identical_across_backends(getkey):
    model = small_model()
    prompt = jax.random.randint(getkey(), (8,), 0, SMALL.vocab_size)
    outs = {}
    for name, be in [
        ("reference", "reference"),
        ("energy", "energy"),
        ("flash", "flash"),
        ("tree-8", tree(8)),
    ]:
        outs[name] = generate(model, prompt, max_new_tokens=64, backend=be)
        assert outs[name].shape == (72,)
    for name, out in outs.items():
        np.testing.assert_array_equal(out, outs["reference"], err_msg=name)
    batch = generate(model, jnp.stack([prompt, prompt[::-1]]), max_new_tokens=16, backend=tree(4))
    np.testing.assert_array_equal(batch[0], outs["reference"][:24])


def test_sampling_is_reproducible_and_uses_top_k(getkey):
    model = small_model()
    prompt = jnp.arange(5)
    key = getkey()
    a = generate(model, prompt, max_new_tokens=20, temperature=1.0, top_k=3, key=key)
    b = generate(model, prompt, max_new_tokens=20, temperature=1.0, top_k=3, key=key)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="needs key"):
        generate(model, prompt, max_new_tokens=2, temperature=1.0)


@contextlib.contextmanager
def compilations():
    """The XLA compilations that happen inside the block."""
    compiles, listening = [], [True]

    def count(event, duration, **kwargs):
        if listening[0] and "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield compiles
    finally:
        listening[0] = False


def test_decode_step_does_not_recompile(getkey):
    model = small_model()
    cache = model.init_cache(32)
    _, cache = prefill(model, jnp.arange(4), cache)
    _, cache = decode_step(model, jnp.asarray(3), cache)
    tokens = [jnp.asarray(t) for t in range(10)]
    with compilations() as compiles:
        for t in tokens:
            _, cache = decode_step(model, t, cache)
        jax.block_until_ready(cache)
    assert compiles == []
    assert int(cache.length) == 15


def test_a_decoder_given_a_cache_from_elsewhere_does_not_recompile():
    """A cache assigned to a `Decoder` (here committed to its device by `device_put`, as a
    cache filled elsewhere often is) is stepped by the program compiled already."""
    model = small_model()
    decoder = model.decoder(max_len=32)
    decoder.prefill(jnp.arange(4))
    decoder.step(jnp.asarray(3))
    filled = jax.tree.map(lambda x: x + 0 if x.ndim >= 3 else x, decoder.cache)
    filled = jax.device_put(filled, jax.devices()[0])
    with compilations() as compiles:
        decoder.cache = filled
        for t in range(3):
            decoder.step(jnp.asarray(t))
        jax.block_until_ready(decoder.cache)
    assert compiles == []
    assert int(decoder.length) == 8


def test_a_mesh_decoder_given_its_cache_back_does_not_recompile():
    """On a mesh too: the cache read back (its length through the host) or changed on the
    mesh and assigned again is stepped by the programs compiled already, and a host copy of
    it by the same step program (only its placement on the mesh compiles)."""
    model = small_model()
    decoder = model.decoder(max_len=32, backend=tree(2))
    decoder.prefill(jnp.arange(4))
    decoder.step(jnp.asarray(3))
    want = decoder.step(jnp.asarray(1))
    decoder.cache = jax.tree.map(lambda x: x[...] if x.ndim >= 3 else x, decoder.cache)
    decoder.reset()
    decoder.prefill(jnp.arange(4))
    decoder.step(jnp.asarray(3))
    changed = jax.tree.map(lambda x: x + 0 if x.ndim >= 3 else x, decoder.cache)
    with compilations() as compiles:
        decoder.cache = decoder.cache
        got = decoder.step(jnp.asarray(1))
        decoder.cache = changed
        decoder.step(jnp.asarray(2))
        jax.block_until_ready(decoder.cache)
    assert compiles == []
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    host = jax.tree.map(lambda x: np.asarray(x) if x.ndim >= 3 else x, decoder.cache)
    with compilations() as compiles:
        decoder.cache = host
        jax.block_until_ready(decoder.cache)
    placing = len(compiles)
    with compilations() as compiles:
        decoder.step(jnp.asarray(4))
        jax.block_until_ready(decoder.cache)
    assert compiles == [], placing
    assert decoder.length == 7  # 4 + 1, back to 5 with `changed`, then 2 steps


@pytest.mark.parametrize("where", ["tree-2", "linear-state"])
def test_a_decoder_holds_every_kind_of_cache(where):
    """A `Decoder` on a sharded cache (its length made on one device must not be pinned there
    against the mesh's K and V) and on a linear state (a host-side leaf among its arrays)
    prefills, steps and takes a cache assigned back, with the logits of the functional calls
    on one device."""
    if where == "linear-state":
        model, be = Transformer(SMALL, energy=LinearKernel(), key=jax.random.key(0)), None
    else:
        model, be = small_model(), tree(2)
    decoder = model.decoder(max_len=16, backend=be)
    cache = model.init_cache(16)
    prompt = jnp.arange(5) % SMALL.vocab_size
    want, cache = prefill(model, prompt, cache)
    np.testing.assert_allclose(decoder.prefill(prompt), want, rtol=1e-5, atol=1e-5)
    decoder.cache = decoder.cache
    for t in range(3):
        want, cache = decode_step(model, jnp.asarray(t), cache)
        np.testing.assert_allclose(decoder.step(jnp.asarray(t)), want, rtol=1e-5, atol=1e-5)
    assert decoder.length == 8


def test_generate_compiles_once_per_shape(getkey):
    model = small_model()
    prompt = jax.random.randint(getkey(), (6,), 0, SMALL.vocab_size)
    other = jax.random.randint(getkey(), (6,), 0, SMALL.vocab_size)
    first = generate(model, prompt, max_new_tokens=5)
    with compilations() as compiles:
        again = jax.block_until_ready(generate(model, other, max_new_tokens=5))
    assert compiles == []
    assert again.shape == first.shape


def test_writing_past_max_len_is_an_error():
    model = small_model()
    cache = model.init_cache(8)
    _, cache = prefill(model, jnp.arange(6), cache)
    with pytest.raises(Exception, match="overflow the cache of max_len=8"):
        jax.block_until_ready(prefill(model, jnp.arange(3), cache))


def test_round_robin_cache_fills_shards_evenly():
    cache = KVCache.create(2, 100, 4, mesh=mesh_of(4), kv_axis="kv", block=4)
    assert cache.max_len == 112  # rounded up to a multiple of devices * block
    positions = cache.positions()
    assert sorted(positions) == list(range(112))
    shard = cache.max_len // 4
    for length in (1, 17, 50, 112):
        filled = [int(np.sum(positions[d * shard : (d + 1) * shard] < length)) for d in range(4)]
        assert max(filled) - min(filled) <= 4
    np.testing.assert_array_equal(cache.slots(jnp.asarray(positions)), np.arange(112))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_round_robin_writes_land_in_their_slots(dtype, layout, getkey):
    """Appends to a sharded cache (a prompt, then one token at a time, the last past
    `max_len`) put every token's bits in the slot of its position, in every dtype (a 16-bit
    cache is scattered into as integers); the token past `max_len` changes no slot."""
    cache = KVCache.create(
        2, 16, 4, mesh=mesh_of(4), kv_axis="kv", block=2, dtype=dtype, layout=layout
    )
    tokens = jax.random.normal(getkey(), (17, 2, 4), dtype)
    append = eqx.filter_jit(lambda c, k: c.append(k, -k))
    cache = append(cache, tokens[:9])
    for i in range(9, 16):
        cache = append(cache, tokens[i : i + 1])
    full = append(cache, tokens[16:])  # past max_len: not written, counted in length
    assert int(full.length) == 17
    slots = np.asarray(cache.slots(jnp.arange(16)))
    for c in (cache, full):
        k, v = np.asarray(c.k), np.asarray(c.v)
        if layout == "bhsd":
            k, v = np.swapaxes(k, 0, 1), np.swapaxes(v, 0, 1)
        np.testing.assert_array_equal(k[slots], np.asarray(tokens[:16]))
        np.testing.assert_array_equal(v[slots], -np.asarray(tokens[:16]))


def test_causality(getkey):
    """The gradient of a position's logits with respect to later tokens is 0."""
    model = small_model()
    x = jax.random.normal(getkey(), (10, SMALL.hidden_size))
    for backend in ("energy", "reference"):
        jac = jax.jacrev(lambda x, b=backend: model.from_embeddings(x, backend=b)[4])(x)
        assert np.all(jac[:, 5:] == 0)
        assert np.any(jac[:, :5] != 0)


@pytest.mark.slow
def test_training_through_energy_matches_reference(getkey):
    """The gradient of the energy path is a second derivative of F; training through it follows
    the reference's loss curve."""
    from treeattn.training import TrainConfig, train

    tokens = np.asarray(jax.random.randint(getkey(), (400,), 0, SMALL.vocab_size))
    config = TrainConfig(steps=50, batch_size=4, seq_len=16, warmup_steps=5, learning_rate=1e-2)
    curves = {}
    for backend in ("energy", "reference"):
        _, curves[backend] = train(small_model(), tokens, config, backend=backend, progress=False)
    a, b = np.asarray(curves["energy"]), np.asarray(curves["reference"])
    assert b[-1] < b[0] - 0.5  # it learns
    np.testing.assert_allclose(a, b, rtol=1e-4)


def test_attention_backend_kernel_choice():
    """`kernel` is a name or an ordered tuple; names map to one record; the deprecated
    `flash_backend=x` is `(x, "auto")`."""
    with pytest.warns(DeprecationWarning, match="flash_backend"):
        assert AttentionBackend("flash", flash_backend="pallas").kernel == ("pallas", "auto")
    with pytest.warns(DeprecationWarning, match="flash_backend"):
        assert AttentionBackend("flash", flash_backend="auto").kernel == "auto"
    assert AttentionBackend("flash", kernel=["pallas", "xla"]).kernel == ("pallas", "xla")
    assert hash(AttentionBackend("flash", kernel=("pallas", "auto")))  # a static argument
    assert AttentionBackend("energy").kernel == "energy" and not AttentionBackend("energy").sharded
    assert AttentionBackend("reference").name == "reference"
    tree = AttentionBackend("tree", mesh=mesh_of(2), kv_axis="kv")
    assert (tree.kernel, tree.schedule, tree.name, tree.sharded) == ("auto", "tree", "tree", True)
    ring = AttentionBackend("ring", mesh=mesh_of(2), kv_axis="kv", kernel="energy")
    assert (ring.kernel, ring.schedule) == ("energy", "ring")
    assert AttentionBackend.of("flash") == AttentionBackend("flash")
    with pytest.raises(ValueError, match="name must be one of"):
        AttentionBackend("fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs mesh= and kv_axis="):
        AttentionBackend("tree")
    with pytest.raises(ValueError, match="backend must be one of"):
        AttentionBackend("flash", kernel="fast")  # type: ignore[arg-type]


@pytest.mark.fast(stacked=True)
@pytest.mark.parametrize("stacked", [True, False])
def test_attention_inputs_reproduce_every_layer_attention(stacked, getkey):
    """`attention_inputs` gives the heads each layer attends with: the free energy's gradient
    over them, through the layer's output projection, is the layer's attention output (on the
    reference backend), layer after layer; with q/k norms (Qwen3), biases and GQA."""
    from treeattn.energy import energy_attention

    config = dataclasses.replace(SMALL, qk_norm=True, attention_bias=True, num_hidden_layers=3)
    model = Transformer(config, key=getkey())
    # Every weight jittered, so that the norms (initialised to ones) are not the identity.
    model = jax.tree.map(
        lambda a: (
            a * (1 + 0.3 * jax.random.normal(getkey(), a.shape)) if eqx.is_inexact_array(a) else a
        ),
        model,
    )
    if not stacked:
        model = model.unstack_layers()
    tokens = jax.random.randint(getkey(), (12,), 0, config.vocab_size)
    q, k, v = eqx.filter_jit(model.attention_inputs)(tokens)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    assert q.shape == (3, 12, heads, dim) and k.shape == v.shape == (3, 12, kv_heads, dim)
    x = jax.vmap(model.embed_tokens)(tokens)
    for i in range(config.num_hidden_layers):
        block = model.block(i)
        h = block.input_layernorm(x)
        expected = block.self_attn(h, h, h, backend="reference")
        attn = energy_attention(q[i], k[i], v[i], causal=True).reshape(12, -1)
        got = jax.vmap(block.self_attn.output_proj)(attn)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        x, _ = block(x, None, AttentionBackend("reference"))
