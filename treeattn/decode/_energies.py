"""Decoding with an energy other than softmax: the energy's general path.

The fused kernels compute softmax partials only. Any other energy is served by
[`energy_partial`][treeattn.energy.energy_partial] one batch row at a time under `vmap`:
which keys a row sees comes from the one visibility builder (lengths, causality, windows,
masks, key positions), the energy reads absolute positions, and across devices its monoid
merges the shards (tree) or the shards travel around the ring.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .._numerics import Dims, visibility
from .._sharding import SequenceSharding
from ..energy import Energy, Softmax, energy_partial, is_plain_softmax
from ._registry import BackendUnavailable, check_backend


SOFTMAX = Softmax()
"""The default energy of the decode functions: softmax, through the fused kernels."""
GENERAL_BACKENDS = ("auto", "reference")
"""The backend names that serve a general energy (its own path; no kernel is fused for it)."""


def check_energy(fn: str, energy) -> Energy:
    """`energy` as an `Energy` (None: `Softmax()`, as before `energy=` had a default)."""
    if energy is None:
        return Softmax()
    if not isinstance(energy, Energy):
        raise ValueError(
            f"{fn}: energy must be a treeattn.energy.Energy (e.g. Softmax()), got "
            f"{type(energy).__name__}"
        )
    return energy


def name_of(energy: Energy) -> str:
    return f"energy={type(energy).__name__}(...)"


def check_sharded_call(
    fn: str, energy: Energy, backend, mesh, kv_axis, *, bias, kv_positions, shard_lengths
) -> bool:
    """For `tree_decode` and `ring_decode`: whether `energy` (already checked) takes its general
    path, and if so what that path cannot take, refused with the reason."""
    if is_plain_softmax(energy):
        return False
    devices = SequenceSharding.create(fn, mesh, kv_axis).devices
    kw = {"bias": bias, "kv_positions": kv_positions, "shard_lengths": shard_lengths}
    check_general_call(fn, energy, backend, devices=devices, **kw)
    return True


def check_general_call(
    fn: str,
    energy: Energy,
    backend: str | Sequence[str],
    *,
    bias=None,
    kv_positions=None,
    shard_lengths=None,
    devices: int = 1,
) -> None:
    """What the general path of `energy` cannot take, refused with the reason."""
    names = check_backend(fn, backend)
    if not any(name in GENERAL_BACKENDS for name in names):
        raise BackendUnavailable(
            f"{fn}: backend={backend!r} cannot serve {name_of(energy)}: the fused kernels "
            f"compute softmax only; pass backend='auto' or 'reference' (the energy's own path)"
        )
    if bias is not None:
        raise ValueError(
            f"{fn}: bias cannot be combined with {name_of(energy)}: an energy's logits are its "
            "own (energy.logits); write the bias into a subclass's logits, or pass a mask"
        )
    ordered = not energy.monoid.commutative
    if ordered and kv_positions is not None and devices > 1:
        raise ValueError(
            f"{fn}: {name_of(energy)} has an ordered monoid ({energy.monoid.name}), folded "
            f"across the {devices} devices shard by shard, which needs every shard to hold one "
            "contiguous range of positions; kv_positions (e.g. a round-robin cache, whose "
            "shards interleave) does not give that: store the cache in position order and pass "
            "kv_length, or use flash_attention (one device folds by position)"
        )
    if shard_lengths is not None and (ordered or _reads_positions(energy)):
        raise ValueError(
            f"{fn}: {name_of(energy)} reads the keys' positions "
            f"({'their order' if ordered else 'ALiBi'}), which shard_lengths does not give; "
            "pass kv_positions and kv_length instead"
        )


def _reads_positions(energy: Energy) -> bool:
    return isinstance(energy, Softmax) and energy.alibi_slopes is not None


def _position_order(ordered: bool, k, v, pos, mask):
    """An ordered monoid folds keys in the order given: sort the slots by position."""
    if not ordered:
        return k, v, pos, mask
    order = jnp.argsort(pos, stable=True)
    k, v, pos = jnp.take(k, order, axis=0), jnp.take(v, order, axis=0), jnp.take(pos, order)
    if mask is not None:
        mask = jnp.take(mask, order, axis=-1)
    return k, v, pos, mask


def _row_dims(dims: Dims) -> Dims:
    return dataclasses.replace(dims, batch=1, layout="bshd")


def _bshd(dims: Dims, k, v):
    if dims.layout == "bhsd":
        return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    return k, v


@functools.partial(jax.jit, static_argnames=("dims", "causal", "window", "scale"))
def energy_flash(
    energy, q, k, v, offsets, lengths, positions, mask, *, dims, causal, window, scale
):
    """`(out, F)` of `flash_attention(energy=...)` on checked arguments (those of
    `run_kernel`): every batch row with `energy_partial`, under `vmap`."""
    k, v = _bshd(dims, k, v)
    row_dims = _row_dims(dims)
    ordered = not energy.monoid.commutative

    def row(q, k, v, offset, length, pos, m):
        if pos is None:
            pos = jnp.arange(dims.kv_seq, dtype=jnp.int32)
        else:
            k, v, pos, m = _position_order(ordered, k, v, pos, m)
        vis = visibility(
            row_dims,
            causal=causal,
            q_offset=offset,
            kv_positions=pos,
            kv_length=length,
            mask=m,
            window=window,
        )
        kw = {"kv_total": dims.kv_seq, "visible": vis, "scale": scale}
        return energy_partial(q, k, v, energy=energy, kv_positions=pos, q_offset=offset, **kw)

    with jax.named_scope("flash_attention_energy"):
        out, f = jax.vmap(row)(q, k, v, offsets, lengths, positions, mask)
    return out, f


@functools.partial(jax.jit, static_argnames=("plan", "scale", "reduction", "schedule", "kv_total"))
def energy_sharded(
    plan,
    energy,
    q,
    k,
    v,
    offsets,
    lengths,
    positions,
    mask,
    *,
    scale,
    reduction,
    schedule,
    kv_total,
):
    """`tree_decode` / `ring_decode` of `energy` on a planned call (see `_plan.plan_decode`):
    each device's shard of every row with `energy_partial`, under `vmap`, merged by the
    monoid's `reduction` (`schedule="tree"`) or by passing the shards around (`"ring"`)."""
    dims = plan.dims  # of one shard
    n = dims.kv_seq
    row_dims = _row_dims(dims)
    ordered = not energy.monoid.commutative

    def local(q, k, v, offsets, lengths, positions, mask, bias):
        del bias
        k, v = _bshd(dims, k, v)
        me = plan.local_shard()
        start = me * n

        def row(q, k, v, offset, length, pos, m):
            if plan.per_shard:  # this shard's filled slots; every query sees each of them
                pos = start + jnp.arange(n, dtype=jnp.int32)
                vis = visibility(row_dims, kv_length=length[me], mask=m)
            else:
                if pos is None:
                    pos = start + jnp.arange(n, dtype=jnp.int32)
                elif plan.devices == 1:
                    k, v, pos, m = _position_order(ordered, k, v, pos, m)
                vis = visibility(
                    row_dims,
                    causal=plan.causal,
                    q_offset=offset,
                    kv_positions=pos,
                    kv_length=length,
                    mask=m,
                    window=plan.window,
                )
            kw = {"kv_total": kv_total, "visible": vis, "scale": scale, "rank": start}
            kw |= {"axis_name": plan.axis_name, "reduction": reduction, "schedule": schedule}
            return energy_partial(q, k, v, energy=energy, kv_positions=pos, q_offset=offset, **kw)

        out, _ = jax.vmap(row)(q, k, v, offsets, lengths, positions, mask)
        return out.astype(q.dtype)

    with jax.named_scope(f"{schedule}_decode_energy"):
        return plan.shard_map(local)(q, k, v, offsets, lengths, positions, mask, None)
