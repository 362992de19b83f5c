r"""The free energy with keys and values sharded along the sequence (paper, Algorithms 1 and 2).

Each device reduces its shard of keys to the partial free energy of every query,
$\mathrm{lse}^{(d)}_{i,h} = \log\sum_{a \in \mathrm{shard}\ d} e^{x_{i,h,a}}$, and the devices merge
these with associative reductions (Algorithm 1: a max, then a sum). Attention is the gradient of
the merged energy at $\zeta = 0$; a custom VJP implements Algorithm 2: the forward saves the
merged energy $F$ (which holds the max), and the gradient needs **one** more sum across devices,
of $\sum_{a\in\mathrm{shard}} e^{x_a - F} v_a$ (and of the query gradient, packed with it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from ._checks import (
    Dims,
    check_multihead,
    check_q_offset,
    compute_dtype,
    default_scale,
    visibility,
)
from ._free_energy import _rows, _tilt, _unrows, masked_logsumexp, scaled_logits
from ._merge import AxisName, Reduction, allreduce_partials, allreduce_sum, check_reduction


def _logits(q, k, v, zeta, dims: Dims, scale: float, zeta_at_zero: bool) -> Array:
    """Local logits $s\\,q\\cdot k_a + \\zeta\\cdot v_a$, `[kv_heads, group * q_seq, kv_local]`."""
    x = scaled_logits(q, k, dims, scale)
    if not zeta_at_zero:
        ct = x.dtype
        x = x + _tilt(_rows(zeta.astype(ct), dims), v.astype(ct))
    return x


def _grid(dims: Dims) -> tuple[int, int, int, int]:
    return (dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq)


def _local_terms(q, k, v, zeta, vis, dims, scale, axis_name, reduction, zeta_at_zero):
    """Algorithm 1 on one device: the global F_{i,h}, `[q_seq, heads]`, from the local shard."""
    x = _logits(q, k, v, zeta, dims, scale, zeta_at_zero)
    lse_local = masked_logsumexp(x.reshape(_grid(dims)), vis)
    _, lse = allreduce_partials(None, lse_local, axis_name=axis_name, reduction=reduction)
    return lse.reshape(dims.heads, dims.q_seq).T


def _local_grads(q, k, v, zeta, vis, f, ct, dims, scale, axis_name, reduction, zeta_at_zero):
    """Algorithm 2 on one device: cotangents of (q, k, v, zeta) given the merged energies `f`.

    `ct` `[q_seq, heads]` is the cotangent of F_{i,h}, the same on every device.
    """
    ct_dtype = compute_dtype(q.dtype)
    x = _logits(q, k, v, zeta, dims, scale, zeta_at_zero).reshape(_grid(dims))
    if vis is not None:
        x = jnp.where(vis, x, -jnp.inf)
    f_grid = f.T.reshape(dims.kv_heads, dims.group, dims.q_seq)
    ct_grid = ct.T.reshape(dims.kv_heads, dims.group, dims.q_seq).astype(ct_dtype)
    # Lines 3-4: the global attention weights of the local keys, e^{x_a - F}; F >= max_a x_a,
    # so this never overflows. A query with no visible key anywhere has F = -inf and weight 0.
    f_safe = jnp.where(jnp.isfinite(f_grid), f_grid, 0.0)
    p = jnp.exp(x - f_safe[..., None]) * ct_grid[..., None]
    p_rows = p.reshape(dims.kv_heads, dims.group * dims.q_seq, dims.kv_seq)
    d_zeta = jnp.einsum("kms,skv->kmv", p_rows, v.astype(ct_dtype))
    d_q = scale * jnp.einsum("kms,skd->kmd", p_rows, k.astype(ct_dtype))
    # Line 5: the one reduction across devices. The two sums are reduced separately so that an
    # unused one (d_q, when only attention is wanted) is removed by XLA; when both are live,
    # XLA's all-reduce combiner packs them into a single all-reduce.
    d_zeta = allreduce_sum(d_zeta, axis_name=axis_name, reduction=reduction)
    d_q = allreduce_sum(d_q, axis_name=axis_name, reduction=reduction)
    # The local keys and values need no communication.
    q_rows = _rows(q.astype(ct_dtype), dims)
    d_k = (scale * jnp.einsum("kms,kmd->skd", p_rows, q_rows)).astype(k.dtype)
    if zeta_at_zero:
        d_v = jnp.zeros_like(v)
    else:
        zeta_rows = _rows(zeta.astype(ct_dtype), dims)
        d_v = jnp.einsum("kms,kmv->skv", p_rows, zeta_rows).astype(v.dtype)
    return (
        _unrows(d_q, dims).astype(q.dtype),
        d_k,
        d_v,
        _unrows(d_zeta, dims).astype(zeta.dtype),
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


def _prepare(fn, q, k, v, zeta, *, axis_name, causal, mask, q_offset, kv_offset, reduction):
    dims = check_multihead(fn, q, k, v, zeta=zeta, mask=mask)
    check_q_offset(fn, q_offset)
    check_reduction(fn, reduction, axis_name)
    if kv_offset is None:
        kv_offset = lax.axis_index(axis_name) * dims.kv_seq
    else:
        check_q_offset(fn, kv_offset)
    vis = visibility(dims, causal=causal, mask=mask, q_offset=q_offset, kv_offset=kv_offset)
    return dims, vis


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

    **Arguments:** as [`multihead_free_energy`][treeattn.energy.multihead_free_energy], plus
    `axis_name` (a mesh axis name or tuple of names), `kv_offset`, and `reduction` in
    `{"allreduce", "butterfly", "hierarchical"}` (`"butterfly"` needs `check_vma=False` on the
    enclosing `shard_map`; `"hierarchical"` needs `axis_name=(slow, fast)`).

    **Returns:** the scalar $F_\mathrm{tot}$ (float32, or float64), replicated.
    """
    fn = "sharded_free_energy"
    dims, vis = _prepare(
        fn,
        q,
        k,
        v,
        zeta,
        axis_name=axis_name,
        causal=causal,
        mask=mask,
        q_offset=q_offset,
        kv_offset=kv_offset,
        reduction=reduction,
    )
    s = default_scale(dims.qk, scale)
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
    dims, vis = _prepare(
        fn,
        q,
        k,
        v,
        None,
        axis_name=axis_name,
        causal=causal,
        mask=mask,
        q_offset=q_offset,
        kv_offset=kv_offset,
        reduction=reduction,
    )
    s = default_scale(dims.qk, scale)
    zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))

    def total(zeta):
        return jnp.sum(_sharded_terms(q, k, v, zeta, vis, dims, s, axis_name, reduction, True))

    with jax.named_scope("sharded_energy_attention"):
        out = jax.grad(total)(zeta)
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Global arrays: shard_map wrappers
# ---------------------------------------------------------------------------------------------


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis in Auto mode.

    From jax 0.9 on, `jax.make_mesh` makes Explicit axes by default, and `shard_map` then
    refuses inputs whose sharding type does not already match `in_specs`; the tree functions
    shard their inputs themselves, so they run their `shard_map` on the Auto view of the mesh.
    """
    axis_type = getattr(jax.sharding, "AxisType", None)
    types = getattr(mesh, "axis_types", None)
    if axis_type is None or types is None or all(t == axis_type.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * len(types))


def _mesh_axes(fn: str, mesh: Mesh, kv_axis: AxisName) -> tuple[AxisName, int]:
    axes = (kv_axis,) if isinstance(kv_axis, str) else tuple(kv_axis)
    for a in axes:
        if a not in mesh.shape:
            raise ValueError(
                f"{fn}: kv_axis {a!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})"
            )
    return (axes[0] if len(axes) == 1 else axes), math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class _Tree:
    """Static configuration of one tree-sharded energy (hashable: a custom_vjp static arg)."""

    mesh: Mesh
    axis_name: AxisName
    local: Dims  # sizes of one device's shard
    scale: float
    causal: bool
    reduction: str
    zeta_at_zero: bool
    user_mesh: Mesh  # as given (its axes may be Explicit); `mesh` is its Auto view

    def specs(self, args: dict) -> dict:
        seq = P(self.axis_name)
        specs = {"q": P(), "k": seq, "v": seq, "zeta": P(), "q_offset": P()}
        if "mask" in args:
            specs["mask"] = P(*([None] * (args["mask"].ndim - 1)), self.axis_name)
        return specs

    def shard_map(self, fn, in_specs, out_specs):
        # The butterfly's result is replicated by construction, which the checker cannot see.
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=self.reduction != "butterfly",
        )

    def visible(self, a: dict):
        kv_offset = lax.axis_index(self.axis_name) * self.local.kv_seq
        return visibility(
            self.local,
            causal=self.causal,
            mask=a.get("mask"),
            q_offset=a["q_offset"],
            kv_offset=kv_offset,
        )

    def static(self):
        return (self.local, self.scale, self.axis_name, self.reduction, self.zeta_at_zero)


def _tree_forward(tree: _Tree, args: dict) -> Array:
    def local(a):
        return _local_terms(a["q"], a["k"], a["v"], a["zeta"], tree.visible(a), *tree.static())

    return tree.shard_map(local, (tree.specs(args),), P())(args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tree_terms(tree: _Tree, args: dict) -> Array:
    """F_{i,h} of globally sharded arrays: Algorithm 1 in one shard_map, Algorithm 2 in another.

    The gradient is defined here, outside the shard_maps, so it holds for every schedule
    (including the butterfly, whose shard_map runs without the replication checker).
    """
    return _tree_forward(tree, args)


def _tree_terms_fwd(tree: _Tree, args: dict):
    f = _tree_forward(tree, args)
    return f, (args, f)


def _tree_terms_bwd(tree: _Tree, res, ct):
    args, f = res

    def local(a, f, ct):
        grads = _local_grads(
            a["q"], a["k"], a["v"], a["zeta"], tree.visible(a), f, ct, *tree.static()
        )
        return dict(zip(("q", "k", "v", "zeta"), grads, strict=True))

    specs = tree.specs(args)
    out_specs = {name: specs[name] for name in ("q", "k", "v", "zeta")}
    grads = tree.shard_map(local, (specs, P(), P()), out_specs)(args, f, ct)
    cotangents: dict[str, Any] = {
        name: _like(g, args[name], tree.user_mesh) for name, g in grads.items()
    }
    for name in ("q_offset", "mask"):
        if name in args:
            cotangents[name] = _float0_like(args[name])
    return (cotangents,)


_tree_terms.defvjp(_tree_terms_fwd, _tree_terms_bwd)


def _tree_setup(
    fn, q, k, v, zeta, *, mesh, kv_axis, causal, mask, scale, q_offset, reduction, zeta_at_zero
):
    """Validate, pad the sequence to a multiple of the device count, and build the config."""
    dims = check_multihead(fn, q, k, v, zeta=zeta, mask=mask)
    check_q_offset(fn, q_offset)
    axis_name, p = _mesh_axes(fn, mesh, kv_axis)
    check_reduction(fn, reduction, axis_name)
    pad = -dims.kv_seq % p
    if pad:
        # Keys beyond the sequence are padding: zero, and masked out everywhere.
        k = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
        valid = jnp.arange(dims.kv_seq + pad) < dims.kv_seq
        if mask is None:
            mask = jnp.broadcast_to(valid, (dims.q_seq, dims.kv_seq + pad))
        else:
            mask = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)]) & valid
    local = dataclasses.replace(dims, kv_seq=(dims.kv_seq + pad) // p)
    tree = _Tree(
        auto_mesh(mesh),
        axis_name,
        local,
        default_scale(dims.qk, scale),
        causal,
        reduction,
        zeta_at_zero,
        mesh,
    )
    if zeta is None:
        zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))
    args = {"q": q, "k": k, "v": v, "zeta": zeta, "q_offset": jnp.asarray(q_offset, jnp.int32)}
    if mask is not None:
        args["mask"] = jnp.asarray(mask)
    return tree, args


def tree_free_energy(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    zeta: Float[Array, "q_seq heads dv"],
    *,
    mesh: Mesh,
    kv_axis: AxisName,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    reduction: Reduction = "allreduce",
) -> Float[Array, ""]:
    r"""[`sharded_free_energy`][treeattn.energy.sharded_free_energy] for global arrays.

    `k`, `v` (and `mask`) are split along the sequence over the mesh axis `kv_axis` (a name, or
    `(slow, fast)` for the hierarchical schedule); `q` and `zeta` are replicated. A sequence that
    does not divide evenly is padded with masked keys (so some shards may hold no valid key at
    all). Same value as [`multihead_free_energy`][treeattn.energy.multihead_free_energy];
    differentiable in `q`, `k`, `v` and `zeta` with the one-reduction gradient of Algorithm 2,
    for every schedule.

    ```python
    mesh = jax.make_mesh((4,), ("kv",), axis_types=(jax.sharding.AxisType.Auto,))
    F = tree_free_energy(q, k, v, zeta, mesh=mesh, kv_axis="kv", causal=True)
    ```
    """
    tree, args = _tree_setup(
        "tree_free_energy",
        q,
        k,
        v,
        zeta,
        mesh=mesh,
        kv_axis=kv_axis,
        causal=causal,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        reduction=reduction,
        zeta_at_zero=False,
    )
    return _tree_energy(tree, args)


@functools.partial(jax.jit, static_argnums=0)
def _tree_energy(tree: _Tree, args: dict) -> Array:
    return jnp.sum(_tree_terms(tree, args))


def tree_energy_attention(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    mesh: Mesh,
    kv_axis: AxisName,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    reduction: Reduction = "allreduce",
) -> Float[Array, "q_seq heads dv"]:
    r"""Attention over a sequence sharded on `kv_axis`: `jax.grad` of
    [`tree_free_energy`][treeattn.energy.tree_free_energy] in $\zeta$ at $\zeta = 0$.

    The forward runs Algorithm 1 on every shard (two reductions of `[q_seq, heads]` with the
    `"allreduce"` schedule) and the gradient Algorithm 2 (one reduction of `[q_seq, heads, dv]`);
    at $\zeta = 0$ the source term is not computed. Same result as
    [`energy_attention`][treeattn.energy.energy_attention]; differentiable in q, k, v.

    **Returns:** `[q_seq, heads, dv]` in the input dtype, replicated.
    """
    tree, args = _tree_setup(
        "tree_energy_attention",
        q,
        k,
        v,
        None,
        mesh=mesh,
        kv_axis=kv_axis,
        causal=causal,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        reduction=reduction,
        zeta_at_zero=True,
    )

    return _tree_attention(tree, args).astype(q.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _tree_attention(tree: _Tree, args: dict) -> Array:
    def total(zeta):
        return jnp.sum(_tree_terms(tree, {**args, "zeta": zeta}))

    with jax.named_scope("tree_energy_attention"):
        return jax.grad(total)(args["zeta"])
