"""GGUF checkpoints (llama.cpp's format): the metadata as a config, the tensors dequantised.

A GGUF file holds a model's hyperparameters as `{arch}.*` metadata and its tensors under
llama.cpp's names (`blk.{i}.attn_q.weight`, ...), some quantised in blocks. Here the metadata
becomes a Hugging Face `config.json`-style dict (read by `config_from_dict`, where every family
rule lives), the tensors are dequantised to float32 with `gguf.quants.dequantize`, renamed to
Hugging Face's names and handed to the same tensor-to-model path as safetensors checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from ._config import FAMILIES, LlamaConfig, config_from_dict
from ._hf import Checkpoint
from ._layers import Llama3Scaling, RotaryEmbedding


if TYPE_CHECKING:
    pass


# llama.cpp's architecture (`general.architecture`) of each family this decoder reads. Mistral
# has none of its own: llama.cpp converts it as "llama"; a sliding window makes it Mistral here.
ARCHITECTURES = tuple(dict.fromkeys(f.gguf or name for name, f in FAMILIES.items()))

# llama.cpp's tensor names -> Hugging Face's (the same `[out, in]` matrices once dequantised).
_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_HF = {v: k for k, v in _TOP.items()}
_LAYER_HF = {v: k for k, v in _LAYER.items()}
_GGUF_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)|(\w+)\.(weight|bias)")
_HF_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)|(.+)\.(weight|bias)")
# Llama 3's rotary frequency scaling: llama.cpp writes it as one factor per frequency.
ROPE_FREQS = "rope_freqs.weight"


def _rename(name: str, pattern: re.Pattern, top: dict, layer: dict, layer_name: str):
    """`name` in the other naming scheme, or None when it is not one of a decoder's tensors."""
    m = pattern.fullmatch(name)
    if m is None:
        return None
    if m[1] is not None:
        leaf = layer.get(m[2])
        return None if leaf is None else layer_name.format(m[1], leaf, m[3])
    base = top.get(m[4])
    return None if base is None else f"{base}.{m[5]}"


def to_hf(name: str) -> str | None:
    """The Hugging Face name of llama.cpp's tensor `name` (None: not one of a decoder's)."""
    return _rename(name, _GGUF_NAME, _TOP, _LAYER, "model.layers.{}.{}.{}")


def to_gguf(name: str) -> str:
    """llama.cpp's name of the Hugging Face tensor `name` (itself if it has none)."""
    return _rename(name, _HF_NAME, _TOP_HF, _LAYER_HF, "blk.{}.{}.{}") or name


def _label(name: str) -> str:
    gguf_name = to_gguf(name)
    return name if gguf_name == name else f"{gguf_name} ({name})"


# ---------------------------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------------------------


def _open(path: pathlib.Path):
    import gguf

    if not path.is_file():
        what = "is a folder, not a GGUF file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"from_gguf: {path} {what}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OverflowError, struct.error) as e:
        raise ValueError(f"from_gguf: {path} is not a readable GGUF file ({e})") from None


def metadata(reader) -> dict[str, Any]:
    """Every metadata value of a `gguf.GGUFReader`, as Python scalars, strings and lists."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _config_dict(meta: dict[str, Any], names: set[str], where: str) -> dict[str, Any]:
    """A Hugging Face `config.json`-style dict from llama.cpp's metadata and tensor names."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architecture {arch!r} is not supported "
            f"(only {', '.join(repr(a) for a in ARCHITECTURES)})"
        )

    def key(name: str, default: Any = None, *, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            if required:
                raise ValueError(f"{where}: the metadata lacks {full}")
            return default
        value = meta[full]
        if isinstance(value, list):
            raise ValueError(
                f"{where}: {full} differs between layers ({value[:8]}...), which this decoder "
                "cannot represent"
            )
        return value

    experts = key("expert_count", 0)
    if experts:
        raise ValueError(
            f"{where}: {arch}.expert_count={experts} (mixture of experts) is not supported"
        )
    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    # llama.cpp's default head size is the width per head; `key_length` states another one.
    head_dim = key("attention.key_length", hidden // heads if heads else None)
    value_dim = key("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ValueError(
            f"{where}: {arch}.attention.value_length={value_dim} differs from the key length "
            f"{head_dim} (not supported)"
        )
    rotary = key("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(
            f"{where}: {arch}.rope.dimension_count={rotary} rotates part of a head of "
            f"{head_dim} (partial rotary embeddings are not supported)"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else key("vocab_size")
    if vocab is None:
        raise ValueError(f"{where}: neither tokenizer.ggml.tokens nor {arch}.vocab_size is stated")
    window = key("attention.sliding_window", 0)
    family = {"llama": "mistral" if window else "llama"}.get(arch, arch)
    d: dict[str, Any] = {
        "model_type": family,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        # llama.cpp's defaults when the file leaves these out.
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        # llama.cpp writes the output matrix only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    if family == "mistral":
        d["sliding_window"] = window
    kind = key("rope.scaling.type", "none")
    if kind != "none":
        # Read by `config_from_dict`, which names the types this decoder cannot represent.
        d["rope_scaling"] = {"rope_type": kind, "factor": key("rope.scaling.factor", 1.0)}
    return d


def read_config(path: str | pathlib.Path) -> LlamaConfig:
    """The `LlamaConfig` a GGUF file's metadata describes (no tensor is read)."""
    path = pathlib.Path(path)
    reader = _open(path)
    return _config(reader, path)[0]


def _config(reader, path: pathlib.Path) -> tuple[LlamaConfig, dict[str, Any]]:
    where = f"from_gguf: {path}"
    meta = metadata(reader)
    names = {t.name for t in reader.tensors}
    d = _config_dict(meta, names, where)
    if ROPE_FREQS in names:
        tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
        scaling = _llama3_scaling(_dequantize(tensor, where), d, where)
        d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(scaling)}
    try:
        return config_from_dict(d), meta
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


def _dequantize(tensor, where: str) -> np.ndarray:
    """A reader tensor as float32 in NumPy's (Hugging Face's) axis order."""
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{where}: tensor {tensor.name} has quantisation type {tensor.tensor_type.name}, "
            "which gguf.quants.dequantize cannot convert"
        ) from None
    # GGUF lists the dimensions innermost first.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(values, np.float32).reshape(shape)


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of `attn_q` / `attn_k` (weights or biases) for its rotary kernel.

    llama.cpp's converter (`LlamaModel.permute`) reorders the rows of each head from Hugging
    Face's halves `(x_0 .. x_{d/2-1}, x_{d/2} .. x_{d-1})` to interleaved pairs
    `(x_0, x_{d/2}, x_1, x_{d/2+1}, ...)`; this is its inverse.
    """
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_scaling(factors: np.ndarray, d: dict[str, Any], where: str) -> Llama3Scaling:
    r"""`Llama3Scaling`'s parameters from llama.cpp's per-frequency factors `rope_freqs.weight`.

    llama.cpp divides each inverse frequency by its factor $r_i$: 1 for wavelengths below
    `original / high_freq_factor`, `factor` above `original / low_freq_factor`, and between them
    $1 / ((1 - s) / \mathrm{factor} + s)$ with $s = (\mathrm{original}/\lambda - \mathrm{low})
    / (\mathrm{high} - \mathrm{low})$, linear in $1/\lambda$. Only the ratios of `original`,
    `low` and `high` matter, so `low_freq_factor` is taken as 1 and the line through the
    smoothed factors gives the other two. The result is checked against every factor.
    """
    head_dim = d["head_dim"]
    rotary = RotaryEmbedding(head_dim, d["rope_theta"])
    inv = rotary.inv_freq()
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape != inv.shape:
        raise ValueError(
            f"{where}: {ROPE_FREQS} has {factors.size} factors, the head dimension {head_dim} "
            f"has {inv.size} frequencies"
        )
    factor = float(factors.max())
    wavelength = 2 * math.pi / inv
    smooth = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1 and smooth.sum() >= 2:
        s = (factor / factors[smooth] - 1) / (factor - 1)
        slope, intercept = np.polyfit(1 / wavelength[smooth], s, 1)
        if intercept < 0:
            scaling = Llama3Scaling(
                factor=factor,
                low_freq_factor=1.0,
                high_freq_factor=float(np.round(1 - 1 / intercept, 6)),
                original_max_position_embeddings=int(round(-slope / intercept)),
            )
            scaled = RotaryEmbedding(head_dim, d["rope_theta"], scaling).inv_freq()
            if np.allclose(inv / scaled, factors, rtol=1e-4, atol=0):
                return scaling
    raise ValueError(
        f"{where}: {ROPE_FREQS} (per-frequency rotary factors {np.round(factors, 4).tolist()[:8]}"
        "...) is not Llama 3's rotary scaling, the only one supported"
    )


def read_gguf(path: str | pathlib.Path) -> Checkpoint:
    """The configuration and the dequantised, renamed tensors of a GGUF file (see
    `Transformer.from_gguf`)."""
    path = pathlib.Path(path)
    where = f"from_gguf: {path}"
    reader = _open(path)
    config, _ = _config(reader, path)
    unexpected = [t.name for t in reader.tensors if to_hf(t.name) is None and t.name != ROPE_FREQS]
    if unexpected:
        raise ValueError(f"{where}: unexpected tensors {unexpected[:8]}")
    assert config.head_dim is not None and config.num_key_value_heads is not None  # resolved
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = to_hf(t.name)
        if name is None:
            continue
        w = _dequantize(t, where)
        # llama.cpp permutes q and k rows of some families only (its `LlamaModel`).
        leaf = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if FAMILIES[config.model_type].gguf_permuted and leaf in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if leaf == "attn_q" else config.num_key_value_heads
            if w.shape[0] == heads * config.head_dim:  # else the shape check names it
                w = unpermute_rotary(w, heads)
        tensors[name] = w
    return Checkpoint(config, tensors, where, _label)
