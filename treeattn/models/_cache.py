"""The KV cache: a fixed-size pytree, head-major, optionally sharded round-robin over devices."""

from __future__ import annotations

import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from .._numerics import Layout
from .._sharding import SequenceSharding


class KVCache(eqx.Module):
    """Keys and values of the tokens seen so far, preallocated to `max_len` slots.

    Stored head-major, `k[..., kv_heads, max_len, qk]` (the layout that streams at memory speed
    in a decode step), with any leading axes (one per layer when a model stacks its layers).
    `length` is the number of tokens written. A cache is passed into a layer and returned
    updated, never mutated; its shapes never change, so a decode step never recompiles.

    **Sharded caches.** With `devices = p > 1`, the slots are split into p contiguous shards
    (one per device along the mesh axis) and tokens are appended round-robin in blocks of
    `block` tokens: token t goes to shard `(t // block) % p`, so the shards fill evenly and every
    device has the same amount of attention to do at any length. `positions()` gives the token
    position held by each slot (what `tree_decode(kv_positions=...)` needs).

    **Overflow.** Writing past `max_len` never wraps around. `prefill`, `decode_step`,
    `generate` and an eager model call check on the host, before running, and raise a
    `ValueError`; they know the length of a cache they returned without waiting for the device,
    so the check does not stall the decode loop. Inside a compiled program (a cache traced
    under `jit`), a single-device cache raises at run time (`equinox.error_if`). A sharded
    cache cannot: an error raised on one device would leave the others waiting in a
    collective. There the overflowing tokens are not written, `length` still counts them
    (`length > max_len` flags the overflow) and `Transformer` returns NaN logits.
    """

    k: Float[Array, "*layers kv_heads max_len qk"]
    v: Float[Array, "*layers kv_heads max_len vo"]
    length: Int[Array, "*layers"]
    devices: int = eqx.field(static=True, default=1)
    block: int = eqx.field(static=True, default=1)

    @classmethod
    def create(
        cls,
        kv_heads: int,
        max_len: int,
        qk: int,
        vo: int | None = None,
        *,
        layers: int | None = None,
        dtype=jnp.float32,
        mesh: Mesh | None = None,
        kv_axis: str | tuple[str, ...] | None = None,
        block: int = 16,
    ) -> KVCache:
        """An empty cache. With `mesh` and `kv_axis`, the slots are sharded over that axis and
        `max_len` is rounded up to a multiple of `devices * block`."""
        vo = qk if vo is None else vo
        lead = () if layers is None else (layers,)
        devices = 1
        if mesh is not None and kv_axis is not None:
            devices = SequenceSharding.create("KVCache.create", mesh, kv_axis).devices
        if devices > 1:
            max_len = -(-max_len // (devices * block)) * devices * block
        else:
            block = max_len
        k = jnp.zeros((*lead, kv_heads, max_len, qk), dtype)
        v = jnp.zeros((*lead, kv_heads, max_len, vo), dtype)
        length = jnp.zeros(lead, jnp.int32)
        if devices > 1:
            assert mesh is not None and kv_axis is not None
            spec = P(*([None] * (len(lead) + 1)), kv_axis, None)
            k = jax.device_put(k, NamedSharding(mesh, spec))
            v = jax.device_put(v, NamedSharding(mesh, spec))
        _remember(length, 0)
        return cls(k=k, v=v, length=length, devices=devices, block=block)

    @property
    def layout(self) -> Layout:
        """How K and V are stored: head-major, `"bhsd"` (`[..., kv_heads, max_len, d]`)."""
        return "bhsd"

    @property
    def max_len(self) -> int:
        return self.k.shape[-2]

    def slots(self, positions: Int[Array, " n"]) -> Int[Array, " n"]:
        """The slot holding each token position."""
        if self.devices == 1:
            return positions
        p, b, shard = self.devices, self.block, self.max_len // self.devices
        return ((positions // b) % p) * shard + (positions // (b * p)) * b + positions % b

    def positions(self) -> np.ndarray:
        """The token position held by each slot, `[max_len]` (a constant)."""
        s = np.arange(self.max_len)
        if self.devices == 1:
            return s
        p, b, shard = self.devices, self.block, self.max_len // self.devices
        d, j = s // shard, s % shard
        return ((j // b) * p + d) * b + j % b

    def append(self, k: Float[Array, "n kv_heads qk"], v: Float[Array, "n kv_heads vo"]) -> KVCache:
        """Write `n` new tokens after the `length` already cached. Writing past `max_len`
        never wraps around: see "Overflow" above. Shapes are checked before anything runs."""
        heads, qk, vo = self.k.shape[-3], self.k.shape[-1], self.v.shape[-1]
        if k.ndim != 3 or v.ndim != 3 or k.shape[1:] != (heads, qk) or v.shape[1:] != (heads, vo):
            raise ValueError(
                f"KVCache.append: k{tuple(k.shape)} and v{tuple(v.shape)} must be "
                f"[n, kv_heads={heads}, {qk}] and [n, kv_heads={heads}, {vo}] for this cache "
                f"(k{tuple(self.k.shape)}, v{tuple(self.v.shape)}, head-major)"
            )
        n = k.shape[0]
        if v.shape[0] != n:
            raise ValueError(f"KVCache.append: k has {n} tokens, v has {v.shape[0]}")
        if n > self.max_len:
            raise ValueError(_overflow_message(n, None, self.max_len))
        overflow = self.length + n > self.max_len
        k = jnp.swapaxes(k, 0, 1).astype(self.k.dtype)  # head-major, as stored
        v = jnp.swapaxes(v, 0, 1).astype(self.v.dtype)
        if self.devices == 1:
            length = eqx.error_if(self.length, overflow, _overflow_message(n, None, self.max_len))
            # The new tokens take consecutive slots: a slice update. (Under generate's vmap
            # JAX lowers this to a scatter as well, one with in-bounds, non-overlapping
            # indices.)
            new_k = _write(self.k, k, length)
            new_v = _write(self.v, v, length)
        elif n == 1:
            # On overflow the slot computed would belong to another position: write back
            # what it holds instead (a one-token read, not a pass over the cache).
            start = self.slots(self.length)
            axis = self.k.ndim - 2
            k = jnp.where(overflow, jax.lax.dynamic_slice_in_dim(self.k, start, 1, axis), k)
            v = jnp.where(overflow, jax.lax.dynamic_slice_in_dim(self.v, start, 1, axis), v)
            new_k = _write(self.k, k, start)
            new_v = _write(self.v, v, start)
        else:
            slots = self.slots(self.length + jnp.arange(n, dtype=jnp.int32))
            slots = jnp.where(overflow, self.max_len, slots)  # out of bounds: dropped
            new_k = self.k.at[..., slots, :].set(k, mode="drop")
            new_v = self.v.at[..., slots, :].set(v, mode="drop")
        return KVCache(
            k=new_k, v=new_v, length=self.length + n, devices=self.devices, block=self.block
        )


def _overflow_message(n: int, length: int | None, max_len: int) -> str:
    held = "" if length is None else f" after the {length} cached"
    return (
        f"KVCache.append: writing {n} token(s){held} would overflow the cache of max_len={max_len}"
    )


# What the host knows of the lengths of concrete caches, keyed by the identity of their
# `length` array: a cache made by `create`, or returned by `prefill` / `decode_step`, has a
# known length without a device-to-host copy (which would wait for the step to finish and
# stall the asynchronous decode loop by about a millisecond per token).
_KNOWN: dict[int, tuple[weakref.ref, int]] = {}


def _remember(length: Array, value: int) -> None:
    if isinstance(length, Tracer):
        return
    key = id(length)
    _KNOWN[key] = (weakref.ref(length, lambda _: _KNOWN.pop(key, None)), value)


def reserve(cache: KVCache, n: int) -> int | None:
    """Check on the host that `n` more tokens fit into `cache`; the length they will bring
    it to, or `None` for a traced cache (checked in the program instead)."""
    if n > cache.max_len:
        raise ValueError(_overflow_message(n, None, cache.max_len))
    length = cache.length
    if isinstance(length, Tracer):
        return None
    known = _KNOWN.get(id(length))
    if known is not None and known[0]() is length:
        held = known[1]
    else:
        # Replicated: any one copy will do (in a multi-process run not every copy is local).
        addressable = getattr(length, "is_fully_addressable", True)
        local = length if addressable else length.addressable_data(0)
        held = int(np.max(np.asarray(local))) if length.size else 0
    if held + n > cache.max_len:
        raise ValueError(_overflow_message(n, held, cache.max_len))
    return held + n


def remember(cache: KVCache, length: int | None) -> None:
    """Record the length `reserve` promised for the cache a call returned."""
    if length is not None:
        _remember(cache.length, length)


def _write(buffer: Array, new: Array, start: Array) -> Array:
    """`buffer[..., start:start + n, :] = new` for `buffer[..., heads, slots, d]`."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, new, start, axis=buffer.ndim - 2)
