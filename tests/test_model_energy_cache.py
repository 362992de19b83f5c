"""Energies in a model with a cache: LinearKernel decodes against its linear state in constant
time (the tokens of the full forward), and other energies read the KV cache where it lies
(no cache-sized copy or gather in the compiled step), checked from the compiled HLO."""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_CONFIG, decode_program, tree

from treeattn.energy import CosFormer, LinearKernel, LinearState, Sigmoid, Softmax, StickBreaking
from treeattn.models import (
    AttentionBackend,
    KVCache,
    LinearCache,
    MultiheadAttention,
    Transformer,
    decode_step,
    generate,
    prefill,
)


CONFIG = dataclasses.replace(TINY_CONFIG, max_position_embeddings=1 << 16)


# Two kv heads: with one (MQA), XLA:CPU drops the unit head axis of the cache between its
# in-place update and the products that read it, and copies the buffer to do so, on every
# path that reads it with XLA's own products (the fused softmax kernels do not).
GQA = dataclasses.replace(CONFIG, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@eqx.filter_jit
def _full_pass(model, tokens):
    return model(tokens, backend="reference")


def greedy_full_forward(model, prompt, n):
    """Each new token the argmax of one full pass (no cache) over the tokens so far. The passes
    run over one buffer of every position (one compilation): the model is causal, so the
    positions not yet filled do not reach the logits read."""
    m = prompt.shape[0]
    tokens = jnp.concatenate([prompt, jnp.zeros((n,), prompt.dtype)])
    for i in range(n):
        logits = _full_pass(model, tokens)
        assert not isinstance(logits, tuple)
        tokens = tokens.at[m + i].set(jnp.argmax(logits[m + i - 1]).astype(tokens.dtype))
    return tokens


# Linear energies with a decoding state: features of the key alone, and features of the key at
# its position (cosFormer, whose horizon of 16 tokens makes the cosine vary from 1 to 0.1).
LINEAR = pytest.mark.parametrize(
    "energy", [LinearKernel(), CosFormer(16)], ids=["linear", "cosformer"]
)


@LINEAR
def test_linear_generate_gives_the_tokens_of_the_full_forward(energy, getkey):
    model = Transformer(CONFIG, energy=energy, key=getkey())
    cache = model.init_cache(16)
    assert isinstance(cache, LinearCache) and cache.layers == CONFIG.num_hidden_layers
    assert isinstance(model.init_cache(16, linear_state=False), KVCache)
    prompt = jax.random.randint(getkey(), (5,), 0, CONFIG.vocab_size)
    want = greedy_full_forward(model, prompt, 6)
    np.testing.assert_array_equal(generate(model, prompt, max_new_tokens=6, max_len=16), want)
    # the state is not sharded: the tree backend decodes against it too
    be = tree(2)
    got = generate(model, prompt, max_new_tokens=6, backend=be, max_len=16)
    np.testing.assert_array_equal(got, want)


@LINEAR
def test_linear_generate_batched_with_padding(energy, getkey):
    """Padding after a shorter prompt never enters the state: each row generates what it
    would alone (at its own positions)."""
    model = Transformer(CONFIG, energy=energy, key=getkey())
    a = jax.random.randint(getkey(), (6,), 0, CONFIG.vocab_size)
    b = jax.random.randint(getkey(), (3,), 0, CONFIG.vocab_size)
    prompts = jnp.stack([a, jnp.concatenate([b, jnp.zeros(3, b.dtype)])])
    mask = jnp.array([[1] * 6, [1, 1, 1, 0, 0, 0]])
    got = generate(model, prompts, max_new_tokens=4, max_len=16, attention_mask=mask)
    np.testing.assert_array_equal(got[0], greedy_full_forward(model, a, 4))
    np.testing.assert_array_equal(got[1, 6:], greedy_full_forward(model, b, 4)[3:])


@LINEAR
def test_linear_state_logits_equal_the_kv_cache_and_the_full_forward(energy, getkey):
    model = Transformer(CONFIG, energy=energy, key=getkey())
    tokens = jax.random.randint(getkey(), (9,), 0, CONFIG.vocab_size)
    full = model(tokens, backend="reference")
    assert not isinstance(full, tuple)
    for cache in (model.init_cache(16), model.init_cache(16, linear_state=False)):
        logits, cache = prefill(model, tokens[:6], cache)
        np.testing.assert_allclose(logits, full[:6], rtol=1e-5, atol=1e-5)
        for i in range(6, 9):
            step, cache = decode_step(model, tokens[i], cache)
            np.testing.assert_allclose(step, full[i], rtol=1e-5, atol=1e-5)


def test_a_layer_with_a_linear_cache(getkey):
    layer = MultiheadAttention(4, 16, num_kv_heads=2, energy=LinearKernel(), key=getkey())
    x = jax.random.normal(getkey(), (7, 16))
    cache = layer.init_cache(8)
    assert isinstance(cache, LinearCache) and isinstance(cache.state, LinearState)
    out, cache = layer(x[:5], x[:5], x[:5], cache=cache)  # not causal: all keys so far
    out2, cache = layer(x[5:], x[5:], x[5:], cache=cache)
    want = layer(x, x, x)
    assert not isinstance(want, tuple)
    np.testing.assert_allclose(out2, want[5:], rtol=1e-5, atol=1e-5)
    windowed = MultiheadAttention(
        4, 16, causal=True, local_window_size=(2, 0), energy=LinearKernel(), key=getkey()
    )
    assert isinstance(windowed.init_cache(8), KVCache)  # a sum cannot forget a window's keys
    with pytest.raises(ValueError, match="LinearCache serves energy=LinearKernel"):
        windowed(x, x, x, cache=layer.init_cache(8))


def step_analysis(model, cache, backend: str | AttentionBackend = "energy"):
    return decode_program(model, cache, backend)


@pytest.mark.fast(energy="linear")
@pytest.mark.parametrize("energy", ["linear", "cosformer"], ids=["linear", "cosformer"])
def test_a_linear_decode_step_does_not_depend_on_the_context(energy):
    """Structural: the compiled step's arguments, temporaries and FLOPs are the same for a
    context of 1K and of 32K tokens (a KV cache's arguments grow 32x); cosFormer's features
    read the position, and still do not grow with it."""
    energy = LinearKernel() if energy == "linear" else CosFormer(CONFIG.max_position_embeddings)
    model = Transformer(CONFIG, energy=energy, key=jax.random.key(0)).unstack_layers()
    sizes = {}
    for max_len in (1024, 32768):
        for linear in (True, False):
            compiled = step_analysis(model, model.init_cache(max_len, linear_state=linear))
            memory = compiled.memory_analysis()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            assert memory is not None and cost is not None
            sizes[max_len, linear] = (
                memory.argument_size_in_bytes,
                memory.temp_size_in_bytes,
                cost["flops"],
            )
    assert sizes[1024, True] == sizes[32768, True]
    assert sizes[32768, False][0] > 16 * sizes[1024, False][0]  # the KV cache grows
    assert sizes[32768, True][0] < sizes[1024, False][0]


def big_copies(text: str, elements: int) -> list[str]:
    """Instructions outside fused computations that make a buffer of at least `elements`
    elements other than the in-place update of a cache buffer: copies, transposes, gathers,
    all-gathers, concatenations, or a fusion computing a new one."""
    found, comp = [], None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            comp = header.group(1)
            continue
        if comp is None or "fused" in comp or "wrapped" in comp or "region" in comp:
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \(?\w+\[([\d,]*)\]", line)
        if not m:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        if not dims or np.prod(dims) < elements:
            continue
        if re.search(r"\b(parameter|get-tuple-element|bitcast)\(", line):
            continue
        if "dynamic-update-slice_fusion" in m.group(1):  # the new token, written in place
            continue
        found.append(line.strip()[:200])
    return found


@pytest.mark.parametrize("backend", ["energy", "flash"])
def test_a_sigmoid_decode_step_reads_the_cache_where_it_lies(backend):
    model = Transformer(GQA, energy=Sigmoid(bias=jnp.asarray(-2.0)), key=jax.random.key(0))
    model = model.unstack_layers()
    cache = model.init_cache(2048)
    assert isinstance(cache, KVCache) and cache.layout == "bhsd"
    compiled = step_analysis(model, cache, backend)
    layer_k = cache.layer(0).k
    assert isinstance(layer_k, jax.Array)
    assert big_copies(compiled.as_text() or "", layer_k.size) == []
    memory = compiled.memory_analysis()
    assert memory is not None
    assert memory.alias_size_in_bytes >= 2 * GQA.num_hidden_layers * layer_k.nbytes
    assert memory.temp_size_in_bytes < layer_k.nbytes / 4


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize(
    "energy", [Sigmoid(bias=jnp.asarray(-2.0)), StickBreaking()], ids=["sigmoid", "stick"]
)
def test_an_energy_decode_step_reads_each_cache_once(energy, kv_heads):
    """Attention as the gradient at zeta = 0 of an energy over the cache in place: per layer
    one product reads the keys (the logits) and one the values (the gradient); the tilt
    zeta.v is 0 there and never computed as a product (which XLA does not fold away)."""
    cfg = dataclasses.replace(GQA, num_key_value_heads=kv_heads)
    model = Transformer(cfg, energy=energy, key=jax.random.key(0)).unstack_layers()
    cache = model.init_cache(256)
    assert isinstance(cache, KVCache)
    params, static = eqx.partition(model, eqx.is_array)
    token = jnp.zeros((1,), jnp.int32)

    def step(params, cache):
        return eqx.combine(params, static)(token, cache, backend="energy")

    jaxpr = jax.make_jaxpr(step)(params, cache).jaxpr
    layer_k = cache.layer(0).k
    assert isinstance(layer_k, jax.Array)
    h, n, d = layer_k.shape  # head-major; the logits read it as [n, h, d]
    shapes = {(h, n, d), (n, h, d)}
    reads = [e for e in _dots(jaxpr) if shapes & {x.aval.shape for x in e.invars}]
    assert len(reads) == 2 * cfg.num_hidden_layers, reads


def _dots(jaxpr):
    """Every `dot_general` of `jaxpr` and of the jaxprs in its equations' parameters; of a
    `cond`, one branch (a kernel is staged once per lowering platform, with
    `jax.lax.platform_dependent`, and one program holds one of them)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        if eqn.primitive.name == "cond":
            yield from _dots(eqn.params["branches"][0].jaxpr)
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _dots(inner)


@pytest.mark.parametrize(
    "energy", [None, Sigmoid(bias=jnp.asarray(-2.0))], ids=["softmax", "sigmoid"]
)
def test_a_round_robin_cache_is_neither_gathered_nor_reordered(energy):
    """On a cache sharded round-robin over 2 devices, a decode step appends in place and an
    order-free energy reads every shard where it lies: nothing shard-sized or larger is
    all-gathered, gathered or copied (the energy package's own zeroing of non-finite keys
    inside `tree_energy_attention` is one fused pass per shard, counted separately)."""
    be = tree(2)
    model = Transformer(GQA, energy=energy, key=jax.random.key(0)).unstack_layers()
    cache = model.init_cache(2048, mesh=be.mesh, kv_axis="kv")
    assert isinstance(cache, KVCache)
    text = step_analysis(model, cache, be).as_text() or ""
    layer_k = cache.layer(0).k
    assert isinstance(layer_k, jax.Array)
    shard = layer_k.size // 2
    ops = big_copies(text, shard)
    assert not [op for op in ops if re.search(r"all-gather|gather|all-to-all|sort", op)], ops
    if energy is None:
        assert ops == []


@pytest.mark.parametrize(
    "energy",
    [
        Sigmoid(bias=jnp.asarray(-2.0)),
        Softmax(alibi_slopes=jnp.array([0.5, 0.25])),
        StickBreaking(),
    ],
    ids=["sigmoid", "alibi", "stick-breaking"],
)
def test_decoding_over_a_round_robin_cache_matches_the_full_forward(energy, getkey):
    """A cache sharded round-robin (block 2 over 2 devices) read by the in-place path: the
    positions go to the energy's context (ALiBi), an ordered energy is put in order."""
    be = tree(2)
    model = Transformer(CONFIG, energy=energy, key=getkey())
    tokens = jax.random.randint(getkey(), (11,), 0, CONFIG.vocab_size)
    full = model(tokens, backend="reference")
    assert not isinstance(full, tuple)
    cache = model.init_cache(16, mesh=be.mesh, kv_axis="kv", block=2, layout="bhsd")
    assert isinstance(cache, KVCache) and cache.devices == 2
    logits, cache = prefill(model, tokens[:7], cache, backend="energy")
    np.testing.assert_allclose(logits, full[:7], rtol=2e-5, atol=2e-5)
    for i in range(7, 11):
        step, cache = decode_step(model, tokens[i], cache, backend="energy")
        np.testing.assert_allclose(step, full[i], rtol=2e-5, atol=2e-5)
