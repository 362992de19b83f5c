"""The sharded free energy: the three reduction schedules side by side, on p simulated devices.

    python benchmarks/reduction.py            # p = 2, 4, 8; q_seq 8, kv_seq 32768, 16 heads of 128
    python benchmarks/reduction.py --quick

For each p and schedule: the collectives of the compiled program and the bytes one device sends
(read off the HLO; ring model for all-reduces), and the median run time of the forward
(`tree_free_energy`) and of the forward plus its gradient in zeta (attention,
`tree_energy_attention`), next to the unsharded energy on one device in the same run.
The devices are simulated on this machine's CPU cores, so the times measure the software path,
not a network (see docs/sharded-energy.md for what they mean on a real cluster).
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--q-seq", type=int, default=8)
    parser.add_argument("--kv-seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="kv_seq 4096, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.kv_seq, args.repeats = 4096, 3
    # The simulated device count must be set before JAX starts.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(args.devices))
    run(args)


def run(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _common import compile_and_time, machine, write_json
    from jax.sharding import Mesh

    from treeattn.energy import (
        energy_attention,
        multihead_free_energy,
        tree_energy_attention,
        tree_free_energy,
    )
    from treeattn.profiling import collective_stats

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (args.q_seq, args.heads, args.dim))
    k = jax.random.normal(keys[1], (args.kv_seq, args.heads, args.dim))
    v = jax.random.normal(keys[2], (args.kv_seq, args.heads, args.dim))
    zeta = jnp.zeros((args.q_seq, args.heads, args.dim))
    kw = {"causal": True, "q_offset": args.kv_seq - args.q_seq}

    print(f"machine: {machine()}")
    print(
        f"q_seq {args.q_seq}, kv_seq {args.kv_seq}, {args.heads} heads of {args.dim}, fp32, "
        f"causal; medians of {args.repeats} runs; compile time apart\n"
    )
    fwd1 = compile_and_time(
        lambda q, k, v, z: multihead_free_energy(q, k, v, z, **kw),
        q,
        k,
        v,
        zeta,
        repeats=args.repeats,
    )
    att1 = compile_and_time(
        lambda q, k, v: energy_attention(q, k, v, **kw), q, k, v, repeats=args.repeats
    )
    print(
        f"baseline, unsharded on one device: forward {fwd1['median_s'] * 1e3:.1f} ms, "
        f"forward + gradient (attention) {att1['median_s'] * 1e3:.1f} ms\n"
    )
    header = (
        f"{'p':>2} {'schedule':<13} {'fwd colls':<14} {'fwd+grad colls':<18} "
        f"{'bytes/dev':>10} {'eq.35':>9} {'fwd':>9} {'fwd+grad':>9} {'vs 1 dev':>9} "
        f"{'compile':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for p in args.devices:
        flat = Mesh(np.array(jax.devices()[:p]), ("kv",))
        nodes = 2 if p % 2 == 0 and p > 2 else 1
        two = Mesh(np.array(jax.devices()[:p]).reshape(nodes, p // nodes), ("node", "local"))
        for schedule in ("allreduce", "butterfly", "hierarchical"):
            if schedule == "hierarchical":
                tk = {"mesh": two, "kv_axis": ("node", "local"), "reduction": schedule}
            else:
                tk = {"mesh": flat, "kv_axis": "kv", "reduction": schedule}

            def fwd(q, k, v, z, tk=tk):
                return tree_free_energy(q, k, v, z, **tk, **kw)

            def att(q, k, v, tk=tk):
                return tree_energy_attention(q, k, v, **tk, **kw)

            f_exe, a_exe = {}, {}
            f_time = compile_and_time(fwd, q, k, v, zeta, repeats=args.repeats, keep=f_exe)
            a_time = compile_and_time(att, q, k, v, repeats=args.repeats, keep=a_exe)
            f_stats = collective_stats(f_exe["compiled"])
            a_stats = collective_stats(a_exe["compiled"])
            # Paper eq. (35): 2 (p-1)/p (b d + 2 b n_h) elements, b = q_seq, d = heads * dim.
            eq35 = (
                2
                * (p - 1)
                / p
                * (args.q_seq * args.heads * args.dim + 2 * args.q_seq * args.heads)
                * 4
            )

            def colls(s):
                return ", ".join(
                    f"{n} {kind.replace('collective-permute', 'permute')}"
                    for kind, n in (
                        (k_, s.count(k_)) for k_ in ("all-reduce", "collective-permute")
                    )
                    if n
                )

            row = {
                "p": p,
                "schedule": schedule,
                "forward_collectives": f_stats.summary(),
                "attention_collectives": a_stats.summary(),
                "attention_bytes_sent_per_device": a_stats.bytes_sent(),
                "eq35_bytes": eq35,
                "forward": f_time,
                "attention": a_time,
                "attention_vs_one_device": a_time["median_s"] / att1["median_s"],
            }
            rows.append(row)
            print(
                f"{p:>2} {schedule:<13} {colls(f_stats):<14} {colls(a_stats):<18} "
                f"{a_stats.bytes_sent():>10.0f} {eq35:>9.0f} "
                f"{f_time['median_s'] * 1e3:>7.1f}ms {a_time['median_s'] * 1e3:>7.1f}ms "
                f"{row['attention_vs_one_device']:>8.2f}x {a_time['compile_s']:>7.2f}s"
            )
    path = write_json(
        "reduction",
        {
            "machine": machine(),
            "args": vars(args),
            "baseline": {"forward": fwd1, "attention": att1},
            "rows": rows,
        },
    )
    print(
        f"\nbytes/dev: bytes one device sends for forward + gradient (ring model for "
        f"all-reduces: 2(g-1)/g of the buffer per reduction; a permute sends its buffer)."
        f"\neq.35: the paper's 2(p-1)/p (bd + 2 b n_h) elements of 4 bytes.\nwrote {path}"
    )


if __name__ == "__main__":
    main()
