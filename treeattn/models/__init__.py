"""Equinox layers and a Llama-style decoder whose attention runs on every treeattn backend."""

import warnings as _warnings

from .. import pretrained as _pretrained, training as _training
from ..decode import AttentionBackend as AttentionBackend
from ._attention import MultiheadAttention as MultiheadAttention
from ._cache import KVCache as KVCache, LinearCache as LinearCache
from ._config import LlamaConfig as LlamaConfig
from ._generate import (
    decode_step as decode_step,
    generate as generate,
    prefill as prefill,
    sample as sample,
)
from ._layers import (
    Llama3Scaling as Llama3Scaling,
    RMSNorm as RMSNorm,
    RotaryEmbedding as RotaryEmbedding,
    SwiGLU as SwiGLU,
    matmul as matmul,
)
from ._llama import DecoderBlock as DecoderBlock, Transformer as Transformer


# Deprecated aliases: names that live in other subpackages.
_MOVED = {
    "train": _training,
    "TrainConfig": _training,
    "lm_loss": _training,
    "CharTokenizer": _pretrained,
    "load_text": _pretrained,
    "DATA": _pretrained,
    "CHECKPOINTS": _pretrained,
}


def __getattr__(name: str):
    if name in _MOVED:
        home = _MOVED[name]
        _warnings.warn(
            f"treeattn.models.{name} is deprecated: use {home.__name__}.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(home, name)
    raise AttributeError(f"module 'treeattn.models' has no attribute {name!r}")
