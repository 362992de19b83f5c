"""A model's decode step at memory speed: the cache updated in place, never copied; batched
generation with prompts of different lengths; both cache layouts on every backend."""

import dataclasses
import functools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backend_of, decode_program, generate_program, mesh_of, tree
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from treeattn._native import load_kernel
from treeattn.models import (
    AttentionBackend,
    KVCache,
    LlamaConfig,
    PackedWeight,
    Transformer,
    _generate,
    decode_step,
    generate,
    prefill,
)
from treeattn.models._cache import empty_rows, write_at
from treeattn.models._generate import _PREPARED, prepared


CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
MAX_LEN = 2048  # large enough that a copy of one layer's cache stands out


def model_of(dtype=jnp.float32):
    return Transformer(CONFIG, dtype=dtype, key=jax.random.key(0))


@eqx.filter_jit
def full_pass(model, tokens):
    """One causal pass over `tokens`, no cache, on the reference backend (compiled once)."""
    return model(tokens, backend="reference")


def compiled_step(model, cache, backend):
    return decode_program(model, cache, backend)


# A cache-sized buffer converted (XLA:CPU widens a 16-bit float slice update or scatter to
# float32, the whole buffer there and back), scattered into, copied, broadcast or transposed.
# (A `bitcast-convert`, the same bits read as integers, is not a `convert`.)
CACHE_COPY = re.compile(r"(?<![\w-])(copy|transpose|concatenate|broadcast|convert|scatter)\(")
# A sharded cache is written by a scatter that drops the overflow (see `KVCache`); of a
# 16-bit float cache, on its bits, so nothing converts it either.
SHARDED_COPY = re.compile(r"(?<![\w-])(copy|transpose|concatenate|broadcast|convert)\(")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["flash", AttentionBackend("flash", kernel="cpu")])
def test_compiled_decode_step_holds_no_copy_of_the_cache(backend, dtype):
    """The compiled step updates each layer's cache buffer in place (the parameter is aliased
    to the output) and neither copies, converts nor transposes a cache-sized buffer."""
    model = model_of(dtype).unstack_layers()
    cache = model.init_cache(MAX_LEN, layout="bhsd")
    assert cache.layers == CONFIG.num_hidden_layers
    compiled = compiled_step(model, cache, backend)
    text = compiled.as_text()
    layer_shape = ",".join(str(n) for n in cache.layer(0).k.shape)
    big = [
        line
        for line in text.splitlines()
        if re.search(rf"\[{layer_shape}\]", line) and CACHE_COPY.search(line)
    ]
    assert big == [], "\n".join(big)
    # Every K and V buffer is aliased to an output: 2 * layers entries.
    header = text.splitlines()[0]
    assert "input_output_alias" in header
    assert header.count("may-alias") >= 2 * CONFIG.num_hidden_layers
    memory = compiled.memory_analysis()
    cache_bytes = sum(x.nbytes for x in (*cache.k, *cache.v))
    assert memory.alias_size_in_bytes >= cache_bytes
    # Temporaries: activations only, far below one layer's K.
    assert memory.temp_size_in_bytes < cache.layer(0).k.nbytes / 4


def test_decoding_runs_the_energy_backend_on_the_fused_kernel():
    """`AttentionBackend.decoding`: the default `"energy"` backend decodes on `"flash"`; every
    other backend (an explicit kernel on a mesh included) is kept."""
    assert AttentionBackend("energy").decoding == AttentionBackend("flash")
    for be in ("reference", "flash", AttentionBackend("flash", kernel="cpu")):
        assert AttentionBackend.of(be).decoding == AttentionBackend.of(be)
    mesh = mesh_of(1)
    sharded = AttentionBackend("tree", kernel="energy", mesh=mesh, kv_axis="kv")
    assert sharded.decoding is sharded


@pytest.mark.parametrize("batch", [None, 8], ids=["one", "batch8"])
def test_a_decode_step_evaluates_its_rotary_angles_once(batch):
    """Every layer turns its queries and keys by the angles of the step's positions: the
    compiled step evaluates cos and sin once for all layers and heads. (Fused into each
    rotation, XLA:CPU evaluated them once per rotated element of every layer.)"""
    if jax.default_backend() != "cpu":
        pytest.skip("a property of XLA:CPU's fusion")
    text = model_of().decoder(max_len=MAX_LEN, batch=batch).compiled_step().as_text()
    assert CONFIG.num_hidden_layers > 1
    assert len(re.findall(r" cosine\(", text)) == 1
    assert len(re.findall(r" sine\(", text)) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_model_as_constructed_decodes_on_the_fused_kernel(dtype):
    """A model on its default backend (`"energy"`), decoded as documented (`model.decoder`,
    `decode_step`), runs the fused kernel: its compiled step neither converts nor copies a
    cache-sized buffer (the gradient of the free energy widens a bfloat16 cache to float32),
    and its logits and tokens are those of decoding through the gradient itself."""
    model = model_of(dtype)
    assert model.backend.name == "energy"
    decoder = model.decoder(max_len=MAX_LEN)
    assert decoder.backend.name == "flash"
    text = decoder.compiled_step().as_text()
    layer_shape = ",".join(str(n) for n in decoder.cache.layer(0).k.shape)
    big = [
        line
        for line in text.splitlines()
        if re.search(rf"\[{layer_shape}\]", line) and CACHE_COPY.search(line)
    ]
    assert big == [], "\n".join(big)
    if jax.default_backend() == "cpu" and load_kernel() is None:
        assert 'custom_call_target="treeattn_cpu_decode"' in text

    prompt = jax.random.randint(jax.random.key(3), (12,), 0, CONFIG.vocab_size)
    energy = model.decoder(max_len=64, backend="energy")
    fused = model.decoder(max_len=64)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(
        np.asarray(fused.prefill(prompt), np.float32),
        np.asarray(energy.prefill(prompt), np.float32),
        rtol=tol,
        atol=tol,
    )
    token = jnp.asarray(5)
    for _ in range(4):
        a, b = fused.step(token), energy.step(token)
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
        )
        token = jnp.argmax(b)
    cache = model.init_cache(64)
    assert cache.layout == decoder.cache.layout
    logits, _ = decode_step(model, token, cache)
    assert logits.shape == (CONFIG.vocab_size,)


@pytest.mark.parametrize(
    ("backend", "rows", "dtype"),
    [
        ("flash", 1, jnp.float32),
        ("flash", 3, jnp.float32),
        ("flash", 3, jnp.bfloat16),
        ("flash", 20, jnp.bfloat16),  # more rows than are unrolled: a loop over them
        ("tree-2", 1, jnp.float32),
        ("tree-2", 3, jnp.float32),
        ("tree-2", 3, jnp.bfloat16),
    ],
    ids=[
        "flash-1",
        "flash-3",
        "flash-3-bf16",
        "flash-20-bf16",
        "tree-2-1",
        "tree-2-3",
        "tree-2-3-bf16",
    ],
)
def test_batched_generate_holds_no_copy_of_the_cache(backend, rows, dtype):
    """`generate`'s compiled loop receives one empty cache per row, allocated in place (shard
    by shard) and donated: every buffer is aliased to an output, nothing copies, converts,
    scatters into, broadcasts or transposes a cache-sized buffer (each row's new token is one
    slice update, for every dtype), and the temporaries are activations only."""
    model = model_of(dtype)
    backend = backend_of(backend)
    be = backend if isinstance(backend, AttentionBackend) else AttentionBackend(backend)
    mesh, axis = (be.mesh, "kv") if be.name == "tree" else (None, None)
    if mesh is not None and jax.__version_info__ < (0, 9):
        pytest.skip(
            "XLA:CPU of jax 0.8 writes the prompt into round-robin slots (a scatter) through a "
            "transposed copy of each buffer; newer XLA scatters in place"
        )
    template = jax.eval_shape(
        lambda: model.init_cache(MAX_LEN, mesh=mesh, kv_axis=axis, layout="bhsd")
    )
    cache = empty_rows(template, rows)
    assert cache.length.shape == (rows,) and cache.k[0].shape == (rows, *template.k[0].shape)
    if mesh is not None:  # sharded along the slots, as the tree backend reads it
        assert cache.k[0].sharding.spec == P(None, None, "kv", None)
    params = eqx.filter(model.unstack_layers(), eqx.is_array)
    compiled = generate_program(
        model,
        cache,
        jnp.zeros((rows, 5), jnp.int32),
        backend=be,
        max_new_tokens=4,
        temperature=0.0,
        top_k=None,
    )
    text = compiled.as_text()
    local = cache.k[0].sharding.shard_shape(cache.k[0].shape)  # one device's buffer
    layer_shape = ",".join(str(n) for n in local)
    big = [
        line
        for line in text.splitlines()
        if re.search(rf"\[{layer_shape}\]", line)
        and (CACHE_COPY.search(line) if be.name == "flash" else SHARDED_COPY.search(line))
    ]
    assert big == [], "\n".join(big)
    memory = compiled.memory_analysis()
    itemsize = jnp.dtype(dtype).itemsize
    local_bytes = sum(
        np.prod(x.sharding.shard_shape(x.shape)) * itemsize for x in (*cache.k, *cache.v)
    )
    assert memory.alias_size_in_bytes >= local_bytes
    # Activations only; at these tiny sizes XLA:CPU multiplies bfloat16 in float32 and hoists
    # float32 copies of the weights out of the loop (the weights, not the cache).
    widened = 0 if itemsize == 4 else sum(x.size * 4 for x in jax.tree.leaves(params))
    # A sharded 16-bit cache is scattered into as its bits, and XLA:CPU materialises the bit
    # casts around the scatter: at most one copy of the cache's bits (converting it to float32
    # for a bfloat16 scatter, as before, held twice that).
    bits = local_bytes if (be.name != "flash" and itemsize == 2) else 0
    assert memory.temp_size_in_bytes < np.prod(local) * itemsize / 4 + widened + bits


@pytest.mark.skipif(
    jax.default_backend() != "cpu" or load_kernel() is not None,
    reason="the C++ write runs on a CPU process where it builds",
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [None, 3])
def test_a_step_writes_each_cache_buffer_in_one_call(dtype, batch):
    """A decode step writes each layer's K and V buffer once: of a batch, with one call of
    the C++ write for all its rows (not an operation per row); of one sequence, a float32
    buffer by XLA's own in-place slice update, a bfloat16 one by the C++ write."""
    model = model_of(dtype)
    text = model.decoder(max_len=MAX_LEN, batch=batch).compiled_step().as_text()
    entry = text[text.index("ENTRY") :]
    writes = entry.count('custom_call_target="treeattn_cpu_write"')
    updates = sum("dynamic-update-slice" in line for line in entry.splitlines())
    layers = CONFIG.num_hidden_layers
    if batch is None and dtype == jnp.float32:
        assert writes == 0 and updates >= 2 * layers
    else:
        assert writes == 2 * layers, writes
        assert updates == 0, updates


@pytest.mark.parametrize("mask", [False, True], ids=["same-length", "padded"])
def test_generate_prefill_computes_the_last_logits_only(mask):
    """`generate` samples after each row's last prompt token only: its compiled program holds
    logits for one position per row (`logits_to_keep`), not `[prompt, vocab]` per row."""
    vocab, rows, n_prompt = 1000, 3, 40
    config = dataclasses.replace(CONFIG, vocab_size=vocab)
    model = Transformer(config, key=jax.random.key(0)).unstack_layers()
    template = jax.eval_shape(lambda: model.init_cache(64, layout="bhsd"))
    cache = empty_rows(template, rows)
    text = generate_program(
        model,
        cache,
        jnp.zeros((rows, n_prompt), jnp.int32),
        jnp.ones((rows, n_prompt), bool) if mask else None,
        backend="flash",
        max_new_tokens=3,
        temperature=0.0,
        top_k=None,
    ).as_text()
    logits = {
        shape
        for shape in re.findall(r"\[([\d,]+)\]", text)
        if shape.endswith(f",{vocab}") and shape.split(",")[0] != str(vocab)
    }
    assert logits, "no logits found"
    positions = {math.prod(int(n) for n in shape.split(",")[:-1]) for shape in logits}
    assert max(positions) <= rows, sorted(logits)


def test_a_stacked_model_copies_neither_its_weights_nor_its_cache():
    """A model as constructed (its layers stacked) is prepared for decoding once: its step
    reads every layer's own arrays, so its temporaries hold no slice of a stacked weight
    (XLA materialises one before a product reads it) and no layer's cache."""
    stacked, unstacked = model_of(), model_of().unstack_layers()
    assert not isinstance(stacked.layers, tuple)
    layer_weights = sum(
        x.nbytes for x in jax.tree.leaves(eqx.filter(unstacked.layers[0], eqx.is_array))
    )
    for model in (stacked, unstacked):
        cache = model.init_cache(MAX_LEN, layout="bhsd")
        temps = compiled_step(model, cache, "flash").memory_analysis().temp_size_in_bytes
        assert temps < layer_weights / 4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_packed_weights_decode_as_the_arrays_do(dtype, tied):
    """A decoder with its weights packed (`PackedWeight`, the default on CPU; a tied embedding
    too, whose rows the prompt's tokens read) gives the logits and greedy tokens of one that
    reads the arrays, with prompts of different lengths in a batch. (Fixed prompts: in
    bfloat16 two logits can round to a tie that the two sums break differently.)"""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    model = Transformer(config, dtype=dtype, key=jax.random.key(0))
    prompts = jax.random.randint(jax.random.key(1), (2, 6), 0, config.vocab_size)
    mask = jnp.array([[True] * 6, [False] * 2 + [True] * 4])
    runs, generated = {}, {}
    for packed in (True, False):
        decoder = model.decoder(max_len=32, batch=2, packed=packed)
        leaves = jax.tree.leaves(decoder._prep.model, is_leaf=lambda x: isinstance(x, PackedWeight))
        weights = [leaf for leaf in leaves if isinstance(leaf, PackedWeight)]
        assert len(weights) == (7 * config.num_hidden_layers + 1) * packed
        steps = [decoder.prefill(prompts, logits_to_keep=1)[:, -1]]
        for _ in range(4):
            steps.append(decoder.step(jnp.argmax(steps[-1], axis=-1)))
        runs[packed] = np.stack([np.asarray(x, np.float32) for x in steps])
        decoder.reset()
        generated[packed] = decoder.generate(prompts, max_new_tokens=5, attention_mask=mask)
    atol = 1e-5 if dtype == jnp.float32 else 0.1
    np.testing.assert_allclose(runs[True], runs[False], rtol=atol, atol=atol)
    # The greedy tokens wherever the top two logits are further apart than the tolerance (in
    # bfloat16 two sums in different orders may break a near tie differently).
    top2 = np.sort(runs[False], axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * atol
    np.testing.assert_array_equal(runs[True].argmax(-1)[clear], runs[False].argmax(-1)[clear])
    if dtype == jnp.float32:
        np.testing.assert_array_equal(generated[True], generated[False])


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_each_layer_reads_its_own_row_of_the_stacks(stacked):
    """With every array of every layer its own (norms and biases too, which the decoder
    stacks, and the projections, which it packs into one stack per kind), a decoder's logits
    are those of one causal pass over the same tokens: each layer reads its own row."""
    config = dataclasses.replace(CONFIG, attention_bias=True, mlp_bias=True)
    model = Transformer(config, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    model = eqx.combine(jax.tree.unflatten(tree, leaves), static)
    if not stacked:
        model = model.unstack_layers()
    norms = np.stack([np.asarray(model.block(i).input_layernorm.weight) for i in range(3)])
    assert np.ptp(norms, axis=0).min() > 0  # every layer's norm differs from the others'
    tokens = jax.random.randint(jax.random.key(2), (7,), 0, config.vocab_size)
    want = np.asarray(full_pass(model, tokens))
    decoder = model.decoder(max_len=16)
    got = [decoder.prefill(tokens[:4])] + [decoder.step(t)[None] for t in tokens[4:]]
    got = np.concatenate([np.asarray(x) for x in got])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if decoder.packed:  # 7 weight stacks, 7 bias stacks, 2 norm stacks, embedding, norm, head
        assert len(decoder._prep.leaves) == 19


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_packing_holds_no_unstacked_copy(monkeypatch, stacked):
    """A model is packed one kind of projection at a time, into one stack per kind that every
    layer reads (`PackedWeight(stack, out, i)`): whenever a kind is packed, the arrays alive
    beyond the model's own are the stacks packed so far and that kind's weights (stacked, for
    layers given as a tuple), never a copy of every layer's weights (a third copy at the
    peak). The prepared model's weights are then those stacks, each once."""
    config = dataclasses.replace(CONFIG, num_hidden_layers=6)
    model = Transformer(config, key=jax.random.key(0))
    if not stacked:
        model = model.unstack_layers()

    def nbytes(tree):
        return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))

    whole = nbytes(model.layers)
    before = sum(x.nbytes for x in jax.live_arrays())
    extra, packed_so_far, kinds = [], [0], []
    pack = _generate._stacked_panels

    def recording(w):
        extra.append(sum(x.nbytes for x in jax.live_arrays()) - before - packed_so_far[0])
        out = pack(w)
        kinds.append(len(w) if isinstance(w, list) else w.shape[0])
        packed_so_far[0] += out.nbytes
        return out

    monkeypatch.setattr(_generate, "_stacked_panels", recording)
    prep = prepared(model, packed=True)
    assert len(kinds) == 7  # q, k, v, o, gate, up, down
    assert kinds == [config.num_hidden_layers] * 7
    assert isinstance(prep.model.layers, tuple)
    # At most one kind's weights stacked (the largest of 7, well below half of the layers').
    assert max(extra) <= 0.5 * whole, (max(extra), whole)
    blocks = prep.model.layers
    for i, block in enumerate(blocks):
        w = block.self_attn.query_proj.weight
        assert isinstance(w, PackedWeight) and w.layer == i
        assert w.panels is blocks[0].self_attn.query_proj.weight.panels
    # Each array once in the program's arguments: 7 stacks, 2 stacked norms, and the model's
    # embedding, final norm and head.
    assert len(prep.leaves) == 12, [x.shape for x in prep.leaves]
    assert len({id(x) for x in prep.leaves}) == len(prep.leaves)


def test_packing_is_a_choice_checked_once_and_not_made_inside_a_trace():
    """`packed=` must be a bool or None; a prepared model is not prepared again the other way;
    inside a user's `jit` the model is neither packed (a pass over every weight per call) nor
    cached (its arrays would be the trace's)."""
    model = model_of().unstack_layers()
    with pytest.raises(ValueError, match="packed must be None, True or False"):
        model.decoder(max_len=8, packed="yes")
    prep = prepared(model, packed=True)
    assert prep.packed and prepared(model, packed=True) is prep
    with pytest.raises(ValueError, match="packed=False for a model prepared with packed=True"):
        prepared(prep, packed=False)
    other = model_of().unstack_layers()
    cache = other.init_cache(16)

    @jax.jit
    def step(token, cache):
        return decode_step(other, token, cache)

    text = step.lower(jnp.asarray(1), cache).compile().as_text()
    assert "treeattn_cpu_matmul_packed" not in text
    assert not [k for k in _PREPARED if k[0] == id(other)]


def test_decode_step_donates_the_cache():
    model = model_of().unstack_layers()
    cache = model.init_cache(64)
    _, cache = prefill(model, jnp.arange(5), cache, backend="flash")
    old = cache
    _, cache = decode_step(model, jnp.asarray(1), cache, backend="flash")
    assert all(x.is_deleted() for x in (*old.k, *old.v))
    assert int(cache.length) == 6


# Each cache layout through each kind of backend (energy / reference, flash, tree).
@pytest.mark.parametrize(
    "backend, layout",
    [
        ("energy", "bhsd"),
        ("reference", "bshd"),
        ("flash", "bhsd"),
        (AttentionBackend("flash", kernel="xla"), "bshd"),
        ("tree-2", "bhsd"),
        ("tree-4", "bshd"),
    ],
    ids=["energy", "reference", "flash-auto", "flash-xla", "tree-2", "tree-4"],
)
def test_both_layouts_give_the_logits_of_one_full_pass(backend, layout, getkey):
    backend = backend_of(backend)
    model = model_of()
    tokens = jax.random.randint(getkey(), (14,), 0, CONFIG.vocab_size)
    full = full_pass(model, tokens)
    be = backend if isinstance(backend, AttentionBackend) else AttentionBackend(backend)
    mesh = be.mesh if be.name == "tree" else None
    cache = model.init_cache(32, mesh=mesh, kv_axis="kv" if mesh else None, block=2, layout=layout)
    assert cache.layout == layout
    logits, cache = prefill(model, tokens[:9], cache, backend=backend)
    steps = [logits]
    for t in tokens[9:]:
        step, cache = decode_step(model, t, cache, backend=backend)
        steps.append(step[None])
    np.testing.assert_allclose(jnp.concatenate(steps), full, rtol=1e-5, atol=1e-5, err_msg=layout)


def test_unstacking_keeps_the_model():
    model = model_of()
    tokens = jnp.arange(10) % CONFIG.vocab_size
    unstacked = model.unstack_layers()
    assert isinstance(unstacked.layers, tuple) and len(unstacked.layers) == 3
    np.testing.assert_allclose(unstacked(tokens), model(tokens), rtol=1e-6, atol=1e-6)
    again = unstacked.stack_layers()
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


LENGTHS = (7, 3, 5)


@functools.cache
def prompts_alone() -> tuple[list[jax.Array], list[np.ndarray]]:
    """Prompts of different lengths, and the 6 tokens each generates alone on the reference
    backend (computed once: every backend must give the same tokens)."""
    model = model_of()
    keys = jax.random.split(jax.random.key(11), len(LENGTHS))
    prompts = [
        jax.random.randint(key, (n,), 0, CONFIG.vocab_size)
        for key, n in zip(keys, LENGTHS, strict=True)
    ]
    alone = [np.asarray(generate(model, p, max_new_tokens=6, backend="reference")) for p in prompts]
    return prompts, alone


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["reference", "flash", "tree-2"], ids=["reference", "flash", "tree-2"]
)
def test_batched_prompts_of_different_lengths(backend):
    """Rows padded to one length (left or right) with an attention mask generate what each
    prompt generates alone."""
    backend = backend_of(backend)
    model = model_of()
    prompts, alone = prompts_alone()
    width = max(LENGTHS)
    pad = 0
    for side in ("left", "right"):
        rows, mask = [], []
        for p in prompts:
            fill = [pad] * (width - len(p))
            rows.append(
                fill + list(np.asarray(p)) if side == "left" else list(np.asarray(p)) + fill
            )
            ones = [1] * len(p)
            mask.append([0] * len(fill) + ones if side == "left" else ones + [0] * len(fill))
        batch = generate(
            model,
            jnp.asarray(rows, jnp.int32),
            attention_mask=jnp.asarray(mask, jnp.int32),
            max_new_tokens=6,
            backend=backend,
        )
        assert batch.shape == (3, width + 6)
        np.testing.assert_array_equal(batch[:, :width], np.asarray(rows))
        for row, ref in zip(np.asarray(batch), alone, strict=True):
            np.testing.assert_array_equal(row[width:], ref[-6:], err_msg=side)


def test_attention_mask_is_checked():
    model = model_of()
    prompts = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"attention_mask must have the prompt's shape \(2, 4\)"):
        generate(model, prompts, attention_mask=jnp.ones((2, 3)), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] hold no prompt token"):
        generate(
            model,
            prompts,
            attention_mask=jnp.asarray([[1, 1, 0, 0], [0, 0, 0, 0]]),
            max_new_tokens=2,
        )


def test_a_model_cache_appends_through_its_layers():
    cache = KVCache.create(2, 8, 4, layers=2)
    with pytest.raises(ValueError, match=r"holds 2 layers; append to cache.layer\(i\)"):
        cache.append(jnp.zeros((1, 2, 4)), jnp.zeros((1, 2, 4)))
    layer = cache.layer(1).append(jnp.ones((3, 2, 4)), jnp.ones((3, 2, 4)))
    merged = cache.with_layers([cache.layer(0), layer])
    assert int(merged.length) == 3
    np.testing.assert_array_equal(merged.k[1][:, :3], 1.0)
    with pytest.raises(ValueError, match="layout must be one of"):
        KVCache.create(2, 8, 4, layout="hsd")  # type: ignore[arg-type]


@pytest.mark.fast(p=4, block=2)
@pytest.mark.parametrize("p, block", [(1, 1), (2, 1), (2, 3), (4, 2), (8, 2)])
def test_shard_lengths_count_the_filled_slots(p, block):
    """`shard_lengths()` of a round-robin cache is, per shard, the number of its slots whose
    position (`positions()`) is below the length — at every length, up to overflow."""
    mesh = mesh_of(p)
    cache = KVCache.create(1, 5 * p * block, 2, mesh=mesh, kv_axis="kv", block=block)
    lengths = np.arange(cache.max_len + 4)
    batched = eqx.tree_at(lambda c: c.length, cache, jnp.asarray(lengths, jnp.int32))
    fills = np.asarray(batched.shard_lengths())
    held = cache.positions().reshape(p, -1)
    expected = (held[None] < np.minimum(lengths, cache.max_len)[:, None, None]).sum(-1)
    np.testing.assert_array_equal(fills, expected)
    # The filled slots of a shard are its first ones.
    assert (np.diff(held, axis=1) > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("p, name", [(2, "tree"), (4, "tree"), (8, "tree"), (4, "ring")])
def test_round_robin_decode_steps_match_one_full_pass(p, name, getkey):
    """Decode steps over a cache sharded round-robin (each shard told its fill length) give the
    logits of the reference backend's full pass, after prompts that leave the shards unevenly
    filled (some empty, one partly filled); the ring baseline too."""
    model = model_of()
    tokens = jax.random.randint(getkey(), (14,), 0, CONFIG.vocab_size)
    full = full_pass(model, tokens)
    backend = tree(p, name)
    for n in (1, 5, 11):
        cache = model.init_cache(32, mesh=backend.mesh, kv_axis="kv", block=2)
        logits, cache = prefill(model, tokens[:n], cache, backend=backend)
        fills = np.asarray(cache.shard_lengths())
        assert fills.sum() == n and fills.min() < fills.max(), fills
        steps = [logits[-1:]]
        for t in tokens[n : n + 3]:
            step, cache = decode_step(model, t, cache, backend=backend)
            steps.append(step[None])
        np.testing.assert_allclose(
            jnp.concatenate(steps), full[n - 1 : n + 3], rtol=1e-5, atol=1e-5, err_msg=f"{n=}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("p, name", [(2, "tree"), (8, "tree"), (2, "ring")])
def test_round_robin_generate_gives_the_reference_tokens(p, name, getkey):
    """Batched greedy generation with prompts of different lengths (left-padded) on a cache
    sharded round-robin gives the tokens of the reference backend on one device (tree, and
    the ring baseline)."""
    model = model_of()
    lengths = (1, 4, 9)
    width = max(lengths)
    prompts = jax.random.randint(getkey(), (len(lengths), width), 0, CONFIG.vocab_size)
    mask = jnp.arange(width)[None, :] >= width - jnp.asarray(lengths)[:, None]
    kw = dict(attention_mask=mask, max_new_tokens=6)
    expected = generate(model, prompts, backend="reference", **kw)
    got = generate(model, prompts, backend=tree(p, name), **kw)
    np.testing.assert_array_equal(got, expected)


def _write_np(buffer, update, start, axis):
    out = np.array(buffer, np.float64)
    start = int(np.clip(start, 0, buffer.shape[axis] - update.shape[axis]))
    index = [slice(None)] * buffer.ndim
    index[axis] = slice(start, start + update.shape[axis])
    out[tuple(index)] = update
    return out


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.bool_, jnp.int4]
)
@pytest.mark.parametrize("rows", [2, 19])  # unrolled, and a loop over the rows
def test_the_cache_write_under_vmap(dtype, rows, getkey):
    """`write_at` under `vmap`: per-row starts (one slice write per row; on CPU one C++ call
    for the rows, whose elements fill whole bytes), a shared start, a shared buffer, a shared
    update, nested `vmap`, and clamping at the end, against NumPy."""
    buffers = (3 * jax.random.normal(getkey(), (rows, 2, 9, 3))).astype(dtype)
    updates = (3 * jax.random.normal(getkey(), (rows, 2, 2, 3))).astype(dtype)
    starts = jnp.arange(rows, dtype=jnp.int32) % 9  # past 7 (= 9 - 2): clamped, as lax does
    write = functools.partial(write_at, axis=1)
    b, u = np.asarray(buffers, np.float64), np.asarray(updates, np.float64)
    want = [_write_np(b[i], u[i], int(starts[i]), 1) for i in range(rows)]
    cases = {
        "per-row starts": (jax.vmap(write)(buffers, updates, starts), want),
        "one start": (
            jax.vmap(write, (0, 0, None))(buffers, updates, starts[3]),
            [_write_np(b[i], u[i], int(starts[3]), 1) for i in range(rows)],
        ),
        "one buffer": (
            jax.vmap(write, (None, 0, 0))(buffers[0], updates, starts),
            [_write_np(b[0], u[i], int(starts[i]), 1) for i in range(rows)],
        ),
        "one update": (
            jax.vmap(write, (0, None, 0))(buffers, updates[0], starts),
            [_write_np(b[i], u[0], int(starts[i]), 1) for i in range(rows)],
        ),
        "nested": (
            jax.vmap(jax.vmap(write))(buffers[None], updates[None], starts[None])[0],
            want,
        ),
    }
    for name, (got, expected) in cases.items():
        assert got.dtype == dtype, name
        np.testing.assert_array_equal(np.asarray(got, np.float64), np.stack(expected), name)


def test_the_cache_write_is_differentiable(getkey):
    """Forward and reverse mode through the batched write; and the gradient of a batched
    prefill into an empty cache equals the gradient of the model without a cache."""
    with jax.enable_x64(True):
        buffers = jax.random.normal(getkey(), (3, 2, 6, 4), jnp.float64)
        updates = jax.random.normal(getkey(), (3, 2, 1, 4), jnp.float64)
        starts = jnp.asarray([0, 5, 2], jnp.int32)
        write = jax.vmap(functools.partial(write_at, axis=1), (0, 0, None))
        # Compiled: check_grads' op-by-op dispatch of second derivatives is slow.
        check_grads(
            jax.jit(lambda b, u: jax.vmap(lambda b, u, s: write_at(b, u, s, 1))(b, u, starts)),
            (buffers, updates),
            order=2,
            modes=("fwd", "rev"),
        )
        check_grads(jax.jit(lambda b, u: write(b, u, starts[1])), (buffers, updates), order=1)
    model = model_of()
    x = jax.random.normal(getkey(), (2, 5, CONFIG.hidden_size))

    def loss(x, cached):
        if not cached:
            logits = jax.vmap(model.from_embeddings)(x)
            assert not isinstance(logits, tuple)
            return jnp.sum(logits**2)
        cache = empty_rows(jax.eval_shape(lambda: model.init_cache(8)), 2)
        logits, _ = jax.vmap(lambda x, c: model.from_embeddings(x, c, backend="reference"))(
            x, cache
        )
        return jnp.sum(logits**2)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    np.testing.assert_allclose(grad(x, True), grad(x, False), rtol=2e-4, atol=1e-5)
