r"""The free energy of global arrays whose keys and values are sharded over a mesh.

`tree_free_energy` and `tree_energy_attention` take whole arrays, shard the sequence over the
mesh axis `kv_axis` themselves, and run Algorithm 1 in one `shard_map` and Algorithm 2 (the
one-reduction gradient) in another; the gradient is a custom VJP defined outside both, so it
holds for every reduction schedule.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .._numerics import check_window, compute_dtype, default_scale
from .._partials import AxisName, Reduction, check_reduction
from .._sharding import SequenceSharding
from ._checks import check_multihead, check_q_offset
from ._energies import SOFTMAX, Energy, check_energy
from ._generic import mesh_attention, mesh_total, on_mesh_plan, total_energy


def _setup(
    fn,
    q,
    k,
    v,
    zeta,
    *,
    mesh,
    kv_axis,
    causal,
    mask,
    scale,
    q_offset,
    reduction,
    zeta_at_zero,
    local_window_size=None,
):
    """Validate, pad the sequence to a multiple of the device count, and build the config."""
    dims = check_multihead(fn, q, k, v, zeta=zeta, mask=mask, scale=scale)
    check_q_offset(fn, q_offset)
    window = check_window(fn, local_window_size)
    sharding = SequenceSharding.create(fn, mesh, kv_axis)
    check_reduction(fn, reduction, sharding.axis_name)
    pad = sharding.padding(dims.kv_seq)
    if pad:
        # Keys beyond the sequence are padding: zero, and masked out everywhere.
        k, v = sharding.pad(k, 0), sharding.pad(v, 0)
        valid = jnp.arange(dims.kv_seq + pad) < dims.kv_seq
        if mask is None:
            mask = jnp.broadcast_to(valid, (dims.q_seq, dims.kv_seq + pad))
        else:
            mask = sharding.pad(jnp.asarray(mask), mask.ndim - 1) & valid
    local = dataclasses.replace(dims, kv_seq=(dims.kv_seq + pad) // sharding.devices)
    scale = default_scale(dims.qk, scale)
    has_mask = mask is not None
    plan = on_mesh_plan(
        sharding, local, dims.kv_seq, scale, causal, reduction, zeta_at_zero, has_mask, window
    )
    if zeta is None:
        zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))
    args = {"q": q, "k": k, "v": v, "zeta": zeta, "q_offset": jnp.asarray(q_offset, jnp.int32)}
    if mask is not None:
        args["mask"] = jnp.asarray(mask)
    return plan, args


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
    energy: Energy = SOFTMAX,
) -> Float[Array, ""]:
    r"""[`sharded_free_energy`][treeattn.energy.sharded_free_energy] for global arrays.

    `k`, `v` (and `mask`) are split along the sequence over the mesh axis `kv_axis` (a name, or
    `(slow, fast)` for the hierarchical schedule); `q` and `zeta` are replicated. A sequence that
    does not divide evenly is padded with masked keys (so some shards may hold no valid key at
    all). Same value as [`multihead_free_energy`][treeattn.energy.multihead_free_energy];
    differentiable in `q`, `k`, `v` and `zeta` with the one-reduction gradient of Algorithm 2,
    for every schedule. `local_window_size` is a sliding window by absolute position, as in
    `multihead_free_energy`. Any `energy` (default `Softmax()`) reduces with its monoid's schedule.

    ```python
    mesh = jax.make_mesh((4,), ("kv",), axis_types=(jax.sharding.AxisType.Auto,))
    F = tree_free_energy(q, k, v, zeta, mesh=mesh, kv_axis="kv", causal=True)
    ```
    """
    plan, args = _setup(
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
        local_window_size=local_window_size,
    )
    check_energy("tree_free_energy", energy)
    if plan.cfg.local.kv_seq == 0:  # no key to shard: the answer needs no device but this one
        kw = {"causal": causal, "scale": scale, "window": plan.window}
        return total_energy(energy, q, k, v, args["zeta"], mask, args["q_offset"], **kw)
    return mesh_total(plan, energy, args)


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
    plan, args = _setup(
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
        local_window_size=local_window_size,
    )
    check_energy("tree_energy_attention", energy)
    if plan.cfg.local.kv_seq == 0:  # no key to shard: every row attends to nothing
        return jnp.zeros((*q.shape[:2], v.shape[-1]), q.dtype)
    return mesh_attention(plan, energy, args).astype(q.dtype)
