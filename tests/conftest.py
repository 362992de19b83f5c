"""Test configuration: strict dtype promotion, 8 simulated CPU devices, seeded keys."""

import os
import random


# The simulated device count must be set before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402


jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Each new shape compiles; keep property tests to a modest number of examples.
settings.register_profile("default", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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
