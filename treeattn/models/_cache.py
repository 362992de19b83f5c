"""The KV cache: a fixed-size pytree, head-major, optionally sharded round-robin over devices."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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
        raises an error (at run time under `jit`), never wraps around."""
        n = k.shape[0]
        length = eqx.error_if(
            self.length,
            self.length + n > self.max_len,
            f"KVCache.append: writing {n} token(s) would overflow the cache of "
            f"max_len={self.max_len}",
        )
        k = jnp.swapaxes(k, 0, 1).astype(self.k.dtype)  # head-major, as stored
        v = jnp.swapaxes(v, 0, 1).astype(self.v.dtype)
        if self.devices == 1 or n == 1:
            # The new tokens take consecutive slots: a slice update. (Under generate's vmap
            # JAX lowers this to a scatter as well, one with in-bounds, non-overlapping
            # indices.)
            start = self.slots(length)
            new_k = _write(self.k, k, start)
            new_v = _write(self.v, v, start)
        else:
            slots = self.slots(length + jnp.arange(n, dtype=jnp.int32))
            new_k = self.k.at[..., slots, :].set(k)
            new_v = self.v.at[..., slots, :].set(v)
        return KVCache(k=new_k, v=new_v, length=length + n, devices=self.devices, block=self.block)


def _write(buffer: Array, new: Array, start: Array) -> Array:
    """`buffer[..., start:start + n, :] = new` for `buffer[..., heads, slots, d]`."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, new, start, axis=buffer.ndim - 2)
