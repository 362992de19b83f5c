"""The plan of one sequence-sharded decode call, shared by tree decoding and the ring: the
checked arguments, the cache padded to the device count, per-row offsets and lengths, and the
kernel resolved for one shard."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from .._numerics import (
    MASKING_ARGUMENTS,
    Dims,
    Layout,
    Masking,
    Window,
    check_masking,
    default_scale,
)
from .._partials import AxisName, Reduction, check_reduction
from .._sharding import SequenceSharding
from ..energy import Energy, is_plain_softmax
from ._checks import check_call, check_shard_lengths, per_row, positions_per_row
from ._energies import check_energy, energy_sharded, name_of
from ._flash import run_kernel
from ._registry import Backend, BackendUnavailable, Choice, kernel_call, resolve
from ._xla import Static


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A decode call laid out over the devices of a sequence sharding (hashable)."""

    sharding: SequenceSharding
    dims: Dims  # of one shard
    causal: bool
    kernel: Choice  # resolved for one shard, per lowering platform
    positional: bool  # the keys carry explicit positions (kv_positions), sharded with K/V
    window: Window | None = None  # a sliding window by absolute position
    has_mask: bool = False  # a mask [batch, #heads, #q_seq, kv_seq], sharded with K/V
    has_bias: bool = False  # a bias, the same
    per_shard: bool = False  # lengths are [batch, devices]: each shard's filled slots
    general: bool = False  # another energy than softmax: its monoid merges the shards
    kv_finite: bool = False  # every key and value is known to be finite

    @property
    def axis_name(self) -> AxisName:
        return self.sharding.axis_name

    @property
    def devices(self) -> int:
        return self.sharding.devices

    def shard_map(self, local, masking: Masking | None = None):
        """`shard_map` over the cache: q, offsets, lengths replicated; K, V (and the key
        positions, mask and bias) sharded along the sequence; with `masking` (a ninth
        argument), its key segment ids `[batch, kv_seq]` sharded too, the rest replicated."""
        kv = self.sharding.spec(4, 1 + self.dims.seq_axis)
        pos = self.sharding.spec(2, 1) if self.positional else None
        mask = self.sharding.spec(4, 3) if self.has_mask else None
        bias = self.sharding.spec(4, 3) if self.has_bias else None
        specs: tuple = (P(), kv, kv, P(), P(), pos, mask, bias)
        if masking is not None:
            segments = None if masking.kv_segments is None else self.sharding.spec(2, 1)
            specs += (jax.tree.map(lambda _: P(), masking.keys(None)).keys(segments),)
        return self.sharding.shard_map(local, specs, P())

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

    def attend(self, shard, q, k, v, q_offset, kv_length, positions, mask, bias, *, scale: float):
        """`(out float32, lse)` of the keys of shard `shard` (held by this device, with its
        slice of the mask and bias), on the plan's kernel: the local step of tree decoding and
        of every ring hop. Positions stay absolute (the window and causality hold across
        shards): the query offset is moved by the shard's first position."""
        q_off, kv_len = self.local_view(q_offset, kv_length, shard)
        static = Static(self.dims, self.causal, self.window, scale, kv_finite=self.kv_finite)
        args = (q, k, v, q_off, kv_len, positions, mask, bias)
        out, lse = run_kernel(self.kernel, *args, static=static)
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
    local_window_size=None,
    mask=None,
    bias=None,
    shard_lengths=None,
    energy: Energy,
    kv_finite: bool = False,
    has_masking: bool = False,
):
    """Check the arguments, pad the cache (and the mask and bias) to a multiple of the device
    count if it must, and plan the call. Returns `(plan, q, k, v, q_offset[batch],
    kv_length[batch], positions, mask, bias)`; with `shard_lengths`, the lengths are
    `[batch, devices]` and the call is planned without causality (every query sees every
    filled key). Another energy than softmax is planned on the `"energy"` kernel, whose
    monoid states merge across the devices; what that cannot take is refused here."""
    given = dict(locals())
    del given["has_masking"]
    dims, window, mask, bias = check_call(**given)
    sharding = SequenceSharding.create(fn, mesh, kv_axis)
    if reduction is not None:
        check_reduction(fn, reduction, sharding.axis_name)
    _check_energy_schedule(fn, energy, sharding.devices, kv_positions, shard_lengths)
    extra = {"energy": energy, "kv_finite": bool(kv_finite), "has_masking": has_masking}
    if shard_lengths is not None:
        if has_masking:
            raise ValueError(
                f"{fn}: segment ids, prefix_length, chunk_size and mask_mod need the keys' "
                "positions and shard_lengths gives none; pass kv_positions and kv_length"
            )
        if window is not None:
            raise ValueError(
                f"{fn}: local_window_size needs the keys' positions and shard_lengths gives "
                "none; pass kv_positions and kv_length for a windowed call"
            )
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
        return _plan_per_shard(fn, sharding, dims, q, k, v, fills, backend, mask, bias, extra)
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
        if mask is not None:  # padding slots are hidden (they also sit past any length)
            mask = sharding.pad(mask, 3, value=False)
        if bias is not None:
            bias = sharding.pad(bias, 3)
    local = dataclasses.replace(dims, kv_seq=(dims.kv_seq + pad) // sharding.devices)
    positional = positions is not None
    plan = _plan(fn, sharding, local, q, backend, causal, positional, window, mask, bias, **extra)
    return plan, q, k, v, offsets, lengths, positions, mask, bias


def _plan_per_shard(fn, sharding, dims, q, k, v, fills, backend, mask, bias, extra):
    """The plan of a call with per-shard fill lengths: each shard's kernel masks its slots by
    a length alone, which every fused kernel takes (no positions, no causal mask, no copy)."""
    lengths = jnp.maximum(fills, 0)  # a traced negative length sees no key
    local = dataclasses.replace(dims, kv_seq=dims.kv_seq // sharding.devices)
    plan = _plan(
        fn, sharding, local, q, backend, False, False, None, mask, bias, per_shard=True, **extra
    )
    return plan, q, k, v, per_row(0, dims.batch, 0), lengths, None, mask, bias


def _plan(
    fn,
    sharding,
    local,
    q,
    backend,
    causal,
    positional,
    window,
    mask,
    bias,
    *,
    per_shard=False,
    energy: Energy,
    kv_finite: bool = False,
    has_masking: bool = False,
) -> DecodePlan:
    """The plan of one shard's call (`local` its sizes), its kernel resolved per platform."""
    call = kernel_call(
        local,
        jnp.result_type(q),
        causal=causal,
        has_length=True,
        q_offset=None,
        has_positions=positional,
        window=window,
        has_mask=mask is not None,
        has_bias=bias is not None,
        energy=energy,
        has_masking=has_masking,
    )
    choice = resolve(fn, backend, call)
    general = not is_plain_softmax(energy) or has_masking
    if general and {name for _, name in choice.kernels} != {"energy"}:
        what = f"energy={name_of(energy)}" if has_masking is False else "masking rules"
        raise BackendUnavailable(
            f"{fn}: backend={backend!r} cannot serve {what} across devices: they run on the "
            "'energy' kernel, whose monoid states merge (pass backend='auto' or 'energy')"
        )
    return DecodePlan(
        sharding,
        local,
        causal,
        choice,
        positional,
        window=window,
        has_mask=mask is not None,
        has_bias=bias is not None,
        per_shard=per_shard,
        general=general,
        kv_finite=kv_finite,
    )


def _check_energy_schedule(fn, energy: Energy, devices: int, kv_positions, shard_lengths) -> None:
    """What the schedule of a sharded energy cannot take, refused with the reason."""
    ordered = not energy.monoid.commutative
    if ordered and kv_positions is not None and devices > 1:
        raise ValueError(
            f"{fn}: energy={name_of(energy)} has an ordered monoid ({energy.monoid.name}), "
            f"folded across the {devices} devices shard by shard, which needs every shard to "
            "hold one contiguous range of positions; kv_positions (e.g. a round-robin cache, "
            "whose shards interleave) does not give that: store the cache in position order and "
            "pass kv_length, or use flash_attention (one device folds by position)"
        )
    if shard_lengths is not None and (ordered or energy.reads_positions):
        what = "their order (an ordered monoid)" if ordered else "their positions in its logits"
        raise ValueError(
            f"{fn}: energy={name_of(energy)} reads the keys' {what}, which shard_lengths (fill "
            "counts) does not give; pass kv_positions and kv_length instead"
        )


def run_sharded(fn: str, schedule: str, softmax, q, k, v, *, energy, reduction, **options):
    """`tree_decode` / `ring_decode` (`schedule`) of their arguments: the call planned, then
    softmax by `softmax(plan, q, k, v, offsets, lengths, positions, mask, bias, *, scale,
    reduction)` (the schedule's local steps and merges), any other energy (or a call with
    masking rules) by its monoid's schedule (`energy_sharded`)."""
    energy = check_energy(fn, energy)
    k_seq_axis = 1 if options.get("kv_layout", "bshd") == "bshd" else 2
    kv_total = k.shape[k_seq_axis]
    rules = {name: options.pop(name) for name in MASKING_ARGUMENTS}
    batch = q.shape[0] if q.ndim == 4 else 1
    masking = check_masking(fn, q_seq=q.shape[-3], kv_seq=kv_total, batch=batch, **rules)
    plan, q, k, v, offsets, lengths, positions, mask, bias = plan_decode(
        fn, q, k, v, energy=energy, reduction=reduction, has_masking=masking is not None, **options
    )
    s = default_scale(plan.dims.qk, options.get("scale"))
    if plan.general:
        padded = k.shape[k_seq_axis]
        if masking is not None and masking.kv_segments is not None and padded > kv_total:
            # Padding slots sit past every length: any segment id will do.
            masking = masking.keys(plan.sharding.pad(masking.kv_segments, 1))
        kw = {"scale": s, "reduction": reduction or "allreduce", "kv_total": kv_total}
        args = (plan, energy, q, k, v, offsets, lengths, positions, mask)
        return energy_sharded(*args, masking, schedule=schedule, **kw)
    args = (plan, q, k, v, offsets, lengths, positions, mask, bias)
    return softmax(*args, scale=s, reduction=reduction)
