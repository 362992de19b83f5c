"""Tree decoding vs the Ring Attention baseline vs one device: the paper's decode measurements.

    python benchmarks/decode.py                  # p = 1, 2, 4, 8; context 16K, 64K, 256K
    python benchmarks/decode.py --quick          # p = 1, 8; context 16K, 64K; fp32
    python benchmarks/decode.py --contexts 1048576 --dtypes bfloat16 --no-ring
    python benchmarks/decode.py --heads 12 --kv-heads 4 --dim 64 --name decode_gqa  # GQA
    python benchmarks/decode.py --kernel-grid    # only: the cpu kernel over a grid of shapes

One decode step (batch 1, one query, 16 heads of 128 unless told) against a KV cache sharded
along the sequence over p simulated CPU devices, in the library's recommended head-major layout
("bhsd").
For every (dtype, context, p): median latency of tree_decode (backend "auto", and "xla" as the
named baseline for the local kernel), ring_decode and, at p = 1, the single-device
flash_attention; the streaming floor (reading the local K/V shard once) measured
in the same rounds; collectives and bytes per device from the compiled HLO (loops times their
trip counts) and peak memory from XLA's memory analysis, beside the paper's formulas (29)-(35).
Compile time is reported apart. The same script runs unchanged on GPUs (it uses whatever devices
JAX sees, simulating CPU devices only when the backend is the CPU).

With `--kernel-grid` (on its own, written to `results/decode_kernel.json`): one decode step of
one sequence through the C++ `"cpu"` kernel on one device, over head sizes {32, 64, 128}, query
heads per kv head {1, 3, 4, 8}, float32 and bfloat16, and 8K and 32K cached tokens (kv heads x
head size = 256 in every cell: 64 MiB of float32 K and V at 32K), against the time of reading
K and V once (a `jnp.sum` of each, which XLA streams) in the same rounds, caches cold (a 64 MiB
read before every call, as in a model's step, whose weights and other layers evict them).
Medians of the per-round ratios with their quartiles; the worst and the median cell per dtype.
"""

from __future__ import annotations

import argparse
import os


SETTLE_S = 0.1  # the least pause after the xla kernel's call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536, 262144])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: default --heads")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (medians; 9, --kernel-grid 41)"
    )
    parser.add_argument("--no-ring", action="store_true", help="skip the ring baseline")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--name", default="decode", help="results/<name>.json (the plot only for 'decode')"
    )
    parser.add_argument(
        "--layouts-only", action="store_true", help="only the one-device layout comparison"
    )
    parser.add_argument(
        "--kernel-grid",
        action="store_true",
        help="only the cpu kernel against a read, over its own grid (not --contexts/--dtypes)",
    )
    args = parser.parse_args()
    args.rounds = args.rounds or (41 if args.kernel_grid else 9)
    if args.quick:
        args.devices, args.contexts, args.dtypes, args.rounds = (
            [1, 8],
            [16384, 65536],
            ["float32"],
            5,
        )
    if args.kernel_grid:
        args.devices = [1]  # one device: the kernel's threads are the machine's
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", max(args.devices))
    if args.layouts_only:
        from _common import machine, write_json

        write_json("decode_layouts", {"machine": machine(), "layouts": layouts(args)})
        return
    if args.kernel_grid:
        from _common import machine, write_json

        write_json("decode_kernel", {"machine": machine(), "rows": kernel_grid(args.rounds)})
        return
    run(args)


def run(args) -> None:
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from _common import machine, write_json
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from treeattn.decode import flash_attention, ring_decode, tree_decode
    from treeattn.profiling import collective_stats

    h, dh = args.heads, args.dim
    kvh = args.kv_heads or h
    if h % kvh:
        raise SystemExit(f"--heads {h} is not a multiple of --kv-heads {kvh}")
    d, dq = kvh * dh, h * dh  # cached elements per token; query (and output) elements
    rows = []
    print(f"machine: {machine()}")
    print(
        f"batch 1, one query, {h} heads ({kvh} kv heads) of {dh}, kv_layout bhsd; "
        f"medians of {args.rounds} interleaved rounds; compile time apart\n"
    )
    header = (
        f"{'dtype':<9}{'context':>9}{'p':>3} {'floor':>9} {'tree':>9} {'tree xla':>9} "
        f"{'ring':>10} {'tree/floor':>10} {'xla/floor':>9} {'ring/tree':>9} {'tree MB':>9} "
        f"{'ring MB':>9} "
        f"{'tree/ring mem':>13} {'tree B/dev':>10} {'ring B/dev':>11} {'compile t/r':>12}"
    )
    print(header)
    print("-" * len(header))
    for dtype in args.dtypes:
        itemsize = jnp.dtype(dtype).itemsize
        for n in args.contexts:
            for p in args.devices:
                if n % p:
                    continue
                mesh = Mesh(np.array(jax.devices()[:p]), ("kv",))
                spec = P(None, None, "kv", None)
                sharding = NamedSharding(mesh, spec)

                def init(key, n=n, dtype=dtype):
                    return jax.random.normal(key, (1, kvh, n, dh), jnp.dtype(dtype))

                make = jax.jit(init, out_shardings=sharding)
                k, v = make(jax.random.key(1)), make(jax.random.key(2))
                q = jax.random.normal(jax.random.key(0), (1, 1, h, dh), jnp.dtype(dtype))

                def floor_fn(q, k, v, mesh=mesh, spec=spec):
                    # Read the local K and V shard once (a reduction XLA streams).
                    def local(k, v):
                        return (
                            jnp.sum(k, axis=(2, 3), dtype=jnp.float32)
                            + jnp.sum(v, axis=(2, 3), dtype=jnp.float32)
                        )[None]

                    return jax.shard_map(
                        local, mesh=mesh, in_specs=(spec, spec), out_specs=P("kv")
                    )(k, v)

                def tree_fn(q, k, v, mesh=mesh):
                    return tree_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd")

                def tree_xla_fn(q, k, v, mesh=mesh):
                    # The named baseline for the local kernel: tree decoding on the plain-JAX
                    # blockwise kernel instead of the C++ one "auto" picks on CPU.
                    return tree_decode(
                        q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd", backend="xla"
                    )

                def ring_fn(q, k, v, mesh=mesh):
                    return ring_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd")

                fns = {"floor": floor_fn, "tree": tree_fn}
                if p == 1:
                    fns["single"] = lambda q, k, v: flash_attention(q, k, v, kv_layout="bhsd")[0]
                fns["tree_xla"] = tree_xla_fn  # last in each round: see below
                if not args.no_ring and p > 1:
                    fns["ring"] = ring_fn
                compiled, compile_s = {}, {}
                for name, fn in fns.items():
                    start = time.perf_counter()
                    compiled[name] = jax.jit(fn).lower(q, k, v).compile()
                    compile_s[name] = time.perf_counter() - start
                    jax.block_until_ready(compiled[name](q, k, v))  # warm-up
                # Interleave floor, tree (and single) round by round so that machine noise hits
                # them alike. The xla kernel goes last in a round and is followed by a pause as
                # long as it took: in bfloat16 its work runs on past its result (measured: the
                # tree took 75 ms alone, 343 ms right after it, 78 ms after a 0.3 s pause). The
                # ring, whose large copies disturb whatever runs next, is timed on its own
                # afterwards, with fewer rounds (it is slow).
                times: dict[str, list[float]] = {name: [] for name in compiled}
                for name_set, n_rounds in (
                    ([x for x in compiled if x != "ring"], args.rounds),
                    ([x for x in compiled if x == "ring"], max(3, args.rounds // 3)),
                ):
                    for _ in range(n_rounds if name_set else 0):
                        for name in name_set:
                            start = time.perf_counter()
                            jax.block_until_ready(compiled[name](q, k, v))
                            times[name].append(time.perf_counter() - start)
                            if name == "tree_xla":
                                time.sleep(max(SETTLE_S, times[name][-1]))
                med = {name: statistics.median(t) for name, t in times.items()}
                paired, paired_xla = (
                    statistics.median(
                        t / f for t, f in zip(times[name], times["floor"], strict=True)
                    )
                    for name in ("tree", "tree_xla")
                )

                def peak(c):
                    m = c.memory_analysis()
                    return (
                        m.argument_size_in_bytes
                        + m.output_size_in_bytes
                        + m.temp_size_in_bytes
                        - m.alias_size_in_bytes
                    )

                t_stats = collective_stats(compiled["tree"])
                row = {
                    "dtype": dtype,
                    "context": n,
                    "p": p,
                    "floor_s": med["floor"],
                    "tree_s": med["tree"],
                    "tree_over_floor_paired": paired,
                    "tree_xla_s": med["tree_xla"],
                    "tree_xla_over_floor_paired": paired_xla,
                    "tree_collectives": t_stats.summary(),
                    "tree_bytes_per_device": t_stats.bytes_sent(),
                    "tree_peak_bytes": peak(compiled["tree"]),
                    "compile_s": compile_s,
                    # Paper: t = n / p tokens per device, b = 1, d = heads * dim (elements).
                    "eq30_tree_mem_bytes": (2 * (n // p) * d + 2 * dq + 2 * h) * itemsize,
                    "eq35_tree_comm_bytes": 2 * (p - 1) / p * (dq + 2 * h) * 4,
                }
                if "single" in med:
                    row["single_s"] = med["single"]
                if "ring" in med:
                    r_stats = collective_stats(compiled["ring"])
                    row.update(
                        ring_s=med["ring"],
                        ring_over_tree=med["ring"] / med["tree"],
                        ring_collectives=r_stats.summary(),
                        ring_bytes_per_device=r_stats.bytes_sent(),
                        ring_peak_bytes=peak(compiled["ring"]),
                        eq29_ring_mem_bytes=(4 * (n // p) * d + 2 * dq) * itemsize,
                        eq31_ring_comm_bytes=2 * (n // p) * d * (p - 1) * itemsize,
                        tree_over_ring_mem=peak(compiled["tree"]) / peak(compiled["ring"]),
                    )
                rows.append(row)

                def ms(x):
                    return f"{x * 1e3:7.1f}ms" if x is not None else f"{'-':>9}"

                ring_s = row.get("ring_s")
                print(
                    f"{dtype:<9}{n:>9}{p:>3} {ms(row['floor_s'])} {ms(row['tree_s'])} "
                    f"{ms(row['tree_xla_s'])} {ms(ring_s):>10} {paired:>9.2f}x "
                    f"{paired_xla:>8.2f}x "
                    f"{row.get('ring_over_tree', float('nan')):>8.1f}x "
                    f"{row['tree_peak_bytes'] / 2**20:>9.0f} "
                    f"{row.get('ring_peak_bytes', float('nan')) / 2**20:>9.0f} "
                    f"{row.get('tree_over_ring_mem', float('nan')):>13.2f} "
                    f"{row['tree_bytes_per_device']:>10.0f} "
                    f"{row.get('ring_bytes_per_device', float('nan')):>11.3g} "
                    f"{compile_s['tree']:>5.2f}/{compile_s.get('ring', float('nan')):<5.2f}s"
                )
                del k, v, compiled
    print(
        "\nfloor: reading the local K/V shard once (same rounds). tree: backend 'auto' (the C++ "
        "kernel on CPU); tree xla: backend 'xla'.\ntree/floor, xla/floor: medians of the "
        "per-round ratios.\nMB: peak memory per device (arguments + outputs + temporaries, "
        "XLA memory analysis); B/dev: bytes one device sends (HLO, ring model)."
    )
    targets(rows)
    layout_rows = layouts(args) if args.name == "decode" else []
    path = write_json(
        args.name,
        {"machine": machine(), "args": vars(args), "rows": rows, "layouts": layout_rows},
    )
    print(f"wrote {path}")
    if args.name == "decode":
        plot(rows)


def layouts(args) -> list[dict]:
    """One device, one decode step: the cache layout against the time of reading K and V."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp

    from treeattn.decode import flash_attention

    n, h, dh = 65536, args.heads, args.dim
    k = jax.random.normal(jax.random.key(1), (1, h, n, dh))
    v = jax.random.normal(jax.random.key(2), (1, h, n, dh))
    q = jax.random.normal(jax.random.key(0), (1, 1, h, dh))
    ks, vs = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    fns = {
        "read K and V once": (lambda q, k, v: jnp.sum(k) + jnp.sum(v), k, v),
        "flash_attention bhsd": (
            lambda q, k, v: flash_attention(q, k, v, kv_layout="bhsd")[0],
            k,
            v,
        ),
        "flash_attention bshd": (
            lambda q, k, v: flash_attention(q, k, v, kv_layout="bshd")[0],
            ks,
            vs,
        ),
        "flash_attention bhsd xla": (
            lambda q, k, v: flash_attention(q, k, v, kv_layout="bhsd", backend="xla")[0],
            k,
            v,
        ),
        "flash_attention bshd xla": (
            lambda q, k, v: flash_attention(q, k, v, kv_layout="bshd", backend="xla")[0],
            ks,
            vs,
        ),
    }
    compiled = {
        name: (jax.jit(f).lower(q, a, b).compile(), a, b) for name, (f, a, b) in fns.items()
    }
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(args.rounds):
        for name, (c, a, b) in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(q, a, b))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["read K and V once"])
    print(f"\nlayout, one device, context {n}, fp32 (medians of {args.rounds}):")
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        rows.append({"name": name, "median_s": med, "vs_read": med / base})
        print(f"  {name:<24} {med * 1e3:8.1f} ms  {med / base:6.2f}x")
    return rows


def kernel_grid(rounds: int) -> list[dict]:
    """One decode step through the cpu kernel against one read of its K and V, cold, per cell
    of (dtype, head size, query heads per kv head, context); the per-round ratios' median and
    quartiles, then the worst and the median cell per dtype."""
    import itertools
    import statistics
    import time

    import jax
    import jax.numpy as jnp

    from treeattn.decode import flash_attention

    evict = jnp.ones((16 << 20,), jnp.float32)  # 64 MiB, read before every timed call
    read_evict = jax.jit(jnp.sum).lower(evict).compile()
    grid = itertools.product(("float32", "bfloat16"), (32, 64, 128), (1, 3, 4, 8), (8192, 32768))
    print(
        f"\nthe cpu kernel, one decode step of one sequence against reading its K and V once "
        f"(cold); medians of {rounds} rounds in turns, [quartiles] of the per-round ratios"
    )
    print(f"{'dtype':<9} {'head':>4} {'group':>5} {'context':>7} {'read':>9} {'kernel':>9}  ratio")
    rows = []
    for dtype, dim, group, n in grid:
        kv_heads = 256 // dim
        keys = jax.random.split(jax.random.key(3), 3)
        q = jax.random.normal(keys[0], (1, 1, group * kv_heads, dim), dtype)
        k, v = (jax.random.normal(kk, (1, kv_heads, n, dim), dtype) for kk in keys[1:])
        length = jnp.full((1,), n, jnp.int32)

        def step(q, k, v, length=length):
            kw = {"kv_length": length, "q_offset": length - 1, "causal": True}
            return flash_attention(q, k, v, kv_layout="bhsd", backend="cpu", **kw)[0]

        def read(q, k, v):
            return jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)

        calls = {
            name: jax.jit(f).lower(q, k, v).compile()
            for name, f in (("read", read), ("kernel", step))
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for c in calls.values():
            jax.block_until_ready(c(q, k, v))
        for _ in range(rounds):
            for name, c in calls.items():
                jax.block_until_ready(read_evict(evict))
                start = time.perf_counter()
                jax.block_until_ready(c(q, k, v))
                times[name].append(time.perf_counter() - start)
        ratios = sorted(a / b for a, b in zip(times["kernel"], times["read"], strict=True))
        quartiles = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
        row = {"dtype": dtype, "dim": dim, "group": group, "kv_heads": kv_heads, "context": n}
        row |= {f"{name}_s": statistics.median(t) for name, t in times.items()}
        row |= {"ratio": statistics.median(ratios), "ratio_quartiles": quartiles}
        rows.append(row)
        print(
            f"{dtype:<9} {dim:>4} {group:>5} {n:>7} {row['read_s'] * 1e3:>7.2f}ms "
            f"{row['kernel_s'] * 1e3:>7.2f}ms  {row['ratio']:.2f}x "
            f"[{quartiles[0]:.2f}, {quartiles[1]:.2f}]"
        )
    print("\nworst first:")
    for dtype in ("float32", "bfloat16"):
        mine = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: -r["ratio"])
        worst = mine[0]
        print(
            f"  {dtype:<9} worst {worst['ratio']:.2f}x (head {worst['dim']}, group "
            f"{worst['group']}, {worst['context']} tokens), median "
            f"{statistics.median(r['ratio'] for r in mine):.2f}x of {len(mine)} cells"
        )
    return rows


def targets(rows) -> None:
    """The issue's targets at p = 8, context 256K, fp32."""
    sel = [r for r in rows if r["p"] == 8 and r["context"] == 262144 and r["dtype"] == "float32"]
    if not sel or "ring_s" not in sel[0]:
        return
    r = sel[0]
    same_p = [x for x in rows if x["p"] == 8 and x["dtype"] == "float32"]
    flat = len({x["tree_bytes_per_device"] for x in same_p}) == 1
    checks = [
        ("tree >= 6x faster than ring", r["ring_over_tree"], r["ring_over_tree"] >= 6),
        (
            "tree <= 1.5x the streaming floor",
            r["tree_over_floor_paired"],
            r["tree_over_floor_paired"] <= 1.5,
        ),
        (
            "tree peak memory <= 0.55x ring",
            r["tree_over_ring_mem"],
            r["tree_over_ring_mem"] <= 0.55,
        ),
        ("tree communication independent of context", float(flat), flat),
    ]
    print("\ntargets at p = 8, context 256K, fp32:")
    for name, value, ok in checks:
        print(f"  {name:<45} {value:8.2f}  {'met' if ok else 'MISSED'}")


def plot(rows) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    import pathlib

    fp32 = [r for r in rows if r["dtype"] == "float32" and "ring_s" in r]
    if not fp32:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    contexts = sorted({r["context"] for r in fp32})
    devices = sorted({r["p"] for r in fp32})
    base = {
        p: next((r["ring_s"] for r in fp32 if r["p"] == p and r["context"] == contexts[0]), None)
        for p in devices
    }
    for p in devices:
        sel = sorted((r for r in fp32 if r["p"] == p), key=lambda r: r["context"])
        xs = [r["context"] for r in sel]
        ax1.plot(xs, [r["ring_s"] / base[p] for r in sel], "o--", label=f"ring, p={p}")
        ax1.plot(xs, [r["tree_s"] / base[p] for r in sel], "o-", label=f"tree, p={p}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("context (tokens)")
    ax1.set_ylabel(f"time relative to ring at {contexts[0] // 1024}K")
    ax1.set_title("(a) decode latency vs context (fp32)")
    ax1.legend(fontsize=7)
    big = max(contexts)
    sel = sorted((r for r in fp32 if r["context"] == big), key=lambda r: r["p"])
    ax2.plot([r["p"] for r in sel], [r["ring_s"] * 1e3 for r in sel], "o--", label="ring")
    ax2.plot([r["p"] for r in sel], [r["tree_s"] * 1e3 for r in sel], "o-", label="tree")
    ax2.plot([r["p"] for r in sel], [r["floor_s"] * 1e3 for r in sel], ":", label="floor")
    ax2.set_xlabel("devices p (simulated on 2 CPU cores)")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.set_title(f"(b) latency vs devices, {big // 1024}K tokens")
    ax2.legend()
    fig.tight_layout()
    out = pathlib.Path(__file__).with_name("results") / "decode.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
