"""Equinox layers and a Llama-style decoder whose attention runs on every treeattn backend."""

from .. import pretrained as _pretrained, training as _training
from .._deprecated import moved
from ..decode import AttentionBackend as AttentionBackend
from ._attention import MultiheadAttention as MultiheadAttention
from ._cache import KVCache as KVCache, LinearCache as LinearCache
from ._config import LlamaConfig as LlamaConfig
from ._eviction import attention_scores as attention_scores
from ._generate import (
    Decoder as Decoder,
    decode_step as decode_step,
    generate as generate,
    prefill as prefill,
    sample as sample,
)
from ._layers import (
    Llama3Scaling as Llama3Scaling,
    PackedWeight as PackedWeight,
    RMSNorm as RMSNorm,
    RotaryEmbedding as RotaryEmbedding,
    SwiGLU as SwiGLU,
    matmul as matmul,
)
from ._llama import DecoderBlock as DecoderBlock, Transformer as Transformer


# Deprecated aliases: names that live in other subpackages.
__getattr__ = moved(
    "treeattn.models",
    {
        **dict.fromkeys(("train", "TrainConfig", "lm_loss"), _training),
        **dict.fromkeys(("CharTokenizer", "load_text", "DATA", "CHECKPOINTS"), _pretrained),
    },
)
