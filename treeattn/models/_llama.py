"""A Llama-style decoder: pre-norm blocks with RoPE, GQA and SwiGLU, on any attention backend."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._attention import AttentionBackend, MultiheadAttention, as_backend
from ._cache import KVCache
from ._layers import Llama3Scaling, RMSNorm, RotaryEmbedding, SwiGLU


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters, named as in Hugging Face's `LlamaConfig` (so `config.json` maps 1:1)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3Scaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        # Resolve the defaults once, so that equal models have equal (static) configs: a config
        # read back from `config.json` then matches the one it was written from.
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} must be a "
                f"multiple of num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def kv_heads(self) -> int:
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def dim_head(self) -> int:
        assert self.head_dim is not None
        return self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face `config.json`; what this architecture cannot represent (another
        activation, sliding-window attention) is an error, not a silent difference."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"LlamaConfig: hidden_act {d['hidden_act']!r} is not supported")
        if d.get("sliding_window") is not None and d.get("use_sliding_window", True):
            raise ValueError(
                f"LlamaConfig: sliding-window attention (sliding_window="
                f"{d['sliding_window']}) is not supported"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        scaling = d.get("rope_scaling")
        # transformers >= 5 writes `rope_parameters` (theta and scaling together).
        params = d.get("rope_parameters")
        if params:
            if "rope_theta" in params:
                kw["rope_theta"] = params["rope_theta"]
            if params.get("rope_type", "default") != "default":
                scaling = params
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"LlamaConfig: rope_scaling type {kind!r} is not supported")
            keys = {f.name for f in dataclasses.fields(Llama3Scaling)}
            kw["rope_scaling"] = Llama3Scaling(**{k: v for k, v in scaling.items() if k in keys})
        else:
            kw["rope_scaling"] = None
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        rope: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
            d["rope_scaling"] = dict(rope)
        # Both spellings: `rope_theta`/`rope_scaling` (transformers 4) and `rope_parameters` (5).
        d["rope_parameters"] = {**rope, "rope_theta": self.rope_theta}
        d["num_key_value_heads"] = self.kv_heads
        d["head_dim"] = self.dim_head
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
        return d


class DecoderBlock(eqx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    input_layernorm: RMSNorm
    self_attn: MultiheadAttention
    post_attention_layernorm: RMSNorm
    mlp: SwiGLU

    def __init__(
        self, config: LlamaConfig, *, backend: AttentionBackend, dtype=None, key: PRNGKeyArray
    ):
        k1, k2 = jax.random.split(key)
        c = config
        rotary = RotaryEmbedding(c.dim_head, c.rope_theta, c.rope_scaling)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.self_attn = MultiheadAttention(
            c.num_attention_heads,
            c.hidden_size,
            qk_size=c.dim_head,
            vo_size=c.dim_head,
            use_query_bias=c.attention_bias,
            use_key_bias=c.attention_bias,
            use_value_bias=c.attention_bias,
            use_output_bias=c.attention_bias,
            dtype=dtype,
            num_kv_heads=c.kv_heads,
            causal=True,
            rotary=rotary,
            backend=backend,
            key=k1,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(
            c.hidden_size, c.intermediate_size, use_bias=c.mlp_bias, dtype=dtype, key=k2
        )

    def __call__(self, x, cache: KVCache | None, backend: AttentionBackend | None):
        h = self.input_layernorm(x)
        if cache is None:
            attn = self.self_attn(h, h, h, backend=backend)
            new_cache = None
        else:
            attn, new_cache = self.self_attn(h, h, h, cache=cache, backend=backend)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_cache


class Transformer(eqx.Module):
    """A Llama-family decoder-only language model.

    The `num_hidden_layers` blocks are stored stacked (every array has a leading layer axis)
    and run with `lax.scan`, so compile time does not grow with depth. Unbatched: `tokens[seq]`;
    batch with `jax.vmap`.

    ```python
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Transformer(config, key=jax.random.key(0))
    logits = model(jnp.arange(10))                      # [10, 256]
    ```
    """

    embed_tokens: eqx.nn.Embedding
    layers: DecoderBlock
    norm: RMSNorm
    lm_head: eqx.nn.Linear | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(
        self,
        config: LlamaConfig,
        *,
        backend: str | AttentionBackend = "energy",
        dtype=None,
        key: PRNGKeyArray,
    ):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        be = as_backend(backend)
        self.config = config
        self.embed_tokens = eqx.nn.Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, key=k_embed
        )

        @eqx.filter_vmap
        def make(k):
            return DecoderBlock(config, backend=be, dtype=dtype, key=k)

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
        self, max_len: int, *, mesh=None, kv_axis=None, block: int = 16, dtype=None
    ) -> KVCache:
        """An empty KV cache for all layers (sharded over `mesh`/`kv_axis` for `"tree"`)."""
        c = self.config
        dtype = dtype or self.embed_tokens.weight.dtype
        return KVCache.create(
            c.kv_heads,
            max_len,
            c.dim_head,
            layers=c.num_hidden_layers,
            dtype=dtype,
            mesh=mesh,
            kv_axis=kv_axis,
            block=block,
        )

    @jax.named_scope("treeattn.models.Transformer")
    def __call__(
        self,
        tokens: Int[Array, " seq"],
        cache: KVCache | None = None,
        *,
        backend: str | AttentionBackend | None = None,
    ) -> Float[Array, "seq vocab"] | tuple[Float[Array, "seq vocab"], KVCache]:
        """Logits of every position; with `cache`, the tokens follow the cached ones and the
        updated cache is returned too."""
        return self.from_embeddings(jax.vmap(self.embed_tokens)(tokens), cache, backend=backend)

    def from_embeddings(
        self,
        x: Float[Array, "seq hidden"],
        cache: KVCache | None = None,
        *,
        backend: str | AttentionBackend | None = None,
    ) -> Float[Array, "seq vocab"] | tuple[Float[Array, "seq vocab"], KVCache]:
        """As `__call__`, from token embeddings (differentiable inputs)."""
        be = None if backend is None else as_backend(backend)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def layer(x, xs):
            params, layer_cache = xs
            block = eqx.combine(params, static)
            x, new_cache = block(x, layer_cache, be)
            return x, new_cache

        # Unrolling a few layers per loop trip saves a decode step most of its loop overhead
        # (0.7 -> 0.45 ms per token for the shipped 4-layer model on 2 CPU cores) while
        # compile time stays bounded for deep models.
        x, new_cache = jax.lax.scan(
            layer, x, (dynamic, cache), unroll=min(4, self.config.num_hidden_layers)
        )
        x = self.norm(x)
        if self.lm_head is None:
            logits = x @ self.embed_tokens.weight.T
        else:
            logits = jax.vmap(self.lm_head)(x)
        return logits if cache is None else (logits, new_cache)

    # -----------------------------------------------------------------------------------------
    # Hugging Face checkpoints (safetensors; no torch needed)
    # -----------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | pathlib.Path, *, dtype=None, backend: str | AttentionBackend = "energy"
    ) -> Transformer:
        """Load a Hugging Face Llama-family checkpoint from a local folder: `config.json` and
        `model.safetensors`, or shards listed in `model.safetensors.index.json`. Missing,
        unexpected or mis-shaped tensors raise a `ValueError` that names them."""
        from safetensors.numpy import load_file

        path = pathlib.Path(path)
        config = LlamaConfig.from_dict(json.loads((path / "config.json").read_text()))
        index = path / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.exists()
            else ["model.safetensors"]
        )
        tensors: dict[str, np.ndarray] = {}
        for f in files:
            if not (path / f).exists():
                raise ValueError(f"from_pretrained: {path / f} is missing")
            tensors.update(load_file(str(path / f)))
        if config.tie_word_embeddings:  # some writers keep the tied copy as well
            tensors.pop("lm_head.weight", None)
        dtype = dtype or jnp.float32
        model = eqx.filter_eval_shape(
            cls, config, backend=backend, dtype=dtype, key=jax.random.key(0)
        )
        wanted = _hf_names(config)
        missing = [n for n in wanted if n not in tensors]
        unexpected = [n for n in tensors if n not in wanted and "rotary_emb" not in n]
        if missing or unexpected:
            raise ValueError(
                f"from_pretrained: missing tensors {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''}; unexpected {unexpected[:8]}"
            )
        leaves = []
        for name, where, layered in _parameter_map(config):
            target = where(model)
            names = (
                [name.format(i=i) for i in range(config.num_hidden_layers)] if layered else [name]
            )
            expected = target.shape[1:] if layered else target.shape
            for n in names:
                if tensors[n].shape != expected:
                    raise ValueError(
                        f"from_pretrained: {n} has shape {tensors[n].shape}, the "
                        f"model expects {expected}"
                    )
            value = np.stack([tensors[n] for n in names]) if layered else tensors[name]
            leaves.append((where, jnp.asarray(value, dtype)))
        for where, value in leaves:
            model = eqx.tree_at(where, model, value)
        return model

    def save_pretrained(self, path: str | pathlib.Path) -> None:
        """Write `config.json` and `model.safetensors` in the Hugging Face Llama format."""
        from safetensors.numpy import save_file

        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = self.config
        d = config.to_dict()
        d["torch_dtype"] = str(jnp.dtype(self.embed_tokens.weight.dtype))
        (path / "config.json").write_text(json.dumps(d, indent=2) + "\n")
        out = {}
        for name, where, layered in _parameter_map(config):
            value = np.asarray(where(self))
            if layered:
                for i in range(config.num_hidden_layers):
                    out[name.format(i=i)] = np.ascontiguousarray(value[i])
            else:
                out[name] = np.ascontiguousarray(value)
        save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


# Hugging Face's name of each projection in a layer -> ours (the same `[out, in]` matrices).
_ATTENTION = {
    "q_proj": "query_proj",
    "k_proj": "key_proj",
    "v_proj": "value_proj",
    "o_proj": "output_proj",
}
_MLP = ("gate_proj", "up_proj", "down_proj")


def _getter(path: str):
    """`m -> m.a.b.c` for `path = "a.b.c"`."""
    return lambda m: functools.reduce(getattr, path.split("."), m)


def _parameter_map(config: LlamaConfig):
    """(Hugging Face name, accessor, per-layer?) for every parameter."""
    top = [
        ("model.embed_tokens.weight", "embed_tokens.weight"),
        ("model.norm.weight", "norm.weight"),
    ]
    if not config.tie_word_embeddings:
        top.append(("lm_head.weight", "lm_head.weight"))
    per_layer = [
        (f"{n}.weight", f"{n}.weight") for n in ("input_layernorm", "post_attention_layernorm")
    ]
    kinds = ["weight"] + (["bias"] if config.attention_bias else [])
    per_layer += [
        (f"self_attn.{hf}.{kind}", f"self_attn.{ours}.{kind}")
        for kind in kinds
        for hf, ours in _ATTENTION.items()
    ]
    kinds = ["weight"] + (["bias"] if config.mlp_bias else [])
    per_layer += [(f"mlp.{n}.{kind}", f"mlp.{n}.{kind}") for kind in kinds for n in _MLP]
    return [(hf, _getter(ours), False) for hf, ours in top] + [
        ("model.layers.{i}." + hf, _getter("layers." + ours), True) for hf, ours in per_layer
    ]


def _hf_names(config: LlamaConfig) -> set[str]:
    names = set()
    for name, _, layered in _parameter_map(config):
        if layered:
            names.update(name.format(i=i) for i in range(config.num_hidden_layers))
        else:
            names.add(name)
    return names
