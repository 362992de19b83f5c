"""Hugging Face checkpoints: `config.json` and safetensors weights, without torch."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import re
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._config import LlamaConfig
from ._layers import Llama3Scaling


if TYPE_CHECKING:
    from ..decode import AttentionBackend, AttentionName
    from ._llama import Transformer


CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# How transformers names the shards of a sharded checkpoint.
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")

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
# config.json
# ---------------------------------------------------------------------------------------------


# Each family's class in transformers, and the defaults of its config class for the keys
# that decide the architecture (a `config.json` normally lists them all).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6},
    "mistral": {"rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6},
    "qwen3": {"rms_norm_eps": 1e-6, "head_dim": 128},
}
# Which switches a family has: (attention_bias, qkv_bias, qk_norm, mlp_bias, sliding_window)
# either free (None) or fixed to a value, as transformers builds each family.
_FIXED: dict[str, dict[str, Any]] = {
    "llama": {"qkv_bias": False, "qk_norm": False, "sliding_window": None},
    "mistral": {"attention_bias": False, "qkv_bias": False, "qk_norm": False, "mlp_bias": False},
    "qwen2": {
        "attention_bias": False,
        "qkv_bias": True,
        "qk_norm": False,
        "mlp_bias": False,
        "sliding_window": None,
    },
    "qwen3": {"qkv_bias": False, "qk_norm": True, "mlp_bias": False, "sliding_window": None},
}


def _family(d: dict[str, Any]) -> str:
    model_type = d.get("model_type")
    architectures = d.get("architectures") or []
    if model_type is not None and model_type not in ARCHITECTURES:
        raise ValueError(
            f"LlamaConfig: model_type {model_type!r} is not supported "
            f"(only {', '.join(repr(m) for m in ARCHITECTURES)})"
        )
    if model_type is None and architectures:
        known = [m for m, a in ARCHITECTURES.items() if a in architectures]
        if not known:
            raise ValueError(
                f"LlamaConfig: architectures {architectures} are not supported (no model_type; "
                f"only {', '.join(ARCHITECTURES.values())})"
            )
        return known[0]
    return model_type or "llama"


def _windows(family: str, d: dict[str, Any]) -> int | None:
    """The one sliding window of every layer (`None`: none), or a `ValueError` naming the
    setting this decoder cannot represent."""
    window = d.get("sliding_window")
    types = d.get("layer_types")
    if family in ("qwen2", "qwen3"):
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
    if family == "llama":
        if window is not None and d.get("use_sliding_window", True):
            raise ValueError(
                f"LlamaConfig: sliding-window attention (sliding_window={window}) is not "
                "supported for model_type 'llama' (use 'mistral')"
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
    d = {**_FAMILY_DEFAULTS[family], **d}
    for name in ("attention_bias", "mlp_bias"):
        fixed = _FIXED[family].get(name)
        if name in d and fixed is not None and bool(d[name]) != fixed:
            raise ValueError(
                f"LlamaConfig: {name}={d[name]} is not supported for model_type {family!r} "
                f"({ARCHITECTURES[family]} has no such biases)"
            )
    fields = {f.name for f in dataclasses.fields(LlamaConfig)} - {"qkv_bias", "qk_norm"}
    kw = {k: v for k, v in d.items() if k in fields}
    kw.update(model_type=family, sliding_window=_windows(family, d))
    for name in ("attention_bias", "mlp_bias"):
        if name in _FIXED[family]:
            kw[name] = _FIXED[family][name]
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
    for name, fixed in _FIXED[family].items():
        if getattr(config, name) != fixed:
            raise ValueError(
                f"LlamaConfig: {name}={getattr(config, name)} cannot be written as a Hugging "
                f"Face {family!r} config ({ARCHITECTURES[family]} has {name}={fixed})"
            )
    d = dataclasses.asdict(config)
    for name in ("qkv_bias", "qk_norm", *_FIXED[family]):
        d.pop(name, None)  # implied by the family
    rope: dict[str, Any] = {"rope_type": "default"}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
        d["rope_scaling"] = dict(rope)
    # Both spellings: `rope_theta`/`rope_scaling` (transformers 4) and `rope_parameters` (5).
    d["rope_parameters"] = {**rope, "rope_theta": config.rope_theta}
    if family == "mistral":
        d["sliding_window"] = config.sliding_window
    elif family in ("qwen2", "qwen3"):
        d.update(use_sliding_window=False, sliding_window=None)
    d.update(architectures=[ARCHITECTURES[family]], model_type=family, hidden_act="silu")
    return d


def read_config(path: pathlib.Path) -> LlamaConfig:
    """`path/config.json` as a `LlamaConfig`; a missing file or invalid JSON names the file."""
    file = path / CONFIG
    if not file.is_file():
        what = "is not a folder" if not path.is_dir() else f"has no {CONFIG}"
        raise FileNotFoundError(f"from_pretrained: {path} {what} (looked for {file})")
    text = file.read_text()
    if not text.strip():
        raise ValueError(f"from_pretrained: {file} is empty")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"from_pretrained: {file} is not valid JSON: {e.msg} at line {e.lineno} column "
            f"{e.colno} (char {e.pos})"
        ) from None
    try:
        return config_from_dict(d)
    except ValueError as e:
        raise ValueError(f"from_pretrained: {file}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------

# Hugging Face's name of each projection in a layer -> ours (the same `[out, in]` matrices).
_ATTENTION = {
    "q_proj": "query_proj",
    "k_proj": "key_proj",
    "v_proj": "value_proj",
    "o_proj": "output_proj",
}
_NORMS = {"q_norm": "query_norm", "k_norm": "key_norm"}  # Qwen3's per-head RMSNorms
_MLP = ("gate_proj", "up_proj", "down_proj")


def _getter(path: str):
    """`m -> m.a.b.c` for `path = "a.b.c"`."""
    return lambda m: functools.reduce(getattr, path.split("."), m)


def parameter_map(config: LlamaConfig):
    """(Hugging Face name, accessor, per-layer?) for every parameter."""
    top = [
        ("model.embed_tokens.weight", "embed_tokens.weight"),
        ("model.norm.weight", "norm.weight"),
    ]
    if not config.tie_word_embeddings:
        top.append(("lm_head.weight", "lm_head.weight"))
    per_layer = [
        (f"{n}.weight", f"{n}.weight") for n in ("input_layernorm", "post_attention_layernorm")
    ]
    per_layer += [
        (f"self_attn.{hf}.weight", f"self_attn.{ours}.weight") for hf, ours in _ATTENTION.items()
    ]
    per_layer += [
        (f"self_attn.{hf}.bias", f"self_attn.{ours}.bias")
        for hf, ours in _ATTENTION.items()
        if config.attention_bias or (config.qkv_bias and hf != "o_proj")
    ]
    if config.qk_norm:
        per_layer += [
            (f"self_attn.{hf}.weight", f"self_attn.{ours}.weight") for hf, ours in _NORMS.items()
        ]
    kinds = ["weight"] + (["bias"] if config.mlp_bias else [])
    per_layer += [(f"mlp.{n}.{kind}", f"mlp.{n}.{kind}") for kind in kinds for n in _MLP]
    return [(hf, _getter(ours), False) for hf, ours in top] + [
        ("model.layers.{i}." + hf, _getter("layers." + ours), True) for hf, ours in per_layer
    ]


def hf_names(config: LlamaConfig) -> set[str]:
    names = set()
    for name, _, layered in parameter_map(config):
        if layered:
            names.update(name.format(i=i) for i in range(config.num_hidden_layers))
        else:
            names.add(name)
    return names


# ---------------------------------------------------------------------------------------------
# Loading and saving
# ---------------------------------------------------------------------------------------------


def _weight_files(path: pathlib.Path) -> list[str]:
    index = path / INDEX
    single = path / WEIGHTS
    if index.exists() and single.exists():
        raise ValueError(
            f"from_pretrained: {path} holds both {WEIGHTS} and {INDEX} (a sharded "
            "checkpoint); which one is meant is ambiguous: remove the stale one"
        )
    if not index.exists():
        if not single.exists():
            raise ValueError(f"from_pretrained: {single} is missing (and there is no {INDEX})")
        return [WEIGHTS]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"from_pretrained: {index} has no readable weight_map ({e})") from None
    return sorted(set(weight_map.values()))


def load_pretrained(
    cls: type[Transformer],
    path: str | pathlib.Path,
    *,
    dtype=None,
    backend: AttentionName | AttentionBackend = "energy",
) -> Transformer:
    """See `Transformer.from_pretrained`."""
    from safetensors.numpy import load_file

    path = pathlib.Path(path)
    config = read_config(path)
    tensors: dict[str, np.ndarray] = {}
    for f in _weight_files(path):
        if not (path / f).exists():
            raise ValueError(f"from_pretrained: {path / f} is missing")
        tensors.update(load_file(str(path / f)))
    return model_from_tensors(cls, config, tensors, dtype=dtype, backend=backend)


def model_from_tensors(
    cls: type[Transformer],
    config: LlamaConfig,
    tensors: dict[str, np.ndarray],
    *,
    dtype=None,
    backend: str | AttentionBackend = "energy",
    where: str = "from_pretrained",
    label: Callable[[str], str] = str,
) -> Transformer:
    """A `cls(config)` whose parameters are `tensors`, keyed by their Hugging Face names (any
    format's loader ends here). Missing, unexpected or mis-shaped tensors raise a `ValueError`
    that starts with `where` and names each tensor as `label(name)`."""
    tensors = dict(tensors)
    if config.tie_word_embeddings:  # some writers keep the tied copy as well
        tensors.pop("lm_head.weight", None)
    dtype = dtype or jnp.float32
    model = eqx.filter_eval_shape(cls, config, backend=backend, dtype=dtype, key=jax.random.key(0))
    wanted = hf_names(config)
    missing = [label(n) for n in wanted if n not in tensors]
    unexpected = [label(n) for n in tensors if n not in wanted and "rotary_emb" not in n]
    if missing or unexpected:
        raise ValueError(
            f"{where}: missing tensors {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}; unexpected {unexpected[:8]}"
        )
    leaves = []
    for name, at, layered in parameter_map(config):
        target = at(model)
        names = [name.format(i=i) for i in range(config.num_hidden_layers)] if layered else [name]
        expected = target.shape[1:] if layered else target.shape
        for n in names:
            if tensors[n].shape != expected:
                raise ValueError(
                    f"{where}: {label(n)} has shape {tensors[n].shape}, the model expects "
                    f"{expected}"
                )
        value = np.stack([tensors[n] for n in names]) if layered else tensors[name]
        leaves.append((at, jnp.asarray(value, dtype)))
    for at, value in leaves:
        model = eqx.tree_at(at, model, value)
    return model


def save_pretrained(model: Transformer, path: str | pathlib.Path) -> None:
    """See `Transformer.save_pretrained`."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise type(e)(f"save_pretrained: cannot create the folder {path} ({e.strerror})") from None
    config = model.config
    d = config_to_dict(config)
    d["torch_dtype"] = str(jnp.dtype(model.embed_tokens.weight.dtype))
    out = {}
    for name, where, layered in parameter_map(config):
        value = np.asarray(where(model))
        if layered:
            for i in range(config.num_hidden_layers):
                out[name.format(i=i)] = np.ascontiguousarray(value[i])
        else:
            out[name] = np.ascontiguousarray(value)
    # Both files are written aside in full first, then renamed into place: a failure while
    # writing (a full disk, an interrupted save) leaves the previous checkpoint as it was.
    weights, text = _aside(path, WEIGHTS), _aside(path, CONFIG)
    try:
        # Created here first, so that a folder it cannot write into raises an `OSError` that
        # names it (safetensors' own error does not).
        open(weights, "xb").close()
    except OSError as e:
        raise type(e)(f"save_pretrained: cannot write into {path} ({e.strerror})") from None
    try:
        save_file(out, str(weights), metadata={"format": "pt"})
        with open(text, "x") as f:
            f.write(json.dumps(d, indent=2) + "\n")
        for tmp in (weights, text):
            _sync(tmp)
    except BaseException:
        for tmp in (weights, text):
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        raise
    stale = _sharded_files(path)
    # Weights before config: were the process killed between the two renames, the new weights
    # would not fit the old config and loading would name the mismatch, not run silently.
    os.replace(weights, path / WEIGHTS)
    os.replace(text, path / CONFIG)
    # A sharded checkpoint left in the folder would otherwise be what loaders pick.
    for f in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path / f)


def _aside(path: pathlib.Path, name: str) -> pathlib.Path:
    """A fresh name beside `path / name`, hidden, for writing before the rename."""
    return path / f".{name}.{secrets.token_hex(6)}.tmp"


def _sync(file: pathlib.Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sharded_files(path: pathlib.Path) -> list[str]:
    """The index of a sharded checkpoint in `path` and its shards (listed or named as such)."""
    index = path / INDEX
    if not index.exists():
        return []
    files = {f.name for f in path.iterdir() if _SHARD.fullmatch(f.name)}
    try:
        files |= {
            f
            for f in json.loads(index.read_text())["weight_map"].values()
            if pathlib.Path(f).name == f and f != WEIGHTS
        }
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        pass
    # The index goes first: without it, nothing points at the shards any more.
    return [INDEX, *sorted(files)]
