"""Hugging Face families through one decoder: Llama (tied), Mistral, Qwen2/Qwen2.5, Qwen3.

Each is built by transformers with random weights and a tiny config, saved, loaded by
`Transformer.from_pretrained`, and checked against transformers' own forward on every backend:
logits, logits decoded through the KV cache, greedy tokens, and the round trip back.
"""

import json

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import FAMILIES, backend_of, hf_logits, hf_model

from treeattn.models import (
    AttentionBackend,
    LlamaConfig,
    Transformer,
    decode_step,
)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (family, transformers config) of each case: the switch it exercises in the name.
CASES = {
    "llama-tied-attention-bias": (
        "llama",
        dict(num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True),
    ),
    "mistral-sliding-window": ("mistral", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2.5-qkv-bias-tied-mqa": (
        "qwen2",
        dict(num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "qwen3-qk-norm-head-dim": ("qwen3", dict(num_key_value_heads=2, head_dim=24)),
}
MISTRAL, QWEN2, QWEN3 = (
    "mistral-sliding-window",
    "qwen2.5-qkv-bias-tied-mqa",
    "qwen3-qk-norm-head-dim",
)


BACKENDS = ["energy", "reference", "flash", "tree"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Each case built by transformers, saved, and loaded by treeattn (once per module)."""
    cache = {}

    def load(case):
        if case not in cache:
            family, kw = CASES[case]
            hf = hf_model(family, **{"num_hidden_layers": 2, **kw})
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path, safe_serialization=True)
            cache[case] = hf, Transformer.from_pretrained(path), path
        return cache[case]

    return load


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, loaded):
    hf, ours, _ = loaded(case)
    assert ours.config.model_type == CASES[case][0]
    tokens = np.random.default_rng(0).integers(0, 97, 24)
    expected = hf_logits(hf, tokens)
    for backend in BACKENDS:
        got = ours(jnp.asarray(tokens), backend=backend_of(backend))
        assert ref.rel_err(got, expected) <= 1e-4, backend


@pytest.mark.slow
def test_logits_to_keep_as_in_transformers(loaded):
    """`logits_to_keep` (an int: the last k positions; positions: those) gives transformers'
    logits for the same argument and the same rows of the full logits; on every backend
    through a cache too."""
    hf, ours, _ = loaded("llama-tied-attention-bias")
    tokens = np.random.default_rng(1).integers(0, 97, 24)
    full = np.asarray(ours(jnp.asarray(tokens)))
    cases = {"last": 1, "last5": 5, "positions": [0, 7, 23]}
    expected = {}
    for name, keep in cases.items():
        hf_arg = keep if isinstance(keep, int) else torch.tensor(keep)
        ours_arg = keep if isinstance(keep, int) else jnp.asarray(keep)
        with torch.no_grad():
            want = hf(torch.tensor(tokens)[None], logits_to_keep=hf_arg).logits[0].numpy()
        expected[name] = ours_arg, want
        rows = full[-keep:] if isinstance(keep, int) else full[np.asarray(keep)]
        got = np.asarray(ours(jnp.asarray(tokens), logits_to_keep=ours_arg))
        assert ref.rel_err(got, want) <= 1e-4, name
        np.testing.assert_allclose(got, rows, rtol=1e-5, atol=1e-5, err_msg=name)
    ours_arg, want = expected["positions"]
    for name in BACKENDS:
        backend = backend_of(name)
        where = {"mesh": backend.mesh, "kv_axis": "kv"} if name == "tree" else {}
        cache = ours.init_cache(32, **where)
        got, _ = ours(jnp.asarray(tokens), cache, backend=backend, logits_to_keep=ours_arg)
        assert ref.rel_err(got, want) <= 1e-4, name


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_decoding_through_the_cache_matches_the_full_forward(case, loaded):
    """A prompt fed token by token into the KV cache, then greedy steps: every logit is
    transformers' full forward over the final sequence, and every new token its argmax.
    (One compiled step per backend; prefill of several tokens is tested in test_models.)"""
    hf, ours, _ = loaded(case)
    prompt = list(np.random.default_rng(1).integers(0, 97, 6))
    for backend in BACKENDS:
        be = backend_of(backend)
        mesh = be.mesh if isinstance(be, AttentionBackend) else None
        cache = ours.init_cache(16, mesh=mesh, kv_axis="kv" if mesh else None, block=2)
        tokens, steps = [], []
        while len(tokens) < 14:
            token = prompt[len(tokens)] if len(tokens) < len(prompt) else int(jnp.argmax(steps[-1]))
            tokens.append(token)
            step, cache = decode_step(ours, jnp.asarray(token), cache, backend=be)
            steps.append(step)
        expected = hf_logits(hf, np.asarray(tokens))
        assert ref.rel_err(jnp.stack(steps), expected) <= 1e-4, backend
        greedy = expected[len(prompt) - 1 : -1].argmax(-1)
        np.testing.assert_array_equal(tokens[len(prompt) :], greedy, err_msg=backend)


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_round_trip_is_exact(case, loaded, tmp_path):
    """What treeattn writes is what transformers wrote (same tensors, bit for bit; a config
    transformers reads as the same family), and reads back to the same model."""
    from safetensors.numpy import load_file

    hf, ours, path = loaded(case)
    ours.save_pretrained(tmp_path)
    theirs = load_file(str(path / "model.safetensors"))
    written = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(written) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(written[name], theirs[name], err_msg=name)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == CASES[case][0]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again).__name__ == f"{FAMILIES[CASES[case][0]]}ForCausalLM"
    tokens = np.arange(20) % 97
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(hf, tokens))
    reloaded = Transformer.from_pretrained(tmp_path)
    assert reloaded.config == ours.config
    np.testing.assert_array_equal(reloaded(jnp.asarray(tokens)), ours(jnp.asarray(tokens)))


def rewrite(path, tmp_path, change, drop=()):
    """A copy of the checkpoint in `path` with its config.json changed."""
    import shutil

    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = {**json.loads((path / "config.json").read_text()), **change}
    for key in drop:
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "case, change, message",
    [
        (QWEN2, {"model_type": "gemma"}, "model_type 'gemma' is not supported"),
        (
            QWEN2,
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            "rope_scaling type 'yarn' is not supported",
        ),
        (
            QWEN2,
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 1,
                "layer_types": None,
            },
            "qwen2 sliding-window attention .*use_sliding_window=true",
        ),
        (
            QWEN3,
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention"] * 2,
            },
            "qwen3 sliding-window attention",
        ),
        (
            QWEN2,
            {"attention_bias": True},
            "attention_bias=True is not supported for model_type 'qwen2'",
        ),
        (
            MISTRAL,
            {"attention_bias": True},
            "attention_bias=True is not supported for model_type 'mistral'",
        ),
        (
            QWEN3,
            {"mlp_bias": True},
            "mlp_bias=True is not supported for model_type 'qwen3'",
        ),
        (MISTRAL, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            MISTRAL,
            {"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types",
        ),
    ],
)
def test_unsupported_settings_are_named(case, change, message, loaded, tmp_path):
    _, _, path = loaded(case)
    with pytest.raises(ValueError, match=message):
        Transformer.from_pretrained(rewrite(path, tmp_path, change))


def test_qwen2_sliding_window_switched_off_or_on_no_layer_loads(loaded, tmp_path):
    """Qwen2's `use_sliding_window`: off, or on with every layer below `max_window_layers`,
    no layer slides, and the checkpoint loads as full causal attention."""
    hf, ours, path = loaded(QWEN2)
    for change in (
        {"use_sliding_window": False, "sliding_window": 8},
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
    ):
        model = Transformer.from_pretrained(rewrite(path, tmp_path, change, drop=["layer_types"]))
        assert model.config == ours.config


def test_switches_a_family_lacks_are_refused_on_save():
    config = LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, qk_norm=True,
    )  # fmt: skip
    model = Transformer(config, key=jax.random.key(0))
    assert model.block(0).self_attn.query_norm is not None  # the switch runs...
    with pytest.raises(
        ValueError, match=r"qk_norm=True cannot be written as a Hugging Face 'llama'"
    ):
        config.to_dict()  # ...but has no Llama config.json
    with pytest.raises(ValueError, match="model_type must be one of"):
        LlamaConfig(model_type="gpt2")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_missing_keys_take_the_defaults_of_transformers(family):
    """A `config.json` that leaves out a key means the default of the family's config class in
    transformers (e.g. `rms_norm_eps`: 1e-6 for every family, where `LlamaConfig()` has 1e-5)."""
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = LlamaConfig.from_dict({"model_type": family, **sizes})
    assert config.rms_norm_eps == cls(**sizes).rms_norm_eps
