"""The alpha-beta model of ring vs tree decoding on a DGX H100 cluster, beside the paper.

    python benchmarks/cost_model.py            # table, JSON and plot (docs/img/cost_model.png)
    python benchmarks/cost_model.py --measure  # also with the local attention timed on this CPU

Prints `treeattn.decode.cost_model`'s predictions for the paper's set-up (16 heads of 128,
batch 1, bfloat16; 8 GPUs per node, NVLink 4 inside nodes, 400 Gb/s InfiniBand per GPU across
them) for 8 to 128 GPUs and 80K to 5.12M tokens, next to what the paper reports. Nothing here
ran on a GPU: these are the model's numbers.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time


# The paper (arXiv version, section 6.1, Fig. 3): "close to 8x speed-ups when we use 128 GPUs
# on a sequence length of 5.12M"; 8 GPUs = 1 node, 64 = 8 nodes, 128 = 16 nodes. The ICLR
# version's Table 1 (8 x H100, Llama 3.1 8B, decode time with prefill, so not one attention
# step): speed-ups x4, x4, x2, x3 at 32K, 64K, 128K, 256K.
PAPER = {"fig3_128gpus_5.12M_speedup": 8.0, "table1_8xH100_speedups": [4, 4, 2, 3]}


def measure_local_attention(sizes=(4096, 16384, 65536)):
    """Seconds of one decode step's local attention on this machine (one CPU device, 16 heads of
    128, float32, head-major), as a linear fit in the shard's tokens."""
    import jax

    from treeattn.decode import flash_attention

    points = []
    for n in sizes:
        q = jax.random.normal(jax.random.key(0), (1, 1, 16, 128))
        k = jax.random.normal(jax.random.key(1), (1, 16, n, 128))
        fn = jax.jit(lambda q, k: flash_attention(q, k, k, kv_layout="bhsd")[0])
        jax.block_until_ready(fn(q, k))
        times = []
        for _ in range(7):
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k))
            times.append(time.perf_counter() - start)
        points.append((n, statistics.median(times)))
    (n0, t0), (n1, t1) = points[0], points[-1]
    slope = (t1 - t0) / (n1 - n0)
    intercept = t0 - slope * n0
    return (lambda tokens: intercept + slope * tokens), points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also model with this CPU's speed")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()

    from _common import write_json

    from treeattn.decode import DGX_H100, cost_model

    gpus = [8, 16, 32, 64, 128]
    contexts = [80_000, 320_000, 640_000, 1_280_000, 2_560_000, 5_120_000]
    variants = {"H100 memory-bound attention": None}
    measured_points = None
    if args.measure:
        fit, measured_points = measure_local_attention()
        variants["attention at this CPU's speed"] = fit
    c = DGX_H100
    print(
        f"cluster: {c.name}, {c.devices_per_node} GPUs/node, intra {c.intra_bandwidth / 1e9:.0f} "
        f"GB/s + {c.intra_latency * 1e6:.0f} us, inter {c.inter_bandwidth / 1e9:.0f} GB/s + "
        f"{c.inter_latency * 1e6:.0f} us per GPU, HBM {c.memory_bandwidth / 1e12:.2f} TB/s"
    )
    print("one decode step, batch 1, 16 heads of 128, bfloat16 (the paper's attention block)\n")
    rows = []
    for variant, local in variants.items():
        print(f"-- {variant}")
        header = (
            f"{'GPUs':>5} {'context':>10} {'attention':>10} {'tree':>10} {'ring':>10} "
            f"{'ring/tree':>10} {'tree B/dev':>11} {'ring B/dev':>11}"
        )
        print(header)
        print("-" * len(header))
        for p in gpus:
            for n in contexts:
                r = cost_model(n, p, local_attention=local)
                rows.append({"variant": variant, **r.__dict__, "speedup": r.speedup})
                print(
                    f"{p:>5} {n:>10,} {r.attention * 1e3:>8.3f}ms {r.tree * 1e3:>8.3f}ms "
                    f"{r.ring * 1e3:>8.1f}ms {r.speedup:>9.0f}x {r.tree_bytes:>11,.0f} "
                    f"{r.ring_bytes:>11.3g}"
                )
        print()
    point = next(
        r
        for r in rows
        if r["devices"] == 128
        and r["context"] == 5_120_000
        and r["variant"] == "H100 memory-bound attention"
    )
    print(
        f"paper, 128 GPUs, 5.12M tokens: ~{PAPER['fig3_128gpus_5.12M_speedup']:.0f}x measured; "
        f"the model: {point['speedup']:.0f}x (tree {point['tree'] * 1e3:.2f} ms, ring "
        f"{point['ring'] * 1e3:.0f} ms)"
    )
    path = write_json(
        "cost_model",
        {"cluster": c.__dict__, "paper": PAPER, "rows": rows, "measured": measured_points},
    )
    print(f"wrote {path}")
    if not args.no_plot:
        plot(rows, gpus, contexts)


def plot(rows, gpus, contexts) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    base = [r for r in rows if r["variant"] == "H100 memory-bound attention"]
    ax = axes[0]
    for p in gpus:
        pts = [r for r in base if r["devices"] == p]
        ax.plot([r["context"] / 1e6 for r in pts], [r["speedup"] for r in pts], "o-", label=f"{p}")
    ax.scatter([5.12], [8.0], marker="*", s=200, color="k", zorder=5, label="paper (measured)")
    ax.set(
        xlabel="context (M tokens)",
        ylabel="ring time / tree time",
        yscale="log",
        title="modelled speed-up of tree over ring",
    )
    ax.legend(title="GPUs", fontsize=8)
    ax = axes[1]
    ref = next(r for r in base if r["devices"] == gpus[0] and r["context"] == contexts[0])["ring"]
    for p in (gpus[0], gpus[-1]):
        pts = [r for r in base if r["devices"] == p]
        x = [r["context"] / 1e6 for r in pts]
        ax.plot(x, [r["ring"] / ref for r in pts], "o--", label=f"ring, {p} GPUs")
        ax.plot(x, [r["tree"] / ref for r in pts], "o-", label=f"tree, {p} GPUs")
    ax.set(
        xlabel="context (M tokens)",
        ylabel=f"time / ring at {contexts[0] // 1000}K, {gpus[0]} GPUs",
        yscale="log",
        title="modelled decode time (as the paper's Fig. 3)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = pathlib.Path(__file__).resolve().parents[1] / "docs" / "img" / "cost_model.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
