"""H2O eviction of a KV cache: the kept keys keep their true positions, attention after an
eviction is attention over the kept keys (checked against the model with an explicit mask of
the evicted keys), and decoding continues after them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treeattn.models import (
    KVCache,
    LlamaConfig,
    Transformer,
    attention_scores,
    decode_step,
    prefill,
)
from treeattn.pretrained import CHECKPOINTS, CharTokenizer, load_text


CONFIG = LlamaConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
PROMPT = 24
MAX_LEN = 48
TOL = 1e-5  # float32, relative to the largest logit


@pytest.fixture(scope="module")
def model():
    return Transformer(CONFIG, key=jax.random.key(0))


def tokens_of(n, seed=1, vocab=CONFIG.vocab_size):
    return jax.random.randint(jax.random.key(seed), (n,), 0, vocab, dtype=jnp.int32)


def random_scores(slots, seed=2, layers=CONFIG.num_hidden_layers, heads=2):
    return jax.random.uniform(jax.random.key(seed), (layers, slots, heads))


# ---------------------------------------------------------------------------------------------
# An independent reference: which positions each (layer, kv head) holds, simulated in NumPy,
# and the model run over every token with those as an explicit mask
# ---------------------------------------------------------------------------------------------


def h2o_choice(scores, held, keep, recent, per_head):
    """NumPy: the positions each (layer, kv head) keeps from `held[l][g]` (sorted positions; slot
    a holds held[l][g][a]) under `scores[l, slot, g]`."""
    scores = np.asarray(scores, np.float64)
    out = []
    for layer, heads in enumerate(held):
        kept_heads = []
        summed = scores[layer, : len(heads[0])].sum(axis=1)
        for g, positions in enumerate(heads):
            n = len(positions)
            window = set(range(max(n - recent, 0), n))
            s = scores[layer, :n, g] if per_head else summed
            others = [a for a in range(n) if a not in window]
            best = sorted(others, key=lambda a: -s[a])[:keep]
            kept_heads.append(sorted(positions[a] for a in window | set(best)))
        out.append(kept_heads)
    return out


def visibility(total, evictions, layers=CONFIG.num_hidden_layers, heads=2, window=None):
    """[layers, kv_heads, total, total]: query row r sees what (layer, head) held before it and
    itself; `evictions` maps a length (tokens seen) to a function of what is held -> kept."""
    held = [[[] for _ in range(heads)] for _ in range(layers)]
    vis = np.zeros((layers, heads, total, total), bool)
    for r in range(total):
        if r in evictions:
            held = evictions[r](held)
        for layer in range(layers):
            for g in range(heads):
                held[layer][g].append(r)
                vis[layer, g, r, held[layer][g]] = True
    if window is not None:
        pos = np.arange(total)
        vis &= (pos[:, None] - pos[None, :]) < window
    return vis


def masked_logits(model, tokens, vis):
    """The model over `tokens`, layer l's query head h seeing the keys `vis[l, h // group]`."""
    c = model.config
    group = c.num_attention_heads // c.num_key_value_heads
    x = jax.vmap(model.embed_tokens)(tokens)
    for i in range(c.num_hidden_layers):
        block = model.block(i)
        h = block.input_layernorm(x)
        mask = jnp.asarray(np.repeat(vis[i], group, axis=0))  # [heads, q, kv]
        x = x + block.self_attn(h, h, h, mask=mask, backend="reference")
        x = x + block.mlp(block.post_attention_layernorm(x))
    x = model.norm(x)
    if model.lm_head is None:
        return x @ model.embed_tokens.weight.T
    return jax.vmap(model.lm_head)(x)


def close(a, b, tol=TOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))


def held_positions(cache):
    """Per (layer, kv head): the positions of the filled slots, as the cache records them."""
    n = int(cache.length)
    out = []
    for i in range(cache.layers):
        pos = np.asarray(cache.layer(i).slot_positions)
        pos = np.broadcast_to(pos, (2, pos.shape[-1])) if pos.ndim == 1 else pos
        out.append([list(pos[g, :n]) for g in range(pos.shape[0])])
    return out


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_keep_all_is_a_no_op(model, layout):
    prompt = tokens_of(PROMPT)
    _, cache = prefill(model, prompt, model.init_cache(MAX_LEN, layout=layout))
    before = jax.tree.map(jnp.copy, cache)
    evicted = cache.evict(attention_scores(model, prompt), keep=PROMPT)
    assert int(evicted.length) == PROMPT and int(evicted.dropped) == 0
    for i in range(CONFIG.num_hidden_layers):
        np.testing.assert_array_equal(
            evicted.layer(i).slot_positions[:, :PROMPT], [np.arange(PROMPT)] * 2
        )
    token = jnp.int32(5)
    expected, _ = decode_step(model, token, before)
    got, _ = decode_step(model, token, evicted)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("keep, recent", [(6, 4), (1, 0), (10, 0), (3, 30)])
def test_attention_after_eviction_is_over_the_kept_keys(model, per_head, layout, keep, recent):
    prompt, later = tokens_of(PROMPT), tokens_of(5, seed=3)
    scores = random_scores(PROMPT)
    _, cache = prefill(model, prompt, model.init_cache(MAX_LEN, layout=layout))
    cache = cache.evict(scores, keep, recent=recent, per_head=per_head)
    kept = min(PROMPT, keep + recent)
    assert (int(cache.length), int(cache.dropped), int(cache.next_position)) == (
        kept,
        PROMPT - kept,
        PROMPT,
    )

    def choose(held):
        return h2o_choice(scores, held, keep, recent, per_head)

    # The kept slots hold their true positions, in order.
    full = [[list(range(PROMPT))] * 2 for _ in range(CONFIG.num_hidden_layers)]
    assert held_positions(cache) == choose(full)
    # Two decode steps, then a causal chunk of three tokens, each against the kept keys.
    tokens = jnp.concatenate([prompt, later])
    vis = visibility(len(tokens), {PROMPT: choose})
    reference = masked_logits(model, tokens, vis)
    for j in range(2):
        logits, cache = decode_step(model, later[j], cache)
        close(logits, reference[PROMPT + j])
    logits, cache = prefill(model, later[2:], cache)
    close(logits, reference[PROMPT + 2 :])
    assert int(cache.length) == kept + 5 and int(cache.next_position) == PROMPT + 5
    # Appended tokens sit after the kept ones, at their own positions.
    expected = [[h + list(range(PROMPT, PROMPT + 5)) for h in heads] for heads in choose(full)]
    assert held_positions(cache) == expected


def test_evicting_twice_while_decoding(model):
    prompt, later = tokens_of(PROMPT), tokens_of(8, seed=4)
    s1, s2 = random_scores(PROMPT, seed=5), random_scores(MAX_LEN, seed=6)
    _, cache = prefill(model, prompt, model.init_cache(MAX_LEN))
    cache = cache.evict(s1, 8, recent=2)
    outs = []
    for j in range(4):
        logits, cache = decode_step(model, later[j], cache)
        outs.append(logits)
    cache = cache.evict(s2, 5, recent=3)  # scores cover more slots than are filled
    assert int(cache.length) == 8 and int(cache.next_position) == PROMPT + 4
    for j in range(4, 8):
        logits, cache = decode_step(model, later[j], cache)
        outs.append(logits)
    vis = visibility(
        PROMPT + 8,
        {
            PROMPT: lambda held: h2o_choice(s1, held, 8, 2, True),
            PROMPT + 4: lambda held: h2o_choice(s2, held, 5, 3, True),
        },
    )
    reference = masked_logits(model, jnp.concatenate([prompt, later]), vis)
    close(jnp.stack(outs), reference[PROMPT:])


def test_sliding_window_evicts_per_layer(model):
    config = dataclasses.replace(CONFIG, sliding_window=10)
    windowed = Transformer(config, key=jax.random.key(0))
    prompt, later = tokens_of(PROMPT), tokens_of(3, seed=3)
    scores = random_scores(PROMPT)
    _, cache = prefill(windowed, prompt, windowed.init_cache(MAX_LEN))
    with pytest.raises(ValueError, match="per_head=False"):
        decode_step(windowed, later[0], cache.evict(scores, 6, recent=2))
    _, cache = prefill(windowed, prompt, windowed.init_cache(MAX_LEN))
    cache = cache.evict(scores, 6, recent=2, per_head=False)
    tokens = jnp.concatenate([prompt, later])

    def choose(held):
        return h2o_choice(scores, held, 6, 2, per_head=False)

    reference = masked_logits(
        windowed, tokens, visibility(len(tokens), {PROMPT: choose}, window=10)
    )
    logits, cache = decode_step(windowed, later[0], cache)
    close(logits, reference[PROMPT])
    logits, cache = prefill(windowed, later[1:], cache)
    close(logits, reference[PROMPT + 1 :])


def test_decoder_evicts_and_resets(model):
    prompt, later = tokens_of(PROMPT), tokens_of(3, seed=3)
    scores = attention_scores(model, prompt)
    _, cache = prefill(model, prompt, model.init_cache(MAX_LEN))
    cache = cache.evict(scores, 5, recent=4)
    expected = []
    for t in later:
        logits, cache = decode_step(model, t, cache)
        expected.append(logits)
    decoder = model.decoder(max_len=MAX_LEN)
    decoder.prefill(prompt)
    decoder.evict(scores, 5, recent=4)
    assert decoder.length == 9
    got = [decoder.step(t) for t in later]
    close(jnp.stack(got), jnp.stack(expected))
    decoder.reset()
    assert decoder.cache.slot_positions is None and decoder.length == 0
    logits = decoder.prefill(prompt)
    close(logits, model(prompt))


def test_batched_cache_evicts_each_row(model):
    prompts = jnp.stack([tokens_of(PROMPT, seed=1), tokens_of(PROMPT, seed=7)])
    scores = jnp.stack([random_scores(PROMPT, seed=2), random_scores(PROMPT, seed=8)])
    decoder = model.decoder(max_len=MAX_LEN, batch=2)
    decoder.prefill(prompts)
    decoder.evict(scores, 4, recent=3)
    steps = jnp.array([[1, 2], [3, 4]], jnp.int32)
    got = [decoder.step(steps[:, j]) for j in range(2)]
    for row in range(2):
        _, cache = prefill(model, prompts[row], model.init_cache(MAX_LEN))
        cache = cache.evict(scores[row], 4, recent=3)
        for j in range(2):
            logits, cache = decode_step(model, steps[row, j], cache)
            close(got[j][row], logits)


def test_attention_scores_are_received_attention(model):
    prompt = tokens_of(PROMPT)
    scores = np.asarray(attention_scores(model, prompt))
    assert scores.shape == (CONFIG.num_hidden_layers, PROMPT, 2)
    # Softmax: every query row gives weight 1, and each kv head serves 2 query heads.
    np.testing.assert_allclose(scores.sum(axis=1), 2 * PROMPT, rtol=1e-5)
    # Key a is seen by the PROMPT - a queries at or after it: the last key only by itself.
    assert np.all(scores[:, -1] <= 2 + 1e-5)
    # Stacked and unstacked layers agree.
    np.testing.assert_allclose(attention_scores(model.unstack_layers(), prompt), scores, rtol=1e-6)


def test_errors_name_the_arguments(model):
    prompt = tokens_of(PROMPT)
    _, cache = prefill(model, prompt, model.init_cache(MAX_LEN))
    scores = random_scores(PROMPT)
    with pytest.raises(ValueError, match=f"keep=25 must be at most the cache's length {PROMPT}"):
        cache.evict(scores, 25)
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        cache.evict(scores, 0)
    with pytest.raises(ValueError, match="recent must be an int >= 0, got -1"):
        cache.evict(scores, 3, recent=-1)
    with pytest.raises(ValueError, match=r"scores must have shape \[2, slots, kv_heads=2\]"):
        cache.evict(scores[:, :10], 3)
    with pytest.raises(ValueError, match=r"scores must have shape"):
        cache.evict(scores[0], 3)
    one = KVCache.create(2, 8, 4)
    with pytest.raises(ValueError, match="keep=1 must be at most the cache's length 0"):
        one.evict(jnp.zeros((8, 2)), 1)


def test_shipped_model_evicts_per_head():
    path = CHECKPOINTS / "sonnets"
    model = Transformer.from_pretrained(path)
    tokenizer = CharTokenizer.load(path)
    ids = jnp.asarray(tokenizer.encode(load_text("sonnets.txt")[1000:1100]))
    prompt, later = ids[:80], ids[80:84]
    scores = attention_scores(model, prompt)
    _, cache = prefill(model, prompt, model.init_cache(128))
    cache = cache.evict(scores, 20, recent=8)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads

    def choose(held):
        return h2o_choice(scores, held, 20, 8, True)

    vis = visibility(84, {80: choose}, layers=layers, heads=heads)
    reference = masked_logits(model, ids[:84], vis)
    for j in range(4):
        logits, cache = decode_step(model, later[j], cache)
        close(logits, reference[80 + j])
