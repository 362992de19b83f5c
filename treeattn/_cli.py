"""The `treeattn` command line."""

from __future__ import annotations

import argparse
import sys


def _simulate_devices(n: int) -> None:
    """On a CPU-only machine, give JAX `n` devices (must run before JAX starts its backends)."""
    import jax

    try:
        if getattr(jax.config, "jax_platforms", None) in (None, "", "cpu"):
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # JAX already initialised: use the devices it has
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="treeattn",
        description="Attention as the gradient of a free energy, and tree-reduced decoding.",
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.add_parser(
        "demo",
        help="the main job (the default): energy checks, tree-decoded generation, tree vs ring",
        description="Check attention as jax.grad of the free energy against float64 NumPy, "
        "generate text with the shipped model and its KV cache sharded over 8 simulated "
        "devices (tree decoding), compare every step across backends, and time tree vs ring "
        "decoding.",
    )
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        _simulate_devices(8)
        from ._demo import run

        return 1 if run() else 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
