"""`treeattn verify`: one decode problem on every attention path, against float64 NumPy.

Works on whatever devices JAX has, including a mesh that spans processes (`treeattn launch`):
every process builds the same inputs, K and V are laid out sharded along the sequence over all
devices, and process 0 prints the table.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from . import decode, energy
from ._numpy_reference import softmax_attention_f64


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    batch: int
    q_seq: int
    heads: int
    kv_heads: int
    dim: int
    kv_seq: int

    def inputs(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        b, t, h, kh, d, n = (
            self.batch,
            self.q_seq,
            self.heads,
            self.kv_heads,
            self.dim,
            self.kv_seq,
        )
        q = rng.standard_normal((b, t, h, d)).astype(np.float32)
        k = rng.standard_normal((b, kh, n, d)).astype(np.float32)  # head-major: the cache layout
        v = rng.standard_normal((b, kh, n, d)).astype(np.float32)
        # A full cache and a partly filled one (its last shards hold no valid key).
        lengths = np.array([n, (3 * n) // 5][:b] + [n] * max(0, b - 2), np.int32)
        return q, k, v, lengths


def reference(q, k, v, lengths) -> np.ndarray:
    """Causal attention of queries at the last filled positions, in float64 NumPy."""
    t, n, d = q.shape[1], k.shape[2], q.shape[-1]
    rows = []
    for r in range(q.shape[0]):
        positions = lengths[r] - t + np.arange(t)
        vis = np.arange(n)[None, None, :] <= positions[None, :, None]  # [1, q, kv]
        kt, vt = np.swapaxes(k[r], 0, 1), np.swapaxes(v[r], 0, 1)  # [kv, kv_heads, d]
        rows.append(softmax_attention_f64(q[r], kt, vt, vis, 1 / math.sqrt(d), covariance=False))
    return np.stack(rows)


def _sharded(x: np.ndarray, mesh: Mesh, axis) -> jax.Array:
    """`x` as a global array sharded along its sequence axis (2) over `axis` of `mesh`, built
    from the copy every process holds."""
    sharding = NamedSharding(mesh, P(None, None, axis, None))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _host(x: jax.Array) -> np.ndarray:
    """A replicated result as NumPy on this process."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def paths(problem: Problem, q, k, v, lengths):
    """(name, thunk) for every path that can run here."""
    offsets = lengths - problem.q_seq
    visible = (
        np.arange(problem.kv_seq)[None, None, :]
        <= (offsets[:, None] + np.arange(problem.q_seq)[None, :])[..., None]
    )  # [batch, q_seq, kv_seq]
    kt, vt = np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2)  # [batch, kv_seq, kv_heads, d]

    def energy_path():
        fn = jax.jit(jax.vmap(lambda q, k, v, m: energy.energy_attention(q, k, v, mask=m)))
        return fn(q, kt, vt, visible)

    yield "energy: jax.grad of F at zeta = 0", energy_path
    for backend in decode.BACKENDS:
        if backend == "auto":
            continue

        def fused(backend: decode.Backend = backend):
            out, _ = decode.flash_attention(
                q,
                k,
                v,
                causal=True,
                q_offset=offsets,
                kv_length=lengths,
                backend=backend,
                kv_layout="bhsd",
            )
            return out

        yield f"flash_attention[{backend}], one device", fused
    p = jax.device_count()
    mesh = decode.kv_mesh()
    ks, vs = _sharded(k, mesh, "kv"), _sharded(v, mesh, "kv")
    schedules: list[energy.Reduction] = ["allreduce"]
    if p & (p - 1) == 0:
        schedules.append("butterfly")
    for reduction in schedules:

        def tree(reduction: energy.Reduction = reduction):
            return decode.tree_decode(
                q,
                ks,
                vs,
                mesh=mesh,
                kv_axis="kv",
                kv_length=lengths,
                causal=True,
                reduction=reduction,
                kv_layout="bhsd",
            )

        yield f"tree_decode[{reduction}], {p} devices", tree
    nodes = jax.process_count() if jax.process_count() > 1 else (2 if p >= 4 and p % 2 == 0 else 0)
    if nodes:
        grid = decode.node_mesh(nodes)
        k2, v2 = _sharded(k, grid, ("node", "local")), _sharded(v, grid, ("node", "local"))

        def hierarchical():
            return decode.tree_decode(
                q,
                k2,
                v2,
                mesh=grid,
                kv_axis=("node", "local"),
                kv_length=lengths,
                causal=True,
                reduction="hierarchical",
                kv_layout="bhsd",
            )

        shape = "x".join(str(s) for s in grid.devices.shape)
        yield f"tree_decode[hierarchical], {shape} devices", hierarchical

    def ring():
        return decode.ring_decode(
            q, ks, vs, mesh=mesh, kv_axis="kv", kv_length=lengths, causal=True, kv_layout="bhsd"
        )

    yield f"ring_decode (baseline), {p} devices", ring


def run(kv_seq: int = 4096, tolerance: float = 2e-5) -> int:
    """Print the table (process 0); return 1 if any path disagrees with float64, else 0."""
    lead = jax.process_index() == 0
    say = tqdm.write if lead else (lambda *a, **k: None)  # rows print above the progress bar
    p = jax.device_count()
    if kv_seq % p:
        raise ValueError(f"verify: --kv-seq {kv_seq} must be a multiple of the {p} devices")
    say(
        f"treeattn verify  (jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{jax.process_count()} process(es), {p} device(s))"
    )
    say("max |path - float64 NumPy| / max |float64 NumPy|, float32 inputs\n")
    header = f"  {'problem':<38} {'path':<44} {'rel. error':>10}  ok"
    say(header)
    say("  " + "-" * (len(header) - 2))
    failures = 0
    for problem in (
        Problem("decode: 1 query", 2, 1, 8, 2, 64, kv_seq),
        Problem("chunk: 3 queries, causal", 2, 3, 8, 2, 64, kv_seq),
    ):
        q, k, v, lengths = problem.inputs()
        expected = reference(q, k, v, lengths)
        scale = np.abs(expected).max()
        label = f"{problem.name} ({problem.heads}/{problem.kv_heads} heads)"
        runs = paths(problem, q, k, v, lengths)
        for name, thunk in tqdm(runs, desc=problem.name, leave=False, disable=not lead):
            try:
                got = _host(jax.block_until_ready(thunk()))
            except decode.BackendUnavailable as e:
                reason = str(e).split("unavailable: ")[-1]
                say(f"  {label:<38} {name:<44} {'skipped':>10}  ({reason})")
                label = ""
                continue
            err = float(np.abs(got.astype(np.float64) - expected).max() / scale)
            ok = err <= tolerance
            failures += not ok
            say(f"  {label:<38} {name:<44} {err:>10.1e}  {'yes' if ok else 'NO'}")
            label = ""
    say(
        "\nall paths agree"
        if failures == 0
        else f"\n{failures} path(s) DISAGREE (tolerance {tolerance:g})"
    )
    return int(failures > 0)
