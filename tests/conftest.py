"""Test configuration: strict dtype promotion, 8 simulated CPU devices, seeded keys, and the
fast tier.

`TREEATTN_TEST_PLATFORM` picks the profile: `cpu` (the default; JAX is confined to the CPU,
with 8 simulated devices) or `cuda` (`make test-gpu`: JAX's default backend, the GPUs; the
CPU backend keeps its 8 devices for host-side code). In the GPU profile, tests that need more
devices than the host has, and tests of the XLA:CPU kernel or of CPU multi-process runs, are
skipped with the reason; tests/test_gpu.py runs the GPU kernels against float64 NumPy.

`--fast` (`make test-fast`) runs each test function once: its case marked `fast` (by
`pytest.param(..., marks=pytest.mark.fast)`, or `@pytest.mark.fast(name=value, ...)` on the
function, naming the parameters of the case), else its first; no `slow` test; property tests
on 5 examples. The full grid (`make test`, CI) runs every case.
"""

import gc
import os
import random


PLATFORM = os.environ.get("TREEATTN_TEST_PLATFORM", "cpu")
if PLATFORM not in ("cpu", "cuda"):
    raise ValueError(f"TREEATTN_TEST_PLATFORM must be 'cpu' or 'cuda', got {PLATFORM!r}")
# The simulated device count must be set before JAX initialises its backends.
if PLATFORM == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # LLVM's optimisation of XLA:CPU programs is most of their compile time, and nothing the
    # suite checks depends on it (HLO, buffers, values within tolerances); the benchmarks and
    # users compile at the default level. Processes the tests start inherit it.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402


jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Each new shape compiles; keep property tests to a modest number of examples.
settings.register_profile("default", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.register_profile("fast", max_examples=5, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# What runs only on XLA:CPU, or as several CPU processes on one machine.
CPU_ONLY_MODULES = ("test_native.py", "test_multihost.py", "test_cpu_kernel.py")
CPU_ONLY_NAMES = ("cpu_kernel",)


def devices(p: int) -> list:
    """The first `p` devices of the default backend; skips the test when there are fewer (a
    GPU host has as many as it has GPUs, the CPU profile simulates 8)."""
    available = jax.devices()
    if len(available) < p:
        pytest.skip(f"needs {p} devices, the {PLATFORM} profile has {len(available)}")
    return available[:p]


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help="the fast tier: each test function once (its case marked `fast`, else its first), "
        "no `slow` test, property tests on 5 examples",
    )


def pytest_configure(config):
    if config.getoption("fast"):
        settings.load_profile("fast")


def _function(item) -> str:
    """The test function of `item`: its node id without the parameters."""
    return item.nodeid.split("[", 1)[0]


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays: no single truth value
        return a is b


def _marked_fast(item) -> bool:
    """Whether `item` is its function's case for the fast tier: marked `fast` with no arguments
    (a `pytest.param` mark), or by a mark on the function whose arguments its parameters match."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return any(
        all(name in params and _equal(params[name], value) for name, value in mark.kwargs.items())
        for mark in item.iter_markers("fast")
    )


def _stale_fast_mark(item) -> str | None:
    """What is wrong with the `fast` marks of `item`'s function, if anything: each must name
    parameters of its `parametrize` marks, by keyword, with values they take."""
    taken: dict[str, list] = {}
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs["argnames"]
        cases = mark.args[1] if len(mark.args) > 1 else mark.kwargs["argvalues"]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        for case in cases:
            case = case.values if hasattr(case, "marks") else case if len(names) > 1 else (case,)
            for name, value in zip(names, case, strict=True):
                taken.setdefault(name, []).append(value)
    for mark in item.iter_markers("fast"):
        if mark.args:
            return "pytest.mark.fast takes keywords only"
        for name, value in mark.kwargs.items():
            if not any(_equal(value, v) for v in taken.get(name, [])):
                return f"no parameter {name}={value!r}"
    return None


def fast_tier(items) -> list:
    """One case per test function, none of them `slow`: the case marked `fast`, else the first
    (of those collected: a `-k` or a node id may leave the marked case out)."""
    chosen = {}
    for item in items:
        if item.get_closest_marker("slow") is not None:
            continue
        name = _function(item)
        if name not in chosen or (_marked_fast(item) and not _marked_fast(chosen[name])):
            chosen[name] = item
    return [item for item in items if chosen.get(_function(item)) is item]


@pytest.hookimpl(trylast=True)  # after -k and -m: the tier picks among what they leave
def pytest_collection_modifyitems(config, items):
    checked = set()
    for item in items:
        if item.get_closest_marker("fast") is not None and _function(item) not in checked:
            checked.add(_function(item))
            if problem := _stale_fast_mark(item):
                raise pytest.UsageError(f"{_function(item)}: {problem}")
    if config.getoption("fast"):
        keep = fast_tier(items)
        kept = set(keep)
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = keep
    if PLATFORM == "cpu":
        return
    skip = pytest.mark.skip(reason="tests the XLA:CPU kernel or CPU processes (CPU profile)")
    for item in items:
        if item.path.name in CPU_ONLY_MODULES or any(n in item.name for n in CPU_ONLY_NAMES):
            item.add_marker(skip)


@pytest.fixture
def getkey(request):
    """Fresh PRNG keys from a per-test seed (printed, so a failure can be replayed).

    Set TREEATTN_TEST_SEED to replay a seed.
    """
    seed = int(os.environ.get("TREEATTN_TEST_SEED", random.randrange(2**31)))
    print(f"\n[{request.node.name}] TREEATTN_TEST_SEED={seed}")
    key = jax.random.key(seed)

    def next_key():
        nonlocal key
        key, sub = jax.random.split(key)
        return sub

    return next_key


# Every compiled XLA:CPU executable holds a few memory mappings until its jit cache drops it;
# a worker that compiles tens of thousands of programs reaches the kernel's limit
# (vm.max_map_count, 65,530 by default), and the next compilation aborts or segfaults inside
# LLVM. Past this many mappings the caches are cleared (programs are compiled again on use).
MAX_MAPPINGS = 24_000


def _mappings() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _bounded_executables():
    yield
    if _mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()
