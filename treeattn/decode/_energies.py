"""The kernels of any energy: `"energy"` (its free energy and the gradient, the general path)
and the energy half of `"reference"` (its definition folded key by key), and the schedules of
a general energy across devices.

The fused kernels compute softmax only. Any other energy is served one batch row at a time
under `vmap` by [`energy_partial`][treeattn.energy.energy_partial] (or its twin): which keys a
row sees comes from the one visibility builder (lengths, causality, windows, masks, key
positions), the energy reads absolute positions, a head-major cache is read where it lies, and
across devices its monoid merges the shards (tree) or the shards travel around the ring.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .._numerics import Dims, Masking, visibility
from ..energy import (
    Energy,
    Softmax,
    energy_attention,
    energy_partial,
    energy_partial_reference,
)
from ._xla import Static


SOFTMAX = Softmax()
"""The default energy of the decode functions: softmax, through the fused kernels."""
IN_PLACE_LOGITS = 1 << 24
"""Logits (heads x queries x keys of a row) up to which the `"energy"` kernel materialises a
row's logits against K and V where they lie (every decode step, a prefill chunk); a longer
call without key positions (training, a long prompt) is evaluated blockwise, in O(N d)
memory, through `treeattn.energy.energy_attention`."""


def check_energy(fn: str, energy) -> Energy:
    """`energy` as an `Energy` (None: `Softmax()`)."""
    if energy is None:
        return SOFTMAX
    if not isinstance(energy, Energy):
        raise ValueError(
            f"{fn}: energy must be a treeattn.energy.Energy (e.g. Softmax()), got "
            f"{type(energy).__name__}"
        )
    return energy


def name_of(energy: Energy) -> str:
    return f"{type(energy).__name__}(...)"


def _row_dims(dims: Dims) -> Dims:
    return dataclasses.replace(dims, batch=1, layout="bshd")


def _position_order(dims: Dims, k, v, pos, mask, kv_segments=None):
    """The slots of one row sorted by position (an ordered monoid folds keys in the order
    given): a gather of K and V (and of the keys' mask and segment ids), on one device."""
    order = jnp.argsort(pos, stable=True)
    axis = 0 if dims.layout == "bshd" else 1
    k, v, pos = jnp.take(k, order, axis=axis), jnp.take(v, order, axis=axis), jnp.take(pos, order)
    if mask is not None:
        mask = jnp.take(mask, order, axis=-1)
    if kv_segments is not None:
        kv_segments = jnp.take(kv_segments, order)
    return k, v, pos, mask, kv_segments


def _row_rules(masking: Masking | None, batch: int):
    """The per-row arrays of `masking` (segment ids, prefix, the row's index for a mask
    function), each with a leading batch axis or None, and how to rebuild one row's rules."""
    if masking is None:
        return (None, None, None, None), lambda *_: None
    arrays = (
        masking.q_segments,
        masking.kv_segments,
        masking.prefix,
        jnp.arange(batch, dtype=jnp.int32),
    )

    def rebuild(q_segments, kv_segments, prefix, index):
        return index, dataclasses.replace(
            masking, q_segments=q_segments, kv_segments=kv_segments, prefix=prefix
        )

    return arrays, rebuild


def _rows(
    partial, q, k, v, q_offset, kv_length, kv_pos, mask, energy, static: Static, masking=None
):
    """`partial` (`energy_partial` or its twin) on every batch row under `vmap`, with each
    row's visibility and key positions."""
    dims = static.dims
    ordered = not energy.monoid.commutative
    positioned = kv_pos is not None
    per_row, rebuild = _row_rules(masking, dims.batch)

    def row(q, k, v, offset, length, pos, m, q_seg, kv_seg, prefix, index):
        if pos is None:
            pos = jnp.arange(dims.kv_seq, dtype=jnp.int32)
        elif ordered:
            k, v, pos, m, kv_seg = _position_order(dims, k, v, pos, m, kv_seg)
        rules = rebuild(q_seg, kv_seg, prefix, index)
        vis = visibility(
            _row_dims(dims),
            causal=static.causal,
            q_offset=offset,
            kv_positions=pos,
            kv_length=length if static.has_length or positioned else None,
            mask=m,
            window=static.window,
            masking=None if rules is None else rules[1],
            batch=0 if rules is None else rules[0],
        )
        kw = {"kv_total": dims.kv_seq, "visible": vis, "scale": static.scale}
        return partial(
            q, k, v, energy=energy, kv_positions=pos, q_offset=offset, kv_layout=dims.layout, **kw
        )

    return _each_row(row, q, k, v, q_offset, kv_length, kv_pos, mask, *per_row)


def _each_row(row, *args):
    """`row` over the batch axis of every argument (None stays None): one call for one row,
    which reads a cache buffer given with a unit batch axis where it lies (`vmap` would make
    every product a batched one with two batch axes, for which XLA:CPU copies K), else
    `vmap`."""
    if args[0].shape[0] == 1:
        one = row(*(None if x is None else x[0] for x in args))
        return jax.tree.map(lambda x: x[None], one)
    return jax.vmap(row)(*args)


def _mask_of(static: Static, length, m):
    """One row's mask `[q_seq, kv]` or `[heads, q_seq, kv]` for `energy_attention`: the
    user's mask and the filled length (causality and the window go as they are)."""
    dims = static.dims
    filled = None
    if static.has_length:
        filled = (jnp.arange(dims.kv_seq, dtype=jnp.int32) < length)[None, None, :]
    if m is None:
        if filled is None:
            return None
        return jnp.broadcast_to(filled[0], (dims.q_seq, dims.kv_seq))
    both = m if filled is None else m & filled
    if m.shape[0] == 1:
        return jnp.broadcast_to(both[0], (dims.q_seq, dims.kv_seq))
    return jnp.broadcast_to(both, (dims.heads, dims.q_seq, dims.kv_seq))


def energy_forward(
    q, k, v, q_offset, kv_length, kv_pos, mask, energy: Energy, masking=None, *, static: Static
):
    """`(out, F)` of the `"energy"` kernel: $\\partial F/\\partial\\zeta$ at 0 and $F(0)$ of
    every row. Rows of up to `IN_PLACE_LOGITS` logits (or with key positions) read K and V
    where they lie (`energy_partial`, head-major in place); longer ones go blockwise, where
    tiles that no query sees are skipped."""
    dims = static.dims
    kw = {"kv_finite": static.kv_finite}
    args = (q, k, v, q_offset, kv_length, kv_pos, mask, energy, static, masking)
    if dims.heads * dims.q_seq * dims.kv_seq <= IN_PLACE_LOGITS or kv_pos is not None:
        with jax.named_scope("energy_kernel"):
            return _rows(functools.partial(energy_partial, **kw), *args)
    if dims.layout == "bhsd":  # a long call: blockwise over `[kv, kv_heads, d]` keys
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    per_row, rebuild = _row_rules(masking, dims.batch)

    def row(q, k, v, offset, length, m, q_seg, kv_seg, prefix, index):
        rules = rebuild(q_seg, kv_seg, prefix, index)
        extra = {}
        if rules is not None:
            index, rules = rules
            extra = rules.arguments()
            if rules.mask_mod is not None:  # the row's own index for `b`
                extra["mask_mod"] = jax.tree_util.Partial(_at_row, rules.mask_mod, index)
        return energy_attention(
            q,
            k,
            v,
            causal=static.causal,
            mask=_mask_of(static, length, m),
            scale=static.scale,
            q_offset=offset,
            local_window_size=static.window,
            energy=energy,
            block_size=static.block,
            return_free_energy=True,
            **extra,
        )

    with jax.named_scope("energy_kernel_blockwise"):
        return _each_row(row, q, k, v, q_offset, kv_length, mask, *per_row)


def _at_row(mask_mod, index, b, h, q_idx, kv_idx):
    """`mask_mod` of batch row `index` (a row is evaluated on its own, as row 0)."""
    del b
    return mask_mod(index, h, q_idx, kv_idx)


def energy_reference_forward(
    q, k, v, q_offset, kv_length, kv_pos, mask, energy: Energy, masking=None, *, static: Static
):
    """`(out, F)` of the `"reference"` kernel for another energy than softmax (or a call with
    masking rules): its definition folded key by key (`energy_partial_reference`), every
    batch row under `vmap`."""
    with jax.named_scope("energy_reference"):
        args = (q, k, v, q_offset, kv_length, kv_pos, mask, energy, static, masking)
        return _rows(energy_partial_reference, *args)


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
    masking=None,
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

    def local(q, k, v, offsets, lengths, positions, mask, bias, masking=None):
        del bias
        me = plan.local_shard()
        start = me * n
        per_row, rebuild = _row_rules(masking, dims.batch)

        def row(q, k, v, offset, length, pos, m, q_seg, kv_seg, prefix, index):
            rules = rebuild(q_seg, kv_seg, prefix, index)
            by_rules = {} if rules is None else {"batch": rules[0], "masking": rules[1]}
            if plan.per_shard:  # this shard's filled slots; every query sees each of them
                pos = start + jnp.arange(n, dtype=jnp.int32)
                vis = visibility(row_dims, kv_length=length[me], mask=m)
            else:
                if pos is None:
                    pos = start + jnp.arange(n, dtype=jnp.int32)
                elif plan.devices == 1 and ordered:
                    k, v, pos, m, kv_seg = _position_order(dims, k, v, pos, m, kv_seg)
                    if rules is not None:
                        by_rules["masking"] = rules[1].keys(kv_seg)
                vis = visibility(
                    row_dims,
                    causal=plan.causal,
                    q_offset=offset,
                    kv_positions=pos,
                    kv_length=length,
                    mask=m,
                    window=plan.window,
                    **by_rules,
                )
            kw = {"kv_total": kv_total, "visible": vis, "scale": scale, "rank": start}
            kw |= {"axis_name": plan.axis_name, "reduction": reduction, "schedule": schedule}
            kw |= {"kv_layout": dims.layout, "kv_finite": plan.kv_finite}
            return energy_partial(q, k, v, energy=energy, kv_positions=pos, q_offset=offset, **kw)

        out, _ = jax.vmap(row)(q, k, v, offsets, lengths, positions, mask, *per_row)
        return out.astype(q.dtype)

    with jax.named_scope(f"{schedule}_decode_energy"):
        args = (q, k, v, offsets, lengths, positions, mask, None)
        if masking is None:
            return plan.shard_map(local)(*args)
        return plan.shard_map(local, masking)(*args, masking)
