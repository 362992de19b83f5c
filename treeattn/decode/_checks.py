"""Validation of the batched decode layout; everything here runs at trace time."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .._numerics import (
    LAYOUTS,
    Dims,
    check_choice,
    check_position,
    check_scale,
    check_window,
    shape_of,
)


def check_decode(
    fn: str,
    q,
    k,
    v,
    *,
    kv_layout: str,
    kv_length: Any = None,
    q_offset: Any = 0,
    kv_positions: Any = None,
    scale: Any = None,
) -> Dims:
    """Validate `q[batch, q_seq, heads, qk]` and K/V in `kv_layout`, the per-row positions and
    lengths, and `scale`. Returns the sizes; `ValueError`s name the argument and the shapes."""
    check_choice(fn, "kv_layout", kv_layout, LAYOUTS)
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    names = "[batch, seq, kv_heads, dim]" if kv_layout == "bshd" else "[batch, kv_heads, seq, dim]"
    if len(qs) != 4:
        raise ValueError(f"{fn}: q must have shape [batch, q_seq, heads, dim], got shape {qs}")
    for name, shape in (("k", ks), ("v", vs)):
        if len(shape) != 4:
            raise ValueError(
                f"{fn}: {name} must have shape {names} (kv_layout={kv_layout!r}), got {shape}"
            )
    if kv_layout == "bshd":
        _, kv_seq, kv_heads, qk = ks
        v_seq, v_heads = vs[1], vs[2]
    else:
        _, kv_heads, kv_seq, qk = ks
        v_heads, v_seq = vs[1], vs[2]
    batch, q_seq, heads, q_dim = qs
    if ks[0] != batch or vs[0] != batch:
        raise ValueError(f"{fn}: batch sizes differ: q {qs}, k {ks}, v {vs}")
    if q_dim != qk:
        raise ValueError(f"{fn}: q {qs} and k {ks} disagree on the head dim ({q_dim} != {qk})")
    if (v_seq, v_heads) != (kv_seq, kv_heads):
        raise ValueError(f"{fn}: k {ks} and v {vs} must agree on seq and kv_heads ({kv_layout})")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{fn}: num_heads={heads} (q {qs}) must be a multiple of num_kv_heads={kv_heads} "
            f"(k {ks})"
        )
    dtypes = {jnp.result_type(x) for x in (q, k, v)}
    if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
        raise ValueError(
            f"{fn}: q, k, v must share one floating dtype, got {jnp.result_type(q)}, "
            f"{jnp.result_type(k)}, {jnp.result_type(v)}"
        )
    if kv_length is not None:
        check_position(fn, "kv_length", kv_length, batch=batch)
    if q_offset is not None:
        check_position(fn, "q_offset", q_offset, batch=batch)
    if kv_positions is not None:
        if not jnp.issubdtype(jnp.result_type(kv_positions), jnp.integer) or shape_of(
            kv_positions
        ) not in ((kv_seq,), (batch, kv_seq)):
            raise ValueError(
                f"{fn}: kv_positions must be integer with shape [kv_seq] = ({kv_seq},) or "
                f"[batch, kv_seq] = {(batch, kv_seq)}, got {shape_of(kv_positions)}"
            )
    check_scale(fn, scale)
    return Dims(q_seq, kv_seq, heads, kv_heads, qk, vs[3], batch=batch, layout=kv_layout)  # type: ignore[arg-type]


def check_call(
    fn: str,
    q,
    k,
    v,
    *,
    kv_layout: str = "bshd",
    kv_length: Any = None,
    q_offset: Any = 0,
    kv_positions: Any = None,
    scale: Any = None,
    local_window_size: Any = None,
    mask: Any = None,
    bias: Any = None,
    **_,
) -> tuple[Dims, Any, Any, Any]:
    """`check_decode`, the window, the mask and the bias of a call (its other arguments are
    checked where they are used). Returns `(dims, window, mask, bias)`, the mask and bias as
    `check_logits_operand` gives them."""
    kw = dict(kv_length=kv_length, q_offset=q_offset, kv_positions=kv_positions, scale=scale)
    dims = check_decode(fn, q, k, v, kv_layout=kv_layout, **kw)
    window = check_window(fn, local_window_size)
    mask = check_logits_operand(fn, "mask", mask, dims)
    return dims, window, mask, check_logits_operand(fn, "bias", bias, dims)


def per_row(x, batch: int, default: int) -> Int[Array, " batch"]:
    """An int or `[batch]` integer argument as int32 `[batch]`."""
    x = default if x is None else x
    return jnp.broadcast_to(jnp.asarray(x).astype(jnp.int32), (batch,))


def positions_per_row(kv_positions, dims: Dims) -> Int[Array, "batch kv_seq"] | None:
    """`kv_positions` (`[kv_seq]` or `[batch, kv_seq]`) as int32 `[batch, kv_seq]`."""
    if kv_positions is None:
        return None
    return jnp.broadcast_to(jnp.asarray(kv_positions).astype(jnp.int32), (dims.batch, dims.kv_seq))


def check_logits_operand(fn: str, name: str, x, dims: Dims):
    """A boolean `mask` or an additive `bias`, broadcastable to
    `[batch, heads, q_seq, kv_seq]` (jax's convention), as
    `[batch, #heads, #q_seq, kv_seq]`: the heads and query axes stay of size 1 where they
    were (nothing is copied per head or query), the batch and key axes are filled out (the
    keys are sliced into blocks or shards, each batch row is one kernel call). None stays
    None."""
    if x is None:
        return None
    dtype = jnp.result_type(x)
    if name == "mask" and dtype != jnp.bool_:
        raise ValueError(f"{fn}: mask must be boolean (True = attend), got dtype {dtype}")
    if name == "bias" and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{fn}: bias must be a floating-point array, got dtype {dtype}")
    full = (dims.batch, dims.heads, dims.q_seq, dims.kv_seq)
    shape = shape_of(x)
    padded = (1,) * (4 - len(shape)) + shape
    if len(shape) > 4 or any(n not in (1, f) for n, f in zip(padded, full, strict=True)):
        raise ValueError(
            f"{fn}: {name} must broadcast to [batch, heads, q_seq, kv_seq] = {full}, got "
            f"shape {shape}"
        )
    target = (dims.batch, padded[1], padded[2], dims.kv_seq)
    return jnp.broadcast_to(jnp.reshape(x, padded), target)


def check_shard_lengths(
    fn: str,
    shard_lengths,
    dims: Dims,
    devices: int,
    *,
    causal: bool,
    kv_length: Any,
    q_offset: Any,
    kv_positions: Any,
) -> Int[Array, "batch devices"]:
    """`shard_lengths` (`[devices]` or `[batch, devices]`, integer: the filled slots at the
    front of each shard) checked against the call, as int32 `[batch, devices]`.

    A shard's keys then carry no position, so the call must be one where every query sees
    every filled key: not causal, or causal with one query per row (a decode step, the query
    at the last filled position). Lengths, offsets and positions describe the same thing
    another way and are refused with it; the cache must split evenly over the devices (its
    shards are what the lengths count)."""
    for name, value in (("kv_length", kv_length), ("q_offset", q_offset)):
        if value is not None:
            raise ValueError(
                f"{fn}: {name} cannot be combined with shard_lengths (which give each shard's "
                f"filled length; every query sees every filled key)"
            )
    if kv_positions is not None:
        raise ValueError(
            f"{fn}: kv_positions and shard_lengths are mutually exclusive: pass positions for "
            "calls where a shard's keys interleave with the queries (causal chunks), "
            "shard_lengths where every query sees every filled key"
        )
    if causal and dims.q_seq != 1:
        raise ValueError(
            f"{fn}: causal=True with shard_lengths needs one query per row (the last filled "
            f"position, which sees every filled key), got q_seq={dims.q_seq}; pass "
            "kv_positions (and kv_length) for a causal chunk of several queries"
        )
    if isinstance(shard_lengths, list | tuple):
        shard_lengths = np.asarray(shard_lengths)
    shape = shape_of(shard_lengths)
    if not jnp.issubdtype(jnp.result_type(shard_lengths), jnp.integer) or shape not in (
        (devices,),
        (dims.batch, devices),
    ):
        raise ValueError(
            f"{fn}: shard_lengths must be integer with shape [devices] = ({devices},) or "
            f"[batch, devices] = {(dims.batch, devices)}, got {jnp.result_type(shard_lengths)} "
            f"{shape}"
        )
    if dims.kv_seq % devices:
        raise ValueError(
            f"{fn}: with shard_lengths the cache must split evenly over the {devices} devices "
            f"(each length counts the slots of one shard), got kv_seq={dims.kv_seq}"
        )
    shard = dims.kv_seq // devices
    if isinstance(shard_lengths, np.ndarray | np.generic):
        bad = np.asarray(shard_lengths, dtype=np.int64)
        if np.any((bad < 0) | (bad > shard)):
            raise ValueError(
                f"{fn}: shard_lengths must be in [0, kv_seq / devices = {shard}], got "
                f"{bad.tolist()}"
            )
    lengths = jnp.asarray(shard_lengths).astype(jnp.int32)
    return jnp.broadcast_to(lengths, (dims.batch, devices))
