"""Test configuration: strict dtype promotion, 8 simulated CPU devices, seeded keys.

`TREEATTN_TEST_PLATFORM` picks the profile: `cpu` (the default; JAX is confined to the CPU,
with 8 simulated devices) or `cuda` (`make test-gpu`: JAX's default backend, the GPUs; the
CPU backend keeps its 8 devices for host-side code). In the GPU profile, tests that need more
devices than the host has, and tests of the XLA:CPU kernel or of CPU multi-process runs, are
skipped with the reason; tests/test_gpu.py runs the GPU kernels against float64 NumPy.
"""

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


def pytest_collection_modifyitems(config, items):
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
