"""Shape and dtype validation of the energy functions' arguments.

Everything here runs at trace time: a bad shape is a `ValueError` before XLA sees anything.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import ArrayLike

from .._numerics import (
    MASKING_ARGUMENTS,
    Dims,
    Masking,
    Window,
    check_masking,
    check_position,
    check_scale,
    check_window,
    shape_of as _shape,
)


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


def dims_of(q, k, v) -> Dims:
    """Sizes of already validated `q[q_seq, heads, qk]`, `k[kv_seq, kv_heads, qk]`, `v`."""
    (q_seq, heads, qk), (kv_seq, kv_heads, _), dv = q.shape, k.shape, v.shape[-1]
    return Dims(q_seq=q_seq, kv_seq=kv_seq, heads=heads, kv_heads=kv_heads, qk=qk, dv=dv)


def check_multihead(
    fn: str,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    zeta: ArrayLike | None = None,
    zeta_name: str = "zeta",
    mask: ArrayLike | None = None,
    scale=None,
) -> Dims:
    """Validate `q[q_seq, heads, qk]`, `k[kv_seq, kv_heads, qk]`, `v[kv_seq, kv_heads, dv]`.

    Also `zeta[q_seq, heads, dv]` and a boolean `mask` of shape `[q_seq, kv_seq]` or
    `[heads, q_seq, kv_seq]` when given, and that `scale` is None or a Python float. Returns
    the sizes; raises `ValueError` naming the shapes.
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
    check_scale(fn, scale)
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


def check_q_offset(fn: str, q_offset, *, name: str = "q_offset") -> None:
    """`q_offset` is a non-negative integer: a Python int or an integer scalar array, whose
    value is checked when it can be read (concrete); a traced one cannot be."""
    check_position(fn, name, q_offset, read_arrays=True)


def check_problem(
    fn: str,
    q,
    k,
    v,
    *,
    zeta=None,
    mask=None,
    scale=None,
    q_offset=0,
    local_window_size=None,
    **rules,
) -> tuple[Dims, Window | None, Masking | None]:
    """What every function of the free energy takes, checked once at its boundary: the heads
    (and `zeta`, `mask`, `scale`), `q_offset`, the sliding window and the masking rules
    (`rules`: the keywords of `MASKING_ARGUMENTS`, others ignored). Returns the sizes, the
    window as `(left, right)` and the rules as one `Masking` (or None)."""
    dims = check_multihead(fn, q, k, v, zeta=zeta, mask=mask, scale=scale)
    check_q_offset(fn, q_offset)
    window = check_window(fn, local_window_size)
    given = {name: rules[name] for name in MASKING_ARGUMENTS if name in rules}
    masking = check_masking(fn, q_seq=dims.q_seq, kv_seq=dims.kv_seq, **given)
    return dims, window, masking
