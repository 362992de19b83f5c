"""Shared timing helpers for the benchmark scripts: warm-up, compile time apart, medians."""

from __future__ import annotations

import json
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def compile_and_time(
    fn: Callable, *args, repeats: int = 7, warmup: int = 2, keep: dict | None = None
) -> dict[str, Any]:
    """Compile `jax.jit(fn)` (timed on its own), warm up, then time `repeats` calls.

    Returns the compile time, the median and spread of the run times (seconds), and the
    compiled FLOP count from XLA's cost analysis. The compiled executable is stored in
    `keep["compiled"]` when `keep` is given.
    """
    jitted = jax.jit(fn)
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - start
    if keep is not None:
        keep["compiled"] = compiled
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {
        "compile_s": compile_s,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": repeats,
        "flops": float(cost.get("flops", float("nan"))) if cost else float("nan"),
    }


def machine() -> dict[str, Any]:
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
    }


def write_json(name: str, payload: dict[str, Any]) -> pathlib.Path:
    out = pathlib.Path(__file__).with_name("results") / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out
