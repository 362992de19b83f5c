"""Prefill, one decode step, and generation loops over a KV cache."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..decode import AttentionBackend, AttentionName
from ._cache import Cache, after_prompts, empty_rows, prompt_padding, remember, reserve
from ._llama import Transformer, check_token_ids, check_token_type


def prefill(
    model: Transformer,
    tokens: Int[Array, " seq"],
    cache: Cache,
    *,
    backend: AttentionName | AttentionBackend | None = None,
) -> tuple[Float[Array, "seq vocab"], Cache]:
    """Run `tokens` after what `cache` holds; return their logits and the updated cache.

    The cache passed in is donated (its buffers are updated in place and become the returned
    cache's): use the returned one from then on.

    Raises a `ValueError` before running if the tokens are not integers, if a concrete
    `tokens` holds ids outside `[0, vocab_size)`, or if they do not fit into the cache (see
    `KVCache`, "Overflow").
    """
    check_token_type("prefill", tokens, model.config.vocab_size, ndim=1)
    check_token_ids("prefill", tokens, model.config.vocab_size)
    length = reserve(cache, tokens.shape[0])
    logits, cache = _prefill(model, tokens, cache, backend=backend)
    remember(cache, length)
    return logits, cache


def decode_step(
    model: Transformer,
    token: Int[Array, ""],
    cache: Cache,
    *,
    backend: AttentionName | AttentionBackend | None = None,
) -> tuple[Float[Array, " vocab"], Cache]:
    """One token in, next-token logits out. Shapes never change, so this compiles once.

    The step reads each weight and each cached key and value once and writes only the new
    token's keys and values, in place: the cache passed in is donated (use the returned one).
    For a model whose layers are stacked (as loaded or trained), unstack them once first,
    `model = model.unstack_layers()`: a stacked model's weights are copied layer by layer on
    every step.

    A full cache raises a `ValueError` before running (see `KVCache`, "Overflow"). The token
    id's value is not checked, so that a token sampled on the device need not be copied to the
    host; an id outside `[0, vocab_size)` reads a clamped embedding row (see `Transformer`).
    """
    check_token_type("decode_step", token, model.config.vocab_size, ndim=0)
    length = reserve(cache, 1)
    logits, cache = _decode_step(model, token, cache, backend=backend)
    remember(cache, length)
    return logits, cache


def _prefill(model, tokens, cache, *, backend):
    params, static = eqx.partition(model, eqx.is_array)
    return _run(params, static, tokens, cache, backend=backend)


def _decode_step(model, token, cache, *, backend):
    params, static = eqx.partition(model, eqx.is_array)
    logits, cache = _run(params, static, token[None], cache, backend=backend)
    return logits[0], cache


# The cache is donated: each layer writes its new keys and values into the buffers it was
# given, and the step holds no copy of any layer's cache (checked from the compiled HLO in
# tests/test_model_decode.py).
@functools.partial(jax.jit, static_argnames=("static", "backend"), donate_argnames=("cache",))
def _run(params, static, tokens, cache, *, backend):
    return eqx.combine(params, static)(tokens, cache, backend=backend)


def sample(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray | None,
    *,
    temperature: float,
    top_k: int | None,
) -> Int[Array, ""]:
    """Greedy when `temperature == 0`; otherwise softmax sampling, optionally from the top k
    (`1 <= top_k <= vocab`)."""
    _check_sampling("sample", temperature, top_k, logits.shape[-1])
    if temperature == 0.0:
        return jnp.argmax(logits).astype(jnp.int32)
    assert key is not None
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def generate(
    model: Transformer,
    prompt: Int[Array, " prompt"] | Int[Array, "batch prompt"],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: PRNGKeyArray | None = None,
    backend: AttentionName | AttentionBackend | None = None,
    mesh=None,
    kv_axis=None,
    max_len: int | None = None,
    attention_mask: Array | None = None,
) -> Int[Array, " total"] | Int[Array, "batch total"]:
    """Generate `max_new_tokens` after `prompt` (one sequence, or a batch).

    Prefills the prompt into a fresh KV cache, then decodes token by token inside one compiled
    `lax.scan`, every row of a batch at once (one kernel call per layer and step, not a loop
    over rows). `temperature=0` is greedy decoding; otherwise a `key` is needed. With
    `backend="tree"` (and `mesh`, `kv_axis`), the cache is sharded along the sequence over the
    mesh axis, tokens are appended round-robin so the shards fill evenly, and attention is
    `tree_decode` (`"ring"`: `ring_decode`, the baseline).

    **Prompts of different lengths.** As with transformers, pad them to one length and pass
    `attention_mask` (`[batch, prompt]`, 1 or True for a prompt token, 0 for padding, on
    either side): each row then keeps its own length in the cache, its tokens sit at positions
    0, 1, ... (what transformers computes from the mask), and no padding is attended to.

    The arguments are checked before anything runs, with a `ValueError` that names the value:
    a prompt that is empty, not integer, or (when concrete) holds ids outside
    `[0, vocab_size)`; an `attention_mask` of another shape or with a row of padding only;
    `temperature < 0`; `top_k` outside `[1, vocab_size]`; and a `max_len` too small for the
    prompt and the new tokens (`prompt + max_new_tokens - 1` tokens are cached: the last one
    is sampled, not run).

    **Returns:** the prompt (as given, padding included) followed by the new tokens,
    `[prompt + max_new_tokens]` (with a leading batch axis if the prompt had one).
    """
    vocab = model.config.vocab_size
    _check_sampling("generate", temperature, top_k, vocab)
    if temperature != 0.0 and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs key=")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be at least 1, got {max_new_tokens}")
    if backend is None and (mesh is not None or kv_axis is not None):
        raise ValueError("generate: mesh= and kv_axis= go with backend='tree'")
    if not hasattr(prompt, "ndim"):
        prompt = jnp.asarray(prompt)
    if prompt.ndim not in (1, 2):
        raise ValueError(
            f"generate: prompt must be [prompt] or [batch, prompt], got shape {prompt.shape}"
        )
    check_token_type("generate", prompt, vocab, ndim=prompt.ndim)
    if prompt.shape[-1] == 0 or prompt.size == 0:
        raise ValueError(f"generate: the prompt is empty (shape {prompt.shape})")
    check_token_ids("generate", prompt, vocab)
    be = model.backend if backend is None else AttentionBackend.of(backend, mesh, kv_axis)
    batched = prompt.ndim == 2
    prompts = prompt if batched else prompt[None]
    lengths = _prompt_lengths(attention_mask, prompts.shape)
    n_prompt = prompts.shape[1]
    total = n_prompt + max_new_tokens
    cache_mesh = be.mesh if be.sharded else None
    cache_axis = be.kv_axis if be.sharded else None
    if max_len is not None and max_len < 1:
        raise ValueError(f"generate: max_len must be at least 1, got {max_len}")
    # The cache's shapes without allocating it; then one cache per row, allocated in place
    # and donated to the loop, which updates it where it lies.
    layout = model.block(0).self_attn.cache_layout(backend=be)
    cache = jax.eval_shape(
        lambda: model.init_cache(
            max_len or total - 1, mesh=cache_mesh, kv_axis=cache_axis, layout=layout
        )
    )
    if total - 1 > cache.max_len:
        raise ValueError(
            f"generate: a prompt of {n_prompt} token(s) and max_new_tokens={max_new_tokens} "
            f"need a cache of {total - 1} tokens, more than max_len={max_len}"
            + (f" (rounded up to {cache.max_len})" if cache.max_len != max_len else "")
        )
    keys = (
        jax.random.split(key, prompts.shape[0])
        if key is not None
        else jnp.zeros((prompts.shape[0],), jnp.uint32)
    )
    # One set of arrays per layer: each weight read in place once per step (see
    # `Transformer.unstack_layers`); the copy is made once per call.
    params, static = eqx.partition(model.unstack_layers(), eqx.is_array)
    cache = empty_rows(cache, prompts.shape[0])
    out, _ = _generate_batch(
        params,
        static,
        prompts,
        lengths,
        cache,
        keys,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        backend=be,
    )
    return out if batched else out[0]


def _prompt_lengths(mask, shape) -> Array | None:
    """Per-row prompt lengths from a transformers-style attention mask (None: all full)."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    batch = shape if len(mask.shape) == 2 else shape[1:]
    if tuple(mask.shape) != tuple(batch):
        raise ValueError(
            f"generate: attention_mask must have the prompt's shape {tuple(batch)}, "
            f"got {tuple(mask.shape)}"
        )
    if mask.ndim == 1:
        mask = mask[None]
    if mask.dtype != jnp.bool_:
        mask = mask != 0
    lengths = jnp.sum(mask, axis=1, dtype=jnp.int32)
    empty = np.flatnonzero(np.asarray(lengths) == 0)
    if empty.size:
        raise ValueError(f"generate: attention_mask rows {empty.tolist()} hold no prompt token")
    return mask


def _check_sampling(name: str, temperature: float, top_k: int | None, vocab: int) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{name}: temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"{name}: top_k must be in [1, vocab_size={vocab}], got {top_k}")


# The settings are static (hashable) arguments: a second call with the same shapes and settings
# reuses the compiled loop. The cache (one per row) is donated and returned: the loop updates
# its buffers in place, and the program holds no copy of them (checked from the compiled HLO in
# tests/test_model_decode.py).
@functools.partial(
    jax.jit,
    static_argnames=("static", "max_new_tokens", "temperature", "top_k", "backend"),
    donate_argnames=("cache",),
)
def _generate_batch(
    params, static, prompts, mask, cache, keys, *, max_new_tokens, temperature, top_k, backend
):
    model = eqx.combine(params, static)
    batch, n_prompt = prompts.shape
    if mask is None:
        tokens, lengths = prompts, jnp.full((batch,), n_prompt, jnp.int32)
    else:
        # Each row's prompt tokens moved to its front, in order (stable): position i of a row
        # is its i-th prompt token, as transformers numbers them from the mask.
        order = jnp.argsort(~mask, axis=1, stable=True)
        tokens = jnp.take_along_axis(prompts, order, axis=1)
        lengths = jnp.sum(mask, axis=1, dtype=jnp.int32)
    forward = jax.vmap(lambda tokens, cache: model(tokens, cache, backend=backend))
    sampling = temperature != 0.0

    def pick(logits, i):
        subs = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys) if sampling else None
        draw = functools.partial(sample, temperature=temperature, top_k=top_k)
        if subs is None:
            return jax.vmap(lambda lg: draw(lg, None))(logits)
        return jax.vmap(draw)(logits, subs)

    def step(carry, i):
        logits, cache = carry
        token = pick(logits, i)
        next_logits, cache = forward(token[:, None], cache)
        return (next_logits[:, 0], cache), token

    # Only each row's last prompt token is sampled from: the prefill computes its logits alone.
    prefill = jax.vmap(
        lambda tokens, cache, last: model(tokens, cache, backend=backend, logits_to_keep=last[None])
    )
    padded = prompt_padding(cache, None if mask is None else lengths)
    logits, cache = prefill(tokens, padded, lengths - 1)
    # A shorter row's padding was run after its prompt; it is not counted: the row's next
    # token overwrites it, and nothing attends to it before then (a linear state never
    # absorbed it).
    cache = after_prompts(cache, lengths)
    first = logits[:, 0]
    # The last token needs no forward pass of its own: scan one step fewer, then sample it.
    (last, cache), new = jax.lax.scan(step, (first, cache), jnp.arange(max_new_tokens - 1))
    final = pick(last, max_new_tokens - 1)
    tokens = jnp.concatenate([prompts.astype(jnp.int32), new.T, final[:, None]], axis=1)
    return tokens, cache
