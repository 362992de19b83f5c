"""Every energy: attention as jax.grad of its free energy vs the same attention written by hand.

    python benchmarks/energies.py            # q_seq = kv_seq = 1024, 8 heads of 64, causal
    python benchmarks/energies.py --quick    # a small shape, for a smoke run
    python benchmarks/energies.py --grid     # the energy table over a grid of shapes
    python benchmarks/energies.py --memory   # also: blockwise memory at 16,384 tokens and
                                             # blockwise vs materialised training time
    python benchmarks/energies.py --decode   # also: one decode step, tree on 8 devices
    python benchmarks/energies.py --linear   # also: a LinearKernel model's decode step, 1K vs 32K
    python benchmarks/energies.py --diagnostics  # only: entropy and received attention vs attention
    python benchmarks/energies.py --masking  # only: causal vs full, packed vs padded, skipping
    python benchmarks/energies.py --prefill  # only: prompts through the XLA kernel and a model

Per energy: run time and compiled FLOPs of `energy_attention(..., energy=E)` against the
attention of that energy written out in jnp (materialised weights times V, the same causal mask,
float32; stick-breaking with one softplus and a reverse `lax.cumsum`), timed in alternating
rounds of the same run. Targets: within 1.15x of the hand-written time and 1.05x of its FLOPs
(those of the materialised form: a blockwise loop's body is counted once by `cost_analysis()`,
and causal calls above 2^23 logits go blockwise). With `--memory`: the compiled temporaries
(`memory_analysis().temp_size_in_bytes`) of training through attention (forward + gradient in q,
k, v) at q = kv = 16,384 tokens, 8 heads of 64, float32, blockwise with blocks of 512 (target:
below 1 GiB; the logits alone are 8 GiB), for every energy and for the default `Softmax()`
(which goes blockwise by itself at that size); then the time of that training step, blockwise
(blocks of 256, the automatic size) vs materialised (`block_size=kv_seq`), at `--train-seq`
tokens (default 2048) where both fit, the two alternated round by round (target: within 1.3x).
With `--decode`: one decode step (a query per row against a cache of `--decode-seq` keys) of
each energy, `tree_decode(energy=E)` vs `ring_decode(energy=E)` over 8 simulated CPU devices and
`flash_attention(energy=E)` on one: medians of interleaved runs (ratios within one run) and the
bytes each device sends, read from the compiled HLO. With `--linear`: the decode step of a small
LinearKernel decoder at a context of 1K and of 32K tokens, against its linear state
(`LinearCache`, constant size) and against a KV cache of the same energy (`linear_state=False`).
With `--diagnostics` (on its own, written to `results/energies_diagnostics.json`):
`attention_entropy` and `received_attention` against `energy_attention` alone (forward, causal,
float32, the default `Softmax()`) on a grid of sequence lengths (`--diagnostics-seqs`; above
2^23 logits all three run blockwise), the three timed in turns round by round (target: each
within 1.5x of attention, the median of the per-round ratios). With `--masking` (on its own,
written to `results/energies_masking.json`): training steps through attention (forward and
gradient in q, k, v; `--masking-heads` heads of `--dim`, float32, blockwise in blocks of 256),
timed in turns round by round: causal against full attention at `--masking-seqs` tokens (target:
about one half, the tiles above the diagonal skipped), and causal with block skipping off (every
tile computed with its visibility); a prompt's attention (forward) through `flash_attention`'s
XLA kernel at the same lengths, causal against full and against causal with its queries in one
chunk; and at `--packed-seq` tokens, eight documents of uneven lengths packed in one row with
segment ids, against one unpacked causal row of the same length (target: about an eighth plus
the diagonal blocks), the same documents padded to the longest into a batch of eight rows, and
`jax.nn.dot_product_attention` with the dense boolean document mask (the baseline a user has
today; timed last, in turns with the packed step again, as its 4 GiB slow what runs after it),
and the packed step with block skipping off — tokens per second and compiled temporaries; then a
whole `Transformer`'s training step (`lm_loss`, 4 layers) on two rows of `--packed-seq` tokens
of 8 and 5 packed documents against the same rows unpacked. Every timed call follows an untimed
one of the same step: the state of a training loop. With `--prefill` (on its own, written to
`results/energies_prefill.json`): the XLA kernel's prompt table above at `--masking-seqs`
tokens, then a 4-layer `Transformer`'s prompt into its KV cache through the default `"energy"`
backend, `"flash"`, and `"flash"` with its queries in one chunk, timed in turns."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _common import compile_and_time, machine, write_json
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from treeattn.decode import flash_attention, ring_decode, tree_decode
from treeattn.energy import (
    CosFormer,
    Differential,
    Forgetting,
    LinearKernel,
    Sigmoid,
    Softmax,
    SoftmaxWithSink,
    Softpick,
    StickBreaking,
    attention_entropy,
    elu_plus_one,
    energy_attention,
    received_attention,
)
from treeattn.models import LlamaConfig, Transformer, decode_step
from treeattn.profiling import collective_stats
from treeattn.training import lm_loss


TIME_TARGET = 1.15
FLOP_TARGET = 1.05
DIAGNOSTICS_TARGET = 1.5
COSFORMER_HORIZON = 16384  # the longest distance of every table here (--memory: 16K tokens)


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

    def cosformer(q, k, v, horizon=COSFORMER_HORIZON):
        # relu(q).relu(k) cos(pi/2 (i - j) / M) over the visible keys, normalised.
        _, causal = _logits(q, k)
        n_q, n_k = q.shape[0], k.shape[0]
        gap = (n_k - n_q + jnp.arange(n_q))[:, None] - jnp.arange(n_k)[None, :]
        cos = jnp.cos((jnp.pi / (2 * horizon)) * gap.astype(jnp.float32))
        w = jnp.einsum("thd,shd->hts", jax.nn.relu(q), jax.nn.relu(k)) * cos
        w = jnp.where(causal, w, 0.0)
        return _apply(w / jnp.sum(w, axis=-1, keepdims=True), v)

    def stick(q, k, v):
        x, causal = _logits(q, k)
        log_r = jnp.where(causal, -jax.nn.softplus(x), 0.0)  # log(1 - beta)
        # log A_a = log beta_a + sum_{b > a} log(1 - beta_b) = x_a + sum_{b >= a} log(1 - beta_b)
        w = jnp.where(causal, jnp.exp(x + lax.cumsum(log_r, axis=2, reverse=True)), 0.0)
        return _apply(w, v)

    def differential(q, k, v, lam=0.5):
        # softmax(s q1.k1) v - lam softmax(s q2.k2) v, s = 1/sqrt(qk) of the whole width.
        half = q.shape[-1] // 2
        s = jnp.sqrt(jnp.float32(half) / q.shape[-1])  # _logits scales by 1/sqrt(half)
        one = softmax(q[..., :half] * s, k[..., :half], v, beta=1.0)
        two = softmax(q[..., half:] * s, k[..., half:], v, beta=1.0)
        return one - lam * two

    def forgetting(q, k, v):
        # s q.k + c_i - c_j with c in the last channel, s = 1/sqrt(qk) of the whole width.
        d = q.shape[-1]
        x, causal = _logits(q[..., :-1] * jnp.sqrt(jnp.float32(d - 1) / d), k[..., :-1])
        x = x + q[:, :, -1].T[:, :, None] - k[:, :, -1].T[:, None, :]
        y = jnp.where(causal, x, -jnp.inf)
        e = jnp.exp(y - jnp.max(y, axis=-1, keepdims=True))
        return _apply(e / jnp.sum(e, axis=-1, keepdims=True), v)

    def softpick(q, k, v):
        # relu(e^x - 1) / sum |e^x - 1|, over the visible keys, shifted by the row's maximum.
        x, causal = _logits(q, k)
        m = jnp.maximum(jnp.max(jnp.where(causal, x, -jnp.inf), axis=-1, keepdims=True), 0.0)
        shifted = jnp.where(causal, jnp.exp(x - m) - jnp.exp(-m), 0.0)
        w = jax.nn.relu(shifted) / jnp.sum(jnp.abs(shifted), axis=-1, keepdims=True)
        return _apply(w, v)

    return {
        "Softmax(beta=2)": softmax,
        "SoftmaxWithSink(0)": lambda q, k, v: softmax(q, k, v, beta=1.0, sink=0.0),
        "Sigmoid()": sigmoid,
        "LinearKernel()": linear,
        f"CosFormer({COSFORMER_HORIZON})": cosformer,
        "StickBreaking()": stick,
        "Differential(0.5)": differential,
        "Forgetting()": forgetting,
        "Softpick()": softpick,
    }[name]


ENERGIES = {
    "Softmax(beta=2)": Softmax(beta=2.0),
    "SoftmaxWithSink(0)": SoftmaxWithSink(sink=0.0),
    "Sigmoid()": Sigmoid(),
    "LinearKernel()": LinearKernel(),
    f"CosFormer({COSFORMER_HORIZON})": CosFormer(COSFORMER_HORIZON),
    "StickBreaking()": StickBreaking(),
    "Differential(0.5)": Differential(lam=0.5),
    "Forgetting()": Forgetting(),
    "Softpick()": Softpick(),
}


def interleaved(hand_fn, grad_fn, args: tuple, repeats: int) -> tuple[dict, dict, float]:
    """Both compiled (compile time and FLOPs as `compile_and_time`), then timed in alternating
    rounds, so that a shared machine slows both alike. Returns their stats and the median of
    the per-round time ratios grad / hand."""
    stats, calls = [], []
    for fn in (hand_fn, grad_fn):
        keep: dict = {}
        stats.append(compile_and_time(fn, *args, repeats=1, keep=keep))
        calls.append(keep["compiled"])
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            jax.block_until_ready(call(*args))
            times[i].append(time.perf_counter() - start)
    for st, ts in zip(stats, times, strict=True):
        st.update(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts), repeats=repeats)
    ratio = statistics.median(g / h for h, g in zip(*times, strict=True))
    return stats[0], stats[1], ratio


def memory(seq: int, heads: int, dim: int, block_size: int | None, energy) -> float:
    x = jax.ShapeDtypeStruct((seq, heads, dim), jnp.float32)

    def loss(q, k, v):
        out = energy_attention(q, k, v, causal=True, energy=energy, block_size=block_size)
        return jnp.sum(out**2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None, "this backend gives no memory analysis"
    return analysis.temp_size_in_bytes


DECODE_ENERGIES = {"Softmax() (kernels)": Softmax(), **ENERGIES}


def _interleaved(calls: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each compiled call, timed in turns (one of each per round), so that
    the load of a shared machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(2):  # warm-up
        for fn in calls.values():
            jax.block_until_ready(fn())
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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
    """One decode step per energy over a cache sharded on p = 8 devices: `tree_decode` (the
    monoid's states merge) vs `ring_decode` (the K/V shards travel) vs `flash_attention` on
    one device — interleaved medians, and the bytes each device sends, from the compiled HLO."""
    p, batch = 8, args.decode_batch
    mesh = Mesh(np.array(jax.devices()[:p]), ("kv",))
    n = -(-args.decode_seq // p) * p
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (batch, 1, args.heads, args.dim))
    k, v = (jax.random.normal(kk, (batch, n, args.heads, args.dim)) for kk in keys[1:])
    ks, vs = (jax.device_put(x, NamedSharding(mesh, P(None, "kv"))) for x in (k, v))
    length = jnp.full((batch,), n, jnp.int32)
    print(
        f"\none decode step, batch {batch}, {n} cached keys, {args.heads} heads of {args.dim}, "
        f"float32: tree vs ring over {p} devices, and one device; medians of {args.repeats} "
        "interleaved runs; bytes each device sends (HLO, ring model for all-reduces)"
    )
    header = (
        f"{'energy':<21} {'1 device':>9} {'tree':>9} {'ring':>9} {'ring/tree':>9} "
        f"{'tree B/dev':>11} {'ring B/dev':>11} {'tree colls':>10}"
    )
    print(header)
    print("-" * len(header))
    out = []
    for name, energy in DECODE_ENERGIES.items():
        kw = {"kv_length": length, "causal": True, "energy": energy}
        sharded = {"mesh": mesh, "kv_axis": "kv", **kw}
        fns = {
            "unsharded": (
                lambda q, k, v, kw=kw: flash_attention(q, k, v, q_offset=length - 1, **kw)[0],
                (q, k, v),
            ),
            "tree": (lambda q, k, v, s=sharded: tree_decode(q, k, v, **s), (q, ks, vs)),
            "ring": (lambda q, k, v, s=sharded: ring_decode(q, k, v, **s), (q, ks, vs)),
        }
        compiled, stats, calls = {}, {}, {}
        for kind, (fn, a) in fns.items():
            compiled[kind] = jax.jit(fn).lower(*a).compile()
            stats[kind] = collective_stats(compiled[kind])
            calls[kind] = functools.partial(compiled[kind], *a)
        t = _interleaved(calls, args.repeats)
        tree, ring = stats["tree"], stats["ring"]
        row = {"energy": name, "devices": p, "batch": batch, "kv": n}
        row |= {f"{kind}_s": t[kind] for kind in t}
        row |= {"tree_bytes": tree.bytes_sent(), "ring_bytes": ring.bytes_sent()}
        row |= {"tree_collectives": tree.summary(), "ring_collectives": ring.summary()}
        out.append(row)
        kinds = ", ".join(f"{v['count']} {kind}" for kind, v in tree.summary().items())
        print(
            f"{name:<21} {t['unsharded'] * 1e3:>7.2f}ms {t['tree'] * 1e3:>7.2f}ms "
            f"{t['ring'] * 1e3:>7.2f}ms {t['ring'] / t['tree']:>8.2f}x "
            f"{tree.bytes_sent():>11.0f} {ring.bytes_sent():>11.0f} {kinds:>10}"
        )
    return out


def linear_decode_rows(args, contexts=(1024, 32768)) -> list[dict]:
    """A linear-energy model's decode step (donated cache, `treeattn.models.decode_step`) at
    each context, for `LinearKernel` and `CosFormer` (features at positions): against its
    linear state and against a KV cache. A step's cost does not depend on what the cache
    holds, so the caches are empty ones with their length set."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(contexts) + 64,
    )
    steps = 2 + args.repeats
    print(
        f"\ndecode step of a {config.num_hidden_layers} x {config.hidden_size} linear-energy "
        f"decoder (8 heads over 2 kv heads of 64), float32; median of {args.repeats} steps"
    )
    print(
        f"{'energy':<18} {'context':>8} {'linear state':>13} {'KV cache':>10} "
        f"{'state bytes':>12} {'KV bytes':>12}"
    )
    out = []
    horizon = config.max_position_embeddings  # every cache below stays within it
    energies = {"LinearKernel()": LinearKernel(), f"CosFormer({horizon})": CosFormer(horizon)}
    for name, ctx in [(name, ctx) for name in energies for ctx in contexts]:
        model = Transformer(config, energy=energies[name], key=jax.random.key(0))
        model = model.unstack_layers()
        row: dict = {"energy": name, "context": ctx}
        for kind, linear in (("state", True), ("kv", False)):
            cache = model.init_cache(ctx + steps, linear_state=linear)
            cache = dataclasses.replace(cache, length=jnp.asarray(ctx - 1, jnp.int32))
            row[f"{kind}_bytes"] = sum(x.nbytes for x in jax.tree.leaves(cache))
            token = jnp.asarray(1, jnp.int32)
            start = time.perf_counter()
            logits, cache = decode_step(model, token, cache)  # compiles
            jax.block_until_ready(logits)
            row[f"{kind}_compile_s"] = time.perf_counter() - start
            logits, cache = decode_step(model, token, cache)
            jax.block_until_ready(logits)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                logits, cache = decode_step(model, token, cache)
                jax.block_until_ready(logits)
                times.append(time.perf_counter() - start)
            row[f"{kind}_median_s"] = statistics.median(times)
        out.append(row)
        print(
            f"{name:<18} {ctx:>8} {row['state_median_s'] * 1e3:>11.2f}ms "
            f"{row['kv_median_s'] * 1e3:>8.2f}ms {row['state_bytes'] / 2**20:>10.2f}MB "
            f"{row['kv_bytes'] / 2**20:>10.1f}MB"
        )
    return out


ATTENTION_GRID = ((512, 8, 64), (1024, 8, 64), (2048, 8, 64), (1024, 4, 128), (1024, 16, 32))
"""`--grid`: (tokens, heads, head size) of the per-energy table."""


def grad_f_in_one_block(q, k, v, *, energy):
    """`energy_attention` materialised (one block of every key), whatever its size."""
    return energy_attention(q, k, v, causal=True, energy=energy, block_size=k.shape[0])


def attention_rows(args) -> list[dict]:
    """Per energy and shape: attention by gradient vs by hand, time and FLOPs; with more than
    one shape, each energy's worst and median cell."""
    shapes = ATTENTION_GRID if args.grid else ((args.seq, args.heads, args.dim),)
    header = (
        f"{'energy':<20} {'shape':>14} {'by hand':>9} {'grad F':>9} {'time/hand':>9} "
        f"{'GFLOP hand':>10} {'GFLOP grad':>10} {'flops/hand':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for seq, heads, dim in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (seq, heads, dim)) for kk in keys)
        for name, energy in ENERGIES.items():

            def grad_f(q, k, v, energy=energy):
                return energy_attention(q, k, v, causal=True, energy=energy)

            # The two compute the same attention (else the comparison means nothing).
            same = jnp.max(jnp.abs(by_hand(name)(q, k, v) - grad_f(q, k, v)))
            assert same < 1e-4, f"{name}: by hand and grad F differ by {float(same):.2e}"
            hand, grad, time_ratio = interleaved(by_hand(name), grad_f, (q, k, v), args.repeats)
            # A blockwise loop's body is counted once by cost_analysis(): the FLOPs are read
            # from the materialised form (one block, every tile; the arithmetic of the energy).
            whole = functools.partial(grad_f_in_one_block, energy=energy)
            grad["flops"] = compile_and_time(whole, q, k, v, repeats=1, warmup=0)["flops"]
            flop_ratio = grad["flops"] / hand["flops"]
            shape = f"{seq}x{heads}x{dim}"
            rows.append({"energy": name, "shape": shape, "seq": seq, "heads": heads, "dim": dim})
            rows[-1] |= {"hand": hand, "grad": grad, "time_ratio": time_ratio}
            rows[-1]["flop_ratio"] = flop_ratio
            print(
                f"{name:<20} {shape:>14} {hand['median_s'] * 1e3:>7.1f}ms "
                f"{grad['median_s'] * 1e3:>7.1f}ms {time_ratio:>8.2f}x "
                f"{hand['flops'] / 1e9:>10.3f} {grad['flops'] / 1e9:>10.3f} {flop_ratio:>9.2f}x"
            )
    ok = all(r["time_ratio"] <= TIME_TARGET and r["flop_ratio"] <= FLOP_TARGET for r in rows)
    if len(shapes) > 1:
        print(f"\nper energy over {len(shapes)} shapes, worst time first: worst (median)")
        summary = []
        for name in ENERGIES:
            mine = [r for r in rows if r["energy"] == name]
            worst = max(mine, key=lambda r: r["time_ratio"])
            summary.append((worst["time_ratio"], name, worst["shape"], mine))
        for worst_time, name, shape, mine in sorted(summary, reverse=True):
            times = [r["time_ratio"] for r in mine]
            flops = [r["flop_ratio"] for r in mine]
            print(
                f"  {name:<20} time {worst_time:.2f}x at {shape} ({statistics.median(times):.2f}x)"
                f"  FLOPs {max(flops):.2f}x ({statistics.median(flops):.2f}x)"
            )
    print(
        f"\ntargets (time <= {TIME_TARGET}x, FLOPs <= {FLOP_TARGET}x) in every cell: "
        f"{'all met' if ok else 'some missed'}"
    )
    return rows


def diagnostics_rows(args) -> list[dict]:
    """Per sequence length: attention, its entropy and each key's received attention (forward,
    causal), compiled, warmed up, then timed in turns; medians, spread (min, max) and the
    median of the per-round ratios to attention."""
    fns = {
        "attention": energy_attention,
        "entropy": attention_entropy,
        "received": received_attention,
    }
    print(
        f"diagnostics vs attention, {args.heads} heads of {args.dim}, causal, float32, Softmax(); "
        f"medians of {args.repeats} rounds (each round runs the three in turn), [min, max]; "
        "ratio: median of per-round ratios to attention"
    )
    header = f"{'seq':>6} {'path (attention/diagnostics)':<28} "
    header += " ".join(f"{n:>24}" for n in fns) + "  ratios"
    print(header)
    print("-" * len(header))
    rows, ok = [], True
    for seq in args.diagnostics_seqs:
        keys = jax.random.split(jax.random.key(3), 3)
        q, k, v = (jax.random.normal(kk, (seq, args.heads, args.dim)) for kk in keys)
        compiled, compile_s = {}, {}
        for name, fn in fns.items():
            start = time.perf_counter()
            run = jax.jit(functools.partial(fn, causal=True)).lower(q, k, v).compile()
            compile_s[name] = time.perf_counter() - start
            compiled[name] = run
            jax.block_until_ready(run(q, k, v))  # warm-up
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, run in compiled.items():
                start = time.perf_counter()
                jax.block_until_ready(run(q, k, v))
                times[name].append(time.perf_counter() - start)
        ratios = {
            name: statistics.median(
                t / a for t, a in zip(times[name], times["attention"], strict=True)
            )
            for name in ("entropy", "received")
        }
        ok &= all(r <= DIAGNOSTICS_TARGET for r in ratios.values())
        # Which path attention takes (causal: above CAUSAL_ELEMENTS of energy/_blockwise), and
        # which the diagnostics take (F for its gradient: above GRADIENT_ELEMENTS).
        logits = seq * seq * args.heads
        limits = (1 << 23, 1 << 22)
        path = "/".join("blockwise" if logits > n else "materialised" for n in limits)
        cells = " ".join(
            f"{statistics.median(t) * 1e3:>8.1f}ms [{min(t) * 1e3:.0f}, {max(t) * 1e3:.0f}]".rjust(
                24
            )
            for t in times.values()
        )
        print(
            f"{seq:>6} {path:<28} {cells}  " + " ".join(f"{n} {r:.2f}x" for n, r in ratios.items())
        )
        row: dict = {"seq": seq, "path": path, "ratios": ratios, "compile_s": compile_s}
        for name, t in times.items():
            row[name] = {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
        rows.append(row)
    print(f"\ntarget (each <= {DIAGNOSTICS_TARGET}x attention): {'met' if ok else 'missed'}")
    return rows


def _train(attend) -> jax.stages.Wrapped:
    """A training step through `attend(q, k, v)`: the gradient of sum(out^2) in q, k and v."""
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2)))


def _timed_in_turns(steps: dict, args_of: dict, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for name, step in steps.items():  # compile and warm up
        jax.block_until_ready(step(*args_of[name]))
    for _ in range(repeats):
        for name, step in steps.items():
            # An untimed call first: each case is timed in the state its own previous step
            # leaves (a training loop's), not the one another case left (jax.nn's 4 GiB).
            jax.block_until_ready(step(*args_of[name]))
            start = time.perf_counter()
            jax.block_until_ready(step(*args_of[name]))
            times[name].append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def _patched(module, name: str, value):
    """Steps compiled inside see `module.name = value`. jax's caches are cleared on the way in
    and out, so that no trace made inside is reused outside, nor the reverse."""
    jax.clear_caches()
    try:
        with mock.patch.object(module, name, value):
            yield
    finally:
        jax.clear_caches()


def _compiled_without_skipping(step, args) -> jax.stages.Compiled:
    """`step` compiled with block skipping off: every blockwise tile computed, each with its
    visibility (the tile bounds report nothing)."""
    from treeattn.energy import _blockwise

    with _patched(_blockwise, "tile_coverage", lambda *_, **__: None):
        return step.lower(*args).compile()


def _temporaries(step, args) -> int:
    compiled = step if isinstance(step, jax.stages.Compiled) else step.lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _ratio(times, name, base) -> dict[str, float]:
    per_round = [t / b for t, b in zip(times[name], times[base], strict=True)]
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}


def prefill_rows(args, *, model: bool = False) -> list[dict] | dict:
    """A prompt's attention through `flash_attention`'s XLA kernel (the default on CPU above 16
    query rows per kv head), forward only: causal against full, and causal with the queries in
    one chunk (`QUERY_CHUNK` above the prompt: every key block computed for every query)."""
    from treeattn.decode import _xla

    heads, kv_heads, dim = 8, 2, args.dim
    rows = []
    print(
        f"\nprefill through flash_attention(backend='xla'), forward, {heads} query / {kv_heads} kv "
        f"heads of {dim}, float32; medians of {args.repeats} rounds in turns, [min, max]"
    )
    print(
        f"{'seq':>6} {'full':>22} {'causal':>22} {'causal, one chunk':>22}  causal/full "
        "[min, max]  one chunk/full"
    )

    def call(causal: bool):
        return jax.jit(functools.partial(flash_attention, causal=causal, backend="xla"))

    for seq in args.masking_seqs:
        keys = jax.random.split(jax.random.key(7), 3)
        q = jax.random.normal(keys[0], (1, seq, heads, dim))
        k, v = (jax.random.normal(kk, (1, seq, kv_heads, dim)) for kk in keys[1:])
        steps: dict = {"full": call(False), "causal": call(True)}
        with _patched(_xla, "QUERY_CHUNK", 1 << 30):
            steps["causal, one chunk"] = call(True).lower(q, k, v).compile()
        times = _timed_in_turns(steps, {n: (q, k, v) for n in steps}, args.repeats)
        ratio = _ratio(times, "causal", "full")
        whole = _ratio(times, "causal, one chunk", "full")
        cells = " ".join(
            f"{statistics.median(t) * 1e3:>9.0f}ms [{min(t) * 1e3:.0f}, {max(t) * 1e3:.0f}]"
            for t in times.values()
        )
        print(
            f"{seq:>6} {cells}  {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]"
            f"  {whole['median']:.2f} [{whole['min']:.2f}, {whole['max']:.2f}]"
        )
        row = {"seq": seq, "causal_over_full": ratio, "one_chunk_over_full": whole}
        rows.append(row | {name: {"median_s": statistics.median(t)} for name, t in times.items()})
    if model:
        one_chunk = functools.partial(_patched, _xla, "QUERY_CHUNK", 1 << 30)
        return {"kernel": rows, "model": model_prefill_rows(args, one_chunk)}
    return rows


def model_prefill_rows(args, one_chunk) -> list[dict]:
    """A whole model's prompt into its KV cache (the program `prefill` runs: 4 layers of 512,
    8 query / 2 kv heads of 64, float32), per attention backend: the default `"energy"`
    (blockwise, tiles above the diagonal skipped), `"flash"` (the XLA kernel on CPU, queries in
    chunks) and `"flash"` with its queries in one chunk (`one_chunk`: a context in which the
    step compiles so)."""
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(args.masking_seqs),
    )
    model = Transformer(config, key=jax.random.key(7))
    rows = []
    print(
        "\nprefill of a Transformer (4 layers of 512, 8 query / 2 kv heads of 64, float32) into "
        f"its cache; medians of {args.repeats} rounds in turns, [min, max]"
    )
    print(f"{'seq':>6} {'energy':>22} {'flash':>22} {'flash, one chunk':>22}  flash/one chunk")

    def step(backend: str):
        return eqx.filter_jit(lambda m, t, c: m(t, c, backend=backend))

    for seq in args.masking_seqs:
        tokens = jax.random.randint(jax.random.key(1), (seq,), 0, config.vocab_size)
        cache = model.init_cache(seq)
        steps: dict = {
            "energy": step("energy").lower(model, tokens, cache).compile(),
            "flash": step("flash").lower(model, tokens, cache).compile(),
        }
        with one_chunk():
            steps["flash, one chunk"] = step("flash").lower(model, tokens, cache).compile()
        times = _timed_in_turns(steps, {n: (model, tokens, cache) for n in steps}, args.repeats)
        ratio = _ratio(times, "flash", "flash, one chunk")
        cells = " ".join(
            f"{statistics.median(t) * 1e3:>9.0f}ms [{min(t) * 1e3:.0f}, {max(t) * 1e3:.0f}]"
            for t in times.values()
        )
        print(f"{seq:>6} {cells}  {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]")
        row = {"seq": seq, "flash_over_one_chunk": ratio}
        rows.append(row | {name: {"median_s": statistics.median(t)} for name, t in times.items()})
    return rows


def masking_rows(args) -> dict:
    """Causal vs full, and packed vs unpacked, padded and dense-masked training steps."""
    heads, dim, block = args.masking_heads, args.dim, 256
    out: dict = {"causal": [], "packed": []}
    print(
        f"training step through attention (grad of sum(out^2) in q, k, v), {heads} heads of "
        f"{dim}, float32, blocks of {block}; medians of {args.repeats} rounds in turns, [min, max]"
    )
    print(
        f"\n{'seq':>6} {'full':>22} {'causal':>22} {'causal, no skipping':>22}  causal/full "
        "[min, max]  no skipping/full"
    )
    for seq in args.masking_seqs:
        keys = jax.random.split(jax.random.key(5), 3)
        q, k, v = (jax.random.normal(kk, (seq, heads, dim)) for kk in keys)
        steps = {
            name: _train(functools.partial(energy_attention, causal=causal, block_size=block))
            for name, causal in (("full", False), ("causal", True))
        }
        steps["causal, no skipping"] = _compiled_without_skipping(steps["causal"], (q, k, v))
        times = _timed_in_turns(steps, {n: (q, k, v) for n in steps}, args.repeats)
        ratio = _ratio(times, "causal", "full")
        unskipped = _ratio(times, "causal, no skipping", "full")
        cells = " ".join(
            f"{statistics.median(t) * 1e3:>9.0f}ms [{min(t) * 1e3:.0f}, {max(t) * 1e3:.0f}]"
            for t in times.values()
        )
        print(
            f"{seq:>6} {cells}  {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]"
            f"  {unskipped['median']:.2f} [{unskipped['min']:.2f}, {unskipped['max']:.2f}]"
        )
        row = {"seq": seq, "causal_over_full": ratio, "unskipped_over_full": unskipped}
        row |= {name: {"median_s": statistics.median(t)} for name, t in times.items()}
        out["causal"].append(row)

    out["prefill"] = prefill_rows(args)

    seq = args.packed_seq
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, seq // 64), 7, replace=False)) * 64
    lengths = np.diff(np.concatenate([[0], cuts, [seq]])).astype(int)
    seg = np.repeat(np.arange(8, dtype=np.int32), lengths)
    longest = int(lengths.max())
    keys = jax.random.split(jax.random.key(6), 3)
    q, k, v = (jax.random.normal(kk, (seq, heads, dim)) for kk in keys)
    # The same documents padded to the longest: a batch of 8 rows, padded keys masked out.
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    index = np.minimum(starts[:, None] + np.arange(longest)[None], seq - 1)
    qb, kb, vb = (x[index] for x in (q, k, v))
    valid = jnp.asarray(np.arange(longest)[None] < lengths[:, None])
    dense = jnp.asarray(seg[:, None] == seg[None, :])

    def padded(qb, kb, vb):
        def row(q, k, v, keep):
            # Key padding as segments: the real keys in segment 0 with every query, padding in 1.
            kw = {"q_segment_ids": jnp.zeros_like(keep, jnp.int32)}
            kw["kv_segment_ids"] = jnp.where(keep, 0, 1).astype(jnp.int32)
            return energy_attention(q, k, v, causal=True, **kw, block_size=block)

        return jax.vmap(row)(qb, kb, vb, valid)

    def jax_dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=dense[None], is_causal=True)

    attend = {
        "packed (segment ids)": lambda q, k, v: energy_attention(
            q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, block_size=block
        ),
        "one causal row": lambda q, k, v: energy_attention(q, k, v, causal=True, block_size=block),
        "padded (8 rows)": padded,
        "jax.nn, dense mask": jax_dense,
    }
    steps = {name: _train(fn) for name, fn in attend.items()}
    args_of = {name: (q, k, v) for name in steps}
    args_of["padded (8 rows)"] = (qb, kb, vb)
    # The packed step again, every tile computed: what skipping saves.
    unskipped = "packed, no skipping"
    steps[unskipped] = _compiled_without_skipping(steps["packed (segment ids)"], (q, k, v))
    args_of[unskipped] = (q, k, v)
    temps = {name: _temporaries(step, args_of[name]) for name, step in steps.items()}
    # jax.nn's 4 GiB step slows whatever runs after it in the process (the machine's memory
    # reclaim): it is timed last, in turns with the packed step again, and its ratio is theirs.
    dense_name, base = "jax.nn, dense mask", "packed (segment ids)"
    ours = {name: step for name, step in steps.items() if name != dense_name}
    times = _timed_in_turns(ours, args_of, args.repeats)
    pair = {name: steps[name] for name in (base, dense_name)}
    again = _timed_in_turns(pair, args_of, max(3, args.repeats // 2))
    print(
        f"\n{seq} tokens as 8 documents of {lengths.tolist()} (padded to {longest}): "
        "tokens/s of a training step, temporaries, time / packed [min, max]"
    )
    for name in steps:
        t = times[name] if name in times else again[name]
        med = statistics.median(t)
        r = _ratio(times if name in times else again, name, base)
        print(
            f"  {name:<22} {seq / med:>9.0f} tok/s {med * 1e3:>8.0f}ms "
            f"{temps[name] / 2**20:>8.0f} MiB  {r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"
        )
        out["packed"].append(
            {
                "case": name,
                "tokens": seq,
                "median_s": med,
                "min_s": min(t),
                "max_s": max(t),
                "tokens_per_s": seq / med,
                "temp_bytes": temps[name],
                "over_packed": r,
            }
        )
    out["documents"] = lengths.tolist()
    out["model"] = model_rows(args)
    return out


def model_rows(args) -> dict:
    """A whole Transformer's training step (`lm_loss`, gradient in every weight) over two rows
    of `--packed-seq` tokens holding different packed documents, against the same rows with
    no segment ids (each one causal document)."""
    seq, heads = args.packed_seq, args.masking_heads
    hidden = heads * args.dim
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
    )
    model = Transformer(config, key=jax.random.key(7))
    rng = np.random.default_rng(1)
    rows = []
    for documents in (8, 5):
        cuts = np.sort(rng.choice(np.arange(1, seq // 64), documents - 1, replace=False)) * 64
        lengths = np.diff(np.concatenate([[0], cuts, [seq]]))
        rows.append(np.repeat(np.arange(documents, dtype=np.int32), lengths))
    seg = jnp.asarray(np.stack(rows))
    tokens = jax.random.randint(jax.random.key(8), (2, seq + 1), 0, config.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step(segment_ids):
        def loss(m):
            return lm_loss(m, inputs, targets, segment_ids=segment_ids)

        return eqx.filter_jit(eqx.filter_grad(loss))

    steps = {"packed (segment ids)": step(seg), "unpacked rows": step(None)}
    args_of = {name: (model,) for name in steps}
    times = _timed_in_turns(steps, args_of, max(3, args.repeats // 2))
    print(
        f"\nTransformer training step ({config.num_hidden_layers} layers of {hidden}, {heads} "
        f"heads of {args.dim}), 2 rows of {seq} tokens as 8 and 5 documents, against the same "
        "rows unpacked:"
    )
    out = []
    for name, t in times.items():
        med = statistics.median(t)
        r = _ratio(times, name, "unpacked rows")
        print(
            f"  {name:<22} {2 * seq / med:>9.0f} tok/s {med * 1e3:>8.0f}ms  "
            f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}] of unpacked"
        )
        out.append({"case": name, "median_s": med, "tokens_per_s": 2 * seq / med, "ratio": r})
    return {"rows": out, "documents": [np.bincount(r).tolist() for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="seq 256, 4 heads of 32")
    parser.add_argument(
        "--grid",
        action="store_true",
        help="the energy table over ATTENTION_GRID's shapes (instead of --seq/--heads/--dim)",
    )
    parser.add_argument("--memory", action="store_true", help="blockwise memory at 16K tokens")
    parser.add_argument("--decode", action="store_true", help="tree vs ring (8 devices)")
    parser.add_argument("--decode-seq", type=int, default=16384, help="cached keys (--decode)")
    parser.add_argument("--decode-batch", type=int, default=4, help="batch rows (--decode)")
    parser.add_argument(
        "--linear", action="store_true", help="LinearKernel decode step at 1K and 32K context"
    )
    parser.add_argument(
        "--linear-only", action="store_true", help="only the LinearKernel decode step"
    )
    parser.add_argument("--train-seq", type=int, default=2048, help="--memory: timing size")
    parser.add_argument(
        "--diagnostics", action="store_true", help="only: entropy, received attention vs attention"
    )
    parser.add_argument(
        "--diagnostics-seqs", type=int, nargs="+", default=[1024, 2048, 4096], help="--diagnostics"
    )
    parser.add_argument("--skip-attention", action="store_true", help="only --memory/--decode")
    parser.add_argument("--masking", action="store_true", help="only: causal, packed, skipping")
    parser.add_argument("--masking-seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--masking-heads", type=int, default=4)
    parser.add_argument("--packed-seq", type=int, default=8192)
    parser.add_argument(
        "--prefill", action="store_true", help="only: prompts, the XLA kernel and a whole model"
    )
    args = parser.parse_args()
    if args.decode:  # before JAX starts its backends
        jax.config.update("jax_num_cpu_devices", 8)
    if args.quick:
        args.seq, args.heads, args.dim, args.repeats = 256, 4, 32, 3
        args.decode_seq, args.decode_batch = 1024, 2
    print(f"machine: {machine()}")
    if args.prefill:
        rows = prefill_rows(args, model=True)
        assert isinstance(rows, dict)
        payload = {"machine": machine(), "args": vars(args), **rows}
        print(f"\nwrote {write_json('energies_prefill', payload)}")
        return
    if args.masking:
        payload = {"machine": machine(), "args": vars(args), **masking_rows(args)}
        print(f"\nwrote {write_json('energies_masking', payload)}")
        return
    if args.diagnostics:
        diag = diagnostics_rows(args)
        payload = {"machine": machine(), "args": vars(args), "diagnostics": diag}
        print(f"\nwrote {write_json('energies_diagnostics', payload)}")
        return
    if args.linear_only:
        lin = linear_decode_rows(args)
        print(f"\nwrote {write_json('energies_linear', {'machine': machine(), 'linear': lin})}")
        return
    shape = f"q_seq = kv_seq = {args.seq}, {args.heads} heads of {args.dim}"
    print(
        f"{'the shapes of ATTENTION_GRID' if args.grid else shape}, causal, float32; "
        f"medians of {args.repeats} alternating rounds after warm-up (time/hand: the median of "
        "the per-round ratios)\n"
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
    payload["linear"] = linear_decode_rows(args) if args.linear else []
    print(f"\nwrote {write_json('energies', payload)}")


if __name__ == "__main__":
    main()
