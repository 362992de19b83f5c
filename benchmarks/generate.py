"""Generation: treeattn against transformers, and a model's decode step against its floor.

    python benchmarks/generate.py                  # throughput: shipped checkpoint, batch 1 and 8
    python benchmarks/generate.py --random-model   # a random Llama of 4 layers x 256, vocab 1000
    python benchmarks/generate.py --static         # + transformers static cache, torch.compile
    python benchmarks/generate.py --mode floor     # the model-level floor, 12 x 768 Llama:
        --dtypes float32 bfloat16 --batch 1 8 --contexts 1024 8192 32768 [--hf [--static]]
    python benchmarks/generate.py --mode floor --sharded 8   # + the cache over 8 devices:
        tree and ring steps beside the one-device step (batch 1)
    python benchmarks/generate.py --mode floor --hf-cached --static   # + transformers decoding
        from the same filled cache at each context (fp32)
    python benchmarks/generate.py --mode floor --products   # + the model's few-row products
        against XLA's own, for every weight shape
    python benchmarks/generate.py --quick          # both modes at tiny sizes, seconds

**throughput**: prompt 512 tokens, 128 new tokens, greedy. Our `generate` is compiled once
(compile time reported apart); transformers' `generate` gets a warm-up call; then both are
timed in interleaved rounds (medians), on this machine's CPU cores in the same run. Target:
>= 3x transformers' tokens per second at batch 1 with identical greedy tokens.

**floor**: a Llama-style decoder of 12 layers x 768 (12 heads of 64, GQA 3:1, SwiGLU 2048,
vocab 32000; ~125M parameters), random weights. A decode step must read every weight and
every filled cache entry once: its floor is (bytes of the weights + bytes of the filled cache
of every row) divided by the bandwidth of a streaming read of as many bytes, timed in the same
run (a `sum` XLA streams). The step is the model on one new token per row over a cache filled
to the context (random slots: the cost does not depend on what they hold), layers unstacked,
cache donated; a batch of rows is `jax.vmap` over one cache per row, as `generate` runs it.
Rounds of step and floor interleave; medians. `--hf` adds generation against transformers with
these weights (saved with `save_pretrained`); identical tokens are checked against the argmax of
transformers' own full forward, and each decode step (transformers' and ours) is reported over
the floor of that step (weights + every row's cache at the mean decoded length).
`--hf-cached` compares decode steps at every batch and context instead: both generators start
from the same filled cache (random keys and values, no prefill timed on either side).

**transformers**: eager with its dynamic cache, and with `--static` also with a static cache
(`cache_implementation="static"`) under `torch.compile`; where that cannot run on this machine
the JSON records why instead of failing.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import statistics
import tempfile
import time
import traceback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["throughput", "floor", "all"], default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, both modes, seconds")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument(
        "--repeats", "--rounds", type=int, default=None, help="timed rounds (medians)"
    )
    parser.add_argument("--backend", default="flash", help="treeattn attention backend")
    parser.add_argument("--random-model", action="store_true", help="throughput: 4 x 256 Llama")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--hf", action="store_true", help="floor: also generate against HF")
    parser.add_argument("--static", action="store_true", help="HF static cache + torch.compile")
    parser.add_argument(
        "--hf-cached",
        action="store_true",
        help="floor: also decode against HF from a filled cache at each context",
    )
    parser.add_argument(
        "--products",
        action="store_true",
        help="floor: also the model's matrix products with a few rows against XLA's",
    )
    parser.add_argument("--name", default=None, help="JSON name under results/")
    parser.add_argument(
        "--max-gb", type=float, default=8.0, help="floor: skip cases needing more memory"
    )
    parser.add_argument(
        "--sharded",
        type=int,
        default=0,
        help="floor: also the cache over this many simulated devices, tree and ring (batch 1)",
    )
    args = parser.parse_args()
    mode = args.mode or ("all" if args.quick else "throughput")
    if args.quick:
        args.contexts = [256] if args.contexts == [1024, 8192, 32768] else args.contexts
    args.repeats = args.repeats or (2 if args.quick else 7)

    import jax

    if args.sharded:  # simulated CPU devices (no effect on other platforms)
        jax.config.update("jax_num_cpu_devices", args.sharded)
    from _common import machine, write_json

    payload: dict = {"machine": machine(), "args": vars(args), "mode": mode}
    if mode in ("throughput", "all"):
        payload["throughput"] = throughput(args)
    if mode in ("floor", "all"):
        payload["floor"] = floor(args)
    name = args.name or ("generate_quick" if args.quick else f"generate_{mode}")
    if name == "generate_throughput":
        name = "generate"
    path = write_json(name, payload)
    print(f"\nwrote {path}")
    del jax


# ---------------------------------------------------------------------------------------------
# transformers, eager and compiled
# ---------------------------------------------------------------------------------------------


def hf_model(model):
    """The same weights as a `transformers.LlamaForCausalLM` (through `save_pretrained`)."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def hf_generators(hf, static: bool) -> dict:
    """Greedy generation with transformers, `fn(ids, new)`: `{"eager": fn}` (dynamic cache)
    and, with `static`, `"static_compiled"` (a static cache with `torch.compile`)."""
    import torch

    def run(ids, new, model=hf, **kw):
        with torch.no_grad():
            # An explicit mask: without one, transformers masks every prompt token equal to
            # pad_token_id.
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                num_beams=1,
                pad_token_id=0,
                **kw,
            )

    out: dict = {"eager": run}
    if static:
        # A copy of its own, so that the eager model stays eager. The forward is compiled on
        # its first call, once per shape: the static cache keeps its shapes from step to step.
        compiled = copy.deepcopy(hf)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        out["static_compiled"] = functools.partial(
            run, model=compiled, cache_implementation="static"
        )
    return out


def timed_rounds(fns: dict, repeats: int) -> dict:
    """Medians of `repeats` interleaved rounds of each function (already warmed up)."""
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def warm(name: str, fn, failures: dict):
    """Call `fn` once (compile, warm-up); on failure record why and return None."""
    try:
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start
    except Exception as e:  # torch.compile needs a C++ toolchain, inductor support...
        failures[name] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        failures[name + "_traceback"] = traceback.format_exc(limit=3)[-2000:]
        return None


# ---------------------------------------------------------------------------------------------
# throughput: generate against transformers on a small model
# ---------------------------------------------------------------------------------------------


def throughput(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from _common import machine

    from treeattn.models import LlamaConfig, Transformer, generate
    from treeattn.pretrained import CHECKPOINTS, CharTokenizer, load_text

    batches = args.batch or ([1, 2] if args.quick else [1, 8])
    n_prompt = args.prompt or (32 if args.quick else 512)
    new = args.new or (8 if args.quick else 128)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.random_model or args.quick:
        config = LlamaConfig(
            vocab_size=1000,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=2 if args.quick else 4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
        model = Transformer(config, key=jax.random.key(0))
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, config.vocab_size, (max(batches), n_prompt))
        name = f"random Llama ({config.num_hidden_layers} x 256, GQA 8/4, vocab 1000)"
    else:
        path = CHECKPOINTS / "sonnets"
        model = Transformer.from_pretrained(path)
        tokenizer = CharTokenizer.load(path)
        ids = tokenizer.encode(load_text("sonnets.txt"))
        starts = np.linspace(0, len(ids) - n_prompt - 1, max(batches)).astype(int)
        prompts = np.stack([ids[s : s + n_prompt] for s in starts])
        name = "shipped sonnets checkpoint (4 x 128, GQA 4/2, vocab 62)"
    hf = hf_model(model)
    print(
        f"machine: {machine()}; torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads), transformers {transformers.__version__}"
    )
    print(
        f"model: {name}; prompt {n_prompt}, {new} new tokens, greedy; "
        f"treeattn backend {args.backend!r}\n"
    )
    rows, failures = compare(args, model, hf, prompts, batches, new, generate, jnp)
    return {"model": name, "prompt": n_prompt, "new": new, "rows": rows, "hf_failures": failures}


def compare(
    args, model, hf, prompts, batches, new, generate, jnp, floor_bytes=None
) -> tuple[list, dict]:
    """treeattn's `generate` against transformers (eager; static + compiled with --static)
    at each batch size: tokens/s in interleaved rounds, and identical greedy tokens.

    With `floor_bytes(batch)` (the bytes a decode step must read: weights + every row's cache
    at the mean length of the decoded steps), a streaming read of as many bytes joins the
    rounds, and each decode step is reported over that floor (`HF step/floor`: how far the
    fastest possible step could beat transformers')."""
    import jax
    import numpy as np
    import torch

    kinds = ["eager"] + (["static_compiled"] if args.static else [])
    header = (
        f"{'batch':>5} {'treeattn tok/s':>15} "
        + " ".join(f"{'HF ' + k + ' tok/s':>24}" for k in kinds)
        + f" {'vs fastest HF':>13} {'decode vs HF':>13}"
        + (f" {'HF step/floor':>13}" if floor_bytes else "")
        + f" {'compile':>8} {'same tokens':>12}"
    )
    print(header)
    print("-" * len(header))
    rows, failures = [], {}
    n_prompt = prompts.shape[1]
    gens = hf_generators(hf, args.static)
    for batch in batches:
        p = jnp.asarray(prompts[:batch], jnp.int32)
        ids = torch.tensor(np.asarray(prompts[:batch]))

        def ours(p=p, new=new):
            return jax.block_until_ready(
                generate(model, p, max_new_tokens=new, backend=args.backend)
            )

        # Each generator also runs for one new token (the prefill and one step): the difference
        # is the time of the other new - 1 decode steps.
        fns = {"treeattn": ours, "treeattn/1": functools.partial(ours, new=1)}
        start = time.perf_counter()
        out = ours()  # compiles
        first = time.perf_counter() - start
        ours(new=1)
        compile_hf = {}
        for kind in kinds:
            for suffix, n in (("", new), ("/1", 1)):
                run = functools.partial(gens[kind], ids, n)
                warmed = warm(f"{kind}{suffix}_batch{batch}", run, failures)
                if warmed is not None:
                    fns[kind + suffix] = run
                    compile_hf[kind + suffix] = warmed[1]
        if floor_bytes is not None:
            stream = jnp.ones((floor_bytes(batch) // 4,), jnp.float32)
            read = jax.jit(jnp.sum)
            jax.block_until_ready(read(stream))
            fns["floor"] = lambda read=read, stream=stream: jax.block_until_ready(read(stream))
        medians = timed_rounds(fns, args.repeats)
        fns.pop("floor", None)
        # Greedy tokens checked against the argmax of transformers' own full forward.
        with torch.no_grad():
            full = hf(torch.tensor(np.asarray(out))).logits[:, n_prompt - 1 : -1].argmax(-1)
        same = bool(np.array_equal(full.numpy(), np.asarray(out)[:, n_prompt:]))
        names = ["treeattn", *(k for k in kinds if k in medians)]
        rate = {k: batch * new / medians[k] for k in names}
        # Decode only: the new - 1 steps after the first token (prefill excluded).
        steps = {k: batch * (new - 1) / (medians[k] - medians[k + "/1"]) for k in names}
        fastest = max((rate[k] for k in kinds if k in rate), default=float("nan"))
        fastest_steps = max((steps[k] for k in kinds if k in steps), default=float("nan"))
        row = {
            "batch": batch,
            "treeattn_tokens_per_s": rate["treeattn"],
            **{f"transformers_{k}_tokens_per_s": rate.get(k) for k in kinds},
            "ratio_vs_fastest_transformers": rate["treeattn"] / fastest,
            "treeattn_decode_tokens_per_s": steps["treeattn"],
            **{f"transformers_{k}_decode_tokens_per_s": steps.get(k) for k in kinds},
            "decode_ratio_vs_fastest_transformers": steps["treeattn"] / fastest_steps,
            "compile_s": first - medians["treeattn"],
            **(
                {
                    "floor_bytes": floor_bytes(batch),
                    "floor_s": medians["floor"],
                    # Seconds per decode step (all rows) over the floor of one step.
                    **{f"{k}_step_over_floor": batch / steps[k] / medians["floor"] for k in names},
                    "fastest_transformers_step_over_floor": batch
                    / fastest_steps
                    / medians["floor"],
                }
                if floor_bytes is not None
                else {}
            ),
            "transformers_first_call_s": compile_hf,
            "identical_to_transformers_forward": same,
        }
        rows.append(row)
        cols = " ".join(
            f"{rate[k]:>24.1f}" if k in rate else f"{'failed (see JSON)':>24}" for k in kinds
        )
        print(
            f"{batch:>5} {rate['treeattn']:>15.1f} {cols} "
            f"{row['ratio_vs_fastest_transformers']:>12.2f}x "
            f"{row['decode_ratio_vs_fastest_transformers']:>12.2f}x "
            + (
                f"{row['fastest_transformers_step_over_floor']:>12.2f}x "
                if floor_bytes is not None
                else ""
            )
            + f"{row['compile_s']:>7.1f}s "
            f"{str(same):>12}"
        )
    for k, why in failures.items():
        if not k.endswith("_traceback"):
            print(f"transformers {k}: {why}")
    print(
        "tokens/s count new tokens (the prompt's prefill time included); 'decode' compares the "
        "rate of the steps after the first new token"
        + (
            "; 'HF step/floor': the fastest transformers decode step over reading the weights "
            "and every row's cache once (at the mean decoded length), timed in the same rounds"
            if floor_bytes is not None
            else ""
        )
    )
    return rows, failures


# ---------------------------------------------------------------------------------------------
# floor: a model's decode step against reading its weights and filled cache once
# ---------------------------------------------------------------------------------------------


def floor(args) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    from treeattn.models import (
        AttentionBackend,
        KVCache,
        LlamaConfig,
        Transformer,
        generate,
    )

    if args.quick:
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(args.contexts) + 64,
        )
    else:
        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=max(args.contexts) + 64,
        )
    batches = args.batch or ([1, 2] if args.quick else [1, 8])
    backend = AttentionBackend(args.backend)
    n, kv_heads, head = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    assert kv_heads is not None and head is not None
    sharded: dict = {}
    if args.sharded:
        from jax.sharding import Mesh

        mesh = Mesh(np.array(jax.devices()[: args.sharded]), ("kv",))
        sharded = {
            name: AttentionBackend(name, kernel=backend.kernel, mesh=mesh, kv_axis="kv")
            for name in ("tree", "ring")
        }

    @functools.partial(jax.jit, static_argnames=("static", "backend"), donate_argnames="cache")
    def step(params, static, tokens, cache, backend):
        model = eqx.combine(params, static)
        return jax.vmap(lambda t, c: model(t[None], c, backend=backend))(tokens, cache)

    read = jax.jit(jnp.sum)
    print(
        f"\nfloor: Llama {n} x {config.hidden_size} (heads {config.num_attention_heads}/"
        f"{kv_heads} of {head}, vocab {config.vocab_size}); backend {args.backend!r}"
        + (f"; tree and ring over {args.sharded} devices at batch 1" if sharded else "")
    )
    header = (
        f"{'dtype':<9} {'batch':>5} {'context':>7} {'weights MB':>10} {'cache MB':>9} "
        f"{'floor':>9} {'step':>9} {'step/floor':>10} {'GB/s read':>9}"
    )
    if sharded:
        header += f" {'p floor':>9} {'tree':>9} {'tree/p fl':>10} {'ring':>9} {'ring/tree':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        model = Transformer(config, dtype=dtype, key=jax.random.key(0)).unstack_layers()
        params, static = eqx.partition(model, eqx.is_array)
        weights = sum(x.nbytes for x in jax.tree.leaves(params))
        for batch in batches:
            for context in args.contexts:
                filled = batch * 2 * n * kv_heads * context * head * dtype.itemsize
                total = weights + filled
                copies = 2 + (1 if sharded and batch == 1 else 0)  # caches and the stream
                if copies * total > args.max_gb * 1e9:
                    why = f"needs {copies * total / 1e9:.1f} GB (> --max-gb {args.max_gb:g})"
                    rows.append(
                        {"dtype": dtype_name, "batch": batch, "context": context, "skipped": why}
                    )
                    print(f"{dtype_name:<9} {batch:>5} {context:>7} skipped: {why}")
                    continue

                def at(batch=batch, context=context):  # a fresh array: the cache is donated
                    return jnp.full((batch,), context - 1, jnp.int32)

                def filled_cache(batch=batch, context=context, dtype=dtype, **where):
                    cache = KVCache.create(
                        kv_heads, context + 8, head, layers=n, dtype=dtype, batch=batch, **where
                    )
                    keys = jax.random.split(jax.random.key(1), 2 * n)
                    fill = [  # random slots: the cost does not depend on what they hold
                        jax.device_put(jax.random.normal(k, x.shape, dtype), x.sharding)
                        for k, x in zip(keys, (*cache.k, *cache.v), strict=True)
                    ]
                    return eqx.tree_at(
                        lambda kv: (kv.k, kv.v, kv.length),
                        cache,
                        (tuple(fill[:n]), tuple(fill[n:]), at()),
                    )

                runs = {"step": (backend, filled_cache())}
                if sharded and batch == 1:
                    for name, be in sharded.items():
                        runs[name] = (be, filled_cache(mesh=be.mesh, kv_axis="kv"))
                caches = {name: c for name, (_, c) in runs.items()}
                stream = jnp.ones((total // 4,), jnp.float32)
                jax.block_until_ready(read(stream))
                tokens = jnp.ones((batch,), jnp.int32)
                compile_s = {}
                for name, (be, _) in runs.items():
                    for i in range(2):  # compile, warm up
                        start = time.perf_counter()
                        logits, caches[name] = step(params, static, tokens, caches[name], be)
                        jax.block_until_ready(logits)
                        caches[name] = eqx.tree_at(lambda c: c.length, caches[name], at())
                        if i == 0:
                            compile_s[name] = time.perf_counter() - start
                times: dict = {"floor": [], **{name: [] for name in runs}}
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(read(stream))
                    times["floor"].append(time.perf_counter() - start)
                    for name, (be, _) in runs.items():
                        start = time.perf_counter()
                        logits, caches[name] = step(params, static, tokens, caches[name], be)
                        jax.block_until_ready(logits)
                        times[name].append(time.perf_counter() - start)
                        caches[name] = eqx.tree_at(lambda c: c.length, caches[name], at())
                med = {name: statistics.median(v) for name, v in times.items()}
                t, f = med["step"], med["floor"]
                row = {
                    "dtype": dtype_name,
                    "batch": batch,
                    "context": context,
                    "weights_bytes": weights,
                    "cache_bytes": filled,
                    "floor_s": f,
                    "step_s": t,
                    "step_over_floor": t / f,
                    "read_GBps": total / f / 1e9,
                    "first_call_s": compile_s,
                }
                line = (
                    f"{dtype_name:<9} {batch:>5} {context:>7} {weights / 1e6:>10.0f} "
                    f"{filled / 1e6:>9.0f} {f * 1e3:>7.1f}ms {t * 1e3:>7.1f}ms "
                    f"{t / f:>9.2f}x {total / f / 1e9:>9.1f}"
                )
                if "tree" in med:
                    # Simulated devices share this machine's memory: each reads every weight
                    # (they are replicated) and its own shard of the cache.
                    device_floor = f * (args.sharded * weights + filled) / total
                    row |= {
                        "devices": args.sharded,
                        "tree_s": med["tree"],
                        "ring_s": med["ring"],
                        "device_floor_s": device_floor,
                        "tree_over_floor": med["tree"] / f,
                        "tree_over_device_floor": med["tree"] / device_floor,
                        "ring_over_tree": med["ring"] / med["tree"],
                    }
                    line += (
                        f" {device_floor * 1e3:>7.1f}ms {med['tree'] * 1e3:>7.1f}ms "
                        f"{med['tree'] / device_floor:>9.2f}x "
                        f"{med['ring'] * 1e3:>7.1f}ms {med['ring'] / med['tree']:>8.2f}x"
                    )
                rows.append(row)
                print(line)
                del caches, runs, stream
    plot_floor(rows)
    out: dict = {"config": str(config), "rows": rows}
    if args.hf:
        model = Transformer(config, key=jax.random.key(0))
        hf = hf_model(model)
        n_prompt = args.prompt or (32 if args.quick else 1024)
        new = args.new or (8 if args.quick else 32)
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, config.vocab_size, (max(batches), n_prompt))
        print(f"\nagainst transformers, fp32: prompt {n_prompt}, {new} new tokens, greedy")
        weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))

        def floor_bytes(batch):
            # The decoded steps see n_prompt + 1 ... n_prompt + new - 1 cached tokens.
            tokens = n_prompt + new / 2
            return int(weights + batch * 2 * n * kv_heads * tokens * head * 4)

        hf_rows, failures = compare(
            args,
            model.unstack_layers(),
            hf,
            prompts,
            batches,
            new,
            generate,
            jnp,
            floor_bytes=floor_bytes,
        )
        out |= {"hf_prompt": n_prompt, "hf_new": new, "hf": hf_rows, "hf_failures": failures}
    if args.products:
        out["products"] = compare_products(args, config)
    if args.hf_cached:
        new = args.new or (8 if args.quick else 32)
        cached, failures = compare_cached(args, config, batches, args.contexts, new)
        out |= {"hf_cached": cached, "hf_cached_failures": failures}
    return out


def compare_products(args, config) -> list:
    """The products of a decode step with a few rows (one per sequence of the batch): the
    model's `matmul` against XLA's own `x @ w.T` on the weight as Equinox stores it (`[out, in]`,
    float32 accumulation for narrower types), and a streaming read of the weight, in
    interleaved rounds; for every weight shape of the model."""
    import jax
    import jax.numpy as jnp

    from treeattn.models import matmul  # the product every projection of the model runs

    hidden, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    shapes = {
        "q, o": (hidden, hidden),
        "k, v": (kv, hidden),
        "gate, up": (config.intermediate_size, hidden),
        "down": (hidden, config.intermediate_size),
        "lm head": (config.vocab_size, hidden),
    }

    @jax.jit
    def xla(x, w):
        wide = jnp.finfo(x.dtype).bits >= 32
        y = jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=None if wide else jnp.float32
        )
        return y.astype(x.dtype)

    ours, read = jax.jit(matmul), jax.jit(jnp.sum)
    print("\nproducts with a few rows: the model's matmul against XLA's x @ w.T")
    header = (
        f"{'dtype':<9} {'weight':<9} {'[out, in]':>12} {'rows':>4} {'stream':>9} "
        f"{'XLA':>9} {'matmul':>9} {'XLA/matmul':>10} {'matmul/stream':>13}"
    )
    print(header)
    print("-" * len(header))
    rows_out = []
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        for name, shape in shapes.items():
            w = jax.random.normal(jax.random.key(0), shape, dtype)
            for rows in (1, 2, 8, 32, 64):
                x = jax.random.normal(jax.random.key(1), (rows, shape[1]), dtype)
                fns = {
                    "stream": lambda w=w: jax.block_until_ready(read(w)),
                    "xla": lambda x=x, w=w: jax.block_until_ready(xla(x, w)),
                    "matmul": lambda x=x, w=w: jax.block_until_ready(ours(x, w)),
                }
                for fn in fns.values():
                    fn()
                m = timed_rounds(fns, 5 * args.repeats)
                row = {
                    "dtype": dtype_name,
                    "weight": name,
                    "shape": list(shape),
                    "rows": rows,
                    **{f"{k}_s": v for k, v in m.items()},
                    "xla_over_matmul": m["xla"] / m["matmul"],
                    "matmul_over_stream": m["matmul"] / m["stream"],
                }
                rows_out.append(row)
                print(
                    f"{dtype_name:<9} {name:<9} {str(list(shape)):>12} {rows:>4} "
                    f"{m['stream'] * 1e3:>7.2f}ms {m['xla'] * 1e3:>7.2f}ms "
                    f"{m['matmul'] * 1e3:>7.2f}ms {row['xla_over_matmul']:>9.2f}x "
                    f"{row['matmul_over_stream']:>12.2f}x"
                )
    return rows_out


def compare_cached(args, config, batches, contexts, new) -> tuple[list, dict]:
    """Decoding from a filled cache: `new` greedy steps of treeattn and of transformers from
    the same cache contents (random keys and values, `context` tokens per row), at each batch
    size and context; a streaming read of the step's bytes joins the interleaved rounds.

    transformers runs its own `generate` with the cache passed as `past_key_values` (eager with
    its dynamic cache; with `--static`, its static cache under `torch.compile`): each call is
    `new` one-token forwards, as ours is. No prefill is timed on either side, so long contexts
    cost what their decode steps cost."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from treeattn.models import AttentionBackend, KVCache, Transformer

    backend = AttentionBackend(args.backend)
    model = Transformer(config, key=jax.random.key(0))
    hf = hf_model(model)
    params, static = eqx.partition(model.unstack_layers(), eqx.is_array)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    n, kv_heads, head = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    assert kv_heads is not None and head is not None
    compiled_hf = None
    if args.static:
        compiled_hf = copy.deepcopy(hf)
        compiled_hf.forward = torch.compile(compiled_hf.forward, fullgraph=True)

    # As `generate` runs its steps: one compiled scan, every row at once, the cache donated.
    @functools.partial(jax.jit, static_argnames=("static", "new"), donate_argnames="cache")
    def greedy(params, static, token, cache, new):
        model = eqx.combine(params, static)
        forward = jax.vmap(lambda t, c: model(t[None], c, backend=backend))

        def body(carry, _):
            token, cache = carry
            logits, cache = forward(token, cache)
            token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return (token, cache), token

        (_, cache), tokens = jax.lax.scan(body, (token, cache), None, length=new)
        return tokens.T, cache

    # `generate(cache=)` in newer transformers, `past_key_values=` before.
    cache_kwarg = (
        "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    )
    kinds = ["eager"] + (["static_compiled"] if args.static else [])
    hf_generate = hf_generators(hf, static=False)["eager"]  # any model, any cache
    print(
        f"\nagainst transformers from a filled cache, fp32: {new} greedy steps per call "
        f"(no prefill on either side), backend {args.backend!r}"
    )
    header = (
        f"{'batch':>5} {'context':>7} {'floor':>9} {'treeattn':>9} "
        + " ".join(f"{'HF ' + k:>18}" for k in kinds)
        + f" {'ours/floor':>10} {'HF/floor':>9} {'vs fastest HF':>13} {'same tokens':>11}"
    )
    print(header)
    print("-" * len(header))
    rows, failures = [], {}

    def case(batch: int, context: int) -> dict:
        filled = batch * 2 * n * kv_heads * context * head * 4
        # Ours, transformers' (and its static copy), its concatenated copy during a step,
        # and the stream.
        need = 3 * weights + filled * (4 + len(kinds) - 1)
        if need > args.max_gb * 1e9:
            why = f"needs {need / 1e9:.1f} GB (> --max-gb {args.max_gb:g})"
            print(f"{batch:>5} {context:>7} skipped: {why}")
            return {"batch": batch, "context": context, "skipped": why}
        cache = KVCache.create(kv_heads, context + new, head, layers=n, batch=batch)
        keys = jax.random.split(jax.random.key(2), 2 * n)
        fill = [
            jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(keys, (*cache.k, *cache.v), strict=True)
        ]

        def at():  # a fresh array: the cache is donated
            return jnp.full((batch,), context, jnp.int32)

        state = {
            "cache": eqx.tree_at(
                lambda kv: (kv.k, kv.v, kv.length),
                cache,
                (tuple(fill[:n]), tuple(fill[n:]), at()),
            )
        }
        rng = np.random.default_rng(context + batch)
        last = rng.integers(0, config.vocab_size, (batch,))
        token = jnp.asarray(last, jnp.int32)

        def ours():
            state["cache"] = eqx.tree_at(lambda c: c.length, state["cache"], at())
            out, state["cache"] = greedy(params, static, token, state["cache"], new)
            state["tokens"] = jax.block_until_ready(out)

        # transformers' caches hold the same keys and values ([batch, kv heads, seq, d]).
        def torch_layer(i):
            k, v = (np.array(x[:, :, :context]) for x in (fill[i], fill[n + i]))
            return torch.from_numpy(k), torch.from_numpy(v)

        hf_caches: dict = {"eager": transformers.DynamicCache(config=hf.config)}
        if compiled_hf is not None:
            hf_caches["static_compiled"] = transformers.StaticCache(
                config=hf.config, max_cache_len=context + new
            )
        for i in range(n):
            k, v = torch_layer(i)
            for c in hf_caches.values():
                c.update(k, v, i)
        del k, v
        # The first `context` ids are cached already: transformers runs only the last.
        ids = torch.tensor(np.concatenate([np.zeros((batch, context), np.int64), last[:, None]], 1))
        results: dict = {}

        def theirs(kind, model_):
            cache = hf_caches[kind]
            cache.crop(-(int(cache.get_seq_length()) - context))  # back to the context
            results[kind] = hf_generate(ids, new, model=model_, **{cache_kwarg: cache})

        stream = jnp.ones(((weights + filled) // 4,), jnp.float32)
        read = jax.jit(jnp.sum)
        fns: dict = {
            "floor": lambda read=read, stream=stream: jax.block_until_ready(read(stream)),
            "treeattn": ours,
        }
        for kind, model_ in (("eager", hf), ("static_compiled", compiled_hf)):
            if kind in kinds:
                fn = functools.partial(theirs, kind, model_)
                if warm(f"{kind}_batch{batch}_context{context}", fn, failures) is not None:
                    fns[kind] = fn
        start = time.perf_counter()
        ours()
        compile_s = time.perf_counter() - start
        for fn in fns.values():
            fn()
        medians = timed_rounds(fns, args.repeats)
        # One step reads the weights and every row's cache at its mean length.
        step_bytes = weights + batch * 2 * n * kv_heads * (context + (new - 1) / 2) * head * 4
        floor_s = medians["floor"] * step_bytes / (weights + filled)
        step = {k: medians[k] / new for k in ("treeattn", *kinds) if k in medians}
        ran = [k for k in kinds if k in step]
        fastest = min((step[k] for k in ran), default=float("nan"))
        tokens = np.asarray(state["tokens"])
        same = {k: bool(np.array_equal(results[k][:, context + 1 :].numpy(), tokens)) for k in ran}
        row = {
            "batch": batch,
            "context": context,
            "new": new,
            "weights_bytes": weights,
            "cache_bytes": filled,
            "floor_s": floor_s,
            "treeattn_step_s": step["treeattn"],
            **{f"transformers_{k}_step_s": step.get(k) for k in kinds},
            "treeattn_step_over_floor": step["treeattn"] / floor_s,
            "fastest_transformers_step_over_floor": fastest / floor_s,
            "speedup_vs_fastest_transformers": fastest / step["treeattn"],
            "compile_s": compile_s - medians["treeattn"],
            "identical_tokens": same,
        }
        cols = " ".join(
            f"{step[k] * 1e3:>16.1f}ms" if k in step else f"{'failed (JSON)':>18}" for k in kinds
        )
        print(
            f"{batch:>5} {context:>7} {floor_s * 1e3:>7.1f}ms {step['treeattn'] * 1e3:>7.1f}ms "
            f"{cols} {row['treeattn_step_over_floor']:>9.2f}x "
            f"{row['fastest_transformers_step_over_floor']:>8.2f}x "
            f"{row['speedup_vs_fastest_transformers']:>12.2f}x {str(all(same.values())):>11}"
        )
        return row

    for batch in batches:
        for context in contexts:
            rows.append(case(batch, context))
    for k, why in failures.items():
        if not k.endswith("_traceback"):
            print(f"transformers {k}: {why}")
    print(
        "per decode step (all rows); floor: the weights and every row's cache at its mean "
        "length, at the bandwidth of a streaming read timed in the same rounds; 'vs fastest HF': "
        "the faster transformers step over treeattn's"
    )
    return rows, failures


def plot_floor(rows) -> None:
    """Step time over the floor against context, per dtype and batch (and tree, ring)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    import pathlib

    done = [r for r in rows if "step_s" in r]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype in sorted({r["dtype"] for r in done}):
        for batch in sorted({r["batch"] for r in done}):
            sel = sorted(
                (r for r in done if r["dtype"] == dtype and r["batch"] == batch),
                key=lambda r: r["context"],
            )
            marker, ls = ("o", "-") if dtype == "float32" else ("s", "--")
            xs = [r["context"] for r in sel]
            ax.plot(
                xs,
                [r["step_over_floor"] for r in sel],
                marker=marker,
                ls=ls,
                label=f"{dtype}, batch {batch}",
            )
            tree = [r for r in sel if "tree_s" in r]
            if tree:
                p = tree[0]["devices"]
                ax.plot(
                    [r["context"] for r in tree],
                    [r["tree_over_device_floor"] for r in tree],
                    marker=marker,
                    ls=":",
                    label=f"{dtype}, tree over {p} simulated devices (their floor)",
                )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.3, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("decode step / memory floor")
    ax.set_title("a model's decode step against reading it once")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = pathlib.Path(__file__).with_name("results") / "generate_floor.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
