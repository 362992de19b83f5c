"""What goes wrong with models, checkpoints and caches is said plainly, before anything runs."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treeattn.models import KVCache, LlamaConfig, Transformer, decode_step, generate, prefill


ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY = dict(
    vocab_size=20,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny(key=0, **changes):
    return Transformer(LlamaConfig(**{**TINY, **changes}), key=jax.random.key(key))


def same_parameters(a, b):
    leaves_a = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    leaves_b = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    return (
        a.config == b.config
        and len(leaves_a) == len(leaves_b)
        and all(
            x.shape == y.shape and np.array_equal(x, y)
            for x, y in zip(leaves_a, leaves_b, strict=True)
        )
    )


# ---------------------------------------------------------------------------------------------
# LlamaConfig
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ],
)
@pytest.mark.parametrize("value", [0, -4])
def test_config_rejects_non_positive_sizes(field, value):
    with pytest.raises(ValueError, match=rf"LlamaConfig: {field} must be a positive integer"):
        LlamaConfig(**{**TINY, field: value})


def test_config_rejects_fractional_sizes():
    with pytest.raises(ValueError, match=r"hidden_size must be a positive integer, got 16.5"):
        LlamaConfig(**{**TINY, "hidden_size": 16.5})


def test_config_resolves_hugging_face_defaults_to_ints():
    config = LlamaConfig(**{**TINY, "num_key_value_heads": None})
    assert config.num_key_value_heads == 4 and config.head_dim == 4
    assert not hasattr(config, "kv_heads") and not hasattr(config, "dim_head")


def test_odd_head_dim_names_the_config_fields():
    with pytest.raises(
        ValueError, match=r"head_dim=7 \(hidden_size=28 // num_attention_heads=4\) must be even"
    ):
        LlamaConfig(**{**TINY, "hidden_size": 28})
    with pytest.raises(ValueError, match=r"head_dim=5 must be even"):
        LlamaConfig(**{**TINY, "head_dim": 5})


def test_width_below_the_head_count_names_both():
    with pytest.raises(ValueError, match=r"hidden_size=2 is smaller than num_attention_heads=4"):
        LlamaConfig(**{**TINY, "hidden_size": 2, "num_key_value_heads": 1})


# ---------------------------------------------------------------------------------------------
# from_pretrained: the config
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    return model, tmp_path


def rewrite_config(path, change=None, drop=()):
    config = json.loads((path / "config.json").read_text())
    config.update(change or {})
    for key in drop:
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config))


def test_other_model_types_are_refused_by_name(saved):
    _, path = saved
    rewrite_config(path, {"model_type": "bert", "architectures": ["BertModel"]})
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported"):
        Transformer.from_pretrained(path)


def test_architectures_without_a_model_type_must_be_llama(saved):
    model, path = saved
    rewrite_config(path, {"architectures": ["GPT2LMHeadModel"]}, drop=["model_type"])
    with pytest.raises(ValueError, match=r"architectures \['GPT2LMHeadModel'\]"):
        Transformer.from_pretrained(path)
    rewrite_config(path, {"architectures": ["LlamaForCausalLM"]})
    assert same_parameters(Transformer.from_pretrained(path), model)


def test_missing_essential_keys_are_listed(saved):
    _, path = saved
    rewrite_config(path, drop=["hidden_size", "num_hidden_layers"])
    with pytest.raises(
        ValueError, match=r"lacks the required keys \['hidden_size', 'num_hidden_layers'\]"
    ):
        Transformer.from_pretrained(path)
    (path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"'vocab_size', 'hidden_size', 'intermediate_size'"):
        Transformer.from_pretrained(path)


def test_invalid_json_names_the_file_and_position(saved):
    _, path = saved
    (path / "config.json").write_text('{"vocab_size": 20,\n "hidden_size": }')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON: .* line 2 column 17"):
        Transformer.from_pretrained(path)
    (path / "config.json").write_text("")
    with pytest.raises(ValueError, match=r"config\.json is empty"):
        Transformer.from_pretrained(path)


def test_missing_config_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path} has no config\.json"):
        Transformer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"nowhere is not a folder"):
        Transformer.from_pretrained(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------
# save_pretrained: atomic, and no stale shards
# ---------------------------------------------------------------------------------------------


def test_failed_save_leaves_the_previous_checkpoint_whole(saved, monkeypatch):
    import safetensors.numpy

    old, path = saved
    before = {f.name: f.read_bytes() for f in path.iterdir()}

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)  # a partial file, then the failure
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    new = tiny(key=1, hidden_size=32, num_hidden_layers=3)
    with pytest.raises(OSError, match="No space left"):
        new.save_pretrained(path)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before  # nothing left aside
    monkeypatch.undo()
    assert same_parameters(Transformer.from_pretrained(path), old)
    new.save_pretrained(path)
    assert same_parameters(Transformer.from_pretrained(path), new)


def test_save_into_a_folder_it_cannot_write_names_it(tmp_path):
    target = tmp_path / "read-only"
    target.mkdir()
    target.chmod(0o500)
    if os.access(target, os.W_OK):  # root ignores the mode bits; sysfs refuses root too
        target = pathlib.Path("/sys/kernel")
    with pytest.raises(PermissionError, match=f"save_pretrained: cannot write into {target}"):
        tiny().save_pretrained(target)


def write_sharded(model, path):
    """`model` as transformers shards it: an index and two shard files."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return list(shards)


def test_saving_over_a_sharded_checkpoint_removes_its_shards(tmp_path):
    old = tiny()
    shards = write_sharded(old, tmp_path)
    assert same_parameters(Transformer.from_pretrained(tmp_path), old)
    (tmp_path / "tokenizer.json").write_text("{}")  # not the model's: kept
    new = tiny(key=1)
    new.save_pretrained(tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert not any((tmp_path / s).exists() for s in shards)
    assert same_parameters(Transformer.from_pretrained(tmp_path), new)


def test_a_folder_with_both_layouts_is_ambiguous(tmp_path):
    write_sharded(tiny(), tmp_path)
    tiny(key=1).save_pretrained(tmp_path / "single")
    os.replace(tmp_path / "single" / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"both model\.safetensors and model\.safetensors\.index\.json"
    ):
        Transformer.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------
# Tokens and generation arguments
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5, key=jax.random.key(0)), r"temperature must be >= 0 .* got -0\.5"),
        (dict(temperature=1.0, top_k=0, key=jax.random.key(0)), r"top_k must be in \[1, vocab"),
        (dict(temperature=1.0, top_k=21, key=jax.random.key(0)), r"vocab_size=20\], got 21"),
        (dict(max_len=5), r"prompt of 4 token\(s\) and max_new_tokens=3 need a cache of 6"),
        (dict(max_len=0), r"max_len must be at least 1, got 0"),
    ],
)
def test_generate_checks_its_settings(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, jnp.arange(4), max_new_tokens=3, **kwargs)


def test_generate_checks_the_prompt(model):
    with pytest.raises(ValueError, match=r"the prompt is empty \(shape \(0,\)\)"):
        generate(model, jnp.zeros((0,), jnp.int32), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"the prompt is empty \(shape \(2, 0\)\)"):
        generate(model, jnp.zeros((2, 0), jnp.int32), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"must be integers .* got dtype float32"):
        generate(model, jnp.arange(4.0), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"token ids -1, 20, 57 are outside \[0, vocab_size=20\)"):
        generate(model, jnp.asarray([3, 20, -1, 57, 20]), max_new_tokens=3)


def test_model_call_checks_concrete_token_ids(model):
    with pytest.raises(ValueError, match=r"Transformer: token ids 25 are outside"):
        model(jnp.asarray([1, 25]))
    with pytest.raises(ValueError, match=r"got dtype float32"):
        model(jnp.ones(3))
    # Under jit the ids are traced: the embedding lookup clamps, as documented.
    clamped = jax.jit(lambda t: model(t))(jnp.asarray([1, 25]))
    np.testing.assert_allclose(clamped, model(jnp.asarray([1, 19])), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# KV caches
# ---------------------------------------------------------------------------------------------


def test_append_names_mismatched_shapes():
    cache = KVCache.create(2, 8, 4)
    with pytest.raises(ValueError, match=r"k\(3, 3, 4\) and v\(3, 3, 4\) must be \[n, kv_heads=2"):
        cache.append(jnp.zeros((3, 3, 4)), jnp.zeros((3, 3, 4)))
    with pytest.raises(ValueError, match=r"k\(3, 2, 5\) .* \[n, kv_heads=2, 4\]"):
        cache.append(jnp.zeros((3, 2, 5)), jnp.zeros((3, 2, 4)))
    with pytest.raises(ValueError, match=r"writing 9 token\(s\) would overflow .* max_len=8"):
        cache.append(jnp.zeros((9, 2, 4)), jnp.zeros((9, 2, 4)))


def test_prefill_longer_than_the_cache_is_refused(model):
    cache = model.init_cache(5)
    with pytest.raises(ValueError, match=r"writing 6 token\(s\) would overflow .* max_len=5"):
        prefill(model, jnp.arange(6), cache)
    with pytest.raises(ValueError, match=r"token ids 20 are outside"):
        prefill(model, jnp.asarray([1, 20]), cache)


def test_decode_past_max_len_is_refused_on_the_host(model):
    cache = model.init_cache(5)
    _, cache = prefill(model, jnp.arange(4), cache)
    _, cache = decode_step(model, jnp.asarray(1), cache)
    with pytest.raises(ValueError, match=r"after the 5 cached would overflow .* max_len=5"):
        decode_step(model, jnp.asarray(1), cache)
    # A cache whose length the host has not seen (rebuilt outside prefill/decode_step) is
    # checked by reading its length.
    rebuilt = jax.tree.map(lambda x: x + 0, cache)
    with pytest.raises(ValueError, match=r"after the 5 cached would overflow"):
        decode_step(model, jnp.asarray(1), rebuilt)
    with pytest.raises(ValueError, match=r"must be integers .* got dtype float32"):
        decode_step(model, jnp.asarray(1.0), rebuilt)


OVERFLOW_ON_TWO_DEVICES = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import equinox as eqx, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from treeattn.models import (AttentionBackend, LlamaConfig, Transformer, decode_step,
                                 generate, prefill)

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2)
    model = Transformer(config, key=jax.random.key(0))
    mesh = Mesh(np.array(jax.devices()), ("kv",))
    tree = AttentionBackend("tree", mesh=mesh, kv_axis="kv")

    def refused(f):
        try:
            jax.block_until_ready(f())
        except ValueError as e:
            print("refused:", e)
        else:
            print("ran")

    cache = model.init_cache(4, mesh=mesh, kv_axis="kv", block=1)
    _, cache = prefill(model, jnp.arange(3), cache, backend=tree)
    _, cache = decode_step(model, jnp.asarray(1), cache, backend=tree)
    refused(lambda: decode_step(model, jnp.asarray(1), cache, backend=tree))
    refused(lambda: generate(model, jnp.arange(4), max_len=6, max_new_tokens=40,
                             backend="tree", mesh=mesh, kv_axis="kv"))

    # Traced, inside the user's own jit: no error can be raised, the logits are NaN and the
    # length counts past max_len.
    step = eqx.filter_jit(lambda m, t, c: m(t, c, backend=tree))
    cache = model.init_cache(4, mesh=mesh, kv_axis="kv", block=1)
    for tokens in (jnp.arange(3), jnp.arange(1), jnp.arange(2)):
        logits, cache = step(model, tokens, cache)
        jax.block_until_ready(logits)
        print("traced", int(cache.length), bool(jnp.isnan(logits).all()))
    """
)


@pytest.mark.slow
def test_overflowing_a_sharded_cache_is_an_error_not_a_hang():
    """An overflow check failing on one device of a sharded cache used to leave the other
    waiting in a collective until XLA aborted the process (after about a minute)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", OVERFLOW_ON_TWO_DEVICES],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "refused: KVCache.append: writing 1 token(s) after the 4 cached would overflow the "
        "cache of max_len=4"
    )
    assert lines[1].startswith("refused: generate: a prompt of 4 token(s) and max_new_tokens=40")
    assert lines[2:] == ["traced 3 False", "traced 4 False", "traced 6 True"]


# ---------------------------------------------------------------------------------------------
# logits_to_keep
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (-1, r"logits_to_keep=-1 must lie in \[0, 6\] for 6 tokens"),
        (7, r"logits_to_keep=7 must lie in \[0, 6\]"),
        (True, "must be an int or an integer array, got True"),
        (1.0, "must be an int or an integer array, got 1.0"),
        (jnp.zeros((1,)), r"1-d integer positions, got dtype float32 and shape \(1,\)"),
        (jnp.zeros((1, 1), jnp.int32), r"1-d integer positions, got dtype int32 and shape"),
        (jnp.asarray([0, 6, -1]), r"positions \[6, -1\] are outside \[0, 6\)"),
    ],
)
def test_logits_to_keep_is_checked(keep, message):
    with pytest.raises(ValueError, match=message):
        tiny()(jnp.arange(6), logits_to_keep=keep)


def test_logits_to_keep_accepts_numpy_integers():
    model, tokens = tiny(), jnp.arange(6)
    full = model(tokens)
    close = {"rtol": 1e-5, "atol": 1e-6}  # products of other row counts round differently
    np.testing.assert_allclose(model(tokens, logits_to_keep=np.int64(2)), full[-2:], **close)
    np.testing.assert_allclose(model(tokens, logits_to_keep=np.asarray([3])), full[3:4], **close)
