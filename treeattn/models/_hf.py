"""Hugging Face checkpoints: `config.json` and safetensors weights, without torch."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import re
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._config import LlamaConfig, config_from_dict, config_to_dict


if TYPE_CHECKING:
    from ..decode import AttentionBackend, AttentionName
    from ._llama import Transformer


CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# How transformers names the shards of a sharded checkpoint.
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


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


class Checkpoint(NamedTuple):
    """What a checkpoint file holds, read: the configuration, the tensors under their Hugging
    Face names, and how errors name the file (`where`) and a tensor (`label(name)`)."""

    config: LlamaConfig
    tensors: dict[str, np.ndarray]
    where: str = "from_pretrained"
    label: Callable[[str], str] = str


def read_pretrained(path: str | pathlib.Path) -> Checkpoint:
    """`config.json` and the safetensors weights of a Hugging Face checkpoint folder (see
    `Transformer.from_pretrained`)."""
    from safetensors.numpy import load_file

    path = pathlib.Path(path)
    config = read_config(path)
    tensors: dict[str, np.ndarray] = {}
    for f in _weight_files(path):
        if not (path / f).exists():
            raise ValueError(f"from_pretrained: {path / f} is missing")
        tensors.update(load_file(str(path / f)))
    return Checkpoint(config, tensors)


def model_from_tensors(
    cls: type[Transformer],
    checkpoint: Checkpoint,
    *,
    dtype=None,
    backend: AttentionName | AttentionBackend = "energy",
) -> Transformer:
    """A `cls(config)` whose parameters are the checkpoint's tensors (every format's loader
    ends here). Missing, unexpected or mis-shaped tensors raise a `ValueError` that starts with
    the checkpoint's `where` and names each tensor by its `label`."""
    config, tensors, where, label = checkpoint
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
