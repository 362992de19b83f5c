"""Train the character-level Llama shipped with treeattn on Shakespeare's Sonnets.

    python examples/train_sonnets.py                       # the shipped checkpoint
    python examples/train_sonnets.py --steps 20 --out /tmp/sonnets

Reproduces `treeattn/pretrained/checkpoints/sonnets/` (AdamW, warm-up and cosine schedule, gradient
clipping, attention as the gradient of the free energy). Resumes from `--out` if a training state
is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import jax

from treeattn.models import LlamaConfig, Transformer
from treeattn.pretrained import CHECKPOINTS, CharTokenizer, load_text
from treeattn.training import TrainConfig, train


MODEL = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    parser.add_argument("--backend", default="energy", choices=["energy", "reference", "flash"])
    parser.add_argument("--out", type=pathlib.Path, default=CHECKPOINTS / "sonnets")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    text = load_text("sonnets.txt")
    tokenizer = CharTokenizer.from_text(text)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, **MODEL)
    model = Transformer(config, key=jax.random.key(args.seed))
    train_config = dataclasses.replace(
        TrainConfig(),
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
    )
    model, losses = train(
        model,
        tokenizer.encode(text),
        train_config,
        backend=args.backend,
        checkpoint_dir=args.out,
        tokenizer=tokenizer,
    )
    if losses:
        print(f"final loss {losses[-1]:.3f} (first {losses[0]:.3f}); saved to {args.out}")


if __name__ == "__main__":
    main()
