r"""Numerics shared by every layer: sizes, dtypes, positions, the query-rows layout, the safe
log-sum-exp, argument checks, and the one builder of which keys a query sees.

Everything here is the ground floor of treeattn: `energy`, `decode` and `models` import it, and
it imports none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, Literal, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Bool, Float, Int


Layout = Literal["bshd", "bhsd"]
"""How K and V are stored: `"bshd"` `[batch, seq, kv_heads, dim]` (jax's convention) or head-major
`"bhsd"` `[batch, kv_heads, seq, dim]` (the layout a decode step streams at memory speed)."""
LAYOUTS: tuple[Layout, ...] = get_args(Layout)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes of one attention problem; hashable, so it can be a static argument.

    The energy functions are unbatched (`batch=1`, K/V `[kv_seq, kv_heads, d]`); decoding adds
    the batch and the layout of the cache.
    """

    q_seq: int
    kv_seq: int
    heads: int
    kv_heads: int
    qk: int
    dv: int
    batch: int = 1
    layout: Layout = "bshd"

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, `heads` for MQA)."""
        return self.heads // self.kv_heads

    @property
    def rows(self) -> int:
        """Query rows per key/value head: `group * q_seq`."""
        return self.group * self.q_seq

    @property
    def seq_axis(self) -> int:
        """The sequence axis of K and V without the batch axis."""
        return 0 if self.layout == "bshd" else 1


def compute_dtype(dtype) -> jnp.dtype:
    """The dtype that softmax and log-sum-exp arithmetic runs in: at least float32."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float64) if dtype.itemsize > 4 else jnp.dtype(jnp.float32)


def default_scale(qk: int, scale: float | None) -> float:
    """`scale`, or $1/\\sqrt{qk}$ when it is None."""
    if scale is None:
        return 1.0 / math.sqrt(qk) if qk > 0 else 1.0
    return float(scale)


def as_position(x) -> Int[Array, "*batch"]:
    """A position (int or integer array) as int32, so a new value does not recompile."""
    return jnp.asarray(x).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Checks at the public boundary (trace time: a bad argument is an error before XLA sees it)
# ---------------------------------------------------------------------------------------------


def shape_of(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def check_choice(fn: str, name: str, value, choices: tuple) -> None:
    """`value` must be one of `choices` (a `Literal` vocabulary)."""
    if value not in choices:
        want = " or ".join(map(repr, choices)) if len(choices) <= 2 else f"one of {choices}"
        raise ValueError(f"{fn}: {name} must be {want}, got {value!r}")


def check_scale(fn: str, scale) -> None:
    """`scale` is static: None or a Python real number (an array would be traced)."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(
            f"{fn}: scale must be a Python float or None (it is a static hyperparameter), got "
            f"{type(scale).__name__}{' of shape ' + str(shape_of(scale)) if np.ndim(scale) else ''}"
            "; to learn or trace a scale, multiply q by it instead"
        )
    if not math.isfinite(scale):
        raise ValueError(f"{fn}: scale must be finite, got {scale!r}")


Window = tuple[int, int]
"""A sliding window `(left, right)`: query at position `i` sees keys at `i - left .. i + right`."""


def check_window(fn: str, local_window_size) -> Window | None:
    """`local_window_size` (jax's meaning: an int `w` is `(w, w)`, a pair is `(left, right)`)
    as a `(left, right)` pair of non-negative Python ints, or None."""
    if local_window_size is None:
        return None
    value = local_window_size
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value, value)
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in value)
    ):
        raise ValueError(
            f"{fn}: local_window_size must be an int, a (left, right) pair of ints, or None, "
            f"got {local_window_size!r}"
        )
    left, right = int(value[0]), int(value[1])
    if left < 0 or right < 0:
        raise ValueError(
            f"{fn}: local_window_size must not be negative, got (left, right) = ({left}, {right})"
        )
    return left, right


def check_position(
    fn: str,
    name: str,
    value,
    *,
    batch: int | None = None,
    minimum: int | None = 0,
    read_arrays: bool = False,
) -> None:
    """An integer position or length: a Python int or an integer array of shape `[]` (or
    `[batch]` when `batch` is given). A Python or NumPy value below `minimum` is an error, and
    with `read_arrays` a concrete JAX array's too; a traced one cannot be checked here (the
    kernels clip it, as documented where it is accepted)."""
    if isinstance(value, bool):
        raise ValueError(f"{fn}: {name} must be an integer, got a bool")
    if isinstance(value, numbers.Integral):
        if minimum is not None and value < minimum:
            raise ValueError(f"{fn}: {name} must be >= {minimum}, got {value}")
        return
    dtype = jnp.result_type(value)
    shape = shape_of(value)
    if batch is None and (not jnp.issubdtype(dtype, jnp.integer) or shape != ()):
        raise ValueError(
            f"{fn}: {name} must be an integer scalar, got dtype {dtype} and shape {shape}"
        )
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{fn}: {name} must be an integer or integer array, got dtype {dtype}")
    if batch is not None and shape not in ((), (batch,)):
        raise ValueError(
            f"{fn}: {name} must be a scalar or have shape [batch] = ({batch},), got {shape}"
        )
    readable = is_concrete(value) if read_arrays else isinstance(value, np.ndarray | np.generic)
    if minimum is not None and readable:
        if np.any(np.asarray(value, dtype=np.int64) < minimum):
            raise ValueError(f"{fn}: {name} must be >= {minimum}, got {np.asarray(value)}")


def is_concrete(x) -> bool:
    """Whether the value of `x` can be read here: a NumPy value, or a JAX array that is not
    traced and whose every shard lives in this process."""
    if isinstance(x, np.ndarray | np.generic | numbers.Number):
        return True
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, Tracer)
        and bool(getattr(x, "is_fully_addressable", True))
    )


# ---------------------------------------------------------------------------------------------
# The query rows of each key/value head
# ---------------------------------------------------------------------------------------------


def to_rows(x: Float[Array, "q_seq heads d"], dims: Dims) -> Float[Array, "kv_heads rows d"]:
    """`[q_seq, heads, d] -> [kv_heads, group * q_seq, d]`: row `g * q_seq + t` of kv head `k`
    is query `t` of head `k * group + g`.

    Attention then is a batch (over kv heads) of plain matrix products with no K/V copies for
    GQA; XLA runs both products as batched GEMMs (a 4-d grouped einsum is 2-3x slower on CPU).
    """
    t, kh, g = dims.q_seq, dims.kv_heads, dims.group
    return x.reshape(t, kh, g, x.shape[-1]).transpose(1, 2, 0, 3).reshape(kh, g * t, x.shape[-1])


def from_rows(x: Float[Array, "kv_heads rows d"], dims: Dims) -> Float[Array, "q_seq heads d"]:
    """Inverse of [`to_rows`][]: `[kv_heads, group * q_seq, d] -> [q_seq, heads, d]`."""
    t, kh, g = dims.q_seq, dims.kv_heads, dims.group
    return x.reshape(kh, g, t, x.shape[-1]).transpose(2, 0, 1, 3).reshape(t, kh * g, x.shape[-1])


def lse_from_rows(x: Float[Array, "kv_heads rows"], dims: Dims) -> Float[Array, "q_seq heads"]:
    """`[kv_heads, group * q_seq] -> [q_seq, heads]` (the lse convention of the library)."""
    return x.reshape(dims.heads, dims.q_seq).T


def lse_to_rows(x: Float[Array, "q_seq heads"], dims: Dims) -> Float[Array, "kv_heads rows"]:
    """Inverse of `lse_from_rows`."""
    return x.T.reshape(dims.kv_heads, dims.rows)


# ---------------------------------------------------------------------------------------------
# Which keys a query sees
# ---------------------------------------------------------------------------------------------


class Masking(eqx.Module):
    r"""The rules of visibility beyond causality, windows, lengths and boolean masks: packed
    sequences, a bidirectional prefix, chunks, and a mask function. A pytree: its arrays (and
    those a `mask_mod` closes over as leaves, e.g. a `jax.tree_util.Partial`) are traced, so
    new segment ids or a new prefix do not recompile; `chunk` is static.

    - `q_segments[q_seq]`, `kv_segments[kv_seq]`: integer segment (document) ids; a query sees
      a key only within its own segment (splash attention's `SegmentIds`).
    - `prefix`: keys at positions below it are seen by every query, whatever `causal`, the
      window or `chunk` say (prefix-LM: a bidirectional prompt, a causal continuation).
    - `chunk`: a query at position $i$ sees keys $j$ with $\lfloor i/C\rfloor = \lfloor j/C
      \rfloor$ only (chunked attention, Llama 4), combined with `causal`.
    - `mask_mod(b, h, q_idx, kv_idx) -> bool`: FlexAttention's mask function of the batch row,
      the query head and the absolute query and key positions, written for scalars (it is
      vectorised with `vmap`).
    """

    q_segments: Int[Array, " q_seq"] | None = None
    kv_segments: Int[Array, " kv_seq"] | None = None
    prefix: Int[Array, ""] | None = None
    chunk: int | None = eqx.field(static=True, default=None)
    mask_mod: Any = None

    @property
    def positional(self) -> bool:
        """Whether a rule here reads query positions (prefix, chunk or a mask function)."""
        return self.prefix is not None or self.chunk is not None or self.mask_mod is not None

    def arguments(self) -> dict[str, Any]:
        """The public keyword arguments these rules come from (`MASKING_ARGUMENTS`)."""
        return {
            "q_segment_ids": self.q_segments,
            "kv_segment_ids": self.kv_segments,
            "prefix_length": self.prefix,
            "chunk_size": self.chunk,
            "mask_mod": self.mask_mod,
        }

    def keys(self, kv_segments) -> Masking:
        """The same rules for another block of keys (its own segment ids)."""
        return dataclasses.replace(self, kv_segments=kv_segments)

    def queries(self, q_segments) -> Masking:
        """The same rules for another block of queries (their own segment ids)."""
        return dataclasses.replace(self, q_segments=q_segments)


MASKING_ARGUMENTS = ("q_segment_ids", "kv_segment_ids", "prefix_length", "chunk_size", "mask_mod")
"""The public arguments that `check_masking` gathers into one `Masking`."""


def check_masking(
    fn: str,
    *,
    q_seq: int,
    kv_seq: int,
    q_segment_ids=None,
    kv_segment_ids=None,
    prefix_length=None,
    chunk_size=None,
    mask_mod: Callable | None = None,
    batch: int | None = None,
) -> Masking | None:
    """The public arguments `q_segment_ids`, `kv_segment_ids`, `prefix_length`, `chunk_size`
    and `mask_mod` checked and gathered into one `Masking` (None when none is given). With
    `batch`, segment ids may carry a leading batch axis (of `batch` or 1) and the prefix may be
    `[batch]`; every array then has one: segment ids `[batch, seq]`, the prefix `[batch]`."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given = "q_segment_ids" if kv_segment_ids is None else "kv_segment_ids"
        raise ValueError(f"{fn}: {given} needs its twin: pass both q_ and kv_segment_ids")
    segments = []
    for name, ids, n, axis in (
        ("q_segment_ids", q_segment_ids, q_seq, "q_seq"),
        ("kv_segment_ids", kv_segment_ids, kv_seq, "kv_seq"),
    ):
        if ids is None:
            segments.append(None)
            continue
        dtype, shape = jnp.result_type(ids), shape_of(ids)
        shapes = [(n,)] if batch is None else [(n,), (1, n), (batch, n)]
        if not jnp.issubdtype(dtype, jnp.integer) or shape not in shapes:
            want = f"[{axis}] = ({n},)" if batch is None else f"[batch, {axis}] = ({batch}, {n})"
            raise ValueError(
                f"{fn}: {name} must be an integer array of shape {want}, got dtype {dtype} and "
                f"shape {shape}"
            )
        ids = jnp.asarray(ids).astype(jnp.int32)
        segments.append(ids if batch is None else jnp.broadcast_to(ids, (batch, n)))
    prefix = None
    if prefix_length is not None:
        check_position(fn, "prefix_length", prefix_length, batch=batch)
        prefix = as_position(prefix_length)
        if batch is not None:
            prefix = jnp.broadcast_to(prefix, (batch,))
    if chunk_size is not None and (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, numbers.Integral)
        or chunk_size < 1
    ):
        raise ValueError(f"{fn}: chunk_size must be a positive int or None, got {chunk_size!r}")
    if mask_mod is not None and not callable(mask_mod):
        raise ValueError(f"{fn}: mask_mod must be callable, got {type(mask_mod).__name__}")
    if all(x is None for x in (*segments, prefix_length, chunk_size, mask_mod)):
        return None
    if mask_mod is not None and jax.tree_util.treedef_is_leaf(jax.tree.structure(mask_mod)):
        # A plain function: as a `Partial` it is a pytree with no leaves, compared by identity.
        mask_mod = jax.tree_util.Partial(mask_mod)
    return Masking(
        q_segments=segments[0],
        kv_segments=segments[1],
        prefix=prefix,
        chunk=None if chunk_size is None else int(chunk_size),
        mask_mod=mask_mod,
    )


def _mask_function(mask_mod, batch, heads: int, q_pos, k_pos) -> Bool[Array, "heads q kv"]:
    """`mask_mod(b, h, q_idx, kv_idx)` on every (head, query, key), vectorised."""
    h = jnp.arange(heads, dtype=jnp.int32)
    per_key = jax.vmap(mask_mod, in_axes=(None, None, None, 0))
    per_query = jax.vmap(per_key, in_axes=(None, None, 0, None))
    per_head = jax.vmap(per_query, in_axes=(None, 0, None, None))
    out = per_head(as_position(batch), h, q_pos, k_pos)
    if out.shape != (heads, q_pos.shape[0], k_pos.shape[0]):
        raise ValueError(
            f"mask_mod must return one boolean per (b, h, q_idx, kv_idx), got shape "
            f"{tuple(out.shape)} for {heads} heads, {q_pos.shape[0]} queries, "
            f"{k_pos.shape[0]} keys"
        )
    return out.astype(jnp.bool_)


def visibility(
    dims: Dims,
    *,
    causal: bool = False,
    q_offset: int | Int[Array, ""] = 0,
    kv_offset: int | Int[Array, ""] = 0,
    kv_positions: Int[Array, " kv_seq"] | None = None,
    kv_length: int | Int[Array, ""] | None = None,
    slots: Bool[Array, " kv_seq"] | None = None,
    mask: Bool[Array, "#q_seq kv_seq"] | Bool[Array, "#heads #q_seq kv_seq"] | None = None,
    window: Window | None = None,
    masking: Masking | None = None,
    batch: int | Int[Array, ""] = 0,
) -> Bool[Array, "#kv_heads #group #q_seq kv_seq"] | None:
    r"""The one place that decides which keys each (head, query) sees, in the grouped layout
        `[kv_heads, group, q_seq, kv_seq]` (axes of size 1 broadcast). None means "every key".

        Positions are absolute: query `i` sits at `q_offset + i`; key slot `a` holds position
        `kv_positions[a]`, or `kv_offset + a` (a shard of a longer sequence). A key at position
        $j$ is visible to a query at position $i$ iff

        - its slot is valid (`slots[a]`, e.g. a block that overlaps the previous one),
        - its position is below `kv_length` (the filled part of a cache),
        - by position: when `causal`, $j \le i$ (bottom-right alignment: a query appended after
          a cache of `n` tokens passes `q_offset=n`); when `window = (left, right)`,
          $i - \mathrm{left} \le j \le i + \mathrm{right}$ (jax's `local_window_size`); with
          `masking.chunk` $C$, $\lfloor i/C
    floor = \lfloor j/C
    floor$ — all of these waived for
          $j$ below `masking.prefix` (prefix-LM),
        - with segment ids, the query's and the key's segments are equal (packed sequences),
        - the user's boolean `mask` (`[#q_seq, kv_seq]` or `[#heads, #q_seq, kv_seq]`, axes of
          size 1 broadcast) and `masking.mask_mod(batch, h, i, j)` allow it.
    """
    m_ = masking if masking is not None else Masking()
    chunk, prefix = m_.chunk, m_.prefix
    by_position = causal or window is not None or chunk is not None
    key_ok = slots
    pos = None
    if by_position or kv_length is not None or m_.positional:
        # int32 positions: a context of 2^31 tokens is far beyond any cache.
        if kv_positions is not None:
            pos = jnp.asarray(kv_positions).astype(jnp.int32)
        else:
            pos = as_position(kv_offset) + jnp.arange(dims.kv_seq, dtype=jnp.int32)
    if kv_length is not None:
        assert pos is not None
        filled = pos < as_position(kv_length)
        key_ok = filled if key_ok is None else key_ok & filled
    vis = None if key_ok is None else key_ok[None, None, None, :]
    q_pos = None
    if by_position or m_.mask_mod is not None:
        q_pos = as_position(q_offset) + jnp.arange(dims.q_seq, dtype=jnp.int32)
    if by_position:
        assert pos is not None and q_pos is not None
        qp, kp = q_pos[:, None], pos[None, :]
        seen = None
        if causal:
            seen = kp <= qp
        if window is not None:
            # Differences, not sums: q_pos - left may fall below int32's range for no reason.
            near = (qp - kp <= window[0]) & (kp - qp <= window[1])
            seen = near if seen is None else seen & near
        if chunk is not None:
            same = jnp.floor_divide(qp, chunk) == jnp.floor_divide(kp, chunk)
            seen = same if seen is None else seen & same
        assert seen is not None
        if prefix is not None:
            seen = seen | (kp < prefix)
        vis = seen[None, None] if vis is None else vis & seen[None, None]
    if m_.q_segments is not None and m_.kv_segments is not None:
        same = (m_.q_segments[:, None] == m_.kv_segments[None, :])[None, None]
        vis = same if vis is None else vis & same
    if m_.mask_mod is not None:
        assert pos is not None and q_pos is not None
        allowed = _mask_function(m_.mask_mod, batch, dims.heads, q_pos, pos)
        allowed = allowed.reshape(dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq)
        vis = allowed if vis is None else vis & allowed
    if mask is not None:
        m = jnp.asarray(mask)
        if m.ndim == 2:
            m = m[None, None]
        elif m.shape[0] == 1:
            m = m[None]
        else:
            m = m.reshape(dims.kv_heads, dims.group, *m.shape[1:])
        vis = m if vis is None else vis & m
    return vis


SKIPPED, PARTIAL, COVERED = 0, 1, 2
"""What `tile_coverage` says of a tile: no query sees a key of it, some may, every query sees
every key."""


def tile_coverage(
    dims: Dims,
    *,
    causal: bool,
    q_offset: int | Int[Array, ""],
    kv_offset: int | Int[Array, ""],
    kv_valid: int | Int[Array, ""],
    window: Window | None = None,
    masking: Masking | None = None,
    dense: bool = False,
) -> Int[Array, ""] | None:
    r"""How much of a tile `visibility` shows, read from the bounds of its positions and
    segments without building it: `SKIPPED`, `PARTIAL` or `COVERED` (an int32 scalar), or
    None when no rule but the padding hides a key (every tile is then computed).

    The tile holds queries at `q_offset .. q_offset + q_seq - 1` and keys at `kv_offset ..`, of
    which the first `kv_valid` slots are real. Bounds are conservative: `SKIPPED` only when no
    (query, key) pair can be visible, `COVERED` only when every pair is, so a tile's result
    never depends on them, only its cost. A mask function or a boolean mask (`dense`) is not
    read here: with one, a tile is at most `PARTIAL` and the caller checks the tile itself.
    Under `vmap` it is the batch's (`batch_coverage`).
    """
    m_ = masking if masking is not None else Masking()
    if not (causal or window is not None or m_.chunk is not None or m_.prefix is not None):
        if m_.q_segments is None and m_.mask_mod is None and not dense:
            return None
    q_lo = as_position(q_offset)
    q_hi = q_lo + (dims.q_seq - 1)
    k_lo = as_position(kv_offset)
    k_hi = k_lo + as_position(kv_valid) - 1
    some, every = k_hi >= k_lo, as_position(kv_valid) >= dims.kv_seq
    near, inside = jnp.bool_(True), jnp.bool_(True)
    if causal:
        near, inside = near & (k_lo <= q_hi), inside & (k_hi <= q_lo)
    if window is not None:
        left, right = window
        near &= (q_lo - k_hi <= left) & (k_lo - q_hi <= right)
        inside &= (q_hi - k_lo <= left) & (k_hi - q_lo <= right)
    if m_.chunk is not None:
        qc = jnp.floor_divide(q_lo, m_.chunk), jnp.floor_divide(q_hi, m_.chunk)
        kc = jnp.floor_divide(k_lo, m_.chunk), jnp.floor_divide(k_hi, m_.chunk)
        near &= (kc[0] <= qc[1]) & (qc[0] <= kc[1])
        inside &= (qc[0] == qc[1]) & (kc[0] == kc[1]) & (qc[0] == kc[0])
    if m_.prefix is not None:
        near, inside = near | (k_lo < m_.prefix), inside | (k_hi < m_.prefix)
    some, every = some & near, every & inside
    if m_.q_segments is not None and m_.kv_segments is not None:
        qs, ks = m_.q_segments, m_.kv_segments
        # Padding slots carry a real slot's id, so they widen no range.
        real = jnp.arange(ks.shape[0], dtype=jnp.int32) < as_position(kv_valid)
        ks = jnp.where(real, ks, ks[0])
        q_range, k_range = (jnp.min(qs), jnp.max(qs)), (jnp.min(ks), jnp.max(ks))
        some &= (q_range[0] <= k_range[1]) & (k_range[0] <= q_range[1])
        every &= (q_range[0] == q_range[1]) & (k_range[0] == k_range[1])
        every &= q_range[0] == k_range[0]
    if m_.mask_mod is not None or dense:
        every = jnp.bool_(False)
    return batch_coverage(jnp.where(every, COVERED, jnp.where(some, PARTIAL, SKIPPED)))


@custom_vmap
def batch_coverage(coverage: Int[Array, ""]) -> Int[Array, ""]:
    """A tile's coverage, int32; under `vmap`, that of the whole batch, unbatched: `SKIPPED`
    when every row skips the tile, `COVERED` when every row covers it, else `PARTIAL`. A branch
    on it then stays a branch (a batched predicate would run every branch and select)."""
    return jnp.asarray(coverage, jnp.int32)


@batch_coverage.def_vmap
def _batch_coverage_rule(axis_size, in_batched, coverage):
    del axis_size
    if not in_batched[0]:
        return batch_coverage(coverage), False
    every = jnp.all(coverage == COVERED)
    none = jnp.all(coverage == SKIPPED)
    return batch_coverage(jnp.where(every, COVERED, jnp.where(none, SKIPPED, PARTIAL))), False


def rows_visibility(
    vis: Bool[Array, "#kv_heads #group #q_seq kv_seq"] | None, dims: Dims
) -> Bool[Array, "#kv_heads #rows kv_seq"] | None:
    """`visibility` in the rows layout `[kv_heads, group * q_seq, kv_seq]`."""
    if vis is None:
        return None
    kh = vis.shape[0]
    if vis.shape[1] == 1 and vis.shape[2] == 1:
        return vis.reshape(kh, 1, vis.shape[-1])
    full = jnp.broadcast_to(vis, (kh, dims.group, dims.q_seq, vis.shape[-1]))
    return full.reshape(kh, dims.rows, vis.shape[-1])


def rows_bias(
    bias: Float[Array, "#heads #q_seq kv_seq"], dims: Dims
) -> Float[Array, "#kv_heads #rows kv_seq"]:
    """An additive bias on the logits, `[#heads, #q_seq, kv_seq]` (axes of size 1 broadcast),
    in the rows layout `[kv_heads, group * q_seq, kv_seq]` (size-1 axes kept where they can be).
    It is added to the logits of visible keys; a bias of -inf gives a key weight 0."""
    h, t, s = bias.shape
    if h == 1 and t == 1:
        return bias.reshape(1, 1, s)
    if h == 1:
        return jnp.broadcast_to(bias, (dims.group, t, s)).reshape(1, dims.group * t, s)
    full = jnp.broadcast_to(bias, (dims.heads, dims.q_seq, s))
    return full.reshape(dims.kv_heads, dims.rows, s)


def nonempty(
    dims: Dims, vis: Bool[Array, "#kv_heads #group #q_seq kv_seq"] | None
) -> Bool[Array, "q_seq heads"]:
    """True for every (query, head) that sees at least one key."""
    if vis is None:
        return jnp.full((dims.q_seq, dims.heads), dims.kv_seq > 0)
    shape = (dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq)
    return jnp.any(jnp.broadcast_to(vis, shape), axis=-1).reshape(dims.heads, dims.q_seq).T


def finite_rows(x: Float[Array, "*rows d"]) -> tuple[Float[Array, "*rows d"], Bool[Array, "*rows"]]:
    """`x` (keys or values, one row per key) with every row that holds a NaN or inf set to 0,
    and which rows those were.

    A key that a query does not see carries attention weight exactly 0, but 0 times NaN is NaN
    in every matrix product of the forward and the gradient: an unfilled cache slot or a
    masked-out key would poison every query. So the products run on finite rows, and
    [`poison`][] gives the logit of a non-finite row NaN: a query that sees that key gets NaN
    (NaN in, NaN out), a query that does not see it is untouched (`where`, not a 0 weight).
    """
    bad = jnp.any(~jnp.isfinite(x), axis=-1)
    return jnp.where(bad[..., None], jnp.zeros((), x.dtype), x), bad


def poison(
    x: Float[Array, "*batch kv"], bad: Bool[Array, "*#batch kv"]
) -> Float[Array, "*batch kv"]:
    """Logits `x` with those of non-finite keys or values set to NaN (see `finite_rows`).

    Added as a per-key bias (0 or NaN) rather than selected: the add fuses into the logits'
    other elementwise work and its gradient is the identity, where a select would cost a
    logits-sized pass forward and back."""
    bias = jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), jnp.zeros((), x.dtype))
    return x + lax.stop_gradient(bias)


# ---------------------------------------------------------------------------------------------
# The safe log-sum-exp
# ---------------------------------------------------------------------------------------------


def masked_logsumexp(
    x: Float[Array, "*batch n"], visible: Bool[Array, "*#batch #n"] | None
) -> Float[Array, "*batch"]:
    r"""$\log\sum_{a\ \mathrm{visible}} e^{x_a}$ over the last axis, max-shifted (Appendix 11).

    The shift $m = \max_a x_a$ is held constant under differentiation: $F$ does not depend on
    it (eq. 38), so its derivative would only add terms that cancel. A row with no visible entry
    has $Z = 0$ and returns $-\infty$; every derivative of it is exactly 0 (no NaN), because the
    masked entries carry weight $e^{-\infty} = 0$ and the logarithm only ever sees $Z \ge 1$.
    A NaN among the visible entries gives NaN (never the $-\infty$ of "sees no key").
    """
    if visible is not None:
        x = jnp.where(visible, x, -jnp.inf)
    m = lax.stop_gradient(jnp.max(x, axis=-1, initial=-jnp.inf))
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    z = jnp.sum(jnp.exp(x - m_safe[..., None]), axis=-1)
    # The visible maximum contributes e^0 = 1, so a non-empty row has z >= 1.
    nonempty = (z > 0) | jnp.isnan(z)
    return jnp.where(nonempty, m_safe + jnp.log(jnp.where(nonempty, z, 1.0)), -jnp.inf)


def _zero_like(x: Array) -> Array:
    """Zeros of the shape of `x` that still depend on its entries (selected, never computed
    from them: exactly 0 whatever `x` holds), so they vary wherever `x` does — along a `vmap`
    batch axis, and across the devices of a `shard_map`."""
    return lax.select(jnp.zeros(x.shape, jnp.bool_), x, jnp.zeros_like(x))


def tilt(zeta: Array, v: Array, head_major: bool = False) -> Array:
    """The source term ζ·v_a `[kv_heads, rows, kv]` of every (kv head, query row, key): zeta
    in the rows layout, `v` as `[kv, kv_heads, dv]` (or `[kv_heads, kv, dv]` if
    `head_major`)."""
    return jnp.einsum("kmv,ksv->kms" if head_major else "kmv,skv->kms", zeta, v)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def tilt_at_zero(zeta: Array, v: Array, head_major: bool = False) -> Array:
    r"""The tilt $\zeta\cdot v_a$ (as `tilt`) at the point $\zeta = 0$, which the caller
    knows at trace time, without the product.

    The value there is 0, so the product is not computed (XLA does not fold a product with
    zeros away, and would read V for it); the derivative in $\zeta$ is the exact one ($v_a$,
    the one read of V under `jax.grad`), and the one in $v$, $\zeta\cdot\dot v_a$, vanishes at
    $\zeta = 0$. This saves a third of the FLOPs of `jax.grad` of the free energy while keeping
    it a gradient of $F$; exact to every order in which $\zeta$ is differentiated first
    (attention and then anything; cumulants).

    The zeros depend on the entries of both arguments because the tangent
    $\dot\zeta\cdot v_a$ does: under `vmap` a custom JVP's output must be batched wherever its
    tangent is, and JAX fixes the output's batching before it runs the JVP rule (inside `jit`,
    when it linearises later), so zeros batched like neither argument would break
    differentiation in $v$ of a batched attention. The same dependence carries the
    device-variance inside `shard_map`.
    """
    keys = _zero_like(v[:, :, 0]) if head_major else _zero_like(v[:, :, 0]).T
    return _zero_like(zeta[:, :, :1]) + keys[:, None, :]


def _tilt_at_zero_jvp(head_major, primals, tangents):
    zeta, v = primals
    dzeta, _ = tangents
    out = tilt_at_zero(zeta, v, head_major)
    if isinstance(dzeta, SymbolicZero):
        # Differentiating in q, k, v or the energy only: the tilt stays 0, not a product.
        return out, jnp.zeros_like(out)
    return out, tilt(dzeta, v, head_major)


tilt_at_zero.defjvp(_tilt_at_zero_jvp, symbolic_zeros=True)
