"""The `treeattn` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="treeattn",
        description="Attention as the gradient of a free energy, and tree-reduced decoding.",
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.add_parser(
        "demo",
        help="the main job: verify attention as jax.grad of the free energy (the default)",
        description="Compute attention as jax.grad of the free energy for several shapes and "
        "check it, its Hessian and the tilted source against float64 NumPy.",
    )
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        from ._demo import run

        return 1 if run() else 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
