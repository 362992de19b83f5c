"""Every energy: attention as jax.grad of its free energy vs the same attention written by hand.

    python benchmarks/energies.py            # q_seq = kv_seq = 1024, 8 heads of 64, causal
    python benchmarks/energies.py --quick    # a small shape, for a smoke run
    python benchmarks/energies.py --memory   # also: blockwise memory at 16,384 tokens and
                                             # blockwise vs materialised training time
    python benchmarks/energies.py --decode   # also: one decode step, tree on 8 devices

Per energy: run time and compiled FLOPs of `energy_attention(..., energy=E)` against the
attention of that energy written out in jnp (materialised weights times V), timed in the same
run. Targets: within 1.15x of the hand-written time and 1.05x of its FLOPs. With `--memory`:
the compiled temporaries (`memory_analysis().temp_size_in_bytes`) of training through
attention (forward + gradient in q, k, v) at q = kv = 16,384 tokens, 8 heads of 64, float32,
blockwise with blocks of 512 (target: below 1 GiB; the logits alone are 8 GiB), for every
energy and for the default `Softmax()` (which goes blockwise by itself at that size); then the
time of that training step, blockwise (blocks of 256, the automatic size) vs materialised
(`block_size=kv_seq`), at `--train-seq` tokens (default 2048) where both fit, the two
alternated round by round (target: within 1.3x). With `--decode`: one decode step (a query
against a cache of `--seq` keys) of each energy, `tree_energy_attention` over 8 simulated CPU
devices against `energy_attention` on one (the energy package has no ring
form of a general energy): time and compiled FLOPs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from _common import compile_and_time, machine, write_json

from treeattn.energy import (
    LinearKernel,
    Sigmoid,
    Softmax,
    SoftmaxWithSink,
    StickBreaking,
    elu_plus_one,
    energy_attention,
    tree_energy_attention,
)


TIME_TARGET = 1.15
FLOP_TARGET = 1.05


def _logits(q, k):
    s = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    x = jnp.einsum("thd,shd->hts", q * s, k)
    n_q, n_k = q.shape[0], k.shape[0]
    causal = jnp.arange(n_k)[None, :] <= (n_k - n_q + jnp.arange(n_q))[:, None]
    return x, causal


def _apply(w, v):
    return jnp.einsum("hts,shd->thd", w, v)


def by_hand(name):
    """The attention of energy `name`, written out (MHA, causal, bottom-right)."""

    def softmax(q, k, v, beta=2.0, sink=None):
        x, causal = _logits(q, k)
        y = jnp.where(causal, beta * x, -jnp.inf)
        m = jnp.max(y, axis=-1, keepdims=True)
        if sink is not None:
            m = jnp.maximum(m, beta * sink)
        e = jnp.exp(y - m)
        z = jnp.sum(e, axis=-1, keepdims=True)
        if sink is not None:
            z = z + jnp.exp(beta * sink - m)
        return _apply(e / z, v)

    def sigmoid(q, k, v):
        x, causal = _logits(q, k)
        w = jnp.where(causal, jax.nn.sigmoid(x - jnp.log(k.shape[0])), 0.0)
        return _apply(w, v)

    def linear(q, k, v):
        _, causal = _logits(q, k)
        w = jnp.where(causal, jnp.einsum("thd,shd->hts", elu_plus_one(q), elu_plus_one(k)), 0.0)
        return _apply(w / jnp.sum(w, axis=-1, keepdims=True), v)

    def stick(q, k, v):
        x, causal = _logits(q, k)
        log_r = jnp.where(causal, -jax.nn.softplus(x), 0.0)
        later = jnp.cumsum(log_r[..., ::-1], axis=-1)[..., ::-1] - log_r
        w = jnp.where(causal, jnp.exp(-jax.nn.softplus(-x) + later), 0.0)
        return _apply(w, v)

    return {
        "Softmax(beta=2)": softmax,
        "SoftmaxWithSink(0)": lambda q, k, v: softmax(q, k, v, beta=1.0, sink=0.0),
        "Sigmoid()": sigmoid,
        "LinearKernel()": linear,
        "StickBreaking()": stick,
    }[name]


ENERGIES = {
    "Softmax(beta=2)": Softmax(beta=2.0),
    "SoftmaxWithSink(0)": SoftmaxWithSink(sink=0.0),
    "Sigmoid()": Sigmoid(),
    "LinearKernel()": LinearKernel(),
    "StickBreaking()": StickBreaking(),
}


def memory(seq: int, heads: int, dim: int, block_size: int | None, energy) -> float:
    x = jax.ShapeDtypeStruct((seq, heads, dim), jnp.float32)

    def loss(q, k, v):
        out = energy_attention(q, k, v, causal=True, energy=energy, block_size=block_size)
        return jnp.sum(out**2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None, "this backend gives no memory analysis"
    return analysis.temp_size_in_bytes


def _training_step(energy, block_size: int | None):
    def loss(q, k, v):
        out = energy_attention(q, k, v, causal=True, energy=energy, block_size=block_size)
        return jnp.sum(out**2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def training_times(seq: int, heads: int, dim: int, rounds: int) -> list[dict]:
    """Training through attention (loss on the output, gradient in q, k, v): blockwise (the
    automatic block size) vs materialised, the two alternated in every round; medians and the
    median of the per-round ratios."""
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(kk, (seq, heads, dim)) for kk in keys)
    energies = {**ENERGIES, "Softmax()": Softmax()}
    print(
        f"\ntraining step at {seq} tokens, {heads} heads of {dim}: blockwise (256) vs materialised"
    )
    print(f"{'energy':<20} {'materialised':>12} {'blockwise':>10} {'ratio':>6}")
    out = []
    for name, energy in energies.items():
        steps = {
            "materialised": _training_step(energy, seq),
            "blockwise": _training_step(energy, 256),
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():  # compile and warm up
            jax.block_until_ready(step(q, k, v))
        for _ in range(rounds):
            for label, step in steps.items():
                start = time.perf_counter()
                jax.block_until_ready(step(q, k, v))
                times[label].append(time.perf_counter() - start)
        med = {label: statistics.median(t) for label, t in times.items()}
        ratios = [b / a for a, b in zip(times["materialised"], times["blockwise"], strict=True)]
        ratio = statistics.median(ratios)
        out.append({"energy": name, "seq": seq, **{f"{k}_s": t for k, t in med.items()}})
        out[-1]["ratio"] = ratio
        print(
            f"{name:<20} {med['materialised'] * 1e3:>10.1f}ms {med['blockwise'] * 1e3:>8.1f}ms "
            f"{ratio:>5.2f}x"
        )
    return out


def decode_rows(args) -> list[dict]:
    """One decode step per energy: tree over 8 devices vs unsharded (time, FLOPs)."""
    p = 8
    mesh = jax.make_mesh((p,), ("kv",), axis_types=(jax.sharding.AxisType.Auto,))
    kv = -(-args.seq // p) * p
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, args.heads, args.dim))
    k, v = (jax.random.normal(kk, (kv, args.heads, args.dim)) for kk in keys[1:])
    print(f"\none decode step against {kv} cached keys: tree over {p} devices vs unsharded")
    print(f"{'energy':<20} {'unsharded':>10} {'tree':>9} {'GFLOP 1':>8} {'GFLOP tree':>10}")
    out = []
    for name, energy in ENERGIES.items():

        def one(q, k, v, energy=energy):
            return energy_attention(q, k, v, q_offset=kv - 1, causal=True, energy=energy)

        def tree(q, k, v, energy=energy):
            return tree_energy_attention(
                q, k, v, mesh=mesh, kv_axis="kv", q_offset=kv - 1, causal=True, energy=energy
            )

        a = compile_and_time(one, q, k, v, repeats=args.repeats)
        b = compile_and_time(tree, q, k, v, repeats=args.repeats)
        out.append({"energy": name, "devices": p, "kv": kv, "unsharded": a, "tree": b})
        print(
            f"{name:<20} {a['median_s'] * 1e3:>8.2f}ms {b['median_s'] * 1e3:>7.2f}ms "
            f"{a['flops'] / 1e9:>8.4f} {b['flops'] / 1e9:>10.4f}"
        )
    return out


def attention_rows(args) -> list[dict]:
    """Per energy: attention by gradient vs by hand, time and FLOPs."""
    header = (
        f"{'energy':<20} {'by hand':>9} {'grad F':>9} {'time/hand':>9} {'GFLOP hand':>10} "
        f"{'GFLOP grad':>10} {'flops/hand':>10}"
    )
    print(header)
    print("-" * len(header))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (args.seq, args.heads, args.dim)) for kk in keys)
    rows, ok = [], True
    for name, energy in ENERGIES.items():
        hand = compile_and_time(by_hand(name), q, k, v, repeats=args.repeats)

        def grad_f(q, k, v, energy=energy):
            return energy_attention(q, k, v, causal=True, energy=energy)

        grad = compile_and_time(grad_f, q, k, v, repeats=args.repeats)
        time_ratio = grad["median_s"] / hand["median_s"]
        flop_ratio = grad["flops"] / hand["flops"]
        ok &= time_ratio <= TIME_TARGET and flop_ratio <= FLOP_TARGET
        rows.append({"energy": name, "hand": hand, "grad": grad, "time_ratio": time_ratio})
        rows[-1]["flop_ratio"] = flop_ratio
        print(
            f"{name:<20} {hand['median_s'] * 1e3:>7.1f}ms {grad['median_s'] * 1e3:>7.1f}ms "
            f"{time_ratio:>8.2f}x {hand['flops'] / 1e9:>10.3f} {grad['flops'] / 1e9:>10.3f} "
            f"{flop_ratio:>9.2f}x"
        )
    print(
        f"\ntargets (time <= {TIME_TARGET}x, FLOPs <= {FLOP_TARGET}x): "
        f"{'all met' if ok else 'some missed'}"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="seq 256, 4 heads of 32")
    parser.add_argument("--memory", action="store_true", help="blockwise memory at 16K tokens")
    parser.add_argument("--decode", action="store_true", help="tree (8 devices) vs unsharded")
    parser.add_argument("--train-seq", type=int, default=2048, help="--memory: timing size")
    parser.add_argument("--skip-attention", action="store_true", help="only --memory/--decode")
    args = parser.parse_args()
    if args.decode:  # before JAX starts its backends
        jax.config.update("jax_num_cpu_devices", 8)
    if args.quick:
        args.seq, args.heads, args.dim, args.repeats = 256, 4, 32, 3
    print(f"machine: {machine()}")
    print(
        f"q_seq = kv_seq = {args.seq}, {args.heads} heads of {args.dim}, causal, float32; "
        f"medians of {args.repeats} runs after warm-up\n"
    )
    rows = [] if args.skip_attention else attention_rows(args)
    mem = []
    if args.memory:
        n, h, d = 16384, 8, 64
        print(f"\ntraining through attention at {n} tokens, {h} heads of {d}, float32:")
        cases = [(name, energy, 512) for name, energy in ENERGIES.items()]
        cases += [("Softmax()", Softmax(), 512), ("Softmax()", Softmax(), None)]
        for name, energy, block in cases:
            blocked = memory(n, h, d, block, energy)
            mem.append({"energy": name, "block_size": block, "temp_bytes": blocked})
            how = f"block_size={block}" if block else "block_size=None"
            print(f"  {name:<18} {how:<16} {blocked / 2**30:.3f} GiB of temporaries")
        print(f"  (materialised logits alone: {h * n * n * 4 / 2**30:.0f} GiB)")
        mem += training_times(args.train_seq, h, d, args.repeats)
    dec = decode_rows(args) if args.decode else []
    payload = {"machine": machine(), "args": vars(args), "rows": rows, "memory": mem}
    payload["decode"] = dec
    print(f"\nwrote {write_json('energies', payload)}")


if __name__ == "__main__":
    main()
