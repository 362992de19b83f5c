"""Prefill, one decode step, and generation loops over a KV cache."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._attention import AttentionBackend, as_backend
from ._cache import KVCache, remember, reserve
from ._llama import Transformer, check_token_ids, check_token_type


def prefill(
    model: Transformer,
    tokens: Int[Array, " seq"],
    cache: KVCache,
    *,
    backend: str | AttentionBackend | None = None,
) -> tuple[Float[Array, "seq vocab"], KVCache]:
    """Run `tokens` after what `cache` holds; return their logits and the updated cache.

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
    cache: KVCache,
    *,
    backend: str | AttentionBackend | None = None,
) -> tuple[Float[Array, " vocab"], KVCache]:
    """One token in, next-token logits out. Shapes never change, so this compiles once.

    A full cache raises a `ValueError` before running (see `KVCache`, "Overflow"). The token
    id's value is not checked, so that a token sampled on the device need not be copied to the
    host; an id outside `[0, vocab_size)` reads a clamped embedding row (see `Transformer`).
    """
    check_token_type("decode_step", token, model.config.vocab_size, ndim=0)
    length = reserve(cache, 1)
    logits, cache = _decode_step(model, token, cache, backend=backend)
    remember(cache, length)
    return logits, cache


@eqx.filter_jit
def _prefill(model, tokens, cache, *, backend):
    return model(tokens, cache, backend=backend)


@eqx.filter_jit
def _decode_step(model, token, cache, *, backend):
    logits, cache = model(token[None], cache, backend=backend)
    return logits[0], cache


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
    backend: str | AttentionBackend | None = None,
    mesh=None,
    kv_axis=None,
    max_len: int | None = None,
) -> Int[Array, " total"] | Int[Array, "batch total"]:
    """Generate `max_new_tokens` after `prompt` (one sequence, or a batch of equal-length ones).

    Prefills the prompt into a fresh KV cache, then decodes token by token inside one compiled
    `lax.scan`. `temperature=0` is greedy decoding; otherwise a `key` is needed. With
    `backend="tree"` (and `mesh`, `kv_axis`), the cache is sharded along the sequence over the
    mesh axis, tokens are appended round-robin so the shards fill evenly, and attention is
    `tree_decode`.

    The arguments are checked before anything runs, with a `ValueError` that names the value:
    a prompt that is empty, not integer, or (when concrete) holds ids outside
    `[0, vocab_size)`; `temperature < 0`; `top_k` outside `[1, vocab_size]`; and a `max_len`
    too small for the prompt and the new tokens (`prompt + max_new_tokens - 1` tokens are
    cached: the last one is sampled, not run).

    **Returns:** the prompt followed by the new tokens, `[prompt + max_new_tokens]` (with a
    leading batch axis if the prompt had one).
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
    be = model.layers.self_attn.backend if backend is None else as_backend(backend, mesh, kv_axis)
    batched = prompt.ndim == 2
    prompts = prompt if batched else prompt[None]
    n_prompt = prompts.shape[1]
    total = n_prompt + max_new_tokens
    cache_mesh = be.mesh if be.name == "tree" else None
    cache_axis = be.kv_axis if be.name == "tree" else None
    if max_len is not None and max_len < 1:
        raise ValueError(f"generate: max_len must be at least 1, got {max_len}")
    cache = model.init_cache(max_len or total - 1, mesh=cache_mesh, kv_axis=cache_axis)
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
    out = _generate_batch(
        model,
        prompts,
        cache,
        keys,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        backend=be,
    )
    return out if batched else out[0]


def _check_sampling(name: str, temperature: float, top_k: int | None, vocab: int) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{name}: temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"{name}: top_k must be in [1, vocab_size={vocab}], got {top_k}")


# The settings are static (hashable) arguments: a second call with the same shapes and settings
# reuses the compiled loop.
@eqx.filter_jit
def _generate_batch(model, prompts, cache, keys, *, max_new_tokens, temperature, top_k, backend):
    batch = prompts.shape[0]
    # One cache per row, the batch axis right after the layer axis: the layout the layer scan
    # slices without transposing (a batch axis in front would transpose the cache every step).
    cache = jax.tree.map(
        lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], batch, *x.shape[1:])), cache
    )
    axes = jax.tree.map(lambda _: 1, cache)
    forward = jax.vmap(
        lambda tokens, cache: model(tokens, cache, backend=backend),
        in_axes=(0, axes),
        out_axes=(0, axes),
    )
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

    logits, cache = forward(prompts, cache)
    # The last token needs no forward pass of its own: scan one step fewer, then sample it.
    (last, _), new = jax.lax.scan(step, (logits[:, -1], cache), jnp.arange(max_new_tokens - 1))
    final = pick(last, max_new_tokens - 1)
    return jnp.concatenate([prompts.astype(jnp.int32), new.T, final[:, None]], axis=1)
