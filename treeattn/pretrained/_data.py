"""The data shipped with treeattn: a character tokenizer, texts, trained checkpoints."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np


DATA: pathlib.Path = pathlib.Path(__file__).with_name("data")
"""The folder of the texts shipped with treeattn (`sonnets.txt`)."""

CHECKPOINTS: pathlib.Path = pathlib.Path(__file__).with_name("checkpoints")
"""The folder of the shipped checkpoints (`sonnets/`: a small Llama trained on the Sonnets)."""


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """One token per character of a fixed alphabet."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise ValueError(f"CharTokenizer.encode: characters not in the alphabet: {unknown}")
        return np.fromiter((index[c] for c in text), np.int32, len(text))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))

    def save(self, path: str | pathlib.Path) -> None:
        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text(json.dumps({"type": "char", "chars": self.chars}))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> CharTokenizer:
        return cls(json.loads((pathlib.Path(path) / "tokenizer.json").read_text())["chars"])


def load_text(name: str = "sonnets.txt") -> str:
    """A text shipped with treeattn (`sonnets.txt`: Shakespeare's Sonnets, public domain)."""
    return (DATA / name).read_text()
