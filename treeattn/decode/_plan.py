"""The plan of one sequence-sharded decode call, shared by tree decoding and the ring: the
checked arguments, the cache padded to the device count, per-row offsets and lengths, and the
kernel resolved for one shard."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from .._numerics import Dims, Layout
from .._partials import AxisName, Reduction, check_reduction
from .._sharding import SequenceSharding
from ._checks import check_decode, check_shard_lengths, per_row, positions_per_row
from ._flash import run_kernel
from ._registry import Backend, Choice, kernel_call, resolve


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A decode call laid out over the devices of a sequence sharding (hashable)."""

    sharding: SequenceSharding
    dims: Dims  # of one shard
    causal: bool
    kernel: Choice  # resolved for one shard, per lowering platform
    positional: bool  # the keys carry explicit positions (kv_positions), sharded with K/V
    per_shard: bool = False  # lengths are [batch, devices]: each shard's filled slots

    @property
    def axis_name(self) -> AxisName:
        return self.sharding.axis_name

    @property
    def devices(self) -> int:
        return self.sharding.devices

    def shard_map(self, local):
        """`shard_map` over the cache: q, offsets, lengths replicated; K, V (and the key
        positions) sharded along the sequence."""
        kv = self.sharding.spec(4, 1 + self.dims.seq_axis)
        pos = self.sharding.spec(2, 1) if self.positional else None
        return self.sharding.shard_map(local, (P(), kv, kv, P(), P(), pos), P())

    def local_view(self, q_offset: Array, kv_length: Array, shard: Array | int):
        """(q_offset, kv_length) of shard `shard` relative to its first key; unchanged when the
        keys carry their own positions; the shard's own fill with per-shard lengths (every
        query sees every filled key: the offset is unused). A shard past the filled part gets
        length 0."""
        if self.positional:
            return q_offset, kv_length
        if self.per_shard:
            return q_offset, jnp.clip(kv_length[:, shard], 0, self.dims.kv_seq)
        start = shard * self.dims.kv_seq
        return q_offset - start, jnp.clip(kv_length - start, 0, self.dims.kv_seq)

    def local_shard(self) -> Array:
        return lax.axis_index(self.axis_name)

    def attend(self, shard, q, k, v, q_offset, kv_length, positions, *, scale: float):
        """`(out float32, lse)` of the keys of shard `shard` (held by this device), on the
        plan's kernel: the local step of tree decoding and of every ring hop."""
        q_off, kv_len = self.local_view(q_offset, kv_length, shard)
        out, lse = run_kernel(
            self.kernel,
            q,
            k,
            v,
            q_off,
            kv_len,
            positions,
            dims=self.dims,
            causal=self.causal,
            scale=scale,
        )
        return out.astype(jnp.float32), lse


def plan_decode(
    fn: str,
    q,
    k,
    v,
    *,
    mesh,
    kv_axis,
    kv_length,
    q_offset,
    causal: bool,
    kv_layout: Layout,
    reduction: Reduction | None,
    backend: Backend | Sequence[Backend],
    kv_positions,
    scale,
    shard_lengths=None,
):
    """Check the arguments, pad the cache to a multiple of the device count if it must, and
    plan the call. Returns `(plan, q, k, v, q_offset[batch], kv_length[batch], positions)`;
    with `shard_lengths`, the lengths are `[batch, devices]` and the call is planned without
    causality (every query sees every filled key)."""
    dims = check_decode(
        fn,
        q,
        k,
        v,
        kv_layout=kv_layout,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_positions=kv_positions,
        scale=scale,
    )
    sharding = SequenceSharding.create(fn, mesh, kv_axis)
    if reduction is not None:
        check_reduction(fn, reduction, sharding.axis_name)
    if shard_lengths is not None:
        fills = check_shard_lengths(
            fn,
            shard_lengths,
            dims,
            sharding.devices,
            causal=causal,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_positions=kv_positions,
        )
        return _plan_per_shard(fn, sharding, dims, q, k, v, fills, backend)
    lengths = per_row(kv_length, dims.batch, dims.kv_seq)
    positions = positions_per_row(kv_positions, dims)
    if positions is None:
        lengths = jnp.minimum(lengths, dims.kv_seq)
    if q_offset is None:
        # By default the queries are the last filled positions (decode / chunked decode).
        offsets = lengths - dims.q_seq if causal else per_row(0, dims.batch, 0)
    else:
        offsets = per_row(q_offset, dims.batch, 0)
    # A traced negative length sees no key (clipped, as flash_attention does).
    lengths = jnp.maximum(lengths, 0)
    pad = sharding.padding(dims.kv_seq)
    if pad:
        # A cache whose length divides the device count avoids this copy.
        k, v = sharding.pad(k, 1 + dims.seq_axis), sharding.pad(v, 1 + dims.seq_axis)
        if positions is not None:  # padding slots sit beyond any length
            positions = sharding.pad(positions, 1, value=jnp.iinfo(jnp.int32).max)
    local = dataclasses.replace(dims, kv_seq=(dims.kv_seq + pad) // sharding.devices)
    call = kernel_call(
        local,
        jnp.result_type(q),
        causal=causal,
        has_length=True,
        q_offset=None,
        has_positions=positions is not None,
    )
    plan = DecodePlan(sharding, local, causal, resolve(fn, backend, call), positions is not None)
    return plan, q, k, v, offsets, lengths, positions


def _plan_per_shard(fn, sharding, dims, q, k, v, fills, backend):
    """The plan of a call with per-shard fill lengths: each shard's kernel masks its slots by
    a length alone, which every fused kernel takes (no positions, no causal mask, no copy)."""
    lengths = jnp.maximum(fills, 0)  # a traced negative length sees no key
    local = dataclasses.replace(dims, kv_seq=dims.kv_seq // sharding.devices)
    call = kernel_call(
        local, jnp.result_type(q), causal=False, has_length=True, q_offset=None, has_positions=False
    )
    plan = DecodePlan(sharding, local, False, resolve(fn, backend, call), False, per_shard=True)
    return plan, q, k, v, per_row(0, dims.batch, 0), lengths, None
