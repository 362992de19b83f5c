r"""The free energy with keys and values sharded along the sequence (paper, Algorithms 1 and 2).

Each device reduces its shard of keys to the partial free energy of every query,
$\mathrm{lse}^{(d)}_{i,h} = \log\sum_{a \in \mathrm{shard}\ d} e^{x_{i,h,a}}$, and the devices merge
these with associative reductions (Algorithm 1: a max, then a sum). Attention is the gradient of
the merged energy at $\zeta = 0$; a custom VJP implements Algorithm 2: the forward saves the
merged energy $F$ (which holds the max), and the gradient needs **one** more sum across devices,
of $\sum_{a\in\mathrm{shard}} e^{x_a - F} v_a$ (and of the query gradient, packed with it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .._numerics import (
    Dims,
    as_position,
    check_window,
    compute_dtype,
    default_scale,
    from_rows,
    masked_logsumexp,
    to_rows,
    visibility,
)
from .._partials import (
    AxisName,
    Reduction,
    check_bound_axes,
    check_reduction,
    merge_across,
    sum_across,
)
from ._checks import check_multihead, check_q_offset
from ._energies import SOFTMAX, Energy, check_energy, is_plain_softmax
from ._free_energy import _tilt, bad_logits, finite_kv, scaled_logits


def _logits(q, k, v, bad, zeta, dims: Dims, scale: float, zeta_at_zero: bool) -> Array:
    """Local logits $s\\,q\\cdot k_a + \\zeta\\cdot v_a$, `[kv_heads, group * q_seq, kv_local]`,
    of finite `k`, `v` (NaN where the key/value row was not finite: see `finite_kv`)."""
    x = scaled_logits(q, k, dims, scale)
    if not zeta_at_zero:
        ct = x.dtype
        x = x + _tilt(to_rows(zeta.astype(ct), dims), v.astype(ct))
    return bad_logits(x, bad)


def _grid(dims: Dims) -> tuple[int, int, int, int]:
    return (dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq)


def _local_terms(q, k, v, zeta, vis, dims, scale, axis_name, reduction, zeta_at_zero):
    """Algorithm 1 on one device: the global F_{i,h}, `[q_seq, heads]`, from the local shard."""
    k, v, bad = finite_kv(k, v)
    x = _logits(q, k, v, bad, zeta, dims, scale, zeta_at_zero)
    lse_local = masked_logsumexp(x.reshape(_grid(dims)), vis)
    _, lse = merge_across(None, lse_local, axis_name=axis_name, reduction=reduction)
    return lse.reshape(dims.heads, dims.q_seq).T


def _local_grads(q, k, v, zeta, vis, f, ct, dims, scale, axis_name, reduction, zeta_at_zero):
    """Algorithm 2 on one device: cotangents of (q, k, v, zeta) given the merged energies `f`.

    `ct` `[q_seq, heads]` is the cotangent of F_{i,h}, the same on every device.
    """
    ct_dtype = compute_dtype(q.dtype)
    k_in, v_in = k, v
    k, v, bad = finite_kv(k, v)
    x = _logits(q, k, v, bad, zeta, dims, scale, zeta_at_zero).reshape(_grid(dims))
    if vis is not None:
        x = jnp.where(vis, x, -jnp.inf)
    f_grid = f.T.reshape(dims.kv_heads, dims.group, dims.q_seq)
    ct_grid = ct.T.reshape(dims.kv_heads, dims.group, dims.q_seq).astype(ct_dtype)
    # Lines 3-4: the global attention weights of the local keys, e^{x_a - F}; F >= max_a x_a,
    # so this never overflows. A query with no visible key anywhere has F = -inf and weight 0.
    f_safe = jnp.where(jnp.isfinite(f_grid), f_grid, 0.0)
    p = jnp.exp(x - f_safe[..., None]) * ct_grid[..., None]
    if vis is not None:  # a hidden NaN logit (a non-finite key) must give weight 0, not NaN
        p = jnp.where(vis, p, 0.0)
    p_rows = p.reshape(dims.kv_heads, dims.group * dims.q_seq, dims.kv_seq)
    d_zeta = jnp.einsum("kms,skv->kmv", p_rows, v.astype(ct_dtype))
    d_q = scale * jnp.einsum("kms,skd->kmd", p_rows, k.astype(ct_dtype))
    # Line 5: the one reduction across devices. The two sums are reduced separately so that an
    # unused one (d_q, when only attention is wanted) is removed by XLA; when both are live,
    # XLA's all-reduce combiner packs them into a single all-reduce.
    d_zeta = sum_across(d_zeta, axis_name=axis_name, reduction=reduction)
    d_q = sum_across(d_q, axis_name=axis_name, reduction=reduction)
    # The local keys and values need no communication.
    q_rows = to_rows(q.astype(ct_dtype), dims)
    d_k = (scale * jnp.einsum("kms,kmd->skd", p_rows, q_rows)).astype(k_in.dtype)
    if zeta_at_zero:
        d_v = jnp.zeros_like(v_in)
    else:
        zeta_rows = to_rows(zeta.astype(ct_dtype), dims)
        d_v = jnp.einsum("kms,kmv->skv", p_rows, zeta_rows).astype(v_in.dtype)
    return (
        from_rows(d_q, dims).astype(q.dtype),
        d_k,
        d_v,
        from_rows(d_zeta, dims).astype(zeta.dtype),
    )


def _like(g: Array, x: Array, mesh: Mesh) -> Array:
    """`g` with the sharding type of `x` (for inputs sharded over Explicit mesh axes)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    abstract = getattr(sharding, "mesh", None)
    if sharding is None or abstract is None or abstract.empty:
        return g
    if explicit is None or explicit not in tuple(abstract.axis_types):
        return g
    return jax.sharding.reshard(g, jax.sharding.NamedSharding(mesh, sharding.spec))


def _float0_like(x):
    return None if x is None else np.zeros(np.shape(x), jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _sharded_terms(q, k, v, zeta, vis, dims, scale, axis_name, reduction, zeta_at_zero):
    """Inside `shard_map`: Algorithm 1 forward, Algorithm 2 gradient."""
    return _local_terms(q, k, v, zeta, vis, dims, scale, axis_name, reduction, zeta_at_zero)


def _sharded_terms_fwd(q, k, v, zeta, vis, *static):
    f = _local_terms(q, k, v, zeta, vis, *static)
    # Algorithm 1, line 7: keep the merged energy (it carries the max) for the gradient; the
    # local logits are recomputed there rather than stored (O(q_seq) memory, not O(q_seq * kv)).
    return f, (q, k, v, zeta, vis, f)


def _sharded_terms_bwd(*args):
    *static, (q, k, v, zeta, vis, f), ct = args
    grads = _local_grads(q, k, v, zeta, vis, f, ct, *static)
    return (*grads, _float0_like(vis))


_sharded_terms.defvjp(_sharded_terms_fwd, _sharded_terms_bwd)


def _prepare(
    fn,
    q,
    k,
    v,
    zeta,
    *,
    axis_name,
    causal,
    mask,
    scale,
    q_offset,
    kv_offset,
    reduction,
    local_window_size=None,
):
    dims = check_multihead(fn, q, k, v, zeta=zeta, mask=mask, scale=scale)
    check_q_offset(fn, q_offset)
    check_reduction(fn, reduction, axis_name)
    check_bound_axes(fn, axis_name)
    if kv_offset is None:
        kv_offset = lax.axis_index(axis_name) * dims.kv_seq
    else:
        check_q_offset(fn, kv_offset, name="kv_offset")
    window = check_window(fn, local_window_size)
    vis = visibility(
        dims, causal=causal, mask=mask, q_offset=q_offset, kv_offset=kv_offset, window=window
    )
    return dims, vis, kv_offset


def sharded_free_energy(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_local kv_heads qk"],
    v: Float[Array, "kv_local kv_heads dv"],
    zeta: Float[Array, "q_seq heads dv"],
    *,
    axis_name: AxisName,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_local"] | Bool[Array, "heads q_seq kv_local"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    kv_offset: int | Int[Array, ""] | None = None,
    reduction: Reduction = "allreduce",
    local_window_size: int | tuple[int, int] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, ""]:
    r"""The multi-head free energy of keys and values sharded along `axis_name` (Algorithm 1).

    Call inside `jax.shard_map`. `q` and `zeta` are replicated; `k`, `v` and `mask` are this
    device's shard of the sequence, whose first key sits at absolute position `kv_offset`
    (default `lax.axis_index(axis_name) * kv_local`, i.e. contiguous equal shards in device
    order). Each device reduces its shard to the partial free energies
    $\mathrm{lse}^{(d)}_{i,h}$; the devices merge them with the `reduction` schedule (see
    [`allreduce_partials`][treeattn.energy.allreduce_partials]) into

    $$F_\mathrm{tot} = \sum_{i,h} \log \sum_{d} e^{\mathrm{lse}^{(d)}_{i,h}},$$

    the same value as [`multihead_free_energy`][treeattn.energy.multihead_free_energy] of the
    whole sequence, on every device. Its gradient is a custom VJP (Algorithm 2): the forward keeps
    the merged energies, and the gradient in `zeta` and `q` costs one more reduction (both sums
    packed in it); the gradients in the local `k` and `v` need none.

    **Arguments:** as [`multihead_free_energy`][treeattn.energy.multihead_free_energy] (the
    sliding `local_window_size` included: positions are absolute, so each shard applies it to
    its own keys), plus `axis_name` (a mesh axis name or tuple of names), `kv_offset`, and
    `reduction` in `{"allreduce", "butterfly", "hierarchical"}` (`"butterfly"` needs
    `check_vma=False` on the enclosing `shard_map`; `"hierarchical"` needs
    `axis_name=(slow, fast)`), and `energy` (default `Softmax()`): any
    [`Energy`][treeattn.energy.Energy] reduces with its monoid's schedule — a sum is one
    all-reduce, an ordered monoid one all-gather folded by `kv_offset` (which, like
    `"butterfly"`, needs `check_vma=False`) — and its gradient costs one reduction more.

    **Returns:** the scalar $F_\mathrm{tot}$ (float32, or float64), replicated.
    """
    fn = "sharded_free_energy"
    check_energy(fn, energy)
    dims, vis, kv_offset = _prepare(
        fn,
        q,
        k,
        v,
        zeta,
        axis_name=axis_name,
        causal=causal,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        kv_offset=kv_offset,
        reduction=reduction,
        local_window_size=local_window_size,
    )
    s = default_scale(dims.qk, scale)
    if not is_plain_softmax(energy):
        from ._generic import sharded_total

        args = (q, k, v, zeta, vis, as_position(q_offset), as_position(kv_offset))
        return sharded_total(energy, *args, dims, s, axis_name, reduction)
    return jnp.sum(_sharded_terms(q, k, v, zeta, vis, dims, s, axis_name, reduction, False))


def sharded_energy_attention(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_local kv_heads qk"],
    v: Float[Array, "kv_local kv_heads dv"],
    *,
    axis_name: AxisName,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_local"] | Bool[Array, "heads q_seq kv_local"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    kv_offset: int | Int[Array, ""] | None = None,
    reduction: Reduction = "allreduce",
    local_window_size: int | tuple[int, int] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads dv"]:
    r"""Attention over sharded keys as `jax.grad` of the sharded free energy at $\zeta = 0$.

    Call inside `jax.shard_map`, with the arguments of
    [`sharded_free_energy`][treeattn.energy.sharded_free_energy]. The forward (Algorithm 1)
    and its gradient (Algorithm 2) cost, per device, the attention of the local shard plus
    three reductions of size independent of the sequence length (`"allreduce"`: a max and a sum
    of `[q_seq, heads]`, then a sum of `[q_seq, heads, dv]`); at $\zeta = 0$ the source term is
    not computed. Differentiable in `q`, `k`, `v`.

    **Returns:** `[q_seq, heads, dv]` in the input dtype, replicated.
    """
    fn = "sharded_energy_attention"
    check_energy(fn, energy)
    dims, vis, kv_offset = _prepare(
        fn,
        q,
        k,
        v,
        None,
        axis_name=axis_name,
        causal=causal,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        kv_offset=kv_offset,
        reduction=reduction,
        local_window_size=local_window_size,
    )
    s = default_scale(dims.qk, scale)
    if not is_plain_softmax(energy):
        from ._generic import sharded_attention

        args = (q, k, v, vis, as_position(q_offset), as_position(kv_offset))
        return sharded_attention(energy, *args, dims, s, axis_name, reduction)
    zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))

    def total(zeta):
        return jnp.sum(_sharded_terms(q, k, v, zeta, vis, dims, s, axis_name, reduction, True))

    with jax.named_scope("sharded_energy_attention"):
        out = jax.grad(total)(zeta)
    return out.astype(q.dtype)
