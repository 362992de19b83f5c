"""Generation throughput: treeattn.models.generate vs transformers on CPU torch, same weights.

    python benchmarks/generate.py                 # the shipped checkpoint, batch 1 and 8
    python benchmarks/generate.py --random-model  # a random Llama of 4 layers x 256, vocab 1000

Prompt 512 tokens, 128 new tokens, greedy. Our `generate` is compiled once (compile time
reported apart); transformers' `generate` gets a warm-up call; then both are timed in
interleaved rounds (medians). Both run on
this machine's CPU cores in the same run; the target is >= 3x transformers' tokens per second
at batch 1 with identical greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", default="flash", help="treeattn attention backend")
    parser.add_argument("--random-model", action="store_true")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from _common import machine, write_json

    from treeattn.models import (
        CHECKPOINTS,
        CharTokenizer,
        LlamaConfig,
        Transformer,
        generate,
        load_text,
    )

    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.random_model:
        config = LlamaConfig(
            vocab_size=1000,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
        model = Transformer(config, key=jax.random.key(0))
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, config.vocab_size, (max(args.batch), args.prompt))
        name = "random Llama (4 x 256, GQA 8/4, vocab 1000)"
    else:
        path = CHECKPOINTS / "sonnets"
        model = Transformer.from_pretrained(path)
        tokenizer = CharTokenizer.load(path)
        ids = tokenizer.encode(load_text("sonnets.txt"))
        starts = np.linspace(0, len(ids) - args.prompt - 1, max(args.batch)).astype(int)
        prompts = np.stack([ids[s : s + args.prompt] for s in starts])
        name = "shipped sonnets checkpoint (4 x 128, GQA 4/2, vocab 62)"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()

    print(
        f"machine: {machine()}; torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads), transformers {transformers.__version__}"
    )
    print(
        f"model: {name}; prompt {args.prompt}, {args.new} new tokens, greedy; "
        f"treeattn backend {args.backend!r}\n"
    )
    header = (
        f"{'batch':>5} {'treeattn tok/s':>15} {'transformers tok/s':>19} {'ratio':>7} "
        f"{'compile':>8} {'identical tokens':>17}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for batch in args.batch:
        p = jnp.asarray(prompts[:batch], jnp.int32)

        def ours(p=p):
            return jax.block_until_ready(
                generate(model, p, max_new_tokens=args.new, backend=args.backend)
            )

        def theirs(p=p):
            ids = torch.tensor(np.asarray(p))
            with torch.no_grad():
                # An explicit mask: without one, transformers masks every prompt token equal to
                # pad_token_id (here a character of the text).
                return hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.new,
                    min_new_tokens=args.new,
                    do_sample=False,
                    num_beams=1,
                    pad_token_id=0,
                )

        start = time.perf_counter()
        out = ours()  # compiles
        first = time.perf_counter() - start
        ref = theirs()  # warm-up
        # Interleaved rounds, so that this shared machine's noise hits both alike.
        t_ours_all, t_hf_all = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = ours()
            t_ours_all.append(time.perf_counter() - start)
            start = time.perf_counter()
            ref = theirs()
            t_hf_all.append(time.perf_counter() - start)
        t_ours, t_hf = statistics.median(t_ours_all), statistics.median(t_hf_all)
        compile_s = first - t_ours
        same = bool(np.array_equal(np.asarray(out), ref.numpy()))
        row = {
            "batch": batch,
            "treeattn_tokens_per_s": batch * args.new / t_ours,
            "transformers_tokens_per_s": batch * args.new / t_hf,
            "ratio": t_hf / t_ours,
            "compile_s": compile_s,
            "identical_tokens": same,
        }
        rows.append(row)
        print(
            f"{batch:>5} {row['treeattn_tokens_per_s']:>15.0f} "
            f"{row['transformers_tokens_per_s']:>19.0f} {row['ratio']:>6.1f}x "
            f"{compile_s:>7.1f}s {str(same):>17}"
        )
    path = write_json(
        "generate", {"machine": machine(), "args": vars(args), "model": name, "rows": rows}
    )
    print(f"\ntokens/s count new tokens only (the prompt's prefill time included); wrote {path}")


if __name__ == "__main__":
    main()
