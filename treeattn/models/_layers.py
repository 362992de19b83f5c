"""Llama building blocks: RMSNorm, rotary position embeddings (with Llama-3 scaling), SwiGLU."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._native import (
    GATED_TARGET,
    MATMUL_TARGET,
    MLP_TARGET,
    PACKED_TARGET,
    PANEL,
    QKV_TARGET,
    load_kernel,
)


def _dot_array(x, w):
    """`x @ w.T` for a weight `w[out, in]` (Equinox's layout), contracted in place: a transposed
    operand makes XLA:CPU take a slower path (for bfloat16, 10x slower), so `w` is never
    transposed. Float32 accumulation for float types narrower than 32 bits."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    return jax.lax.dot_general(x, w, dims)


def _layers_of(ws) -> np.ndarray:
    """The `layers` attribute of a packed call: each weight's layer in its stack, -1 for none."""
    return np.array([-1 if w.layer is None else w.layer for w in ws], np.int64)


def _batched(x, batched: bool, axis_size: int):
    """`x` with the vmapped axis in front: as it is when batched, else broadcast."""
    return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))


def _native(x, ws):
    """`_dot` of `x` with each weight of `ws`, by treeattn's C++ product for XLA:CPU
    (`treeattn/_cpu_kernel.cc`): one call for all the weights, whose threads stream each one's
    share of the weight rows once against every row of `x`, at memory speed, float32 sums for
    bfloat16. All the weights are `[out, in]` arrays, or all are `PackedWeight`s."""
    rows = x.reshape(-1, x.shape[-1])
    outs = [jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]), x.dtype) for w in ws]
    if isinstance(ws[0], PackedWeight):
        ys = jax.ffi.ffi_call(PACKED_TARGET, outs)(
            rows, *(w.panels for w in ws), layers=_layers_of(ws)
        )
    else:
        ys = jax.ffi.ffi_call(MATMUL_TARGET, outs)(rows, *ws)
    return tuple(y.reshape(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, ws, strict=True))


@jax.jit
def _panels(w):
    """`w[out, in]` in panels of PANEL output rows (one pass: the pad and the transpose fuse)."""
    out, n = w.shape
    w = jnp.pad(w, ((0, -out % PANEL), (0, 0)))
    if w.dtype == jnp.bfloat16:
        return w.reshape(-1, PANEL, n // 2, 2).transpose(0, 2, 1, 3)
    return w.reshape(-1, PANEL, n).transpose(0, 2, 1)


class PackedWeight(eqx.Module):
    r"""A weight `w[out, in]` laid out once for few-row products on CPU: panels of 16 output
    rows, `panels[p, i, o] = w[16 p + o, i]` for float32 (`[ceil(out / 16), in, 16]`) and
    `panels[p, j, o, h] = w[16 p + o, 2 j + h]` for bfloat16 (`[ceil(out / 16), in / 2, 16,
    2]`), the last panel padded with zeros.

    The C++ product multiplies a panel's 16 weights of one input by that input of every row,
    so its sums build up in the vector lanes of their outputs and need no sums across lanes
    (which cost a product of 8 rows of 256 inputs about a third of its arithmetic with the
    `[out, in]` layout). It takes any number of rows: past 8, blocks of panels stay in L2
    while every group of 8 rows passes over them, so a prompt's product reads the weight once
    too. A [`Decoder`][treeattn.models.Decoder] packs a model's weights when it prepares it.
    It stands in for the array wherever a layer reads its weight: `matmul`, `shape`, `dtype`,
    `astype`, and row lookup (`w[i]`, for a tied embedding).

    With `layer` an int, `panels` is a stack of every layer's panels (a leading layer axis)
    and this weight is layer `layer` of it: the decoder's layers share one stack per kind of
    weight, which the C++ product reads in place, so a step takes one argument per kind
    rather than one per layer and weight (each costs its dispatch about a microsecond).

    ```python
    w = jax.random.normal(jax.random.key(0), (2048, 768))
    y = matmul(jnp.ones((8, 768)), PackedWeight.of(w))     # == matmul(jnp.ones((8, 768)), w)
    ```
    """

    panels: Float[Array, "*layers panels ..."]
    out: int = eqx.field(static=True)
    layer: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.layer is None:
            return
        stack = self.panels.ndim == (5 if self.panels.dtype == jnp.bfloat16 else 4)
        if not stack or not 0 <= self.layer < self.panels.shape[0]:
            raise ValueError(
                f"PackedWeight: layer {self.layer} of a stack of panels with a layer axis, got "
                f"panels{list(self.panels.shape)}"
            )

    @staticmethod
    def packs(w) -> bool:
        """Whether `w` can be packed: a 2-d float32 or bfloat16 array (bfloat16 with an even
        number of inputs)."""
        return (
            getattr(w, "ndim", 0) == 2
            and w.dtype in NATIVE_DTYPES
            and (w.dtype != jnp.bfloat16 or w.shape[1] % 2 == 0)
        )

    @classmethod
    def of(cls, w: Float[Array, "out n"]) -> PackedWeight:
        """`w` packed (a copy of it)."""
        if not cls.packs(w):
            raise ValueError(
                "PackedWeight.of: w must be a 2-d float32 or bfloat16 array (bfloat16 with an "
                f"even number of columns), got {getattr(w, 'dtype', type(w))}"
                f"{list(getattr(w, 'shape', ()))}"
            )
        return cls(_panels(w), w.shape[0])

    @property
    def _pairs(self) -> bool:  # bfloat16: inputs in pairs, a trailing axis of 2
        return self.panels.dtype == jnp.bfloat16

    def _own(self) -> Float[Array, "panels ..."]:
        """This weight's panels (its layer's, from a stack)."""
        return self.panels if self.layer is None else self.panels[self.layer]

    @property
    def shape(self) -> tuple[int, int]:
        n = self.panels.shape[-3 if self._pairs else -2]
        return (self.out, n * (2 if self._pairs else 1))

    @property
    def dtype(self):
        return self.panels.dtype

    def unpack(self) -> Float[Array, "out n"]:
        """The weight as an `[out, in]` array."""
        p = self._own()
        order = (0, 2, 1, 3) if self._pairs else (0, 2, 1)
        return p.transpose(order).reshape(-1, self.shape[1])[: self.out]

    def astype(self, dtype) -> PackedWeight | Array:
        """The weight in `dtype`: packed again where it packs (float32, bfloat16), else the
        `[out, in]` array."""
        if jnp.dtype(dtype) == self.dtype:
            return self
        w = self.unpack().astype(dtype)
        return PackedWeight.of(w) if PackedWeight.packs(w) else w

    def __getitem__(self, i) -> Array:
        """Rows `i` (an integer or an integer array) of the weight, `w[i]`, read from their
        panels, `[*i.shape, in]`: a negative index counts from the end; out of range, a
        concrete int raises `IndexError` and a traced index reads the nearest row (as JAX
        clamps a gather)."""
        if isinstance(i, int) and not -self.out <= i < self.out:
            raise IndexError(f"row {i} of a PackedWeight of {self.out} rows")
        i = jnp.asarray(i)
        i = jnp.clip(jnp.where(i < 0, i + self.out, i), 0, self.out - 1)
        panels = self._own()
        if self._pairs:
            rows = panels[i // PANEL, :, i % PANEL, :]
        else:
            rows = panels[i // PANEL, :, i % PANEL]
        return rows.reshape(*i.shape, self.shape[1])

    def dot(self, x: Float[Array, "*rows n"]) -> Float[Array, "*rows out"]:
        """`_dot(x, w)` by XLA, contracted on the panels as they lie (the jvp, platforms
        without the C++ product; XLA:CPU transposes the panels first)."""
        narrow = jnp.finfo(x.dtype).bits < 32
        kw = {"preferred_element_type": jnp.float32} if narrow else {}
        lead = x.shape[:-1]
        if self._pairs:
            xs = x.reshape(*lead, -1, 2)
            dims = (((len(lead), len(lead) + 1), (1, 3)), ((), ()))
        else:
            xs, dims = x, (((len(lead),), (1,)), ((), ()))
        y = jax.lax.dot_general(xs, self._own(), dims, **kw)
        return y.reshape(*lead, -1)[..., : self.out].astype(x.dtype)


def _dots(x, ws):
    return tuple(_dot(x, w) for w in ws)


def _dot(x, w):
    """`x @ w.T` for a weight `w[out, in]` or a `PackedWeight`."""
    return w.dot(x) if isinstance(w, PackedWeight) else _dot_array(x, w)


# The row counts for which the C++ product streams an `[out, in]` weight faster than XLA:CPU's
# dot (whose few-row products run below memory speed, and in bfloat16 far below:
# benchmarks/generate.py --products); more rows of such a weight are a matrix product XLA
# does well. A packed weight goes to the C++ product with any number of rows.
NATIVE_ROWS = range(1, 33)
NATIVE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _dot_rows(x, ws):
    """`_dot` of `x` with each weight of `ws`, over all the leading axes of `x` as rows: on
    XLA:CPU, float32 or bfloat16 by treeattn's C++ product (`_native`, one call for all the
    weights) when it is built: 1 to 32 rows on `[out, in]` arrays, any number on packed
    weights; else `_xla_rows`, one product per weight."""
    rows = math.prod(x.shape[:-1])
    native = x.dtype in NATIVE_DTYPES and all(w.dtype == x.dtype for w in ws)
    packed = [isinstance(w, PackedWeight) for w in ws]
    if native and rows >= 1 and load_kernel() is None:
        if all(packed) or (not any(packed) and rows in NATIVE_ROWS):
            return jax.lax.platform_dependent(x, ws, cpu=_native, default=_dots)
        if any(packed) and len(ws) > 1:
            return tuple(_dot_rows(x, (w,))[0] for w in ws)
    return tuple(w.dot(x) if p else _xla_rows(x, w) for w, p in zip(ws, packed, strict=True))


def _dot_columns(x, w):
    """`_dot` as `w @ x.T` on a transposed copy of the rows, transposed back: for a few float32
    rows (a decode step of a batch), XLA:CPU streams a weight faster with the rows as contiguous
    columns. The barriers keep XLA from folding both transposes (of `rows` x `in`
    and `rows` x `out` elements, small beside the weight) back into the product."""
    rows = x.reshape(-1, x.shape[-1])
    columns = jax.lax.optimization_barrier(rows.T)
    y = jax.lax.optimization_barrier(jax.lax.dot_general(w, columns, (((1,), (0,)), ((), ()))))
    return y.T.reshape(*x.shape[:-1], w.shape[0])


# The row counts for which `_dot_columns` is the faster product on XLA:CPU
# (benchmarks/generate.py --products: equal at 64 rows, slower from a few hundred).
_FEW_ROWS = range(2, 33)


def _xla_rows(x, w):
    """`_dot` over all the leading axes of `x` as rows, by XLA (where the C++ product is not
    built or does not apply). XLA:CPU computes a product of bfloat16 or float16 with one row
    10-20x slower than with two (it converts the whole weight to float32 first), so on CPU a
    single row of such a type is padded to two; a few float32 rows are multiplied as columns
    (`_dot_columns`)."""
    rows = math.prod(x.shape[:-1])
    narrow = jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32
    if rows in _FEW_ROWS and x.dtype == w.dtype == jnp.float32:
        return jax.lax.platform_dependent(x, w, cpu=_dot_columns, default=_dot)
    if rows != 1 or not narrow:
        return _dot(x, w)

    def two_rows(x, w):
        padded = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        return _dot(padded, w)[:1].reshape(*x.shape[:-1], w.shape[0])

    return jax.lax.platform_dependent(x, w, cpu=two_rows, default=_dot)


@jax.custom_batching.custom_vmap
def _matmul_rows(x, ws):
    return _dot_rows(x, ws)


@_matmul_rows.def_vmap
def _matmul_rows_vmap(axis_size, in_batched, x, ws):
    # Rows batched over shared weights stay rows of one product (whose size decides its form);
    # a batched weight (an ensemble) is one product per member.
    # (Through `_matmul_rows` again, so that an outer `vmap` finds this rule, not the kernel.)
    x_batched, ws_batched = in_batched
    ws_batched = [any(jax.tree.leaves(b)) for b in ws_batched]  # a PackedWeight is a tree
    if not any(ws_batched):
        return _matmul_rows(x, ws), (x_batched,) * len(ws)
    xs = _batched(x, x_batched, axis_size)
    out = tuple(
        jax.vmap(_dot, (0, 0 if batched else None))(xs, w)
        for w, batched in zip(ws, ws_batched, strict=True)
    )
    return out, (True,) * len(ws)


@jax.custom_jvp
def _matmuls(x, ws):
    return _matmul_rows(x, ws)


@_matmuls.defjvp
def _matmuls_jvp(primals, tangents):
    (x, ws), (dx, dws) = primals, tangents
    return _matmuls(x, ws), tuple(_dot(dx, w) + _dot(x, dw) for w, dw in zip(ws, dws, strict=True))


def matmul(
    x: Float[Array, "*rows n"], w: Float[Array, "m n"] | PackedWeight
) -> Float[Array, "*rows m"]:
    r"""$x W^\top$ over the rows of `x` for a weight `w[out, in]` (Equinox's layout, or the
    same weight as a `PackedWeight`; same dtypes), accumulated in float32 for narrower floats.

    One product for every row of every `vmap`ped call, so a decode step of many sequences
    reads each weight once. Differentiable in both arguments, in forward and reverse mode.
    On XLA:CPU, 1 to 32 rows of float32 or bfloat16 go through treeattn's C++ product, which
    streams the weight once at memory speed (see `treeattn._native`), and so do any number of
    rows on a `PackedWeight`; without it, 2 to 32 float32 rows go through XLA as contiguous
    columns (`w @ x.T`) and a single bfloat16 or float16 row is padded to two.

    ```python
    proj = eqx.nn.Linear(768, 2048, use_bias=False, key=jax.random.key(0))
    y = matmul(jnp.ones((8, 768)), proj.weight)                  # [8, 2048]
    ```
    """
    return _matmuls(x, (w,))[0]


def _gated_reference(x, wg, wu):
    r"""SwiGLU's gate $\mathrm{silu}(x W_g^\top) \odot x W_u^\top$ unfused: the products of
    `_matmuls`, then XLA (differentiable, every platform)."""
    g, u = _matmuls(x, (wg, wu))
    return jax.nn.silu(g) * u


def _gated_native(x, wg, wu):
    """The gate by treeattn's C++ product in one call: both products of packed weights, then
    `silu(g) * u` in float32 by the same threads (one rounding to x's dtype, no XLA operation
    after; XLA:CPU's `silu` of bfloat16 rounds after each of its five steps, ~10 us at 8 rows
    of 704)."""
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct((rows.shape[0], wg.shape[0]), x.dtype)
    y = jax.ffi.ffi_call(GATED_TARGET, out)(rows, wg.panels, wu.panels, layers=_layers_of((wg, wu)))
    return y.reshape(*x.shape[:-1], wg.shape[0])


@jax.custom_batching.custom_vmap
def _gated_rows(x, wg, wu):
    if load_kernel() is None:
        return jax.lax.platform_dependent(x, wg, wu, cpu=_gated_native, default=_gated_reference)
    return _gated_reference(x, wg, wu)


@_gated_rows.def_vmap
def _gated_rows_vmap(axis_size, in_batched, x, wg, wu):
    # As `_matmul_rows`: batched rows over shared weights stay rows of one call.
    x_batched, *ws_batched = in_batched
    ws_batched = [any(jax.tree.leaves(b)) for b in ws_batched]
    if not any(ws_batched):
        return _gated_rows(x, wg, wu), x_batched
    xs = _batched(x, x_batched, axis_size)
    axes = tuple(0 if b else None for b in ws_batched)
    return jax.vmap(_gated_reference, (0, *axes))(xs, wg, wu), True


@jax.custom_jvp
def _gated(x, wg, wu):
    return _gated_rows(x, wg, wu)


@_gated.defjvp
def _gated_jvp(primals, tangents):
    # Differentiated, the unfused form (whose products have their own rule), primal too.
    return jax.jvp(_gated_reference, primals, tangents)


def gated_product(
    x: Float[Array, "*rows n"], gate: PackedWeight, up: PackedWeight
) -> Float[Array, "*rows m"]:
    r"""$\mathrm{silu}(x W_g^\top) \odot x W_u^\top$, SwiGLU's gate, for packed weights of one
    shape and `x`'s dtype. On XLA:CPU with treeattn's C++ product one call for both products
    and the gate, computed in float32 and rounded once (the unfused form, `_gated_reference`,
    rounds `silu` step by step in bfloat16); differentiated, or elsewhere, the unfused form."""
    if not gated_fuses(x, gate, up):
        raise ValueError(
            f"gated_product: x and two packed weights of one shape and x's dtype, got x "
            f"{x.dtype}{list(x.shape)}, gate {getattr(gate, 'dtype', type(gate))}"
            f"{list(getattr(gate, 'shape', ()))}, up {getattr(up, 'dtype', type(up))}"
            f"{list(getattr(up, 'shape', ()))}"
        )
    return _gated(x, gate, up)


def gated_fuses(x, gate, up) -> bool:
    """Whether `gated_product` takes `x`, `gate` and `up`: packed weights of one shape, float32
    or bfloat16 as `x` is, and at least one row."""
    return (
        isinstance(gate, PackedWeight)
        and isinstance(up, PackedWeight)
        and gate.shape == up.shape
        and x.dtype in NATIVE_DTYPES
        and gate.dtype == up.dtype == x.dtype
        and x.shape[-1:] == gate.shape[1:]
        and math.prod(x.shape[:-1]) >= 1
    )


def apply_linears(
    projs: tuple[eqx.nn.Linear, ...], x: Float[Array, "*rows n"]
) -> tuple[Float[Array, "*rows m"], ...]:
    """Each of `projs` (`eqx.nn.Linear`s of one input size) over the rows of `x`, in the
    promotion of its weight's and the input's dtypes (what `eqx.nn.Linear` computes in under
    standard promotion), whatever the promotion mode. Projections of one dtype are one product
    call (a layer's q, k and v: on CPU the threads start once for the three)."""
    with jax.numpy_dtype_promotion("standard"):
        dtypes = [jnp.result_type(x, p.weight.dtype) for p in projs]
        if len(set(dtypes)) == 1:
            ys = _matmuls(x.astype(dtypes[0]), tuple(p.weight.astype(dtypes[0]) for p in projs))
        else:
            ys = tuple(
                matmul(x.astype(d), p.weight.astype(d)) for p, d in zip(projs, dtypes, strict=True)
            )
        return tuple(
            y if p.bias is None else y + p.bias.astype(d)
            for y, p, d in zip(ys, projs, dtypes, strict=True)
        )


def apply_linear(proj: eqx.nn.Linear, x: Float[Array, "*rows n"]) -> Float[Array, "*rows m"]:
    """`proj` (an `eqx.nn.Linear`) over the rows of `x`, as `apply_linears`."""
    return apply_linears((proj,), x)[0]


class RMSNorm(eqx.Module):
    r"""Root-mean-square layer norm, $y = w \odot x / \sqrt{\overline{x^2} + \epsilon}$.

    The statistics are taken in float32 and the result cast back (as Llama does).
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5, *, dtype=None):
        self.weight = jnp.ones((dim,), dtype or jnp.float32)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        return _rms_norm(x, self.weight, self.eps)


def _rms_norm(x, weight, eps):
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama-3's rotary frequency scaling (`rope_scaling` with `rope_type: "llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class RotaryEmbedding(eqx.Module):
    r"""Rotary position embeddings (RoFormer) in the "rotate half" convention of Llama.

    Position $t$ rotates the pairs $(x_i, x_{i + d/2})$ by angles $t\,\theta^{-2i/d}$, with the
    inverse frequencies optionally rescaled as in Llama 3. Positions are absolute, so a query
    appended after a cache of $n$ tokens is rotated by $n$, not 0.
    """

    dim: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)
    scaling: Llama3Scaling | None = eqx.field(static=True)

    def __init__(self, dim: int, theta: float = 10000.0, scaling: Llama3Scaling | None = None):
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even, got {dim}")
        self.dim, self.theta, self.scaling = dim, theta, scaling

    def inv_freq(self) -> np.ndarray:
        """Inverse frequencies, `[dim // 2]` (computed in float64 NumPy, a constant)."""
        inv = 1.0 / self.theta ** (np.arange(0, self.dim, 2, dtype=np.float64) / self.dim)
        s = self.scaling
        if s is None:
            return inv
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    def __call__(
        self, x: Float[Array, "seq heads dim"], positions: Int[Array, " seq"]
    ) -> Float[Array, "seq heads dim"]:
        return self.rotate(x, self.angles(positions))

    def angles(
        self, positions: Int[Array, " seq"]
    ) -> tuple[Float[Array, "seq dim"], Float[Array, "seq dim"]]:
        r"""$\cos$ and $\sin$ of the angles $t\,\theta^{-2i/d}$ at `positions`, float32
        `[seq, dim]` each (every angle twice, once per half), for `rotate`."""
        freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(self.inv_freq(), jnp.float32)
        cos, sin = jnp.cos(freqs), jnp.sin(freqs)
        # Whole-width tables made by a concatenation, which XLA:CPU computes as an array of its
        # own: cos and sin are evaluated once per angle. Fused into the rotation instead, they
        # were evaluated once per rotated element (every head, queries and keys apart): a
        # decode step spent 13 us per layer and tensor on them at 8 rows of 2 heads of 128.
        return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)

    def rotate(
        self,
        x: Float[Array, "seq heads dim"],
        angles: tuple[Float[Array, "seq dim"], Float[Array, "seq dim"]],
    ) -> Float[Array, "seq heads dim"]:
        r"""`x` turned by `angles` (from `angles(positions)`), in `x`'s dtype: the pairs
        $(x_1, x_2) \to (x_1 c - x_2 s, x_2 c + x_1 s)$, computed in float32."""
        return _rotate(x, angles)


def _rotate(x: Float[Array, "*seq heads dim"], angles) -> Float[Array, "*seq heads dim"]:
    """`RotaryEmbedding.rotate` over any leading axes (angles `[*seq, dim]`)."""
    # Each half computed apart and the two stacked on an axis of 2: one fusion per tensor on
    # XLA:CPU. The same values as x c + (-x_2, x_1) s, whose concatenation of the halves is an
    # operation of its own (and a flip of the axis runs 2-7x slower): a decode step of queries
    # and keys runs 6 fewer operations per layer.
    x1, x2 = _halves(x.astype(jnp.float32))
    (c1, c2), (s1, s2) = (_halves(a[..., None, :]) for a in angles)
    turned = jnp.stack([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], axis=-2)
    return turned.reshape(x.shape).astype(x.dtype)


def _halves(x: Float[Array, "*lead dim"]) -> tuple[Array, Array]:
    """The two halves of the last axis (`x[..., :d/2]`, `x[..., d/2:]`)."""
    pairs = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    return pairs[..., 0, :], pairs[..., 1, :]


class SwiGLU(eqx.Module):
    r"""The gated feed-forward block of Llama: $W_\mathrm{down}(\mathrm{silu}(W_\mathrm{gate}x)
    \odot W_\mathrm{up}x)$."""

    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(
        self, dim: int, hidden: int, *, use_bias: bool = False, dtype=None, key: PRNGKeyArray
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate_proj = eqx.nn.Linear(dim, hidden, use_bias=use_bias, dtype=dtype, key=k1)
        self.up_proj = eqx.nn.Linear(dim, hidden, use_bias=use_bias, dtype=dtype, key=k2)
        self.down_proj = eqx.nn.Linear(hidden, dim, use_bias=use_bias, dtype=dtype, key=k3)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        g, u = self.gate_proj, self.up_proj
        wg, wu = g.weight, u.weight
        if (
            isinstance(wg, PackedWeight)
            and isinstance(wu, PackedWeight)
            and g.bias is None
            and u.bias is None
            and gated_fuses(x, wg, wu)
        ):
            act = gated_product(x, wg, wu)  # packed weights: one call
        else:
            gate, up = apply_linears((g, u), x)
            act = jax.nn.silu(gate) * up
        return apply_linear(self.down_proj, act)


def _mlp_reference(xs, g, eps, wg, wu, wd):
    r"""A pre-norm block's MLP and residual unfused, $h + W_d\,\mathrm{gate}(\mathrm{RMSNorm}(h))$
    with $h$ the sum of `xs` (one array, or the residual stream and what attention added;
    differentiable, every platform)."""
    x = xs[0] if len(xs) == 1 else xs[0] + xs[1]
    return x + _matmuls(_gated_reference(_rms_norm(x, g, eps), wg, wu), (wd,))[0]


def _mlp_native(xs, g, eps, wg, wu, wd):
    """The block by treeattn's C++ kernel in one call: the sum of `xs`, the norm, the gated
    product, the down product and the residual (one call where XLA:CPU ran nine operations
    per layer)."""
    rows = tuple(x.reshape(-1, x.shape[-1]) for x in xs)
    out = jax.ShapeDtypeStruct(rows[0].shape, xs[0].dtype)
    y = jax.ffi.ffi_call(MLP_TARGET, out)(
        rows[0], g, eps, *rows[1:], wg.panels, wu.panels, wd.panels, layers=_layers_of((wg, wu, wd))
    )
    return y.reshape(xs[0].shape)


@jax.custom_batching.custom_vmap
def _mlp_rows(xs, g, eps, wg, wu, wd):
    if load_kernel() is None:
        return jax.lax.platform_dependent(
            xs, g, eps, wg, wu, wd, cpu=_mlp_native, default=_mlp_reference
        )
    return _mlp_reference(xs, g, eps, wg, wu, wd)


@_mlp_rows.def_vmap
def _mlp_rows_vmap(axis_size, in_batched, xs, *rest):
    # As `_matmul_rows`: batched rows over shared weights stay rows of one call.
    xs_batched, *rest_batched = in_batched
    rest_batched = [any(jax.tree.leaves(b)) for b in rest_batched]
    xs = tuple(_batched(x, b, axis_size) for x, b in zip(xs, xs_batched, strict=True))
    if not any(rest_batched):
        return _mlp_rows(xs, *rest), True
    axes = tuple(0 if b else None for b in rest_batched)
    return jax.vmap(_mlp_reference, (0, *axes))(xs, *rest), True


@jax.custom_jvp
def _mlp(xs, g, eps, wg, wu, wd):
    return _mlp_rows(xs, g, eps, wg, wu, wd)


@_mlp.defjvp
def _mlp_jvp(primals, tangents):
    return jax.jvp(_mlp_reference, primals, tangents)  # differentiated: the unfused form


def mlp_block(
    x: Float[Array, "*rows dim"],
    norm: RMSNorm,
    mlp: SwiGLU,
    plus: Float[Array, "*rows dim"] | None = None,
) -> Float[Array, "*rows dim"]:
    r"""A pre-norm block's MLP with its residual, $h + \mathrm{mlp}(\mathrm{norm}(h))$ for
    $h = x$, or $h = x + \mathrm{plus}$ (the block's first residual sum, what attention
    added). With packed weights without biases, all of `x`'s dtype (a `Decoder`'s on CPU),
    one call of treeattn's C++ kernel: the sum, the norm (its statistics in float32, rounded
    as `RMSNorm` rounds), the gated product (`gated_product`), the down product and the
    residual; differentiated, or elsewhere, the same computed unfused (`_mlp_reference`)."""
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    xs = (x,) if plus is None else (x, plus)
    fuses = (
        g.bias is None
        and u.bias is None
        and d.bias is None
        and gated_fuses(x, g.weight, u.weight)
        and all(a.dtype == x.dtype and a.shape == x.shape for a in xs)
        and isinstance(d.weight, PackedWeight)
        and d.weight.dtype == x.dtype
        and d.weight.shape == (x.shape[-1], g.weight.shape[0])
        and norm.weight.dtype == x.dtype
        and norm.weight.shape == x.shape[-1:]
    )
    if not fuses:
        h = x if plus is None else x + plus
        return h + mlp(norm(h))
    return _mlp(xs, norm.weight, jnp.float32(norm.eps), g.weight, u.weight, d.weight)


def _qkv_reference(x, g, eps, wq, wk, wv, cos, sin):
    r"""A pre-norm attention's inputs unfused: the q, k and v projections of
    $\mathrm{RMSNorm}(x)$, q and k turned by the rotary tables in heads of `cos`'s width
    (differentiable, every platform)."""
    q, k, v = _matmuls(_rms_norm(x, g, eps), (wq, wk, wv))
    d = cos.shape[-1]

    def turn(y):
        return _rotate(y.reshape(*y.shape[:-1], -1, d), (cos, sin)).reshape(y.shape)

    return turn(q), turn(k), v


def _qkv_native(x, g, eps, wq, wk, wv, cos, sin):
    """The same by treeattn's C++ kernel in one call: the norm, one packed product for the
    three weights and the rotation (where XLA:CPU ran seven operations per layer)."""
    d, lead = cos.shape[-1], x.shape[:-1]
    # q and k come out as heads [*rows, heads, d]: reshaped into heads after the call, XLA:CPU
    # copied each (a layout of their unit axes it did not see was the same). v stays flat.
    outs = [jax.ShapeDtypeStruct((*lead, w.shape[0] // d, d), x.dtype) for w in (wq, wk)]
    outs.append(jax.ShapeDtypeStruct((*lead, wv.shape[0]), x.dtype))
    rows, n = x.reshape(-1, x.shape[-1]), math.prod(lead)
    tables = (t.reshape(n, d) for t in (cos, sin))
    ws = (wq, wk, wv)
    q, k, v = jax.ffi.ffi_call(QKV_TARGET, outs)(
        rows, g, eps, *tables, *(w.panels for w in ws), layers=_layers_of(ws)
    )
    return q.reshape(*lead, -1), k.reshape(*lead, -1), v


@jax.custom_batching.custom_vmap
def _qkv_rows(x, g, eps, wq, wk, wv, cos, sin):
    args = (x, g, eps, wq, wk, wv, cos, sin)
    if load_kernel() is None:
        return jax.lax.platform_dependent(*args, cpu=_qkv_native, default=_qkv_reference)
    return _qkv_reference(*args)


@_qkv_rows.def_vmap
def _qkv_rows_vmap(axis_size, in_batched, x, g, eps, wq, wk, wv, cos, sin):
    # As `_matmul_rows`: batched rows (and their angles) over shared weights stay rows of one
    # call; the tables follow x's rows.
    x_b, g_b, eps_b, *w_b, cos_b, sin_b = (any(jax.tree.leaves(b)) for b in in_batched)
    out_batched = (True, True, True)
    if not (g_b or eps_b or any(w_b)):
        x, cos, sin = (_batched(a, b, axis_size) for a, b in ((x, x_b), (cos, cos_b), (sin, sin_b)))
        return _qkv_rows(x, g, eps, wq, wk, wv, cos, sin), out_batched
    axes = tuple(0 if b else None for b in (x_b, g_b, eps_b, *w_b, cos_b, sin_b))
    return jax.vmap(_qkv_reference, axes)(x, g, eps, wq, wk, wv, cos, sin), out_batched


@jax.custom_jvp
def _qkv(x, g, eps, wq, wk, wv, cos, sin):
    return _qkv_rows(x, g, eps, wq, wk, wv, cos, sin)


@_qkv.defjvp
def _qkv_jvp(primals, tangents):
    return jax.jvp(_qkv_reference, primals, tangents)  # differentiated: the unfused form


def qkv_fuses(
    x: Array, norm: object, projs: tuple[eqx.nn.Linear, ...], rotary: RotaryEmbedding | None
) -> bool:
    """Whether `qkv_block` computes `x`'s attention inputs in one call: an `RMSNorm`, q, k and
    v projections of packed weights without biases, all of `x`'s dtype (float32 or bfloat16),
    and a rotary embedding over whole heads."""
    weights = tuple(p.weight for p in projs)
    return (
        isinstance(norm, RMSNorm)
        and isinstance(rotary, RotaryEmbedding)
        and len(projs) == 3
        and all(isinstance(w, PackedWeight) and w.dtype == x.dtype for w in weights)
        and all(p.bias is None for p in projs)
        and x.dtype in NATIVE_DTYPES
        and norm.weight.dtype == x.dtype
        and norm.weight.shape == x.shape[-1:]
        and all(w.shape[1:] == x.shape[-1:] for w in weights)
        and all(w.shape[0] % rotary.dim == 0 for w in weights[:2])
        and math.prod(x.shape[:-1]) >= 1
    )


def qkv_block(
    x: Float[Array, "*rows dim"],
    norm: RMSNorm,
    projs: tuple[eqx.nn.Linear, eqx.nn.Linear, eqx.nn.Linear],
    rotary: RotaryEmbedding,
    positions: Int[Array, "*rows"],
) -> tuple[Float[Array, "*rows q"], Float[Array, "*rows k"], Float[Array, "*rows v"]]:
    r"""A pre-norm self-attention's inputs: $n = \mathrm{norm}(x)$, its projections
    $q, k, v = n W_q^\top, n W_k^\top, n W_v^\top$ (flat, heads side by side), q and k turned
    by `rotary` at `positions`. Where `qkv_fuses` (a `Decoder`'s packed weights on CPU) one
    call of treeattn's C++ kernel, the norm and the rotation rounded as `RMSNorm` and
    `RotaryEmbedding` round; differentiated, or elsewhere, the same unfused
    (`_qkv_reference`)."""
    if not qkv_fuses(x, norm, projs, rotary):
        weights = [(type(p.weight).__name__, str(p.weight.dtype), p.weight.shape) for p in projs]
        raise ValueError(
            f"qkv_block: an RMSNorm, three projections of packed weights without biases and a "
            f"rotary embedding over whole heads of q and k, all of x's dtype; got x "
            f"{x.dtype}{list(x.shape)}, norm {type(norm).__name__}, weights {weights}, rotary "
            f"of dim {getattr(rotary, 'dim', None)}"
        )
    if tuple(positions.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"qkv_block: positions must have x's rows' shape {list(x.shape[:-1])}, got "
            f"{list(positions.shape)}"
        )
    cos, sin = rotary.angles(positions.reshape(-1))
    cos, sin = (t.reshape(*x.shape[:-1], rotary.dim) for t in (cos, sin))
    wq, wk, wv = (p.weight for p in projs)
    return _qkv(x, norm.weight, jnp.float32(norm.eps), wq, wk, wv, cos, sin)
