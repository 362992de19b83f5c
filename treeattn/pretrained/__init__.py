"""Pretrained models' companions: the tokenizer and chat template of a GGUF file, and where the
shipped SmolLM2 checkpoint lies. (The model itself: `treeattn.models.Transformer.from_gguf`.)"""

from ._tokenizer import Tokenizer as Tokenizer, smollm2_gguf as smollm2_gguf
