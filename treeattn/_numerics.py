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
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
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
) -> Bool[Array, "#kv_heads #group #q_seq kv_seq"] | None:
    r"""The one place that decides which keys each (head, query) sees, in the grouped layout
    `[kv_heads, group, q_seq, kv_seq]` (axes of size 1 broadcast). None means "every key".

    Positions are absolute: query `i` sits at `q_offset + i`; key slot `a` holds position
    `kv_positions[a]`, or `kv_offset + a` (a shard of a longer sequence). A key is visible iff

    - its slot is valid (`slots[a]`, e.g. a block that overlaps the previous one),
    - its position is below `kv_length` (the filled part of a cache),
    - when `causal`, its position is not after the query's (bottom-right alignment: a query
      appended after a cache of `n` tokens passes `q_offset=n`),
    - when `window = (left, right)`, its position $j$ is within the query's sliding window,
      $i - \mathrm{left} \le j \le i + \mathrm{right}$ (jax's `local_window_size`),
    - and the user's boolean `mask` (`[#q_seq, kv_seq]` or `[#heads, #q_seq, kv_seq]`, axes of
      size 1 broadcast) allows it.
    """
    key_ok = slots
    pos = None
    if causal or kv_length is not None or window is not None:
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
    if causal or window is not None:
        assert pos is not None
        q_pos = (as_position(q_offset) + jnp.arange(dims.q_seq, dtype=jnp.int32))[:, None]
        seen = None
        if causal:
            seen = pos[None, :] <= q_pos
        if window is not None:
            # Differences, not sums: q_pos - left may fall below int32's range for no reason.
            near = (q_pos - pos[None, :] <= window[0]) & (pos[None, :] - q_pos <= window[1])
            seen = near if seen is None else seen & near
        assert seen is not None
        vis = seen[None, None] if vis is None else vis & seen[None, None]
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
