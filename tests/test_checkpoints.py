"""Hugging Face Llama checkpoints: loaded and saved without torch, checked against transformers."""

import json

import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import hf_logits, hf_model

from treeattn.models import Transformer


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gqa-llama3-rope": dict(
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-head-dim": dict(num_key_value_heads=1, head_dim=24),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_transformers_checkpoint(name, tmp_path):
    hf = hf_model(**CONFIGS[name])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = Transformer.from_pretrained(tmp_path)
    tokens = np.random.default_rng(0).integers(0, 97, 50)
    expected = hf_logits(hf, tokens)
    for backend in ("energy", "reference", "flash"):
        got = ours(jnp.asarray(tokens), backend=backend)
        assert ref.rel_err(got, expected) <= 1e-4, backend


def test_save_is_read_back_by_transformers(tmp_path):
    hf = hf_model(**CONFIGS["gqa-llama3-rope"])
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = Transformer.from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    tokens = np.arange(40) % 97
    np.testing.assert_allclose(
        hf_logits(again, tokens), hf_logits(hf, tokens), rtol=1e-6, atol=1e-6
    )
    reloaded = Transformer.from_pretrained(tmp_path / "ours")
    np.testing.assert_array_equal(reloaded(jnp.asarray(tokens)), ours(jnp.asarray(tokens)))


def test_sharded_checkpoint(tmp_path):
    hf = hf_model(**CONFIGS["mha-tied"])
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = Transformer.from_pretrained(tmp_path)
    tokens = np.arange(30) % 97
    assert ref.rel_err(ours(jnp.asarray(tokens)), hf_logits(hf, tokens)) <= 1e-4


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf = hf_model(**CONFIGS["gqa-llama3-rope"])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'"):
        Transformer.from_pretrained(tmp_path)
    broken = dict(tensors)
    broken["model.layers.2.self_attn.k_proj.weight"] = np.zeros((5, 64), np.float32)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model.layers.2.self_attn.k_proj.weight has shape "
        r"\(5, 64\), the model expects \(32, 64\)",
    ):
        Transformer.from_pretrained(tmp_path)
    good = json.loads((tmp_path / "config.json").read_text())
    for change, message in [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            "rope_scaling type 'yarn' is not supported",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"sliding_window": 4096}, "sliding-window attention"),
    ]:
        config = {**good, **change}
        if "rope_scaling" in change:
            config["rope_parameters"] = change["rope_scaling"]
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            Transformer.from_pretrained(tmp_path)


def test_tied_checkpoint_that_keeps_lm_head(tmp_path):
    """Some writers store the tied output matrix as well; it is the embedding, and is ignored."""
    from safetensors.numpy import load_file, save_file

    hf = hf_model(**CONFIGS["mha-tied"])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    tokens = np.arange(30) % 97
    ours = Transformer.from_pretrained(tmp_path)
    assert ref.rel_err(ours(jnp.asarray(tokens)), hf_logits(hf, tokens)) <= 1e-4
