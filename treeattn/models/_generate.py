"""Prefill, one decode step, and generation loops over a KV cache."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._attention import AttentionBackend, as_backend
from ._cache import KVCache
from ._llama import Transformer


@eqx.filter_jit
def prefill(
    model: Transformer,
    tokens: Int[Array, " seq"],
    cache: KVCache,
    *,
    backend: str | AttentionBackend | None = None,
) -> tuple[Float[Array, "seq vocab"], KVCache]:
    """Run `tokens` after what `cache` holds; return their logits and the updated cache."""
    logits, cache = model(tokens, cache, backend=backend)
    return logits, cache


@eqx.filter_jit
def decode_step(
    model: Transformer,
    token: Int[Array, ""],
    cache: KVCache,
    *,
    backend: str | AttentionBackend | None = None,
) -> tuple[Float[Array, " vocab"], KVCache]:
    """One token in, next-token logits out. Shapes never change, so this compiles once."""
    logits, cache = model(token[None], cache, backend=backend)
    return logits[0], cache


def sample(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray | None,
    *,
    temperature: float,
    top_k: int | None,
) -> Int[Array, ""]:
    """Greedy when `temperature == 0`; otherwise softmax sampling, optionally from the top k."""
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

    **Returns:** the prompt followed by the new tokens, `[prompt + max_new_tokens]` (with a
    leading batch axis if the prompt had one).
    """
    if temperature != 0.0 and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs key=")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be at least 1, got {max_new_tokens}")
    if backend is None and (mesh is not None or kv_axis is not None):
        raise ValueError("generate: mesh= and kv_axis= go with backend='tree'")
    be = model.layers.self_attn.backend if backend is None else as_backend(backend, mesh, kv_axis)
    batched = prompt.ndim == 2
    prompts = prompt if batched else prompt[None]
    n_prompt = prompts.shape[1]
    total = n_prompt + max_new_tokens
    cache_mesh = be.mesh if be.name == "tree" else None
    cache_axis = be.kv_axis if be.name == "tree" else None
    cache = model.init_cache(max_len or total - 1, mesh=cache_mesh, kv_axis=cache_axis)
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
