"""The "cpu" backend: the C++ decode kernel of `treeattn/_cpu_kernel.cc` (built and loaded by
`treeattn._native`), as a kernel call with a `vmap` rule."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._native import TARGET, load_kernel as load_kernel
from ._batching import owns_batch


def _ffi(
    q,
    k,
    v,
    q_offset,
    kv_length,
    kv_pos,
    *,
    scale,
    causal,
    layout,
    has_pos,
    window=None,
    squeeze=True,
):
    batch, q_seq, heads, _ = q.shape
    out_types = (
        jax.ShapeDtypeStruct((batch, q_seq, heads, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((batch, heads, q_seq), jnp.float32),
    )
    if squeeze and batch == 1 and k.ndim == 4 and v.ndim == 4:
        # One row: K and V go without the batch axis. When they are a cache buffer with a unit
        # axis added by the caller, the two reshapes cancel and the kernel reads the buffer
        # itself, so XLA can update it in place just before (see `_cpu_kernel.cc`). XLA:CPU
        # cannot update a buffer in place when the kernel reads it through a reshape: it
        # copies the whole buffer.
        k, v = k[0], v[0]
    return jax.ffi.ffi_call(TARGET, out_types)(
        q,
        k,
        v,
        q_offset,
        kv_length,
        kv_pos,
        scale=np.float32(scale),
        causal=causal,
        window_left=np.int64(-1 if window is None else window[0]),
        window_right=np.int64(-1 if window is None else window[1]),
        layout=layout,
        has_pos=has_pos,
    )


@functools.cache
def _kernel(scale: float, causal: bool, window, layout: str, has_pos: bool, squeeze: bool = True):
    """The kernel call for one set of static attributes, with a vmap rule: a vmapped axis over
    batched K/V (a batch of caches) joins the kernel's batch axis, so `jax.vmap` costs one call,
    not a loop; with K/V shared across the axis, the calls run one after another (folding them
    in would copy the cache). `squeeze`: a single row's K/V go without their unit batch axis
    (an unbatched cache with the caller's unit axis); inside the vmap rule they keep it, since
    there the folded axis is the batched cache's own."""
    attrs = dict(scale=scale, causal=causal, window=window, layout=layout, has_pos=has_pos)

    def call(q, k, v, q_offset, kv_length, kv_pos):
        return _ffi(q, k, v, q_offset, kv_length, kv_pos, **attrs, squeeze=squeeze)

    # Inside the vmap rule the folded batch is the cache's own: its unit axis is kept.
    folded = _kernel(scale, causal, window, layout, has_pos, squeeze=False) if squeeze else None
    return owns_batch(call, folded)


def cpu_forward(
    q, k, v, q_offset, kv_length, kv_pos, mask, bias, *, dims, causal, window, scale, block
):
    """`(out, lse)` from the C++ kernel (loaded by `load_kernel()`, which eligibility calls
    first): online softmax over blocks of 512 keys, each K and V row read once; batch rows
    x kv heads run on XLA's intra-op thread pool. Offsets, lengths and positions arrive int32.
    A sliding window is a per-row range of key positions; masks and biases are refused by
    eligibility."""
    del block
    assert mask is None and bias is None
    has_pos = kv_pos is not None
    if kv_pos is None:
        kv_pos = jnp.zeros((dims.batch, 0), jnp.int32)
    kernel = _kernel(float(scale), bool(causal), window, str(dims.layout), has_pos)
    out, lse = kernel(q, k, v, q_offset, kv_length, kv_pos)
    return out, jnp.swapaxes(lse, 1, 2)  # the kernel writes [batch, heads, q_seq]
