"""Token ids checked at the boundary of the models' calls."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.core import Tracer


def check_token_type(name: str, tokens, vocab: int, *, ndim: int) -> None:
    """Token ids are integer arrays of the expected rank (static: checked under `jit` too)."""
    dtype = getattr(tokens, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"{name}: token ids must be integers in [0, vocab_size={vocab}), got dtype {dtype}"
        )
    if tokens.ndim != ndim:
        want = "a scalar" if ndim == 0 else f"{ndim}-d"
        raise ValueError(f"{name}: the token ids must be {want}, got shape {tokens.shape}")


def check_token_ids(name: str, tokens, vocab: int) -> None:
    """Concrete token ids lie in `[0, vocab)`; traced ones cannot be checked here."""
    if isinstance(tokens, Tracer) or not getattr(tokens, "is_fully_addressable", True):
        return  # traced, or spread over processes: not readable here
    ids = np.asarray(tokens)
    bad = np.unique(ids[(ids < 0) | (ids >= vocab)])
    if bad.size:
        shown = ", ".join(str(int(i)) for i in bad[:8]) + (", ..." if bad.size > 8 else "")
        raise ValueError(f"{name}: token ids {shown} are outside [0, vocab_size={vocab})")
