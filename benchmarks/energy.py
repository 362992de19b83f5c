"""Attention as jax.grad of the free energy vs softmax attention: run time and compiled FLOPs.

    python benchmarks/energy.py            # q_seq = kv_seq = 2048, 16 heads of 128
    python benchmarks/energy.py --quick    # a small shape, for a smoke run

Baseline: `jax.nn.dot_product_attention` (XLA implementation on CPU), timed in the same run.
Also shown: `attention_reference` (the float32 twin) and the naive `jax.grad` of the free energy
at zeta = 0, which pays for the product zeta.v that `energy_attention` skips.
Targets: energy_attention within 1.15x of the baseline's time and 1.05x of its FLOPs.

Above 2^26 logits (2^23 for causal self-attention) `energy_attention` is evaluated blockwise
by itself, in a loop whose body `cost_analysis()` counts once; so FLOPs are also read from the
same call with `block_size` = kv_seq (one block: materialised, the same arithmetic in one
piece), which is also timed. (The default shape has exactly 2^26 logits: the full rows are
materialised, the causal rows blockwise.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _common import compile_and_time, machine, write_json

from treeattn.energy import attention_reference, energy_attention, multihead_free_energy


TIME_TARGET = 1.15
FLOP_TARGET = 1.05


def implementations(causal: bool):
    def dpa(q, k, v):
        return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=causal)[0]

    def energy(q, k, v):
        return energy_attention(q, k, v, causal=causal)

    def materialised(q, k, v):
        return energy_attention(q, k, v, causal=causal, block_size=k.shape[0])

    def reference(q, k, v):
        return attention_reference(q, k, v, causal=causal)

    def naive(q, k, v):
        zeta = jnp.zeros(q.shape[:2] + v.shape[-1:], jnp.float32)
        grad = jax.grad(multihead_free_energy, argnums=3)(
            q, k, v, zeta, causal=causal, block_size=k.shape[0]
        )
        return grad.astype(q.dtype)

    return {
        "dot_product_attention": dpa,
        "energy_attention": energy,
        "energy_attention (1 block)": materialised,
        "attention_reference": reference,
        "naive grad F": naive,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="seq 256, 4 heads of 64")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.heads, args.dim, args.repeats = 256, 4, 64, 3

    print(f"machine: {machine()}")
    print(
        f"q_seq = kv_seq = {args.seq}, {args.heads} heads of {args.dim}; medians of "
        f"{args.repeats} runs after warm-up; compile time apart\n"
    )
    header = (
        f"{'dtype':<9} {'mask':<7} {'implementation':<26} {'median':>9} {'compile':>8} "
        f"{'GFLOP':>8} {'time/base':>9} {'flops/base':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    ok = True
    for dtype in ("float32", "bfloat16"):
        for causal in (False, True):
            keys = jax.random.split(jax.random.key(0), 3)
            shape = (args.seq, args.heads, args.dim)
            q, k, v = (jax.random.normal(kk, shape, jnp.dtype(dtype)) for kk in keys)
            results = {
                name: compile_and_time(fn, q, k, v, repeats=args.repeats)
                for name, fn in implementations(causal).items()
            }
            base = results["dot_product_attention"]
            for name, r in results.items():
                r.update(
                    dtype=dtype,
                    causal=causal,
                    implementation=name,
                    time_ratio=r["median_s"] / base["median_s"],
                    flop_ratio=r["flops"] / base["flops"],
                )
                rows.append(r)
                print(
                    f"{dtype:<9} {'causal' if causal else 'full':<7} {name:<26} "
                    f"{r['median_s'] * 1e3:>7.1f}ms {r['compile_s']:>7.2f}s "
                    f"{r['flops'] / 1e9:>8.2f} {r['time_ratio']:>8.2f}x {r['flop_ratio']:>9.2f}x"
                )
            e, m = results["energy_attention"], results["energy_attention (1 block)"]
            hit = e["time_ratio"] <= TIME_TARGET and m["flop_ratio"] <= FLOP_TARGET
            ok &= hit
            print(
                f"{'':<17} energy_attention targets (time <= {TIME_TARGET}x, "
                f"FLOPs of 1 block <= {FLOP_TARGET}x): {'met' if hit else 'MISSED'}"
            )
    path = write_json("energy", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"\nwrote {path}")
    print("all targets met" if ok else "some targets missed")


if __name__ == "__main__":
    main()
