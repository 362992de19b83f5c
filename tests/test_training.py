"""Training with optax: the example script, checkpoint and resume, and the shipped checkpoint."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree

from treeattn.models import Transformer, generate
from treeattn.pretrained import CHECKPOINTS, CharTokenizer, load_text
from treeattn.training import lm_loss


ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_example_script_trains_checkpoints_and_resumes(tmp_path):
    script = ROOT / "examples" / "train_sonnets.py"
    out = tmp_path / "run"

    def run(steps):
        done = subprocess.run(
            [
                sys.executable,
                str(script),
                "--steps",
                str(steps),
                "--batch-size",
                "2",
                "--seq-len",
                "32",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    first = run(3)
    assert "final loss" in first
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_state.eqx"):
        assert (out / name).exists(), name
    assert json.loads((out / "train_state.json").read_text())["step"] == 3
    second = run(5)  # resumes at step 3
    assert json.loads((out / "train_state.json").read_text())["step"] == 5
    assert "final loss" in second
    model = Transformer.from_pretrained(out)
    assert model.config.vocab_size == CharTokenizer.load(out).vocab_size


def test_weight_decay_spares_norms_and_biases():
    """AdamW decays the weight matrices only; the stacked layers make norm gains 2-d, so the
    mask goes by name."""
    import equinox as eqx
    import optax

    from treeattn.models import LlamaConfig
    from treeattn.training import TrainConfig

    config = LlamaConfig(
        vocab_size=11,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        attention_bias=True,
    )
    params, _ = eqx.partition(Transformer(config, key=jax.random.key(0)), eqx.is_inexact_array)
    # One step with zero gradients: only weight decay moves a parameter.
    optimizer = TrainConfig(learning_rate=1.0, warmup_steps=0, weight_decay=0.5).optimizer()
    with jax.numpy_dtype_promotion("standard"):
        state = optimizer.init(params)
        grads = jax.tree.map(jnp.zeros_like, params)
        updates, _ = optimizer.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    moved = {
        jax.tree_util.keystr(path): bool(jnp.any(a != b))
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(new), strict=True
        )
    }
    assert not moved[".layers.input_layernorm.weight"]
    assert not moved[".norm.weight"]
    assert not moved[".layers.self_attn.query_proj.bias"]
    assert moved[".layers.self_attn.query_proj.weight"]
    assert moved[".embed_tokens.weight"]


def test_shipped_checkpoint_is_trained():
    path = CHECKPOINTS / "sonnets"
    model = Transformer.from_pretrained(path)
    tokenizer = CharTokenizer.load(path)
    ids = tokenizer.encode(load_text("sonnets.txt"))
    windows = np.stack([ids[s : s + 129] for s in range(0, 40000, 4000)])
    loss = float(lm_loss(model, jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])))
    # A uniform guess over the alphabet costs log(62) = 4.1 nats per character.
    assert loss < 1.0
    assert tokenizer.decode(tokenizer.encode("Shall I compare thee")) == "Shall I compare thee"
    with pytest.raises(ValueError, match="not in the alphabet"):
        tokenizer.encode("Z~")


@pytest.mark.slow
def test_shipped_checkpoint_generates_the_same_on_every_backend():
    path = CHECKPOINTS / "sonnets"
    model = Transformer.from_pretrained(path)
    tokenizer = CharTokenizer.load(path)
    prompt = jnp.asarray(tokenizer.encode("When I do count the clock"))
    outs = [
        generate(model, prompt, max_new_tokens=64, backend=be)
        for be in ("reference", "energy", "flash", tree(4))
    ]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    text = tokenizer.decode(outs[0])
    assert text.startswith("When I do count the clock")
