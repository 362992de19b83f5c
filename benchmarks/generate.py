"""Generation: treeattn against transformers, and a model's decode step against its floor.

    python benchmarks/generate.py                  # throughput: shipped checkpoint, batch 1 and 8
    python benchmarks/generate.py --random-model   # a random Llama of 4 layers x 256, vocab 1000
    python benchmarks/generate.py --static         # + transformers static cache, torch.compile
    python benchmarks/generate.py --mode floor     # the floor grid (14 cells), the per-layer
                                                   # cost, the real checkpoint
    python benchmarks/generate.py --mode floor --hf [--static]   # + transformers, fp32 cells
    python benchmarks/generate.py --mode floor --cells 0 5        # some cells of the grid
    python benchmarks/generate.py --mode floor --products   # + the few-row products against
                                                            # XLA's own, for each weight shape
    python benchmarks/generate.py --mode floor --host       # + each step split into the
                                                            # host's call and the rest
    python benchmarks/generate.py --quick          # both modes at tiny sizes, seconds

**throughput**: prompt 512 tokens, 128 new tokens, greedy. Our `generate` is compiled once
(compile time reported apart); transformers' `generate` gets a warm-up call; then both are
timed in interleaved rounds (medians), on this machine's CPU cores in the same run. Target:
>= 3x transformers' tokens per second at batch 1 with identical greedy tokens.

**floor**: a grid of Llama-style decoders with random weights (`_floor.GRID`: a covering set
in which every level of every factor appears: layers 6/12/30, hidden 256/576/768/1024, head
size 32/64/128, 1/3/4/8 query heads per kv head, tied and untied embeddings, fp32 and bf16,
batch 1 and 8, 128/1K/8K/32K cached tokens). A decode step must read every weight and every
filled cache entry once: its floor is the time of a streaming read of as many bytes (every
layer weight, the final norm, the logits' matrix, one embedding row per sequence, and the
filled cache of every row), the fastest of two streaming kernels (XLA's `sum` and a C++ read
on every core) in each round. The step is `Decoder.step` (the model as constructed, layers
stacked: the decoder prepares it once) over a cache filled with random keys and values.
Rounds of the floor and the step interleave; each cell reports the median of the per-round
ratios and their interquartile range; the table lists the worst cell first, and the summary
the worst and the median cell of each target group (fp32/bf16 x batch 1/8). `--hf` adds, for
the fp32 cells, `--new` greedy steps of ours and of transformers (eager; `--static`: its static
cache under `torch.compile`) from the same filled cache, with identical tokens checked.
The per-layer fixed cost (30 layers of hidden 64 against one) and the real SmolLM2-135M
checkpoint stepped through `decode_step` and a `Decoder` follow the grid.
`--host` traces more rounds with the profiler (no Python frames) and splits each step into
the host's part, from the call to the start of the compiled program (flattening the weights,
donating the cache, launching), and the rest (the program, until its logits are ready), each
over its round's floor.
"""

from __future__ import annotations

import argparse
import copy
import functools
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
    parser.add_argument(
        "--backend",
        default=None,
        help="treeattn attention backend (default: the decoder's, `flash` for a model on the "
        "default `energy`)",
    )
    parser.add_argument("--random-model", action="store_true", help="throughput: 4 x 256 Llama")
    parser.add_argument("--hf", action="store_true", help="floor: against transformers (fp32)")
    parser.add_argument("--static", action="store_true", help="HF static cache + torch.compile")
    parser.add_argument("--hf-rounds", type=int, default=5, help="floor: rounds against HF")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--cells", type=int, nargs="+", default=None, help="floor: these cells of the grid"
    )
    parser.add_argument(
        "--arrays",
        action="store_true",
        help="floor: also time each cell's step on the weights as arrays (packed=False), in the "
        "same rounds",
    )
    parser.add_argument(
        "--energy",
        action="store_true",
        help="floor: also time each cell's step decoding through the gradient of the free "
        "energy (backend='energy'), in the same rounds",
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="floor: also split each cell's step into the host's call and the rest (a profiler "
        "trace of more rounds)",
    )
    parser.add_argument(
        "--products",
        action="store_true",
        help="floor: also the model's matrix products with a few rows against XLA's",
    )
    parser.add_argument("--name", default=None, help="JSON name under results/")
    parser.add_argument(
        "--max-gb", type=float, default=16.0, help="floor: skip cells needing more memory"
    )
    args = parser.parse_args()
    mode = args.mode or ("all" if args.quick else "throughput")
    args.repeats = args.repeats or (2 if args.quick else 15 if mode == "floor" else 7)

    import jax
    from _common import machine, write_json
    from _floor import floor

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
        f"treeattn backend {args.backend or 'the default'!r}\n"
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


def compare_products(args, config) -> list:
    """The products of a decode step with a few rows (one per sequence of the batch): the
    model's `matmul` against XLA's own `x @ w.T` on the weight as Equinox stores it (`[out, in]`,
    float32 accumulation for narrower types), and a streaming read of the weight, in
    interleaved rounds (fewer for many rows); for every weight shape of the model."""
    import jax
    import jax.numpy as jnp

    from treeattn.models import PackedWeight, matmul  # what every projection of the model runs

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
    print(
        "\nproducts with a few rows: the model's matmul (on the array, and packed as a Decoder "
        "packs it) against XLA's x @ w.T"
    )
    header = (
        f"{'dtype':<9} {'weight':<9} {'[out, in]':>12} {'rows':>4} {'stream':>9} "
        f"{'XLA':>9} {'matmul':>9} {'packed':>9} {'XLA/matmul':>10} {'packed/matmul':>13} "
        f"{'packed/stream':>13}"
    )
    print(header)
    print("-" * len(header))
    rows_out = []
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        for name, shape in shapes.items():
            w = jax.random.normal(jax.random.key(0), shape, dtype)
            packed = PackedWeight.of(w) if PackedWeight.packs(w) else None
            for rows in (1, 2, 8, 32, 64, 256, 1024):
                x = jax.random.normal(jax.random.key(1), (rows, shape[1]), dtype)
                fns = {
                    "stream": lambda w=w: jax.block_until_ready(read(w)),
                    "xla": lambda x=x, w=w: jax.block_until_ready(xla(x, w)),
                    "matmul": lambda x=x, w=w: jax.block_until_ready(ours(x, w)),
                }
                if packed is not None:
                    fns["packed"] = lambda x=x, p=packed: jax.block_until_ready(ours(x, p))
                for fn in fns.values():
                    fn()
                m = timed_rounds(fns, max(5, 5 * args.repeats // (1 + rows // 64)))
                row = {
                    "dtype": dtype_name,
                    "weight": name,
                    "shape": list(shape),
                    "rows": rows,
                    **{f"{k}_s": v for k, v in m.items()},
                    "xla_over_matmul": m["xla"] / m["matmul"],
                    "matmul_over_stream": m["matmul"] / m["stream"],
                }
                if "packed" in m:
                    row["packed_over_matmul"] = m["packed"] / m["matmul"]
                    row["packed_over_stream"] = m["packed"] / m["stream"]
                rows_out.append(row)
                print(
                    f"{dtype_name:<9} {name:<9} {str(list(shape)):>12} {rows:>4} "
                    f"{m['stream'] * 1e3:>7.2f}ms {m['xla'] * 1e3:>7.2f}ms "
                    f"{m['matmul'] * 1e3:>7.2f}ms {m.get('packed', float('nan')) * 1e3:>7.2f}ms "
                    f"{row['xla_over_matmul']:>9.2f}x "
                    f"{row.get('packed_over_matmul', float('nan')):>12.2f}x "
                    f"{row.get('packed_over_stream', float('nan')):>12.2f}x"
                )
    return rows_out


if __name__ == "__main__":
    main()
