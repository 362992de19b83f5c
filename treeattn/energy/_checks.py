"""Shape and dtype validation, and the visibility mask shared by every energy function.

Everything here runs at trace time: a bad shape is a `ValueError` before XLA sees anything.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int


@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes of one multi-head attention problem (unbatched)."""

    q_seq: int
    kv_seq: int
    heads: int
    kv_heads: int
    qk: int
    dv: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, `heads` for MQA)."""
        return self.heads // self.kv_heads


def dims_of(q, k, v) -> Dims:
    """Sizes of already validated `q[q_seq, heads, qk]`, `k[kv_seq, kv_heads, qk]`, `v`."""
    (q_seq, heads, qk), (kv_seq, kv_heads, _), dv = q.shape, k.shape, v.shape[-1]
    return Dims(q_seq=q_seq, kv_seq=kv_seq, heads=heads, kv_heads=kv_heads, qk=qk, dv=dv)


def as_position(x) -> Int[Array, ""]:
    """A query/key position (int or integer scalar) as an int32 array, so that a new position
    does not recompile a jitted function."""
    return jnp.asarray(x).astype(jnp.int32)


def compute_dtype(dtype) -> jnp.dtype:
    """The dtype that softmax and log-sum-exp arithmetic runs in: at least float32."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float64) if dtype.itemsize > 4 else jnp.dtype(jnp.float32)


def default_scale(qk: int, scale: float | None) -> float:
    """`scale`, or `1/sqrt(qk)` when it is None."""
    if scale is None:
        return 1.0 / math.sqrt(qk) if qk > 0 else 1.0
    return scale


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _check_float(fn: str, **arrays) -> jnp.dtype:
    dtypes = {name: jnp.result_type(x) for name, x in arrays.items()}
    for name, dtype in dtypes.items():
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be a floating-point array, got dtype {dtype}")
    first = next(iter(dtypes.values()))
    if any(d != first for d in dtypes.values()):
        got = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise ValueError(f"{fn}: q, k and v must share one dtype, got {got}")
    return first


def check_multihead(
    fn: str,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    zeta: ArrayLike | None = None,
    zeta_name: str = "zeta",
    mask: ArrayLike | None = None,
) -> Dims:
    """Validate `q[q_seq, heads, qk]`, `k[kv_seq, kv_heads, qk]`, `v[kv_seq, kv_heads, dv]`.

    Also `zeta[q_seq, heads, dv]` and a boolean `mask` of shape `[q_seq, kv_seq]` or
    `[heads, q_seq, kv_seq]` when given. Returns the sizes; raises `ValueError` naming the shapes.
    """
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if len(qs) != 3:
        raise ValueError(f"{fn}: q must have shape [q_seq, heads, qk], got shape {qs}")
    if len(ks) != 3:
        raise ValueError(f"{fn}: k must have shape [kv_seq, kv_heads, qk], got shape {ks}")
    if len(vs) != 3:
        raise ValueError(f"{fn}: v must have shape [kv_seq, kv_heads, dv], got shape {vs}")
    q_seq, heads, qk = qs
    kv_seq, kv_heads, k_qk = ks
    if k_qk != qk:
        raise ValueError(f"{fn}: q {qs} and k {ks} disagree on the key size qk ({qk} != {k_qk})")
    if vs[:2] != ks[:2]:
        raise ValueError(
            f"{fn}: k {ks} and v {vs} must agree on [kv_seq, kv_heads], got {ks[:2]} and {vs[:2]}"
        )
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"{fn}: num_heads={heads} (q {qs}) must be a multiple of num_kv_heads={kv_heads} "
            f"(k {ks})"
        )
    _check_float(fn, q=q, k=k, v=v)
    dims = Dims(q_seq=q_seq, kv_seq=kv_seq, heads=heads, kv_heads=kv_heads, qk=qk, dv=vs[2])
    if zeta is not None:
        check_source(fn, zeta, dims, name=zeta_name)
    if mask is not None:
        check_mask(fn, mask, dims)
    return dims


def check_source(fn: str, zeta: ArrayLike, dims: Dims, *, name: str = "zeta") -> None:
    """`zeta` (or a target `z`) must be a float array of shape `[q_seq, heads, dv]`."""
    expected = (dims.q_seq, dims.heads, dims.dv)
    if _shape(zeta) != expected:
        raise ValueError(
            f"{fn}: {name} must have shape [q_seq, heads, dv] = {expected}, got {_shape(zeta)}"
        )
    dtype = jnp.result_type(zeta)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{fn}: {name} must be a floating-point array, got dtype {dtype}")


def check_mask(fn: str, mask: ArrayLike, dims: Dims) -> None:
    """A boolean mask of shape `[q_seq, kv_seq]` or `[heads, q_seq, kv_seq]`."""
    dtype = jnp.result_type(mask)
    if dtype != jnp.bool_:
        raise ValueError(f"{fn}: mask must be boolean (True = attend), got dtype {dtype}")
    ms = _shape(mask)
    allowed = ((dims.q_seq, dims.kv_seq), (dims.heads, dims.q_seq, dims.kv_seq))
    if ms not in allowed:
        raise ValueError(
            f"{fn}: mask must have shape [q_seq, kv_seq] = {allowed[0]} or "
            f"[heads, q_seq, kv_seq] = {allowed[1]}, got {ms}"
        )


def check_q_offset(fn: str, q_offset) -> None:
    """`q_offset` is a Python int or an integer scalar array (traced values are fine)."""
    if isinstance(q_offset, bool):
        raise ValueError(f"{fn}: q_offset must be an integer, got a bool")
    if isinstance(q_offset, int):
        return
    dtype = jnp.result_type(q_offset)
    if not jnp.issubdtype(dtype, jnp.integer) or _shape(q_offset) != ():
        raise ValueError(
            f"{fn}: q_offset must be an integer scalar, got dtype {dtype} and shape "
            f"{_shape(q_offset)}"
        )


def visibility(
    dims: Dims,
    *,
    causal: bool,
    mask: Bool[Array, ...] | None,
    q_offset: int | Int[Array, ""],
    kv_offset: int | Int[Array, ""] = 0,
) -> Bool[Array, "kv_heads group q_seq kv_seq"] | None:
    """Which keys each (head, query) may see, shaped for the grouped layout of the core.

    Causal masking is bottom-right aligned by absolute position: query `i` sits at position
    `q_offset + i`, key `a` at `kv_offset + a` (a shard of a longer sequence), and the query sees
    the key iff its position is not later (a query appended after a cache of `n` tokens passes
    `q_offset=n`). Returns None when every key is visible.
    """
    vis = None
    if causal:
        # int32 positions: a context of 2^31 tokens is far beyond any cache.
        q_pos = jnp.asarray(q_offset).astype(jnp.int32) + jnp.arange(dims.q_seq, dtype=jnp.int32)
        kv_pos = jnp.asarray(kv_offset).astype(jnp.int32) + jnp.arange(dims.kv_seq, dtype=jnp.int32)
        vis = kv_pos[None, :] <= q_pos[:, None]
        vis = vis[None, None]
    if mask is not None:
        m = jnp.asarray(mask)
        if m.ndim == 2:
            m = m[None, None]
        else:
            m = m.reshape(dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq)
        vis = m if vis is None else vis & m
    return vis


def nonempty(
    dims: Dims, visible: Bool[Array, "#kv_heads #group #q_seq kv_seq"] | None
) -> Bool[Array, "q_seq heads"]:
    """True for every (query, head) that sees at least one key."""
    if visible is None:
        return jnp.full((dims.q_seq, dims.heads), dims.kv_seq > 0)
    shape = (dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq)
    any_visible = jnp.any(jnp.broadcast_to(visible, shape), axis=-1)
    return any_visible.reshape(dims.heads, dims.q_seq).T
