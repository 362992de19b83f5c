"""What the tests share: one tolerance table, meshes and attention backends, input makers, and
one table of energies.

The float64 NumPy references the tests compare against live in `np_reference` (independent of
treeattn); this module builds treeattn's side of a comparison. Test modules import from here,
`np_reference` and `conftest`, never from each other.
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from conftest import devices
from jax.sharding import AxisType, Mesh

from treeattn.energy import (
    SUM,
    CosFormer,
    Differential,
    Energy,
    Forgetting,
    LinearKernel,
    Sigmoid,
    Softmax,
    SoftmaxWithSink,
    Softpick,
    StickBreaking,
)
from treeattn.models import AttentionBackend, LlamaConfig


# ---------------------------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------------------------

# Normwise relative error (`np_reference.rel_err`) allowed for a result against float64 NumPy,
# by the dtype of the inputs (the result is rounded to it; softmax arithmetic runs in float32
# or wider). Tests that hold a result tighter, or compare other quantities (a log-sum-exp, a
# gradient), say so where they do.
TOL = {
    jnp.float64: 1e-12,
    jnp.float32: 2e-5,
    jnp.float16: 3e-3,
    jnp.bfloat16: 2e-2,
}


# ---------------------------------------------------------------------------------------------
# Meshes and attention backends
# ---------------------------------------------------------------------------------------------


def mesh_of(p: int) -> Mesh:
    """A 1-d mesh, axis "kv" (Auto, `Mesh`'s default), over the first `p` devices; skips the
    test when there are fewer."""
    return Mesh(np.array(devices(p)), ("kv",), axis_types=(AxisType.Auto,))


def two_level_mesh(nodes: int, local: int) -> Mesh:
    """A `nodes x local` mesh, axes ("node", "local"), for the hierarchical schedule."""
    return Mesh(
        np.array(devices(nodes * local)).reshape(nodes, local),
        ("node", "local"),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )


def tree(p: int, name: str = "tree") -> AttentionBackend:
    """The models' sharded backend `name` ("tree", or the "ring" baseline) over `mesh_of(p)`."""
    return AttentionBackend(name, mesh=mesh_of(p), kv_axis="kv")


def backend_of(spec: str | AttentionBackend) -> str | AttentionBackend:
    """A backend as a test names it: "tree" is the tree backend over 2 devices, "tree-p" and
    "ring-p" the tree and the ring baseline over p (built when the test runs, so that a host
    with fewer devices skips the test rather than fails to collect it); any other name, or an
    `AttentionBackend`, as it is."""
    if spec == "tree":
        return tree(2)
    if isinstance(spec, str) and (m := re.fullmatch(r"(tree|ring)-(\d+)", spec)):
        return tree(int(m[2]), m[1])
    return spec


# The small decoder of the energy-model tests: 2 query heads over 1 kv head.
TINY_CONFIG = LlamaConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_qkv(getkey, shape, dtype):
    """Normal q [q_seq, heads, qk], k [kv_seq, kv_heads, qk], v [kv_seq, kv_heads, dv] for
    `shape` = (q_seq, kv_seq, heads, kv_heads, qk, dv)."""
    q_seq, kv_seq, heads, kv_heads, qk, dv = shape
    q = jax.random.normal(getkey(), (q_seq, heads, qk), dtype)
    k = jax.random.normal(getkey(), (kv_seq, kv_heads, qk), dtype)
    v = jax.random.normal(getkey(), (kv_seq, kv_heads, dv), dtype)
    return q, k, v


def make_masking(getkey, shape, masking):
    """Keyword arguments for one masking configuration (the same for treeattn and NumPy):
    "none", "causal", "causal_cache" (the queries are the last positions), "mask2d",
    "mask3d" (per head) or "causal_mask3d"."""
    q_seq, kv_seq, heads = shape[:3]
    kw: dict = {}
    if masking.startswith("causal"):
        kw["causal"] = True
    if masking == "causal_cache":
        kw["q_offset"] = kv_seq - q_seq  # bottom-right: the queries are the last positions
    if masking == "mask2d":
        kw["mask"] = jax.random.bernoulli(getkey(), 0.6, (q_seq, kv_seq))
    if masking in ("mask3d", "causal_mask3d"):
        kw["mask"] = jax.random.bernoulli(getkey(), 0.6, (heads, q_seq, kv_seq))
    return kw


def np_kw(kw):
    """`kw` with its mask as a NumPy array, for `np_reference`."""
    out = dict(kw)
    if "mask" in out:
        out["mask"] = np.asarray(out["mask"])
    return out


def make_decode_qkv(getkey, batch, q_seq, heads, kv_heads, kv_seq, dim, dtype=jnp.float32):
    """Normal q [batch, q_seq, heads, dim] and k, v [batch, kv_seq, kv_heads, dim] (bshd)."""
    q = jax.random.normal(getkey(), (batch, q_seq, heads, dim), dtype)
    k = jax.random.normal(getkey(), (batch, kv_seq, kv_heads, dim), dtype)
    v = jax.random.normal(getkey(), (batch, kv_seq, kv_heads, dim), dtype)
    return q, k, v


def to_layout(x, layout):
    """[batch, seq, heads, dim] -> the layout under test ("bshd" or "bhsd")."""
    return x if layout == "bshd" else jnp.swapaxes(x, 1, 2)


def check_out_lse(out, lse, expected_out, expected_lse, dtype):
    """A decode result (out, lse) against float64 NumPy: out within TOL[dtype], lse float32,
    -inf exactly where expected, and otherwise within 1e-5 relative (1e-4 absolute)."""
    assert ref.rel_err(out, expected_out) <= TOL[dtype]
    assert lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], expected_lse[finite], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Hugging Face models (torch and transformers are imported when a test asks for one)
# ---------------------------------------------------------------------------------------------

# The transformers class of each family: `{Name}Config`, `{Name}ForCausalLM`.
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# A tiny model of every family: small enough to run in a second, large enough for GQA.
HF_TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def hf_model(family="llama", **kw):
    """A transformers causal LM of `family` with random weights (seeded) and random norm gains;
    skips the test without torch or transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    name = FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(**{**HF_TINY, **kw})
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():  # non-trivial norm gains and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, tokens):
    """transformers' logits [seq, vocab] of `model` over `tokens`, as NumPy."""
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))[None]).logits[0].numpy()


# ---------------------------------------------------------------------------------------------
# Energies
# ---------------------------------------------------------------------------------------------


class ReLU2(Energy):
    """A user-defined energy, a sum monoid and nothing else written:
    F = sum_a relu(x_a + zeta.v_a)^2 / 2, attention sum_a relu(x_a) v_a."""

    monoid = SUM

    def elements(self, x, tilt, ctx):
        return 0.5 * jax.nn.relu(x + tilt) ** 2


HEADS = 4  # query heads of the energy problems: the per-head parameters below have 4 entries
ALIBI = np.array([0.5, 0.25, 0.125, 0.0625])
SINKS = np.array([0.3, -1.0, 2.0, 0.0])
LAMS = np.array([0.2, 0.5, 0.8, -0.3])  # Differential's lambda per head


@dataclasses.dataclass(frozen=True)
class EnergyCase:
    """One energy under test: its float64 reference (`family` and `params` in
    `np_reference.energy_attention`'s names), and how treeattn's is built from `params`."""

    family: str
    params: dict[str, Any]
    build: Callable[[dict[str, Any]], Energy]


ENERGIES = {
    # Parameters as the unbatched tests give them (Python numbers, per-head arrays of HEADS).
    "softmax_beta": EnergyCase("softmax", {"beta": 1.7}, lambda p: Softmax(beta=p["beta"])),
    "softmax_softcap_alibi": EnergyCase(
        "softmax",
        {"softcap": 1.5, "alibi": ALIBI},
        lambda p: Softmax(softcap=p["softcap"], alibi_slopes=jnp.asarray(p["alibi"], jnp.float32)),
    ),
    "sink": EnergyCase(
        "sink",
        {"sink": SINKS, "beta": 1.0},
        lambda p: SoftmaxWithSink(sink=jnp.asarray(p["sink"], jnp.float32)),
    ),
    "softmax1": EnergyCase(
        "sink", {"sink": 0.0}, lambda p: SoftmaxWithSink(sink=jnp.asarray(p["sink"], jnp.float32))
    ),
    "sigmoid": EnergyCase("sigmoid", {}, lambda p: Sigmoid()),
    "sigmoid_bias": EnergyCase("sigmoid", {"bias": 0.4}, lambda p: Sigmoid(bias=p["bias"])),
    "linear": EnergyCase("linear", {}, lambda p: LinearKernel()),
    # A horizon near the longest distance of the tests, so that the cosine varies.
    "cosformer": EnergyCase("cosformer", {"horizon": 64}, lambda p: CosFormer(p["horizon"])),
    "stick": EnergyCase("stick", {}, lambda p: StickBreaking()),
    "relu2": EnergyCase("relu2", {}, lambda p: ReLU2()),
    # Composite energies (treeattn.energy._composite); Forgetting reads c from the last channel.
    "differential": EnergyCase(
        "differential",
        {"lam": LAMS},
        lambda p: Differential(lam=jnp.asarray(p["lam"], jnp.float32)),
    ),
    "forgetting": EnergyCase("forgetting", {}, lambda p: Forgetting()),
    "softpick": EnergyCase("softpick", {}, lambda p: Softpick()),
    # In a model: parameters as arrays (leaves that train), scalars that fit any head count,
    # and a fixed sigmoid bias (the default -log n counts the key slots, which a cache changes).
    "softmax_beta_softcap": EnergyCase(
        "softmax",
        {"beta": 1.5, "softcap": 5.0},
        lambda p: Softmax(beta=jnp.asarray(p["beta"]), softcap=p["softcap"]),
    ),
    "sink_scalar": EnergyCase(
        "sink", {"sink": 0.5}, lambda p: SoftmaxWithSink(sink=jnp.asarray(p["sink"]))
    ),
    "sigmoid_fixed_bias": EnergyCase(
        "sigmoid", {"bias": -2.0}, lambda p: Sigmoid(bias=jnp.asarray(p["bias"]))
    ),
}

# Every form, each against float64 NumPy on problems of HEADS heads (test_energies); the other
# energy tests draw their cases from these.
GRID = [
    "softmax_beta",
    "softmax_softcap_alibi",
    "sink",
    "softmax1",
    "sigmoid",
    "sigmoid_bias",
    "linear",
    "cosformer",
    "stick",
    "relu2",
    "differential",
    "forgetting",
    "softpick",
]
# One energy of each shipped class, in the models (test_model_energies).
MODEL = ["softmax_beta_softcap", "sink_scalar", "sigmoid_fixed_bias", "linear", "cosformer"]
MODEL += ["stick"]


def make_energy(name: str) -> Energy:
    """The energy `ENERGIES[name]`, freshly built (its arrays made when asked, not at import)."""
    case = ENERGIES[name]
    return case.build(case.params)


def energy_reference(name: str, q, k, v, **kw):
    """(attention, Hessian of F in zeta) of `ENERGIES[name]` in float64 NumPy."""
    case = ENERGIES[name]
    return ref.energy_attention(case.family, case.params, q, k, v, **kw)


def decode_program(model, cache, backend, *, step: bool = True):
    """The compiled program a `Decoder` runs for one token (`step`) or for a prompt, on
    `cache` (its cache structure and backend), lowered for one token: its HLO and memory
    analysis are what a decode step costs."""
    from treeattn.models._generate import _host_checked, prepared

    prep = prepared(model)
    be = AttentionBackend.of(backend)
    leaves, cache_def = jax.tree.flatten(_host_checked(cache))
    run = prep.program("forward", be, cache_def=cache_def, rows=False, keep=0, step=step)
    token = jnp.zeros(() if step else (1,), jnp.int32)
    return run.lower(prep.leaves, token, leaves).compile()


def generate_program(model, cache, prompts, mask=None, *, backend, **sampling):
    """The compiled program `generate` runs over `prompts` `[rows, prompt]` with one cache per
    row (`cache`, made by `empty_rows`); `sampling`: `max_new_tokens`, `temperature`,
    `top_k`."""
    from treeattn.models._generate import _host_checked, prepared

    prep = prepared(model)
    be = AttentionBackend.of(backend)
    run = prep.program("generate", be, rows=True, **sampling)
    keys = jnp.zeros((prompts.shape[0],), jnp.uint32)
    return run.lower(prep.leaves, prompts, mask, _host_checked(cache), keys).compile()
