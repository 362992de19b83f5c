"""The hyperparameters of a Llama-family decoder, in Hugging Face's names."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any, Literal, SupportsIndex, get_args

from ._layers import Llama3Scaling


# Fields that must be positive integers, and those that may be left `None` (then resolved).
_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
_OPTIONAL_POSITIVE = ("num_key_value_heads", "head_dim", "sliding_window")

ModelType = Literal["llama", "mistral", "qwen2", "qwen3"]
"""The Hugging Face families the decoder reads and writes (`model_type` of `config.json`);
what sets each apart is its entry of `FAMILIES` below."""
MODEL_TYPES: tuple[ModelType, ...] = get_args(ModelType)


def _positive_int(name: str, value: object) -> int:
    # JSON has no integer type of its own: 64.0 or true would pass a bare `int()`.
    if isinstance(value, bool) or not isinstance(value, SupportsIndex) or operator.index(value) < 1:
        raise ValueError(f"LlamaConfig: {name} must be a positive integer, got {value!r}")
    return operator.index(value)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters, named as in Hugging Face's `LlamaConfig` (so `config.json` maps 1:1).

    `num_key_value_heads=None` means one kv head per query head (no grouping) and
    `head_dim=None` means `hidden_size // num_attention_heads`; both are resolved when the
    config is made, so after construction they are plain integers. Sizes and counts must be
    positive and the head dimension even (rotary embeddings rotate pairs); a `ValueError`
    names the field otherwise.

    One decoder serves the Llama family's relatives; what sets them apart is a switch:

    - `attention_bias`: biases on the query, key, value and output projections (Llama's
      option, Qwen3's).
    - `qkv_bias`: biases on the query, key and value projections only (Qwen2, Qwen2.5).
    - `qk_norm`: an RMSNorm (with `rms_norm_eps`) over each head of the queries and keys,
      before the rotary embedding (Qwen3).
    - `sliding_window`: each query sees itself and the `sliding_window - 1` keys before it
      (Mistral; `local_window_size=(sliding_window - 1, 0)` in every layer).
    - `tie_word_embeddings`: the output matrix is the embedding matrix.

    `model_type` (`"llama"`, `"mistral"`, `"qwen2"` or `"qwen3"`) names the Hugging Face
    family `config.json` is written as; `qkv_bias=None` and `qk_norm=None` take that family's
    value (`True` for Qwen2 and Qwen3 respectively). A combination the family cannot express
    (e.g. `qk_norm` in a Llama) runs, and `to_dict` / `save_pretrained` refuse it by name.
    """

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
    model_type: ModelType = "llama"
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig: model_type must be one of {MODEL_TYPES}, got {self.model_type!r}"
            )
        for switch in ("qkv_bias", "qk_norm"):  # None: the family's
            if getattr(self, switch) is None:
                object.__setattr__(self, switch, FAMILIES[self.model_type].fixed.get(switch, False))
        for name in _POSITIVE + _OPTIONAL_POSITIVE:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL_POSITIVE:
                object.__setattr__(self, name, _positive_int(name, value))
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LlamaConfig: {name} must be positive, got {getattr(self, name)}")
        head_dim_given = self.head_dim is not None
        # Resolve the defaults once, so that equal models have equal (static) configs: a config
        # read back from `config.json` then matches the one it was written from.
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            head_dim = self.hidden_size // self.num_attention_heads
            if head_dim == 0:
                raise ValueError(
                    f"LlamaConfig: hidden_size={self.hidden_size} is smaller than "
                    f"num_attention_heads={self.num_attention_heads}, which leaves no "
                    f"head_dim; give more width or fewer heads (or set head_dim)"
                )
            object.__setattr__(self, "head_dim", head_dim)
        assert self.num_key_value_heads is not None and self.head_dim is not None
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} must be a "
                f"multiple of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            where = (
                f"head_dim={self.head_dim}"
                if head_dim_given
                else f"head_dim={self.head_dim} (hidden_size={self.hidden_size} // "
                f"num_attention_heads={self.num_attention_heads})"
            )
            raise ValueError(
                f"LlamaConfig: {where} must be even: rotary embeddings rotate pairs of dimensions"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face `config.json`'s contents (`model_type` `"llama"`, `"mistral"`,
        `"qwen2"` or `"qwen3"`). Another model type, missing essential keys, or what this
        decoder cannot represent (another activation, other rotary scalings, Qwen's per-layer
        sliding windows, biases the family does not have) raise a `ValueError` that names
        them."""
        return config_from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` contents of the `model_type` family; a switch that
        family does not have raises a `ValueError` naming it."""
        return config_to_dict(self)


# What a config must state: without them the defaults would describe Llama-7B, and a small
# checkpoint would fail later with a puzzling shape mismatch.
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


# ---------------------------------------------------------------------------------------------
# The families: every fact that sets one apart, in one table
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """What sets a Hugging Face family of the Llama decoder apart.

    - `architecture`: its causal LM class in transformers (`config.json`'s `architectures`).
    - `fixed`: the switches the family fixes (`attention_bias`, `qkv_bias`, `qk_norm`,
      `mlp_bias`, `sliding_window`), as transformers builds it; the others are free.
    - `windows`: how its `config.json` states a sliding window: `"none"` (it has none),
      `"uniform"` (one window for every layer, `sliding_window`) or `"per_layer"`
      (`use_sliding_window`, `max_window_layers`, `layer_types`: Qwen's).
    - `defaults`: its config class's defaults for the keys that decide the architecture (a
      `config.json` normally states them all).
    - `gguf`: llama.cpp's `general.architecture` for it (None: its `model_type`), and
      `gguf_permuted`: whether llama.cpp's converter reorders the rows of `attn_q`/`attn_k`
      for its rotary kernel.
    """

    architecture: str
    fixed: Mapping[str, Any]
    windows: Literal["none", "uniform", "per_layer"] = "none"
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"rms_norm_eps": 1e-6})
    gguf: str | None = None
    gguf_permuted: bool = False


_NO_BIASES = {"attention_bias": False, "qkv_bias": False, "mlp_bias": False}
_NO_WINDOW = {"sliding_window": None}

FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM", {"qkv_bias": False, "qk_norm": False, **_NO_WINDOW}, gguf_permuted=True
    ),
    # llama.cpp converts Mistral as "llama"; its sliding window tells the two apart.
    "mistral": Family(
        "MistralForCausalLM",
        {**_NO_BIASES, "qk_norm": False},
        "uniform",
        {"rms_norm_eps": 1e-6, "sliding_window": 4096},
        gguf="llama",
        gguf_permuted=True,
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM",
        {**_NO_BIASES, "qkv_bias": True, "qk_norm": False, **_NO_WINDOW},
        "per_layer",
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM",
        {"qkv_bias": False, "qk_norm": True, "mlp_bias": False, **_NO_WINDOW},
        "per_layer",
        {"rms_norm_eps": 1e-6, "head_dim": 128},
    ),
}


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def _family(d: dict[str, Any]) -> str:
    model_type = d.get("model_type")
    architectures = d.get("architectures") or []
    if model_type is not None and model_type not in FAMILIES:
        raise ValueError(
            f"LlamaConfig: model_type {model_type!r} is not supported "
            f"(only {', '.join(repr(m) for m in FAMILIES)})"
        )
    if model_type is None and architectures:
        known = [m for m, f in FAMILIES.items() if f.architecture in architectures]
        if not known:
            raise ValueError(
                f"LlamaConfig: architectures {architectures} are not supported (no model_type; "
                f"only {', '.join(f.architecture for f in FAMILIES.values())})"
            )
        return known[0]
    return model_type or "llama"


def _windows(family: str, d: dict[str, Any]) -> int | None:
    """The one sliding window of every layer (`None`: none), or a `ValueError` naming the
    setting this decoder cannot represent."""
    window = d.get("sliding_window")
    types = d.get("layer_types")
    rule = FAMILIES[family].windows
    if rule == "per_layer":
        # transformers: layer i slides when use_sliding_window and (layer_types[i], or by
        # default i >= max_window_layers) say so.
        if not d.get("use_sliding_window", False) or window is None:
            return None
        n = d.get("num_hidden_layers")
        if types is not None:
            sliding = [t == "sliding_attention" for t in types]
        else:
            first = d.get("max_window_layers", 28)
            sliding = [i >= first for i in range(n if isinstance(n, int) else 0)]
        if any(sliding):
            raise ValueError(
                f"LlamaConfig: {family} sliding-window attention (use_sliding_window=true, "
                f"sliding_window={window}, max_window_layers={d.get('max_window_layers')}, "
                f"layer_types={types}) is not supported: its layers differ in their windows"
            )
        return None
    if types is not None and any(t != types[0] for t in types):
        raise ValueError(f"LlamaConfig: layer_types {types} differ between layers (not supported)")
    if rule == "none":
        if window is not None and d.get("use_sliding_window", True):
            raise ValueError(
                f"LlamaConfig: sliding-window attention (sliding_window={window}) is not "
                f"supported for model_type {family!r} (use 'mistral')"
            )
        return None
    return window


def config_from_dict(d: dict[str, Any]) -> LlamaConfig:
    """A `LlamaConfig` from a Hugging Face `config.json`'s contents; see `LlamaConfig.from_dict`."""
    if not isinstance(d, dict):
        raise ValueError(f"LlamaConfig: a config must be a JSON object, got {type(d).__name__}")
    family = _family(d)
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"LlamaConfig: the config lacks the required keys {missing}")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"LlamaConfig: hidden_act {d['hidden_act']!r} is not supported")
    d = {**FAMILIES[family].defaults, **d}
    for name in ("attention_bias", "mlp_bias"):
        fixed = FAMILIES[family].fixed.get(name)
        if name in d and fixed is not None and bool(d[name]) != fixed:
            raise ValueError(
                f"LlamaConfig: {name}={d[name]} is not supported for model_type {family!r} "
                f"({FAMILIES[family].architecture} has no such biases)"
            )
    fields = {f.name for f in dataclasses.fields(LlamaConfig)} - {"qkv_bias", "qk_norm"}
    kw = {k: v for k, v in d.items() if k in fields}
    kw.update(model_type=family, sliding_window=_windows(family, d))
    for name in ("attention_bias", "mlp_bias"):
        if name in FAMILIES[family].fixed:
            kw[name] = FAMILIES[family].fixed[name]
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
    return LlamaConfig(**kw)


def config_to_dict(config: LlamaConfig) -> dict[str, Any]:
    """The `config.json` contents transformers reads as the `model_type` family's causal LM;
    a switch that family does not have raises a `ValueError` naming it."""
    family = config.model_type
    spec = FAMILIES[family]
    for name, fixed in spec.fixed.items():
        if getattr(config, name) != fixed:
            raise ValueError(
                f"LlamaConfig: {name}={getattr(config, name)} cannot be written as a Hugging "
                f"Face {family!r} config ({spec.architecture} has {name}={fixed})"
            )
    d = dataclasses.asdict(config)
    for name in ("qkv_bias", "qk_norm", *spec.fixed):
        d.pop(name, None)  # implied by the family
    rope: dict[str, Any] = {"rope_type": "default"}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
        d["rope_scaling"] = dict(rope)
    # Both spellings: `rope_theta`/`rope_scaling` (transformers 4) and `rope_parameters` (5).
    d["rope_parameters"] = {**rope, "rope_theta": config.rope_theta}
    if spec.windows == "uniform":
        d["sliding_window"] = config.sliding_window
    elif spec.windows == "per_layer":
        d.update(use_sliding_window=False, sliding_window=None)
    d.update(architectures=[spec.architecture], model_type=family, hidden_act="silu")
    return d


assert set(FAMILIES) == set(MODEL_TYPES), "one entry of FAMILIES per ModelType"
