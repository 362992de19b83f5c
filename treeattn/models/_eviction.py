"""H2O's heavy-hitter scores of a prompt (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"): the
attention each token received in every layer and kv head, for `KVCache.evict`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._checks import check_token_ids, check_token_type


if TYPE_CHECKING:
    from ._llama import Transformer


def attention_scores(
    model: Transformer, tokens: Int[Array, " seq"]
) -> Float[Array, "layers seq kv_heads"]:
    r"""The attention each token of `tokens` received from the later ones (itself included),
    in every layer, summed over the query heads of each kv head (H2O's accumulated score):

    $$r_{l,a,g} = \sum_{h \in g} \sum_i p^{(l)}_{i,h,a},$$

    per layer the gradient of $\sum F$ in a per-key bias
    ([`received_attention`][treeattn.energy.received_attention]), with the layer's causality,
    window and energy. Computed on demand by running the model over `tokens` once more, with
    no cache: a decode step is untouched (and not slowed) whether eviction is used or not.

    For a prompt prefilled into an empty cache, slot `a` holds token `a`, so these are the
    scores [`KVCache.evict`][treeattn.models.KVCache.evict] takes:

    ```python
    logits, cache = prefill(model, prompt, model.init_cache(512))
    cache = cache.evict(attention_scores(model, prompt), keep=len(prompt) // 4, recent=16)
    ```

    **Returns:** `[num_hidden_layers, seq, num_key_value_heads]`, float32.
    """
    check_token_type("attention_scores", tokens, model.config.vocab_size, ndim=1)
    check_token_ids("attention_scores", tokens, model.config.vocab_size)
    return _scores(model, tokens)


@eqx.filter_jit
def _scores(model: Transformer, tokens):
    x = jax.vmap(model.embed_tokens)(tokens)

    def layer(x, block):
        r = block.self_attn.received_attention(block.input_layernorm(x))
        x, _ = block(x, None, None)
        return x, r

    if isinstance(model.layers, tuple):
        rs = []
        for block in model.layers:
            x, r = layer(x, block)
            rs.append(r)
        return jnp.stack(rs)
    dynamic, static = eqx.partition(model.layers, eqx.is_array)
    _, rs = jax.lax.scan(lambda x, p: layer(x, eqx.combine(p, static)), x, dynamic)
    return rs
