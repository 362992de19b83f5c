"""One process of a multi-process test run (started by `treeattn launch` or by the tests).

    python tests/multihost_worker.py result OUT.npz   # tree_decode + greedy generation
    python tests/multihost_worker.py hang             # decode steps until killed

The problem is the same as `problem()` builds in the test process, which computes the
single-process answer on 8 simulated devices.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def problem():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 8, 32)).astype(np.float32)
    k = rng.standard_normal((2, 2, 256, 32)).astype(np.float32)  # head-major cache
    v = rng.standard_normal((2, 2, 256, 32)).astype(np.float32)
    lengths = np.array([256, 150], np.int32)
    return q, k, v, lengths


def model():
    import jax

    from treeattn.models import LlamaConfig, Transformer

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Transformer(config, key=jax.random.key(0))


def sharded(x, mesh):
    """`x` (the same on every process) as a global array sharded along axis 2 over "kv"."""
    from treeattn._verify import _sharded

    return _sharded(x, mesh, "kv")


def compute(mesh, reduction="allreduce"):
    """(tree_decode output, greedy tokens) on `mesh` (axis "kv"), as NumPy."""
    import jax
    import jax.numpy as jnp

    from treeattn.decode import tree_decode
    from treeattn.models import AttentionBackend, generate

    q, k, v, lengths = problem()
    ks, vs = sharded(k, mesh), sharded(v, mesh)
    out = tree_decode(
        q,
        ks,
        vs,
        mesh=mesh,
        kv_axis="kv",
        kv_length=lengths,
        causal=True,
        kv_layout="bhsd",
        reduction=reduction,
    )
    out = np.asarray(jax.block_until_ready(out).addressable_data(0))
    tree = AttentionBackend("tree", mesh=mesh, kv_axis="kv")
    tokens = generate(model(), jnp.arange(5), max_new_tokens=24, backend=tree)
    tokens = np.asarray(jax.block_until_ready(tokens).addressable_data(0))
    return out, tokens


def main() -> None:
    from treeattn.distributed import initialize, kv_mesh

    config = initialize()
    assert config is not None, "run under treeattn launch (or set TREEATTN_* variables)"
    import jax

    mesh = kv_mesh()
    if sys.argv[1] == "result":
        out, tokens = compute(mesh)
        if jax.process_index() == 0:
            np.savez(sys.argv[2], out=out, tokens=tokens, devices=jax.device_count())
        print(f"process {jax.process_index()}: done", flush=True)
    elif sys.argv[1] == "hang":
        from treeattn.decode import tree_decode

        q, k, v, _ = problem()
        ks, vs = sharded(k, mesh), sharded(v, mesh)
        fn = jax.jit(
            lambda q, k, v: tree_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd")
        )
        step = 0
        while True:
            jax.block_until_ready(fn(q, ks, vs))
            print(f"process {jax.process_index()}: step {step}", flush=True)
            step += 1
            time.sleep(0.2)


if __name__ == "__main__":
    main()
