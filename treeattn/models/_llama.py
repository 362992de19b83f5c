"""A Llama-style decoder: pre-norm blocks with RoPE, GQA and SwiGLU, on any attention backend."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._numerics import Layout
from ..decode import AttentionBackend, AttentionName
from ..energy import Energy, is_plain_softmax
from ._attention import MultiheadAttention
from ._cache import Cache, KVCache, on_host, reserve
from ._checks import check_token_ids, check_token_type
from ._config import LlamaConfig
from ._generate import Decoder
from ._gguf import read_gguf
from ._hf import model_from_tensors, read_pretrained, save_pretrained
from ._layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_linear, matmul, mlp_block


class DecoderBlock(eqx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    input_layernorm: RMSNorm
    self_attn: MultiheadAttention
    post_attention_layernorm: RMSNorm
    mlp: SwiGLU

    def __init__(
        self,
        config: LlamaConfig,
        *,
        backend: AttentionBackend,
        dtype=None,
        energy: Energy | None = None,
        key: PRNGKeyArray,
    ):
        k1, k2 = jax.random.split(key)
        c = config
        assert c.head_dim is not None and c.num_key_value_heads is not None  # resolved
        rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.self_attn = MultiheadAttention(
            c.num_attention_heads,
            c.hidden_size,
            qk_size=c.head_dim,
            vo_size=c.head_dim,
            use_query_bias=c.attention_bias or bool(c.qkv_bias),
            use_key_bias=c.attention_bias or bool(c.qkv_bias),
            use_value_bias=c.attention_bias or bool(c.qkv_bias),
            use_output_bias=c.attention_bias,
            dtype=dtype,
            num_kv_heads=c.num_key_value_heads,
            causal=True,
            # transformers: query i sees key j when i - sliding_window < j <= i.
            local_window_size=None if c.sliding_window is None else (c.sliding_window - 1, 0),
            rotary=rotary,
            qk_norm_eps=c.rms_norm_eps if c.qk_norm else None,
            backend=backend,
            energy=energy,
            key=k1,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(
            c.hidden_size, c.intermediate_size, use_bias=c.mlp_bias, dtype=dtype, key=k2
        )

    def __call__(self, x, cache: Cache | None, backend: AttentionBackend | None, segment_ids=None):
        norm = self.input_layernorm  # x + attn(norm(x)): on packed weights one call to heads
        if cache is None:
            attn = self.self_attn(x, x, x, backend=backend, segment_ids=segment_ids, norm=norm)
            new_cache = None
        else:
            attn, new_cache = self.self_attn(x, x, x, cache=cache, backend=backend, norm=norm)
        # h = x + attn, then h + mlp(norm(h)): on packed weights one call.
        x = mlp_block(x, self.post_attention_layernorm, self.mlp, cast(Array, attn))
        return x, new_cache

    def _attention_inputs(self, x, segment_ids=None) -> tuple[Array, Array, Array]:
        """The heads `(q, k, v)` that `self(x, None, ...)` attends with."""
        norm = self.input_layernorm
        q, k, v, *_ = self.self_attn._heads(x, x, x, segment_ids=segment_ids, norm=norm)
        return q, k, v


class Transformer(eqx.Module):
    """A Llama-family decoder-only language model (Llama, Mistral, Qwen2/Qwen2.5, Qwen3:
    one decoder, the differences are switches of `LlamaConfig`).

    The `num_hidden_layers` blocks are stored stacked (every array has a leading layer axis)
    and, without a cache, run with `lax.scan`, so compile time does not grow with depth. With a
    cache the layers run one after another, each updating its own cache buffer in place (see
    `KVCache`). Decoding (`decoder()`, `prefill`, `decode_step`, `generate`) prepares the
    weights once with one set of arrays per layer, so that a step reads each weight where it
    lies. Unbatched: `tokens[seq]`; batch with `jax.vmap`.

    ```python
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Transformer(config, key=jax.random.key(0))
    logits = model(jnp.arange(10))                      # [10, 256]
    ```
    """

    embed_tokens: eqx.nn.Embedding
    layers: DecoderBlock | tuple[DecoderBlock, ...]
    norm: RMSNorm
    lm_head: eqx.nn.Linear | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(
        self,
        config: LlamaConfig,
        *,
        backend: AttentionName | AttentionBackend = "energy",
        dtype=None,
        energy: Energy | None = None,
        key: PRNGKeyArray,
    ):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        be = AttentionBackend.of(backend)
        self.config = config
        self.embed_tokens = eqx.nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, key=k_embed
        )

        @eqx.filter_vmap
        def make(k):
            return DecoderBlock(config, backend=be, dtype=dtype, energy=energy, key=k)

        self.layers = make(jax.random.split(k_layers, config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else eqx.nn.Linear(
                config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, key=k_head
            )
        )

    def init_cache(
        self,
        max_len: int,
        *,
        mesh=None,
        kv_axis=None,
        block: int | None = None,
        dtype=None,
        layout: Layout | None = None,
        linear_state: bool | None = None,
    ) -> Cache:
        r"""An empty cache for all layers.

        A model whose attention energy is a [`LinearKernel`][treeattn.energy.LinearKernel]
        (without a sliding window) gets a [`LinearCache`][treeattn.models.LinearCache]: per
        layer the linear state $\sum_a \phi(k_a) v_a^\top$, $\sum_a \phi(k_a)$, against which
        a decode step takes constant time (`linear_state=False` gives a `KVCache` instead; the
        sharding arguments do not apply to a state). Any other model gets a `KVCache`, one
        buffer per layer, sharded over `mesh`/`kv_axis` (default: the model backend's, when it
        has one) in round-robin blocks of `block` tokens (default 16; for an energy with an
        ordered monoid, one contiguous block per shard: see `KVCache.create`). `layout`
        defaults to what decoding reads without a copy: the kernel of the model's backend
        for decoding (`AttentionBackend.decoding`) on its energy
        (`treeattn.decode.cache_layout`)."""
        kw = dict(locals(), layers=self.config.num_hidden_layers)
        del kw["self"]
        kw["dtype"] = dtype or self.embed_tokens.weight.dtype
        attn = self.block(0).self_attn
        linear = attn.uses_linear_state and linear_state is not False  # no layout to choose
        if layout is None and not linear:
            kw["layout"] = attn.cache_layout(kw["dtype"], backend=self.backend.decoding)
        return attn.init_cache(**kw)

    def decoder(self, **options) -> Decoder:
        """`Decoder(self, **options)`: a [`Decoder`][treeattn.models.Decoder] of this model,
        its weights prepared for decoding once (whether its layers are stacked or not), a KV
        cache of `max_len` tokens (one per row with `batch`; sharded over `mesh`/`kv_axis` with
        `backend="tree"` or `"ring"`, default the model's backend for decoding: `"flash"` for
        `"energy"`, see `AttentionBackend.decoding`; `dtype`, `layout` and
        `block` as in `init_cache`), and the cache's length on the host. It offers `prefill`,
        `step` and `generate`."""
        return Decoder(self, **options)

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend of the layers (each call may override it)."""
        first = self.layers[0] if isinstance(self.layers, tuple) else self.layers
        return first.self_attn.backend

    def block(self, i: int) -> DecoderBlock:
        """Block `i`: its own arrays when the layers are unstacked, else a slice of the stack."""
        if isinstance(self.layers, tuple):
            return self.layers[i]
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)

    def unstack_layers(self) -> Transformer:
        """The same model with one set of arrays per layer (`layers` a tuple of blocks).

        A step that reads a stacked weight through a slice makes XLA materialise the slice,
        a copy of every weight per step; the decoding calls (`Decoder`, `decode_step`, ...)
        therefore unstack a model once themselves. Training, `save_pretrained` and compile
        time prefer the stacked form (one `lax.scan`); `stack_layers` goes back.
        """
        if isinstance(self.layers, tuple):
            return self
        blocks = tuple(self.block(i) for i in range(self.config.num_hidden_layers))
        return eqx.tree_at(lambda m: m.layers, self, blocks)

    def stack_layers(self) -> Transformer:
        """The same model with its layers stacked (every array with a leading layer axis)."""
        if not isinstance(self.layers, tuple):
            return self
        dynamic = [eqx.partition(b, eqx.is_array)[0] for b in self.layers]
        static = eqx.partition(self.layers[0], eqx.is_array)[1]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *dynamic)
        return eqx.tree_at(lambda m: m.layers, self, eqx.combine(stacked, static))

    @jax.named_scope("treeattn.models.Transformer")
    def __call__(
        self,
        tokens: Int[Array, " seq"],
        cache: Cache | None = None,
        *,
        backend: AttentionName | AttentionBackend | None = None,
        logits_to_keep: int | Int[Array, " keep"] = 0,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "keep vocab"] | tuple[Float[Array, "keep vocab"], Cache]:
        """Logits of every position; with `cache`, the tokens follow the cached ones and the
        updated cache is returned too (decoding: `backend` defaults to the model's for
        decoding, `AttentionBackend.decoding`).

        `segment_ids` (integer `[seq]`, without a cache) packs several documents into one row,
        each contiguous: a token attends only to the earlier tokens of its own document, and
        rotary positions restart at 0 in each, so every document's logits are those it gets
        alone (see `treeattn.training.lm_loss` for a loss that stays within documents).

        `logits_to_keep` (as in transformers) computes the logits of some positions only: `0`
        (the default) every position, an int `k > 0` the last `k`, an integer array the
        positions it lists (`[keep]`, in order; checked when concrete, clamped to the tokens
        when traced, as token ids are). A prefill that only samples after the last token needs
        `logits_to_keep=1`, which skips the output head's `[seq, vocab]` product (14% of a
        1,024-token prefill of a 12 x 768 model with a 32,000-token vocabulary, on CPU).

        Token ids must be integers (checked always) in `[0, vocab_size)`. Concrete tokens
        (an eager call) are checked and an id outside raises a `ValueError`; traced tokens
        (under `jit`, `vmap`, `grad`) cannot be, and the embedding lookup clamps them: an id
        `>= vocab_size` reads the last row, a negative one counts from the end. Writing past
        the cache's `max_len` is covered in `KVCache` ("Overflow").
        """
        check_token_type("Transformer", tokens, self.config.vocab_size, ndim=1)
        check_token_ids("Transformer", tokens, self.config.vocab_size)
        return self.from_embeddings(
            jax.vmap(self.embed_tokens)(tokens),
            cache,
            backend=backend,
            logits_to_keep=logits_to_keep,
            segment_ids=segment_ids,
        )

    def from_embeddings(
        self,
        x: Float[Array, "seq hidden"],
        cache: Cache | None = None,
        *,
        backend: AttentionName | AttentionBackend | None = None,
        logits_to_keep: int | Int[Array, " keep"] = 0,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "keep vocab"] | tuple[Float[Array, "keep vocab"], Cache]:
        """As `__call__`, from token embeddings (differentiable inputs)."""
        keep = _logits_to_keep(logits_to_keep, x.shape[0])
        be = None if backend is None else AttentionBackend.of(backend)
        length = None
        if cache is not None:
            # A call with a cache decodes: on the backend for decoding, whose layout
            # `init_cache` gives the cache.
            be = self.backend.decoding if be is None else be
            if cache.layers != self.config.num_hidden_layers:
                raise ValueError(
                    f"Transformer: the cache holds {cache.layers} layers, the model has "
                    f"{self.config.num_hidden_layers} (make it with model.init_cache)"
                )
            length = reserve(cache, x.shape[0])
            if isinstance(cache, KVCache):
                # Checked once: on the host when it knows the length, else in the program.
                checked = length is not None or cache.checked
                cache = dataclasses.replace(cache, checked=True) if checked else cache
                cache = cache.check(x.shape[0])
        new_cache = None
        if cache is None and not isinstance(self.layers, tuple):
            dynamic, static = eqx.partition(self.layers, eqx.is_array)

            def layer(x, params):
                x, _ = eqx.combine(params, static)(x, None, be, segment_ids)
                return x, None

            # Unrolling a few layers per loop trip saves most of the loop overhead while
            # compile time stays bounded for deep models.
            x, _ = jax.lax.scan(layer, x, dynamic, unroll=min(4, self.config.num_hidden_layers))
        else:
            # With a cache, the layers run one after another in the program: each reads and
            # updates its own cache buffer in place (see `KVCache`), which a loop over a
            # stacked cache cannot do on XLA:CPU (the slice a layer reads is copied first).
            new_layers = []
            for i in range(self.config.num_hidden_layers):
                layer_cache = None if cache is None else cache.layer(i)
                x, layer_cache = self.block(i)(x, layer_cache, be, segment_ids)
                new_layers.append(layer_cache)
            if cache is not None:
                new_cache = cache.with_layers(new_layers)
        seq = x.shape[0]
        if isinstance(keep, int):
            x = x[-keep:]  # all of them for 0
        else:
            x = jnp.take(x, keep, axis=0, mode="clip")
        x = self.norm(x)
        if self.lm_head is None:
            with jax.numpy_dtype_promotion("standard"):
                dtype = jnp.result_type(x, self.embed_tokens.weight.dtype)
            logits = matmul(x.astype(dtype), self.embed_tokens.weight.astype(dtype))
        else:
            logits = apply_linear(self.lm_head, x)
        if cache is None or new_cache is None:
            return logits
        if cache.devices > 1:
            # A sharded cache cannot raise inside the program (see `KVCache`): the overflow,
            # decided from the replicated length alone, shows as NaN logits instead.
            overflow = jnp.max(cache.length) + seq > cache.max_len
            logits = jnp.where(overflow, jnp.asarray(jnp.nan, logits.dtype), logits)
        return logits, on_host(new_cache, length)

    def attention_inputs(
        self, tokens: Int[Array, " seq"], *, segment_ids: Int[Array, " seq"] | None = None
    ) -> tuple[
        Float[Array, "layers seq heads qk"],
        Float[Array, "layers seq kv_heads qk"],
        Float[Array, "layers seq kv_heads vo"],
    ]:
        """The queries, keys and values every layer's attention reads in `self(tokens)`
        (without a cache): after the projections, the q/k norms and the rotary embedding at
        each token's position, as the layer forms them (the same code).

        They are for inspecting attention with `treeattn.energy`: layer `i`'s attention is
        `energy_attention(q[i], k[i], v[i], causal=True)` (with the layer's
        `local_window_size` and `energy`, and `segment_ids` as `q_segment_ids` and
        `kv_segment_ids` when given), and its output projection
        `block(i).self_attn.output_proj` of that, reshaped to `[seq, heads * vo]`, is the
        block's attention output. So `attention_entropy(q[i], k[i], v[i], causal=True)` and
        `received_attention(...)` read the model's own attention maps.

        **Returns:** `(q, k, v)`, each with a leading layer axis; `k` and `v` per key/value
        head (GQA).

        ```python
        q, k, v = eqx.filter_jit(model.attention_inputs)(tokens)
        h = energy.attention_entropy(q[3], k[3], v[3], causal=True)   # [seq, heads]
        ```
        """
        check_token_type("Transformer", tokens, self.config.vocab_size, ndim=1)
        check_token_ids("Transformer", tokens, self.config.vocab_size)

        def layer(x, block: DecoderBlock):
            heads = block._attention_inputs(x, segment_ids)
            x, _ = block(x, None, None, segment_ids)
            return x, heads

        x = jax.vmap(self.embed_tokens)(tokens)
        if isinstance(self.layers, tuple):
            per_layer = []
            for block in self.layers:
                x, qkv = layer(x, block)
                per_layer.append(qkv)
            q, k, v = (jnp.stack(a) for a in zip(*per_layer, strict=True))
            return q, k, v
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        _, heads = jax.lax.scan(
            lambda x, params: layer(x, eqx.combine(params, static)),
            x,
            dynamic,
            unroll=min(4, self.config.num_hidden_layers),
        )
        return heads

    # -----------------------------------------------------------------------------------------
    # Hugging Face checkpoints (safetensors; no torch needed)
    # -----------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | pathlib.Path,
        *,
        dtype=None,
        backend: AttentionName | AttentionBackend = "energy",
    ) -> Transformer:
        """Load a Hugging Face checkpoint of the Llama family — `model_type` `"llama"`,
        `"mistral"`, `"qwen2"` (Qwen2, Qwen2.5) or `"qwen3"` — from a local folder:
        `config.json` and `model.safetensors`, or shards listed in
        `model.safetensors.index.json`. The families differ by switches of `LlamaConfig`.

        Errors name what is wrong: a missing folder or `config.json` (`FileNotFoundError`);
        invalid JSON (with its position), another `model_type`, a setting the decoder cannot
        represent (see `LlamaConfig.from_dict`), missing
        essential keys (`vocab_size`, `hidden_size`, `intermediate_size`,
        `num_hidden_layers`, `num_attention_heads`), a folder holding both
        `model.safetensors` and a shard index, and missing, unexpected or mis-shaped tensors
        (`ValueError`).

        A path to a `.gguf` file is read by `from_gguf`.
        """
        if pathlib.Path(path).suffix.lower() == ".gguf":
            return cls.from_gguf(path, dtype=dtype, backend=backend)
        return model_from_tensors(cls, read_pretrained(path), dtype=dtype, backend=backend)

    @classmethod
    def from_gguf(
        cls,
        path: str | pathlib.Path,
        *,
        dtype=None,
        backend: AttentionName | AttentionBackend = "energy",
    ) -> Transformer:
        """Load a GGUF checkpoint (llama.cpp's format) of the Llama family: GGUF architecture
        `"llama"` (Llama; Mistral when the file states `llama.attention.sliding_window`),
        `"qwen2"` (Qwen2, Qwen2.5) or `"qwen3"`. Needs the `gguf` package (the `gguf` extra);
        no torch.

        The configuration comes from the file's metadata (`{arch}.block_count`,
        `.embedding_length`, `.feed_forward_length`, `.attention.head_count`,
        `.attention.head_count_kv`, `.attention.key_length`, `.rope.freq_base`,
        `.attention.layer_norm_rms_epsilon`, `.context_length`; the vocabulary size from
        `tokenizer.ggml.tokens`; tied embeddings when there is no `output.weight`; Llama 3's
        rotary scaling from `rope_freqs.weight`) and is checked as `LlamaConfig.from_dict`
        checks a `config.json`. Every tensor is dequantised to float32 with
        `gguf.quants.dequantize` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants
        and the IQ types), the rows of `attn_q` / `attn_k` that llama.cpp permutes for its
        rotary kernel (architecture `"llama"` only) are put back in Hugging Face's order, and
        the model is cast to `dtype` (default float32).

        **Arguments:**

        - `path`: the `.gguf` file.
        - `dtype`: the parameters' dtype (default float32).
        - `backend`: the attention backend of every layer (see `AttentionBackend`).

        **Returns:** the `Transformer`, its layers stacked.

        A missing file raises a `FileNotFoundError`; another architecture, a mixture of
        experts, a quantisation type `gguf` cannot dequantise, settings this decoder cannot
        represent, and missing, unexpected or mis-shaped tensors raise a `ValueError` naming
        the file and the item. The tokenizer and chat template of the same file are read by
        `treeattn.pretrained.Tokenizer.from_gguf`.

        ```python
        model = Transformer.from_gguf(treeattn.pretrained.smollm2_gguf())
        ```
        """
        return model_from_tensors(cls, read_gguf(path), dtype=dtype, backend=backend)

    def save_pretrained(self, path: str | pathlib.Path) -> None:
        """Write `config.json` and `model.safetensors` in the Hugging Face format of the
        config's `model_type` (a switch that family lacks raises a `ValueError` naming it).

        Both files are written in full beside the targets and then renamed into place, so a
        failure while writing leaves a previous checkpoint in `path` as it was. A sharded
        checkpoint in `path` (`model.safetensors.index.json` and its shards) is removed, so
        that loaders find the new weights. Other files (a tokenizer, an optimiser state) are
        left alone.

        A model with another attention energy than `Softmax()` (`Transformer(energy=...)`) has
        no Hugging Face `config.json` and raises a `ValueError`: save it with
        `equinox.tree_serialise_leaves`.
        """
        e = self.energy
        if e is not None and not is_plain_softmax(e):
            raise ValueError(
                f"save_pretrained: the attention energy {type(e).__name__}(...) has no Hugging "
                "Face config.json equivalent (a Llama config is softmax attention); save the "
                "model with equinox.tree_serialise_leaves instead"
            )
        save_pretrained(self.stack_layers(), path)

    @property
    def energy(self) -> Energy | None:
        """The attention energy of the first layer (None: `Softmax()`); each layer has its own
        parameters (stacked: `model.layers.self_attn.energy`)."""
        return self.block(0).self_attn.energy


def _logits_to_keep(keep, seq: int):
    """`logits_to_keep` checked: an int in `[0, seq]` (returned as a Python int) or a 1-d
    integer array (whose concrete values lie in `[0, seq)`)."""
    if isinstance(keep, (bool, np.bool_)) or not isinstance(
        keep, (int, np.integer, jax.Array, np.ndarray)
    ):
        raise ValueError(
            f"Transformer: logits_to_keep must be an int or an integer array, got {keep!r}"
        )
    if isinstance(keep, (int, np.integer)):
        if not 0 <= keep <= seq:
            raise ValueError(
                f"Transformer: logits_to_keep={keep} must lie in [0, {seq}] for {seq} tokens"
            )
        return int(keep)
    if not jnp.issubdtype(keep.dtype, jnp.integer) or keep.ndim != 1:
        raise ValueError(
            "Transformer: logits_to_keep as an array must be 1-d integer positions, got "
            f"dtype {keep.dtype} and shape {keep.shape}"
        )
    if not isinstance(keep, Tracer) and getattr(keep, "is_fully_addressable", True):
        positions = np.asarray(keep)
        bad = positions[(positions < 0) | (positions >= seq)]
        if bad.size:
            raise ValueError(
                f"Transformer: logits_to_keep positions {bad[:8].tolist()} are outside "
                f"[0, {seq}) for {seq} tokens"
            )
    return keep
