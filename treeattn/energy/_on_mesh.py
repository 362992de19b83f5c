r"""The free energy of global arrays whose keys and values are sharded over a mesh.

`tree_free_energy` and `tree_energy_attention` take whole arrays, shard the sequence over the
mesh axis `kv_axis` themselves, and run Algorithm 1 in one `shard_map` and Algorithm 2 (the
one-reduction gradient) in another; the gradient is a custom VJP defined outside both, so it
holds for every reduction schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .._numerics import Dims, Window, check_window, compute_dtype, default_scale, visibility
from .._partials import AxisName, Reduction, check_reduction
from .._sharding import SequenceSharding
from ._checks import check_multihead, check_q_offset
from ._energies import SOFTMAX, Energy, check_energy, is_plain_softmax
from ._sharded import _float0_like, _like, _local_grads, _local_terms


@dataclasses.dataclass(frozen=True)
class _OnMesh:
    """Static configuration of one energy of global arrays sharded over a mesh (hashable: a
    custom_vjp static argument)."""

    sharding: SequenceSharding
    local: Dims  # sizes of one device's shard
    scale: float
    causal: bool
    reduction: Reduction
    zeta_at_zero: bool
    window: Window | None = None

    @property
    def axis_name(self) -> AxisName:
        return self.sharding.axis_name

    def specs(self, args: dict) -> dict:
        seq = self.sharding.spec(3, 0)
        specs = {"q": P(), "k": seq, "v": seq, "zeta": P(), "q_offset": P()}
        if "mask" in args:
            specs["mask"] = self.sharding.spec(args["mask"].ndim, args["mask"].ndim - 1)
        return specs

    def shard_map(self, fn, in_specs, out_specs):
        return self.sharding.shard_map(fn, in_specs, out_specs)

    def visible(self, a: dict):
        kv_offset = lax.axis_index(self.axis_name) * self.local.kv_seq
        return visibility(
            self.local,
            causal=self.causal,
            mask=a.get("mask"),
            q_offset=a["q_offset"],
            kv_offset=kv_offset,
            window=self.window,
        )

    def static(self):
        return (self.local, self.scale, self.axis_name, self.reduction, self.zeta_at_zero)


def _forward(plan: _OnMesh, args: dict) -> Array:
    def local(a):
        return _local_terms(a["q"], a["k"], a["v"], a["zeta"], plan.visible(a), *plan.static())

    return plan.shard_map(local, (plan.specs(args),), P())(args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mesh_terms(plan: _OnMesh, args: dict) -> Array:
    """F_{i,h} of globally sharded arrays: Algorithm 1 in one shard_map, Algorithm 2 in another.

    The gradient is defined here, outside the shard_maps, so it holds for every schedule
    (including the butterfly, whose shard_map runs without the replication checker).
    """
    return _forward(plan, args)


def _mesh_terms_fwd(plan: _OnMesh, args: dict):
    f = _forward(plan, args)
    return f, (args, f)


def _mesh_terms_bwd(plan: _OnMesh, res, ct):
    args, f = res

    def local(a, f, ct):
        grads = _local_grads(
            a["q"], a["k"], a["v"], a["zeta"], plan.visible(a), f, ct, *plan.static()
        )
        return dict(zip(("q", "k", "v", "zeta"), grads, strict=True))

    specs = plan.specs(args)
    out_specs = {name: specs[name] for name in ("q", "k", "v", "zeta")}
    grads = plan.shard_map(local, (specs, P(), P()), out_specs)(args, f, ct)
    cotangents: dict[str, Any] = {
        name: _like(g, args[name], plan.sharding.user_mesh) for name, g in grads.items()
    }
    for name in ("q_offset", "mask"):
        if name in args:
            cotangents[name] = _float0_like(args[name])
    return (cotangents,)


_mesh_terms.defvjp(_mesh_terms_fwd, _mesh_terms_bwd)


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
    plan = _OnMesh(
        sharding, local, default_scale(dims.qk, scale), causal, reduction, zeta_at_zero, window
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
    if not is_plain_softmax(energy):
        from ._generic import mesh_total

        return mesh_total(_generic_plan(plan, k, args), energy, args)
    return _energy(plan, args)


def _generic_plan(plan: _OnMesh, k, args: dict):
    """The plan of the energy's general path; the window applies by absolute position on
    every shard, as for softmax."""
    from ._generic import on_mesh_plan

    return on_mesh_plan(
        plan.sharding,
        plan.local,
        k.shape[0],
        plan.scale,
        plan.causal,
        plan.reduction,
        plan.zeta_at_zero,
        "mask" in args,
        plan.window,
    )


@functools.partial(jax.jit, static_argnums=0)
def _energy(plan: _OnMesh, args: dict) -> Array:
    return jnp.sum(_mesh_terms(plan, args))


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
    if not is_plain_softmax(energy):
        from ._generic import mesh_attention

        return mesh_attention(_generic_plan(plan, k, args), energy, args).astype(q.dtype)
    return _attention(plan, args).astype(q.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _attention(plan: _OnMesh, args: dict) -> Array:
    def total(zeta):
        return jnp.sum(_mesh_terms(plan, {**args, "zeta": zeta}))

    with jax.named_scope("tree_energy_attention"):
        return jax.grad(total)(args["zeta"])
