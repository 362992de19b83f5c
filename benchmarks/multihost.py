"""Tree vs ring decoding across local processes (jax.distributed, gloo), beside one process.

    python benchmarks/multihost.py                      # 2 and 4 processes x 2 devices
    python benchmarks/multihost.py --processes 2 --context 16384 --rounds 5

For each layout, P processes of D simulated CPU devices each are started with `treeattn
launch`, and the same mesh of P x D devices is also run as one process with P x D simulated
devices (the baseline, same run). One decode step (batch 1, one query, 16 heads of 128, fp32,
head-major cache sharded along the sequence): compile time apart, medians, and the bytes one
device sends per step from the compiled HLO.

All processes share this machine's two cores and talk over loopback: this measures the software
path (gloo's collectives, process boundaries), not a network. `treeattn.decode.cost_model`
models real clusters.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time


HERE = pathlib.Path(__file__).resolve().parent


def worker(args) -> None:
    """One process of a run (or the whole single-process baseline): time tree and ring."""
    from treeattn.distributed import initialize

    if initialize() is None:  # the one-process baseline
        import jax

        jax.config.update("jax_num_cpu_devices", args.single)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from treeattn.decode import ring_decode, tree_decode
    from treeattn.distributed import kv_mesh
    from treeattn.profiling import collective_stats

    mesh = kv_mesh()
    sharding = NamedSharding(mesh, P(None, None, "kv", None))
    h, d, n = 16, 128, args.context

    def init(key):
        return jax.random.normal(key, (1, h, n, d), jnp.float32)

    make = jax.jit(init, out_shardings=sharding)
    k, v = make(jax.random.key(1)), make(jax.random.key(2))
    q = np.asarray(jax.random.normal(jax.random.key(0), (1, 1, h, d)))
    fns = {
        "tree": lambda q, k, v: tree_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd"),
        "ring": lambda q, k, v: ring_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd"),
    }
    result = {"processes": jax.process_count(), "devices": jax.device_count(), "context": n}
    outs = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(q, k, v).compile()
        compile_s = time.perf_counter() - start
        outs[name] = jax.block_until_ready(compiled(q, k, v))
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))  # block: queued collectives can deadlock
            times.append(time.perf_counter() - start)
        stats = collective_stats(compiled)
        result[name] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "compile_s": compile_s,
            "bytes_per_device": stats.bytes_sent(),
            "collectives": stats.summary(),
        }
    diff = np.abs(
        np.asarray(outs["tree"].addressable_data(0)) - np.asarray(outs["ring"].addressable_data(0))
    )
    result["max_tree_ring_diff"] = float(diff.max())
    if jax.process_index() == 0:
        pathlib.Path(args.out).write_text(json.dumps(result))


def run_layout(processes: int, per_process: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        common = ["--context", str(args.context), "--rounds", str(args.rounds), "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TREEATTN_")}
        env.setdefault("JAX_PLATFORMS", "cpu")
        if processes == 1:
            cmd = [sys.executable, __file__, "--worker", "--single", str(per_process), *common]
        else:
            cmd = [sys.executable, "-m", "treeattn", "launch", "-n", str(processes)]
            cmd += ["--devices-per-process", str(per_process), "--"]
            cmd += [sys.executable, __file__, "--worker", *common]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--single", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, str(HERE))
    from _common import machine, write_json

    m = args.devices_per_process
    print(f"machine: {machine()}")
    print(
        f"one decode step, {args.context} tokens x 16 heads of 128, fp32, bhsd cache; "
        f"medians of {args.rounds}; {m} simulated devices per process\n"
    )
    header = (
        f"{'layout':<22} {'tree':>9} {'ring':>10} {'ring/tree':>9} {'tree B/dev':>11} "
        f"{'ring B/dev':>11} {'compile t/r':>12} {'|tree-ring|':>11}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for p in args.processes:
        for processes, per in ((1, p * m), (p, m)):
            r = run_layout(processes, per, args)
            r["layout"] = (
                f"1 process x {per} dev" if processes == 1 else f"{processes} processes x {per} dev"
            )
            rows.append(r)
            t, g = r["tree"], r["ring"]
            print(
                f"{r['layout']:<22} {t['median_s'] * 1e3:>7.1f}ms {g['median_s'] * 1e3:>8.1f}ms "
                f"{g['median_s'] / t['median_s']:>8.1f}x {t['bytes_per_device']:>11,.0f} "
                f"{g['bytes_per_device']:>11.3g} {t['compile_s']:>5.2f}/{g['compile_s']:<5.2f}s "
                f"{r['max_tree_ring_diff']:>11.1e}"
            )
    path = write_json("multihost", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
