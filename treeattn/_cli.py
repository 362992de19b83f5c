"""The `treeattn` command line: demo, verify, bench, launch."""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys


BENCHMARKS = ("decode", "reduction", "generate", "multihost", "energy")


def _join_run(devices: int | None) -> None:
    """Join a multi-process run if the environment describes one (`treeattn launch` does);
    otherwise give a CPU-only JAX `devices` simulated devices. Must run before JAX starts."""
    import jax

    from .distributed import initialize

    if initialize() is not None or devices is None:
        return
    try:
        if getattr(jax.config, "jax_platforms", None) in (None, "", "cpu"):
            jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # JAX already initialised: use the devices it has
        pass


def _positive(text: str) -> int:
    """An argparse type: a positive integer (argparse names the option in its message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
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
    verify = sub.add_parser(
        "verify",
        help="equivalence of energy / fused / tree / ring attention on the current devices",
        description="Compute one decode problem (GQA, a partly filled cache, several queries) "
        "on every path — the float64 NumPy reference, attention as jax.grad of the free energy, "
        "every fused backend available here, tree decoding with each reduction schedule and "
        "the ring baseline over all devices — and print the max error of each. Exits 1 if "
        "any path disagrees. Runs across processes under `treeattn launch`.",
    )
    verify.add_argument(
        "--devices", type=_positive, default=8, help="simulated CPU devices of a one-process run"
    )
    verify.add_argument(
        "--kv-seq",
        type=_positive,
        default=4096,
        help="cache length, a multiple of the device count (default 4096)",
    )
    bench = sub.add_parser(
        "bench",
        help="run a benchmark script (decode, reduction, generate, multihost, energy)",
        description="Run benchmarks/<name>.py of a source checkout with this Python; extra "
        "arguments go to the script (e.g. `treeattn bench decode -- --quick`).",
    )
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    launch = sub.add_parser(
        "launch",
        help="run a command as N local processes of one jax.distributed run",
        description="Start N processes on 127.0.0.1 wired together through jax.distributed "
        "(a free coordinator port is chosen), forward their output with a [i] prefix, and "
        "exit non-zero if any fails; every child is stopped on failure or Ctrl-C. Example: "
        "`treeattn launch -n 2 --devices-per-process 4 -- treeattn verify`.",
    )
    launch.add_argument("-n", "--num-processes", type=int, required=True)
    launch.add_argument(
        "--devices-per-process", type=_positive, default=None, help="simulated CPU devices each"
    )
    launch.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    launch.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the others get to stop after a process fails (default 10)",
    )
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and its arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        _join_run(8)
        from ._demo import run

        return 1 if run() else 0
    if args.command == "verify":
        _join_run(args.devices)
        import jax

        from ._verify import run as verify

        if args.kv_seq % jax.device_count():
            parser.error(
                f"argument --kv-seq: {args.kv_seq} must be a multiple of the "
                f"{jax.device_count()} devices"
            )

        return verify(kv_seq=args.kv_seq)
    if args.command == "bench":
        return _bench(args.name, args.args)
    if args.command == "launch":
        from ._launch import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if cmd[:1] == ["treeattn"]:  # this installation's entry point, whatever PATH says
            cmd = [sys.executable, "-m", "treeattn", *cmd[1:]]
        elif cmd and shutil.which(cmd[0]) is None:
            hint = (
                f"; to run `treeattn {cmd[0]}` in each process, write `treeattn launch -n "
                f"{args.num_processes} -- treeattn {' '.join(cmd)}`"
                if cmd[0] in ("demo", "verify", "bench", "launch")
                else ""
            )
            parser.error(f"launch: command {cmd[0]!r} not found{hint}")
        try:
            return launch(
                cmd,
                args.num_processes,
                devices_per_process=args.devices_per_process,
                port=args.port,
                grace=args.grace,
            )
        except ValueError as e:
            parser.error(str(e))
    parser.error(f"unknown command {args.command}")
    return 2


def _bench(name: str, args: list[str]) -> int:
    root = pathlib.Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / f"{name}.py"
    if not script.exists():
        print(
            f"treeattn bench: {script} not found; the benchmarks live in the source checkout "
            "(git clone the repository and install it with `pip install -e .`)",
            file=sys.stderr,
        )
        return 2
    args = args[1:] if args[:1] == ["--"] else args
    return subprocess.call([sys.executable, str(script), *args], cwd=root)


if __name__ == "__main__":
    sys.exit(main())
