"""Attention maps of a pretrained model, read from the free energy: per layer and head, the
entropy of every query's attention and the attention every token receives.

SmolLM2-135M-Instruct (its GGUF file from PyPI, `treeattn.pretrained.smollm2_gguf`) reads a
passage of the Sonnets shipped with treeattn. `Transformer.attention_inputs` gives the
queries, keys and values each layer attends with (after the projections and the rotary
embedding, at each token's position), and two derivatives of the free energy
F = log Σ_a exp(q·k_a/√d + ζ·v_a) read the maps off them (`treeattn.energy`):

    attention_entropy:   H_i = F_i − β ∂F_i/∂β |_{β=1} = −Σ_a p_{i,a} log p_{i,a}   [seq, heads]
    received_attention:  r_a = ∂(Σ_i F_i)/∂b_a |_{b=0} = Σ_i p_{i,a}                [seq, heads]

Written to `--out` (default `examples/out/`, git-ignored):

- `entropy.png`: layers × heads, the mean over queries of H_i / log(i + 1), the entropy as a
  fraction of its maximum (uniform attention over the i + 1 keys query i sees); query 0, which
  sees one key, is left out. The printed table gives the same in nats.
- `received.png`: layers × token positions, the attention each token receives (mean over the
  heads, log colour scale), and per layer the share of all attention that goes to token 0.

    python examples/attention_maps.py --tokens 256 --out /tmp/maps
    python examples/attention_maps.py --tokens 64 --layers 0 1 15 29
"""

from __future__ import annotations

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from treeattn.energy import attention_entropy, received_attention
from treeattn.models import Transformer
from treeattn.pretrained import Tokenizer, load_text, smollm2_gguf


OUT = pathlib.Path(__file__).with_name("out")
FIRST_SONNET = "From fairest creatures"


def passage(tokenizer: Tokenizer, n: int) -> np.ndarray:
    """The first `n` tokens of the Sonnets, from the first sonnet's first line on."""
    text = load_text("sonnets.txt")
    text = text[text.index(FIRST_SONNET) :]
    ids = tokenizer.encode(text[: 8 * n])  # a token is ~4 characters of this text
    if ids.size < n:
        raise ValueError(f"--tokens {n}: the text has only {ids.size} tokens")
    return ids[:n]


@jax.jit
def maps(q, k, v):
    """Entropy `[seq, heads]` (nats) and received attention `[seq, heads]` of one layer."""
    return attention_entropy(q, k, v, causal=True), received_attention(q, k, v, causal=True)


def show(tokenizer: Tokenizer, token: int) -> str:
    return repr(tokenizer.decode([token], skip_special_tokens=False))


def plot(out: pathlib.Path, layers, entropy_frac, received, token0_share, n: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    heads = entropy_frac.shape[1]
    fig, ax = plt.subplots(figsize=(0.45 * heads + 2.2, 0.22 * len(layers) + 1.6))
    im = ax.imshow(entropy_frac, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(heads))
    ax.set_yticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"attention entropy / log(#keys seen)\nmean over {n - 1} queries", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.08)
    fig.tight_layout()
    fig.savefig(out / "entropy.png", dpi=130)
    plt.close(fig)

    fig, (ax, side) = plt.subplots(
        1,
        2,
        figsize=(9, 0.2 * len(layers) + 1.8),
        gridspec_kw={"width_ratios": [4, 1]},
        sharey=True,
    )
    floor = max(float(received[received > 0].min()), 1e-4)
    im = ax.imshow(
        np.maximum(received, floor),
        aspect="auto",
        cmap="magma",
        norm=LogNorm(vmin=floor),
        interpolation="nearest",
    )
    ax.set_yticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
    ax.set_xlabel("token position (key)")
    ax.set_ylabel("layer")
    ax.set_title("attention received (sum over queries, mean over heads)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    side.barh(range(len(layers)), token0_share, color="tab:red")
    side.set_xlim(0, 1)
    side.set_xlabel("share to token 0")
    fig.tight_layout()
    fig.savefig(out / "received.png", dpi=130)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="passage length in tokens")
    parser.add_argument("--layers", type=int, nargs="+", help="layers to map (default: all)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="folder for the PNGs")
    parser.add_argument("--top", type=int, default=5, help="heads and tokens to list")
    args = parser.parse_args(argv)

    path = smollm2_gguf()
    model = Transformer.from_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    c = model.config
    layers = list(range(c.num_hidden_layers)) if args.layers is None else args.layers
    if not layers or not all(0 <= i < c.num_hidden_layers for i in layers):
        parser.error(f"--layers must lie in [0, {c.num_hidden_layers})")
    n = args.tokens
    if n < 2:
        parser.error("--tokens must be at least 2")
    tokens = passage(tokenizer, n)

    q, k, v = eqx.filter_jit(model.attention_inputs)(jnp.asarray(tokens))
    entropy, received = [], []
    for i in layers:
        h, r = maps(q[i], k[i], v[i])
        entropy.append(np.asarray(h))
        received.append(np.asarray(r))
    entropy, received = np.stack(entropy), np.stack(received)  # [layers, seq, heads]

    # Query i sees keys 0..i: its entropy lies in [0, log(i + 1)]; query 0's is 0.
    max_entropy = np.log(np.arange(1, n + 1))[None, :, None]
    mean_nats = entropy[:, 1:].mean(axis=1)  # [layers, heads]
    entropy_frac = (entropy[:, 1:] / max_entropy[:, 1:]).mean(axis=1)
    token0_share = received[:, 0].mean(axis=-1) / n  # each query's weights sum to 1

    args.out.mkdir(parents=True, exist_ok=True)
    plot(args.out, layers, entropy_frac, received.mean(axis=-1), token0_share, n)

    print(
        f"SmolLM2-135M-Instruct ({c.num_hidden_layers} layers, {c.num_attention_heads} heads / "
        f"{c.num_key_value_heads} kv heads) on {n} tokens of the Sonnets, {len(layers)} layers"
    )
    print(f"\nattention entropy, mean over queries 1..{n - 1}: nats (share of log #keys seen)")
    order = np.argsort(entropy_frac, axis=None)
    for label, picks in (("lowest", order[: args.top]), ("highest", order[::-1][: args.top])):
        cells = [np.unravel_index(j, entropy_frac.shape) for j in picks]
        listed = ", ".join(
            f"L{layers[a]}.h{b} {mean_nats[a, b]:.2f} ({entropy_frac[a, b]:.2f})" for a, b in cells
        )
        print(f"  {label:8s}{listed}")
    by_layer = entropy_frac.mean(axis=1)
    print("  by layer: " + " ".join(f"L{i}:{e:.2f}" for i, e in zip(layers, by_layer, strict=True)))

    first = show(tokenizer, int(tokens[0]))
    print(f"\nshare of all attention received by token 0 ({first}), by layer:")
    print("  " + " ".join(f"L{i}:{s:.2f}" for i, s in zip(layers, token0_share, strict=True)))
    sinks = np.argwhere(received[:, 0] / n > 0.9)  # [layer, head] pairs
    listed = ", ".join(f"L{layers[a]}.h{b}" for a, b in sinks) or "none"
    print(f"heads giving token 0 over 90% of their attention: {listed}")
    share = received.mean(axis=(0, 2)) / n  # [seq]: mean over layers and heads
    print("most-attended tokens (share of all attention, mean over the layers and heads):")
    for a in np.argsort(share)[::-1][: args.top]:
        print(f"  position {a:4d} {show(tokenizer, int(tokens[a])):14s} {share[a]:.3f}")
    print(f"\nplots written to {args.out / 'entropy.png'} and {args.out / 'received.png'}")
    return {
        "layers": layers,
        "tokens": tokens,
        "entropy": entropy,
        "received": received,
        "entropy_frac": entropy_frac,
        "token0_share": token0_share,
        "files": [args.out / "entropy.png", args.out / "received.png"],
    }


if __name__ == "__main__":
    main()
