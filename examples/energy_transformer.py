"""An Energy Transformer block: tokens descend an energy built from treeattn's free energies.

The block (Hoover et al., 2023, "Energy Transformer") has one energy over the token states
`x[n, d]`, with `g = LayerNorm(x)`:

    E(x) = -(1/β) Σ_h Σ_i F_{i,h}(g)          (attention: each token against all others)
           - ½ Σ_i Σ_μ relu(ξ_μ · g_i)²        (a Hopfield memory of `memories` patterns)

where `F_{i,h}` is the free energy of query `Q_h g_i` against keys `K_h g_j` (j ≠ i) — for
`--energy softmax` the modern Hopfield `log Σ_j exp(β Q g_i · K g_j)`, and any other energy of
`treeattn.energy` in its place. The tokens move down the energy, `x ← x − α ∇ₓE`, so E falls
step by step. Inputs: characters of the shipped sonnets, embedded and then corrupted with
noise; the block's weights are random (a fixed, untrained energy landscape).

    python examples/energy_transformer.py --energy softmax --steps 60 --plot energy.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from treeattn.energy import (
    Energy,
    LinearKernel,
    Sigmoid,
    Softmax,
    SoftmaxWithSink,
    StickBreaking,
    multihead_free_energy,
)
from treeattn.pretrained import CharTokenizer, load_text


ENERGIES = {
    "softmax": lambda beta: Softmax(beta=beta),
    "sink": lambda beta: SoftmaxWithSink(beta=beta),
    "sigmoid": lambda beta: Sigmoid(),
    "linear": lambda beta: LinearKernel(),
    "stick-breaking": lambda beta: StickBreaking(),
}


def layer_norm(x, gamma, delta, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return gamma * (x - mean) / jnp.sqrt(var + eps) + delta


def make_energy(params, attention: Energy, heads: int, head_dim: int):
    """E(x) of the block, a scalar function of the token states `x[n, d]`."""

    def energy(x):
        n = x.shape[0]
        g = layer_norm(x, params["gamma"], params["delta"])
        q = (g @ params["wq"]).reshape(n, heads, head_dim)
        k = (g @ params["wk"]).reshape(n, heads, head_dim)
        v = jnp.zeros((n, heads, 1), x.dtype)  # at ζ = 0 the values do not enter F
        zeta = jnp.zeros((n, heads, 1), x.dtype)
        others = ~jnp.eye(n, dtype=bool)  # each token attends to all the others
        f = multihead_free_energy(q, k, v, zeta, mask=others, scale=1.0, energy=attention)
        hopfield = 0.5 * jnp.sum(jax.nn.relu(g @ params["xi"]) ** 2)
        return -f / params["beta"] - hopfield

    return energy


def main(argv=None):
    p = argparse.ArgumentParser(description="Tokens descend an Energy Transformer energy.")
    p.add_argument("--energy", choices=sorted(ENERGIES), default="softmax")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--memories", type=int, default=128)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--alpha", type=float, default=0.01, help="step size of x <- x - alpha grad E")
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=pathlib.Path, default=None, help="PNG of E over the steps")
    p.add_argument("--json", type=pathlib.Path, default=None, help="the energies as JSON")
    args = p.parse_args(argv)

    text = load_text()
    tok = CharTokenizer.from_text(text)
    ids = jnp.asarray(tok.encode(text[: args.seq_len]), jnp.int32)
    keys = jax.random.split(jax.random.key(args.seed), 7)
    d, h = args.dim, args.heads
    head_dim = d // h
    params = {
        "embed": jax.random.normal(keys[0], (tok.vocab_size, d)),
        "wq": jax.random.normal(keys[1], (d, d)) / np.sqrt(d),
        "wk": jax.random.normal(keys[2], (d, d)) / np.sqrt(d),
        "xi": jax.random.normal(keys[3], (d, args.memories)) / np.sqrt(d),
        "gamma": jnp.ones(()),
        "delta": jnp.zeros((d,)),
        "beta": jnp.asarray(args.beta),
    }
    x = params["embed"][ids] + args.noise * jax.random.normal(keys[4], (ids.shape[0], d))
    energy = make_energy(params, ENERGIES[args.energy](params["beta"]), h, head_dim)

    @jax.jit
    def step(x):
        e, grad = jax.value_and_grad(energy)(x)
        return x - args.alpha * grad, e

    energies = []
    for _ in range(args.steps):
        x, e = step(x)
        energies.append(float(e))
    energies.append(float(energy(x)))
    print(f"energy={args.energy} E: {energies[0]:.4f} -> {energies[-1]:.4f} ({args.steps} steps)")
    if args.json is not None:
        args.json.write_text(json.dumps({"energy": args.energy, "E": energies}))
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(energies)
        ax.set_xlabel(r"step ($x \leftarrow x - \alpha \nabla_x E$)")
        ax.set_ylabel("E(x)")
        ax.set_title(f"Energy Transformer block, {args.energy} attention")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
