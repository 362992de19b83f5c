"""A model's decode step against its memory floor, and generation against transformers.

    python benchmarks/model_floor.py                       # fp32, batch 1, 1K / 8K / 32K
    python benchmarks/model_floor.py --dtypes float32 bfloat16 --contexts 1024 8192 32768

The model: a Llama-style decoder of 12 layers x 768 (12 heads of 64, GQA 3:1, SwiGLU 2048,
vocab 32000; ~125M parameters), random weights. The floor of one decode step is reading every
weight and every filled cache entry once: (bytes of the weights + bytes of the filled cache)
divided by the bandwidth of a streaming read of the same number of bytes, timed in the same
run (a `sum` XLA streams). The step is `decode_step` on a cache filled to the context (its
slots hold random values: the step's cost does not depend on what they hold), the model's
layers unstacked (`Transformer.unstack_layers`); rounds of step and floor interleave, medians.

`--hf` adds generation against transformers (CPU torch, the same weights saved with
`save_pretrained`, eager with its dynamic cache): prompt `--prompt` tokens, `--new` new tokens,
greedy, identical tokens checked against transformers' own full forward.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backend", default="flash")
    parser.add_argument("--hf", action="store_true", help="also generate against transformers")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from _common import machine, write_json

    from treeattn.models import LlamaConfig, Transformer, decode_step, generate

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=max(args.contexts) + 64,
    )
    print(f"machine: {machine()}")
    rows = []
    header = (
        f"{'dtype':<9} {'batch':>5} {'context':>7} {'weights MB':>10} {'cache MB':>9} "
        f"{'floor':>9} {'step':>9} {'step/floor':>10} {'GB/s read':>9}"
    )
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        model = Transformer(config, dtype=dtype, key=jax.random.key(0)).unstack_layers()
        weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        for batch in args.batch:
            for context in args.contexts:
                if batch != 1:
                    raise SystemExit("decode_step is one sequence; batches are timed with --hf")
                cache = model.init_cache(context + 8, layout="bhsd")
                keys = jax.random.split(jax.random.key(1), 2 * config.num_hidden_layers)
                fill = [
                    jax.random.normal(k, x.shape, dtype)
                    for k, x in zip(keys, (*cache.k, *cache.v), strict=True)
                ]
                n = config.num_hidden_layers
                cache = eqx.tree_at(
                    lambda c: (c.k, c.v, c.length),
                    cache,
                    (tuple(fill[:n]), tuple(fill[n:]), jnp.asarray(context - 1, jnp.int32)),
                )
                filled = 2 * n * config.num_key_value_heads * context * 64 * dtype.itemsize
                total = weights + filled
                stream = jnp.ones((total // 4,), jnp.float32)
                read = jax.jit(lambda x: jnp.sum(x))
                jax.block_until_ready(read(stream))
                token = jnp.asarray(1, jnp.int32)
                for _ in range(2):  # compile, warm up
                    _, cache = decode_step(model, token, cache, backend=args.backend)
                    cache = eqx.tree_at(
                        lambda c: c.length, cache, jnp.asarray(context - 1, jnp.int32)
                    )
                jax.block_until_ready(cache)
                t_step, t_floor = [], []
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    jax.block_until_ready(read(stream))
                    t_floor.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    logits, cache = decode_step(model, token, cache, backend=args.backend)
                    jax.block_until_ready(logits)
                    t_step.append(time.perf_counter() - start)
                    cache = eqx.tree_at(
                        lambda c: c.length, cache, jnp.asarray(context - 1, jnp.int32)
                    )
                step, floor = statistics.median(t_step), statistics.median(t_floor)
                row = {
                    "dtype": dtype_name,
                    "batch": batch,
                    "context": context,
                    "weights_bytes": weights,
                    "cache_bytes": filled,
                    "floor_s": floor,
                    "step_s": step,
                    "step_over_floor": step / floor,
                    "read_GBps": total / floor / 1e9,
                }
                rows.append(row)
                print(
                    f"{dtype_name:<9} {batch:>5} {context:>7} {weights / 1e6:>10.0f} "
                    f"{filled / 1e6:>9.0f} {floor * 1e3:>7.1f}ms {step * 1e3:>7.1f}ms "
                    f"{step / floor:>9.2f}x {total / floor / 1e9:>9.1f}"
                )
                del cache, stream
    hf_rows = []
    if args.hf:
        hf_rows = against_transformers(args, config, generate, Transformer)
    path = write_json(
        "model_floor",
        {
            "machine": machine(),
            "args": vars(args),
            "config": str(config),
            "rows": rows,
            "hf": hf_rows,
        },
    )
    print(f"\nwrote {path}")


def against_transformers(args, config, generate, Transformer):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    model = Transformer(config, key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    model = model.unstack_layers()
    rng = np.random.default_rng(0)
    print(
        f"\ntransformers {transformers.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), eager, dynamic cache; prompt {args.prompt}, "
        f"{args.new} new tokens, greedy, fp32"
    )
    header = (
        f"{'batch':>5} {'treeattn tok/s':>15} {'transformers tok/s':>19} {'ratio':>7} "
        f"{'same tokens':>12}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for batch in (1, 8):
        prompts = rng.integers(0, config.vocab_size, (batch, args.prompt))
        p = jnp.asarray(prompts, jnp.int32)

        def ours(p=p):
            return jax.block_until_ready(
                generate(model, p, max_new_tokens=args.new, backend=args.backend)
            )

        def theirs(prompts=prompts):
            ids = torch.tensor(prompts)
            with torch.no_grad():
                return hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.new,
                    min_new_tokens=args.new,
                    do_sample=False,
                    pad_token_id=0,
                )

        out = ours()
        ref = theirs()
        # Greedy tokens checked against transformers' own full forward (see the notes on
        # its `generate`): argmax of the logits at every generated position.
        with torch.no_grad():
            full = hf(torch.tensor(np.asarray(out))).logits[:, args.prompt - 1 : -1].argmax(-1)
        same = bool(np.array_equal(full.numpy(), np.asarray(out)[:, args.prompt :]))
        t_ours, t_hf = [], []
        for _ in range(3):
            start = time.perf_counter()
            ours()
            t_ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs()
            t_hf.append(time.perf_counter() - start)
        a, b = statistics.median(t_ours), statistics.median(t_hf)
        row = {
            "batch": batch,
            "treeattn_tokens_per_s": batch * args.new / a,
            "transformers_tokens_per_s": batch * args.new / b,
            "ratio": b / a,
            "identical_to_transformers_forward": same,
            "identical_to_transformers_generate": bool(
                np.array_equal(np.asarray(out), ref.numpy())
            ),
        }
        rows.append(row)
        print(
            f"{batch:>5} {row['treeattn_tokens_per_s']:>15.1f} "
            f"{row['transformers_tokens_per_s']:>19.1f} {b / a:>6.2f}x {str(same):>12}"
        )
    return rows


if __name__ == "__main__":
    main()
