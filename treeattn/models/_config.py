"""The hyperparameters of a Llama-family decoder, in Hugging Face's names."""

from __future__ import annotations

import dataclasses
import operator
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
"""The Hugging Face families the decoder reads and writes (`model_type` of `config.json`)."""
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
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.model_type == "qwen2")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.model_type == "qwen3")
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
        from ._hf import config_from_dict

        return config_from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` contents of the `model_type` family; a switch that
        family does not have raises a `ValueError` naming it."""
        from ._hf import config_to_dict

        return config_to_dict(self)
