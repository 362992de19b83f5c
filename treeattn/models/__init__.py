"""Equinox layers and a Llama-style decoder on every treeattn attention backend."""

from ..decode import AttentionBackend as AttentionBackend
from ._attention import MultiheadAttention as MultiheadAttention
from ._cache import KVCache as KVCache, LinearCache as LinearCache
from ._config import LlamaConfig as LlamaConfig
from ._data import (
    CHECKPOINTS as CHECKPOINTS,
    DATA as DATA,
    CharTokenizer as CharTokenizer,
    load_text as load_text,
)
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
from ._train import (
    TrainConfig as TrainConfig,
    lm_loss as lm_loss,
    train as train,
)
