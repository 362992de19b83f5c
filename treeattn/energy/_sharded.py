r"""The free energy with keys and values sharded along the sequence (paper, Algorithms 1 and 2).

Each device reduces its shard of keys to the partial free energy of every query,
$\mathrm{lse}^{(d)}_{i,h} = \log\sum_{a \in \mathrm{shard}\ d} e^{x_{i,h,a}}$, and the devices merge
these with associative reductions (Algorithm 1: a max, then a sum). Attention is the gradient of
the merged energy at $\zeta = 0$; a custom VJP implements Algorithm 2: the forward saves the
merged energy $F$ (which holds the max), and the gradient needs **one** more sum across devices,
of $\sum_{a\in\mathrm{shard}} e^{x_a - F} v_a$ (and of the query gradient, packed with it).

`tree_free_energy` and `tree_energy_attention` take whole arrays instead: they shard the
sequence over the mesh axis `kv_axis` themselves, and run Algorithm 1 in one `shard_map` and
Algorithm 2 (the one-reduction gradient) in another; the gradient is a custom VJP defined
outside both, so it holds for every reduction schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .._numerics import (
    Masking,
    as_position,
    compute_dtype,
    default_scale,
    visibility,
)
from .._partials import (
    AxisName,
    Reduction,
    check_bound_axes,
    check_reduction,
)
from .._sharding import SequenceSharding
from ._checks import check_problem, check_q_offset
from ._energies import SOFTMAX, Energy, check_energy
from ._generic import (
    mesh_attention,
    mesh_total,
    on_mesh_plan,
    sharded_attention,
    sharded_total,
    total_energy,
)


def _sharded(fn, q, k, v, zeta, *, axis_name, mask, q_offset, kv_offset, reduction, **rest):
    """Check the arguments, build this device's visibility, and evaluate: F_tot with a source
    `zeta`, attention without (`zeta=None`). `rest`: `causal`, `scale`, `local_window_size`,
    `energy`."""
    scale, energy = rest["scale"], rest["energy"]
    dims, window, masking = check_problem(
        fn, q, k, v, zeta=zeta, mask=mask, q_offset=q_offset, **rest
    )
    check_reduction(fn, reduction, axis_name)
    check_bound_axes(fn, axis_name)
    check_energy(fn, energy)
    if kv_offset is None:
        kv_offset = lax.axis_index(axis_name) * dims.kv_seq
    else:
        check_q_offset(fn, kv_offset, name="kv_offset")
    vis = visibility(
        dims,
        causal=rest["causal"],
        mask=mask,
        q_offset=q_offset,
        kv_offset=kv_offset,
        window=window,
        masking=masking,
    )
    s = default_scale(dims.qk, scale)
    offsets = (as_position(q_offset), as_position(kv_offset))
    if zeta is None:
        return sharded_attention(energy, q, k, v, vis, *offsets, dims, s, axis_name, reduction)
    return sharded_total(energy, q, k, v, zeta, vis, *offsets, dims, s, axis_name, reduction)


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
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
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
    sliding `local_window_size`, the segment ids, `prefix_length`, `chunk_size` and `mask_mod`
    included: positions are absolute, so each shard applies them to its own keys, and
    `kv_segment_ids` is this shard's), plus `axis_name` (a mesh axis name or tuple of names),
    `kv_offset`, and
    `reduction` in `{"allreduce", "butterfly", "hierarchical"}` (`"butterfly"` needs
    `check_vma=False` on the enclosing `shard_map`; `"hierarchical"` needs
    `axis_name=(slow, fast)`), and `energy` (default `Softmax()`): any
    [`Energy`][treeattn.energy.Energy] reduces with its monoid's schedule — a sum is one
    all-reduce, an ordered monoid one all-gather folded by `kv_offset` (which, like
    `"butterfly"`, needs `check_vma=False`) — and its gradient costs one reduction more.

    **Returns:** the scalar $F_\mathrm{tot}$ (float32, or float64), replicated.
    """
    return _sharded("sharded_free_energy", **locals())


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
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
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
    return _sharded("sharded_energy_attention", zeta=None, **locals())


# ---------------------------------------------------------------------------------------------
# On a mesh: global arrays, sharded here
# ---------------------------------------------------------------------------------------------


def mesh_problem(
    sharding: SequenceSharding,
    dims,
    q,
    k,
    v,
    zeta,
    mask,
    q_offset,
    scale,
    causal,
    reduction,
    window,
    masking: Masking | None = None,
):
    """The plan and the global arguments of an evaluation on a mesh (arguments already
    checked, `dims.kv_seq > 0`): the sequence padded to a multiple of the device count with
    masked keys; `zeta=None` is the point 0."""
    at_zero = zeta is None
    pad = sharding.padding(dims.kv_seq)
    if pad:
        # Keys beyond the sequence are padding: zero, and masked out everywhere.
        k, v = sharding.pad(k, 0), sharding.pad(v, 0)
        valid = jnp.arange(dims.kv_seq + pad) < dims.kv_seq
        if mask is None:
            mask = jnp.broadcast_to(valid, (dims.q_seq, dims.kv_seq + pad))
        else:
            mask = sharding.pad(jnp.asarray(mask), mask.ndim - 1) & valid
        if masking is not None and masking.kv_segments is not None:
            masking = masking.keys(sharding.pad(masking.kv_segments, 0))
    local = dataclasses.replace(dims, kv_seq=(dims.kv_seq + pad) // sharding.devices)
    s = default_scale(dims.qk, scale)
    has_mask = mask is not None
    plan = on_mesh_plan(
        sharding, local, dims.kv_seq, s, causal, reduction, at_zero, has_mask, window
    )
    if at_zero:
        zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))
    args = {"q": q, "k": k, "v": v, "zeta": zeta, "q_offset": jnp.asarray(q_offset, jnp.int32)}
    if mask is not None:
        args["mask"] = jnp.asarray(mask)
    if masking is not None:
        args["masking"] = masking
    return plan, args


def check_on_mesh(fn: str, q, k, v, zeta, *, mesh, kv_axis, reduction, energy, **rest):
    """`check_problem` (`rest`: its keywords, others ignored), the energy, and the sequence
    sharding of `(mesh, kv_axis)` with its `reduction`: `(dims, window, masking, sharding)`."""
    dims, window, masking = check_problem(fn, q, k, v, zeta=zeta, **rest)
    check_energy(fn, energy)
    sharding = SequenceSharding.create(fn, mesh, kv_axis)
    check_reduction(fn, reduction, sharding.axis_name)
    return dims, window, masking, sharding


def _on_mesh(fn, q, k, v, zeta, *, mesh, kv_axis, mask, q_offset, reduction, **rest):
    """Validate, pad the sequence to a multiple of the device count, and evaluate: F_tot with
    a source `zeta`, attention without (`zeta=None`, the point 0). `rest`: `causal`, `scale`,
    `local_window_size`, `energy`."""
    causal, scale, energy = rest["causal"], rest["scale"], rest["energy"]
    dims, window, masking, sharding = check_on_mesh(
        fn,
        q,
        k,
        v,
        zeta,
        mesh=mesh,
        kv_axis=kv_axis,
        mask=mask,
        q_offset=q_offset,
        reduction=reduction,
        **rest,
    )
    at_zero = zeta is None
    if dims.kv_seq == 0:  # no key to shard: the answer needs no device but this one
        if at_zero:
            return jnp.zeros((dims.q_seq, dims.heads, dims.dv), q.dtype)
        kw = {"causal": causal, "scale": scale, "window": window, "masking": masking}
        return total_energy(energy, q, k, v, zeta, mask, jnp.asarray(q_offset, jnp.int32), **kw)
    plan, args = mesh_problem(
        sharding, dims, q, k, v, zeta, mask, q_offset, scale, causal, reduction, window, masking
    )
    if at_zero:
        return mesh_attention(plan, energy, args).astype(q.dtype)
    return mesh_total(plan, energy, args)


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
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, ""]:
    r"""[`sharded_free_energy`][treeattn.energy.sharded_free_energy] for global arrays.

    `k`, `v` (and `mask`) are split along the sequence over the mesh axis `kv_axis` (a name, or
    `(slow, fast)` for the hierarchical schedule); `q` and `zeta` are replicated. A sequence that
    does not divide evenly is padded with masked keys (so some shards may hold no valid key at
    all). Same value as [`multihead_free_energy`][treeattn.energy.multihead_free_energy];
    differentiable in `q`, `k`, `v` and `zeta` with the one-reduction gradient of Algorithm 2,
    for every schedule. `local_window_size`, the segment ids (`kv_segment_ids` split with the
    keys), `prefix_length`, `chunk_size` and `mask_mod` act as in `multihead_free_energy`.
    Any `energy` (default `Softmax()`) reduces with its monoid's schedule.

    ```python
    mesh = jax.make_mesh((4,), ("kv",), axis_types=(jax.sharding.AxisType.Auto,))
    F = tree_free_energy(q, k, v, zeta, mesh=mesh, kv_axis="kv", causal=True)
    ```
    """
    return _on_mesh("tree_free_energy", **locals())


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
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads dv"]:
    r"""Attention over a sequence sharded on `kv_axis`: `jax.grad` of
    [`tree_free_energy`][treeattn.energy.tree_free_energy] in $\zeta$ at $\zeta = 0$.

    The forward runs Algorithm 1 on every shard (two reductions of `[q_seq, heads]` with the
    `"allreduce"` schedule) and the gradient Algorithm 2 (one reduction of `[q_seq, heads, dv]`);
    at $\zeta = 0$ the source term is not computed. Same result as
    [`energy_attention`][treeattn.energy.energy_attention]; differentiable in q, k, v.

    **Returns:** `[q_seq, heads, dv]` in the input dtype, replicated.
    """
    return _on_mesh("tree_energy_attention", zeta=None, **locals())
