"""The model layer with any energy: the paths agree, tree decoding generates the reference
tokens, a small model trains through each energy, and a non-default energy is not saved as a
Hugging Face config."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MODEL, TINY_CONFIG as CONFIG, make_energy, tree

from treeattn.energy import Sigmoid, energy_attention
from treeattn.models import MultiheadAttention, Transformer, generate
from treeattn.training import lm_loss


@pytest.mark.parametrize("name", MODEL)
def test_layer_is_the_energy_attention_of_its_projections(name, getkey):
    e = make_energy(name)
    layer = MultiheadAttention(
        2, 16, num_kv_heads=1, causal=True, energy=e, backend="flash", key=getkey()
    )
    x = jax.random.normal(getkey(), (7, 16))
    q = jax.vmap(layer.query_proj)(x).reshape(7, 2, 8)
    k = jax.vmap(layer.key_proj)(x).reshape(7, 1, 8)
    v = jax.vmap(layer.value_proj)(x).reshape(7, 1, 8)
    want = jax.vmap(layer.output_proj)(
        energy_attention(q, k, v, causal=True, energy=e).reshape(7, 16)
    )
    for backend in ("energy", "reference", "flash", tree(2)):
        got = layer(x, x, x, backend=backend)
        assert not isinstance(got, tuple)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL)
def test_tree_generate_gives_the_reference_tokens(name, getkey):
    """Tree decoding, and the ring baseline, generate the reference path's tokens."""
    model = Transformer(CONFIG, energy=make_energy(name), key=getkey())
    prompt = jax.random.randint(getkey(), (5,), 0, CONFIG.vocab_size)
    want = generate(model, prompt, max_new_tokens=4, backend="reference", max_len=16)
    be = tree(2)
    got = generate(
        model, prompt, max_new_tokens=4, backend=be, mesh=be.mesh, kv_axis="kv", max_len=16
    )
    np.testing.assert_array_equal(got, want)
    ring = generate(model, prompt, max_new_tokens=4, backend=tree(2, "ring"), max_len=16)
    np.testing.assert_array_equal(ring, want)
    # each generated token is the greedy choice of one full pass over the tokens (up to ties)
    logits = model(want[:-1], backend="energy")
    assert not isinstance(logits, tuple)
    logits = logits[4:]
    chosen = jnp.take_along_axis(logits, want[5:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(chosen, logits.max(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL)
def test_a_small_model_trains_through_each_energy(name, getkey):
    model = Transformer(CONFIG, energy=make_energy(name), key=getkey())
    tokens = jnp.tile(jnp.arange(8), 3)[None]  # a repeating pattern, learnable in few steps
    opt = optax.adam(3e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        def loss(p):
            return lm_loss(eqx.combine(p, static), tokens[:, :-1], tokens[:, 1:])

        value, grads = jax.value_and_grad(loss)(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's integer step count
            updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, grads

    losses, grads = [], None
    for _ in range(25):
        params, state, value, grads = step(params, state)
        losses.append(float(value))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    # the energy's own parameters are leaves that receive a gradient
    assert grads is not None
    energy_grads = [g for g in jax.tree.leaves(grads.layers.self_attn.energy) if g is not None]
    if name in ("softmax_beta_softcap", "sink_scalar", "sigmoid_fixed_bias"):
        assert energy_grads and all(np.all(np.isfinite(g)) for g in energy_grads)


def test_saving_a_non_default_energy_to_a_hf_config_raises(tmp_path, getkey):
    model = Transformer(CONFIG, energy=Sigmoid(), key=getkey())
    with pytest.raises(ValueError, match="Sigmoid.*no Hugging Face config.json"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()
    default = Transformer(CONFIG, key=getkey())
    assert default.energy is None
    default.save_pretrained(tmp_path)  # the default writes what it always did
    again = Transformer.from_pretrained(tmp_path)
    assert again.energy is None
    got, want = again(jnp.arange(6)), default(jnp.arange(6))
    assert not isinstance(got, tuple) and not isinstance(want, tuple)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_layer_refuses_what_is_not_an_energy(getkey):
    with pytest.raises(ValueError, match="energy must be a treeattn.energy.Energy"):
        MultiheadAttention(2, 16, energy="sigmoid", key=getkey())  # pyright: ignore[reportArgumentType]
