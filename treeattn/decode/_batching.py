"""A kernel that owns its batch axis: the `vmap` rule the decode kernels share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def owns_batch(kernel, folded=None):
    """`kernel(q, k, v, ...) -> (out, lse)`, batched over axis 0 of every argument, with a vmap
    rule that folds a vmapped axis into that batch axis (one call of `folded`, default
    `kernel`, not a loop) when K and V are batched, and maps over it when they are shared
    (folding would copy the cache).

    (cuDNN's own batching rule reshapes every operand to the folded batch, and fails when one
    of them — the query lengths JAX builds, or lengths shared across the vmapped axis — is not
    batched; the C++ kernel has none.)"""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return kernel(*args)

    @call.def_vmap
    def _rule(axis_size, in_batched, *args):
        pairs = list(zip(args, in_batched, strict=True))
        if not (in_batched[1] and in_batched[2]):

            def one(batched):
                it = iter(batched)
                return call(*(next(it) if b else a for a, b in pairs))

            return lax.map(one, [a for a, b in pairs if b]), (True, True)
        batch = args[1].shape[1]

        def fold(a, b):
            a = a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
            return a.reshape(axis_size * batch, *a.shape[2:])

        out, lse = (folded or call)(*(fold(a, b) for a, b in pairs))
        unfold = (x.reshape(axis_size, batch, *x.shape[1:]) for x in (out, lse))
        return tuple(unfold), (True, True)

    return call
