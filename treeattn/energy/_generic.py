r"""One evaluation path for every `Energy`: local, sharded inside `shard_map`, and on a mesh.

Per query row the free energy is the energy's readout of its monoid's reduction of the per-key
elements. Attention is `jax.grad` in $\zeta$ at $\zeta = 0$ (the tilt $\zeta\cdot v$ is not
computed there: `tilt_at_zero`), cumulants are higher derivatives. Across devices each shard
lifts its keys to a state, the monoid's collective schedule merges the states, and the
gradient is the paper's Algorithm 2 for any monoid: the pullback of the merged state to a
device's own state needs no communication, so the gradient costs one reduction more (of the
cotangents of the replicated q, ζ and energy parameters).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from .._numerics import (
    Dims,
    Masking,
    Window,
    compute_dtype,
    default_scale,
    lse_from_rows,
    visibility,
)
from .._partials import AxisName, Reduction, axis_size, sum_across
from .._sharding import SequenceSharding
from ._blockwise import blockwise, blockwise_attention, choose_block, zero_cotangents
from ._checks import dims_of
from ._energies import Context, make_context
from ._local import local_state, readout


def free_energy_terms(
    energy,
    q,
    k,
    v,
    zeta,
    mask,
    q_offset,
    causal,
    scale,
    at_zero,
    block_size=None,
    window=None,
    masking: Masking | None = None,
) -> Array:
    """$F$ of every (query, head), `[q_seq, heads]`, blockwise when `choose_block` picks a
    block (see `total_energy`), else from the materialised logits. `window` is a sliding window
    by absolute position; `masking` the other rules of visibility (segments, prefix, chunks)."""
    dims = dims_of(q, k, v)
    block = choose_block(dims, block_size, causal=causal)
    if block is not None:
        kw = {"block": block, "causal": causal, "scale": scale, "at_zero": at_zero}
        kw |= {"window": window, "masking": masking}
        return blockwise(energy, q, k, v, zeta, mask, q_offset, dims, **kw)
    vis = visibility(
        dims, causal=causal, mask=mask, q_offset=q_offset, window=window, masking=masking
    )
    ctx = make_context(dims, default_scale(dims.qk, scale), q_offset, 0, dims.kv_seq)
    state = local_state(energy, q, k, v, zeta, vis, ctx, at_zero, once=True)
    return lse_from_rows(energy.readout(state, ctx), ctx.dims)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_size", "window"))
def total_energy(
    energy,
    q,
    k,
    v,
    zeta,
    mask,
    q_offset,
    *,
    causal,
    scale,
    block_size=None,
    window=None,
    masking=None,
):
    args = (energy, q, k, v, zeta, mask, q_offset, causal, scale, False, block_size, window)
    return jnp.sum(free_energy_terms(*args, masking))


@functools.partial(
    jax.jit, static_argnames=("causal", "scale", "block_size", "window", "with_energy")
)
def attention(
    energy,
    q,
    k,
    v,
    mask,
    q_offset,
    *,
    causal,
    scale,
    block_size=None,
    window=None,
    with_energy=False,
    masking=None,
):
    r"""$\partial F/\partial\zeta$ at 0 `[q_seq, heads, dv]` (and with `with_energy`, $F(0)$
    `[q_seq, heads]`): blockwise (a custom VJP of its own, in O(N d) memory through training)
    when `choose_block` picks a block, else the materialised $F$ and its pullback. `window` is a
    sliding window by absolute position."""
    dims = dims_of(q, k, v)
    block = choose_block(dims, block_size, causal=causal)
    if block is not None:
        kw = {"block": block, "causal": causal, "scale": scale, "window": window}
        kw["masking"] = masking
        with jax.named_scope("energy_attention"):
            out = blockwise_attention(energy, q, k, v, mask, q_offset, dims, **kw)
            if not with_energy:
                return out.astype(q.dtype)
            # F in blocks of its own (its own custom VJP): computed only where it is used.
            f = blockwise(energy, q, k, v, None, mask, q_offset, dims, at_zero=True, **kw)
        return out.astype(q.dtype), f
    zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))

    def terms(zeta):
        args = (energy, q, k, v, zeta, mask, q_offset, causal, scale, True, 0, window)
        return free_energy_terms(*args, masking)

    with jax.named_scope("energy_attention"):
        f, pull = jax.vjp(terms, zeta)
        (out,) = pull(jnp.ones_like(f))
    return (out.astype(q.dtype), f) if with_energy else out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("order", "causal", "scale", "window"))
def cumulant(energy, q, k, v, mask, q_offset, *, order, causal, scale, window=None, masking=None):
    dims = dims_of(q, k, v)

    def total(zeta):
        # Forward mode (the higher derivatives) needs the materialised form: block_size=0.
        args = (energy, q, k, v, zeta, mask, q_offset, causal, scale, True, 0, window)
        return jnp.sum(free_energy_terms(*args, masking))

    def mean_field(u):
        return jax.grad(total)(jnp.broadcast_to(u, (dims.q_seq, dims.heads, dims.dv)))

    derivative = mean_field
    for _ in range(order - 1):
        derivative = jax.jacfwd(derivative)
    with jax.named_scope("value_moments"):
        out = derivative(jnp.zeros((dims.dv,), compute_dtype(q.dtype)))
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Sharded: inside shard_map (Algorithm 1 forward, Algorithm 2 gradient, for any monoid)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sharded:
    """Static configuration of one sharded evaluation (hashable)."""

    local: Dims
    scale: float
    kv_total: int
    axis_name: AxisName
    reduction: Reduction
    at_zero: bool
    head_major: bool = False  # K and V `[kv_heads, kv, d]` (a cache read where it lies)
    finite: bool = False  # K and V are known finite: no pass zeroes non-finite rows

    def local_state(self, energy, q, k, v, zeta, vis, ctx):
        kw = {"head_major": self.head_major, "finite": self.finite}
        return local_state(energy, q, k, v, zeta, vis, ctx, self.at_zero, **kw)


def _like(g: Array, x: Array, mesh) -> Array:
    """`g` with the sharding type of `x` (for inputs sharded over Explicit mesh axes)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    abstract = getattr(sharding, "mesh", None)
    if sharding is None or abstract is None or abstract.empty:
        return g
    if explicit is None or explicit not in tuple(abstract.axis_types):
        return g
    return jax.sharding.reshard(g, jax.sharding.NamedSharding(mesh, sharding.spec))


def sharded_context(cfg: Sharded, q_offset, kv_offset, kv_pos=None) -> Context:
    """The context of this device's keys: at `kv_offset + a`, or at the absolute positions
    `kv_pos[a]` when given (a cache not stored in position order); `kv_offset` is then only
    the rank an ordered monoid folds the devices by."""
    ctx = make_context(cfg.local, cfg.scale, q_offset, kv_offset, cfg.kv_total)
    return ctx if kv_pos is None else ctx._replace(k_pos=jnp.asarray(kv_pos).astype(jnp.int32))


def sharded_forward(cfg: Sharded, energy, q, k, v, zeta, vis, q_offset, kv_offset, kv_pos=None):
    """F `[q_seq, heads]` of the whole sequence on every device, and what its gradient keeps."""
    ctx = sharded_context(cfg, q_offset, kv_offset, kv_pos)
    state = cfg.local_state(energy, q, k, v, zeta, vis, ctx)
    merged, residual = energy.monoid.across(state, cfg.axis_name, cfg.reduction, kv_offset)
    return readout(energy, merged, ctx), (state, merged, residual)


def sharded_backward(
    cfg: Sharded, energy, q, k, v, zeta, vis, q_offset, kv_offset, saved, ct, kv_pos=None
):
    """Cotangents of (energy, q, k, v, zeta): one reduction, of the replicated ones."""
    ctx = sharded_context(cfg, q_offset, kv_offset, kv_pos)
    state, merged, residual = saved
    # Cotangents for the energy's inexact arrays only; its integer ones (a position) get float0.
    fixed = eqx.filter(energy, eqx.is_inexact_array, inverse=True)
    energy = eqx.filter(energy, eqx.is_inexact_array)
    _, pull_readout = jax.vjp(lambda e, m: readout(eqx.combine(e, fixed), m, ctx), energy, merged)
    d_energy_once, d_merged = pull_readout(ct)
    d_state = energy.monoid.pullback(state, merged, residual, d_merged)
    # The replicated inputs enter as per-device copies (plus a zero that varies like the local
    # keys): their cotangents are then this device's share, reduced once below, and JAX does not
    # insert its own sum for them inside a shard_map that checks replication.
    zero = jnp.sum(jnp.zeros_like(k[:1, :1, :1]))
    local = jax.tree.map(lambda x: x + zero.astype(jnp.result_type(x)), (energy, q, zeta))
    _, pull_local = jax.vjp(
        lambda e, q, k, v, z: cfg.local_state(eqx.combine(e, fixed), q, k, v, z, vis, ctx),
        local[0],
        local[1],
        k,
        v,
        local[2],
    )
    d_state = jax.tree.map(lambda c: c + zero.astype(c.dtype), d_state)
    d_energy, d_q, d_k, d_v, d_zeta = pull_local(d_state)
    # Each leaf is reduced on its own so that an unused one (d_q, when only attention is
    # wanted) is removed; XLA packs the live ones into one all-reduce.
    reduce = functools.partial(sum_across, axis_name=cfg.axis_name, reduction=cfg.reduction)
    d_energy = jax.tree.map(lambda a, b: reduce(a) + b, d_energy, d_energy_once)
    d_energy = eqx.combine(d_energy, zero_cotangents(fixed))
    return d_energy, reduce(d_q), d_k, d_v, reduce(d_zeta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sharded_terms(cfg: Sharded, energy, q, k, v, zeta, vis, q_offset, kv_offset, kv_pos=None):
    return sharded_forward(cfg, energy, q, k, v, zeta, vis, q_offset, kv_offset, kv_pos)[0]


def _sharded_terms_fwd(cfg, energy, q, k, v, zeta, vis, q_offset, kv_offset, kv_pos=None):
    f, saved = sharded_forward(cfg, energy, q, k, v, zeta, vis, q_offset, kv_offset, kv_pos)
    return f, (energy, q, k, v, zeta, vis, q_offset, kv_offset, kv_pos, saved)


def _sharded_terms_bwd(cfg, res, ct):
    energy, q, k, v, zeta, vis, q_offset, kv_offset, kv_pos, saved = res
    grads = sharded_backward(
        cfg, energy, q, k, v, zeta, vis, q_offset, kv_offset, saved, ct, kv_pos
    )
    return (*grads, *zero_cotangents((vis, q_offset, kv_offset, kv_pos)))


sharded_terms.defvjp(_sharded_terms_fwd, _sharded_terms_bwd)


def no_keys(energy, q, k, v, zeta, q_offset, dims: Dims, scale) -> Array:
    """F `[q_seq, heads]` of a sequence without keys: the readout of the monoid's identity
    (and of the energy's once-only term), computed without a collective."""
    ctx = make_context(dims, scale, q_offset, 0, 0)
    return readout(energy, local_state(energy, q, k, v, zeta, None, ctx, False), ctx)


def sharded_total(
    energy, q, k, v, zeta, vis, q_offset, kv_offset, dims, scale, axis_name, reduction
):
    """`sharded_free_energy` for any energy (arguments already checked)."""
    if dims.kv_seq == 0:  # no key anywhere: every device holds the answer already
        return jnp.sum(no_keys(energy, q, k, v, zeta, q_offset, dims, scale))
    total = dims.kv_seq * axis_size(axis_name)
    cfg = Sharded(dims, scale, total, axis_name, reduction, False)
    return jnp.sum(sharded_terms(cfg, energy, q, k, v, zeta, vis, q_offset, kv_offset))


def sharded_attention(energy, q, k, v, vis, q_offset, kv_offset, dims, scale, axis_name, reduction):
    """`sharded_energy_attention` for any energy (arguments already checked)."""
    if dims.kv_seq == 0:  # no key anywhere: every row attends to nothing
        return jnp.zeros((dims.q_seq, dims.heads, dims.dv), q.dtype)
    cfg = Sharded(dims, scale, dims.kv_seq * axis_size(axis_name), axis_name, reduction, True)
    zeta = jnp.zeros((dims.q_seq, dims.heads, dims.dv), compute_dtype(q.dtype))

    def total(zeta):
        return jnp.sum(sharded_terms(cfg, energy, q, k, v, zeta, vis, q_offset, kv_offset))

    with jax.named_scope("sharded_energy_attention"):
        return jax.grad(total)(zeta).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# On a mesh: global arrays, the custom VJP outside the two shard_maps
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OnMesh:
    sharding: SequenceSharding
    cfg: Sharded
    causal: bool
    has_mask: bool
    window: Window | None = None  # a sliding window by absolute position

    def specs(self, args: dict):
        seq = self.sharding.spec(3, 0)
        specs: dict[str, Any] = {"q": P(), "k": seq, "v": seq, "zeta": P(), "q_offset": P()}
        if self.has_mask:
            specs["mask"] = self.sharding.spec(_mask_ndim(args), _mask_ndim(args) - 1)
        if "masking" in args:
            # Every rule is replicated but the key segment ids, which travel with the keys.
            m = args["masking"]
            specs["masking"] = jax.tree.map(lambda _: P(), m.keys(None)).keys(
                None if m.kv_segments is None else self.sharding.spec(1, 0)
            )
        return specs

    def local(self, a: dict):
        kv_offset = lax.axis_index(self.cfg.axis_name) * self.cfg.local.kv_seq
        vis = visibility(
            self.cfg.local,
            causal=self.causal,
            mask=a.get("mask"),
            q_offset=a["q_offset"],
            kv_offset=kv_offset,
            window=self.window,
            masking=a.get("masking"),
        )
        return (a["q"], a["k"], a["v"], a["zeta"], vis, a["q_offset"], kv_offset)


def _mask_ndim(args: dict) -> int:
    return args["mask"].ndim if "mask" in args else 2


def _mesh_forward(plan: OnMesh, energy, args: dict):
    def local(energy, a):
        f, saved = sharded_forward(plan.cfg, energy, *plan.local(a))
        return f, jax.tree.map(lambda x: jnp.asarray(x)[None], saved)

    axis = plan.sharding.axis_name
    in_specs = (P(), plan.specs(args))
    return plan.sharding.shard_map(local, in_specs, (P(), P(axis)))(energy, args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def mesh_terms(plan: OnMesh, energy, args: dict):
    return _mesh_forward(plan, energy, args)[0]


def _mesh_terms_fwd(plan, energy, args):
    f, saved = _mesh_forward(plan, energy, args)
    return f, (energy, args, saved)


def _mesh_terms_bwd(plan, res, ct):
    energy, args, saved = res
    specs = plan.specs(args)
    axis = plan.sharding.axis_name

    def local(energy, a, saved, ct):
        saved = jax.tree.map(lambda x: x[0], saved)
        q, k, v, zeta, vis, q_offset, kv_offset = plan.local(a)
        d_e, d_q, d_k, d_v, d_z = sharded_backward(
            plan.cfg, energy, q, k, v, zeta, vis, q_offset, kv_offset, saved, ct
        )
        return d_e, {"q": d_q, "k": d_k, "v": d_v, "zeta": d_z}

    out_specs = (P(), {name: specs[name] for name in ("q", "k", "v", "zeta")})
    d_energy, grads = plan.sharding.shard_map(local, (P(), specs, P(axis), P()), out_specs)(
        energy, args, saved, ct
    )
    # On a mesh with Explicit axes each cotangent takes the sharding type of its input.
    mesh = plan.sharding.user_mesh
    grads: dict[str, Any] = {name: _like(g, args[name], mesh) for name, g in grads.items()}
    for name in ("q_offset", "mask", "masking"):
        if name in args:
            grads[name] = zero_cotangents(args[name])
    return d_energy, grads


mesh_terms.defvjp(_mesh_terms_fwd, _mesh_terms_bwd)


@functools.partial(jax.jit, static_argnums=0)
def mesh_total(plan: OnMesh, energy, args: dict):
    return jnp.sum(mesh_terms(plan, energy, args))


@functools.partial(jax.jit, static_argnums=0)
def mesh_attention(plan: OnMesh, energy, args: dict):
    def total(zeta):
        return jnp.sum(mesh_terms(plan, energy, {**args, "zeta": zeta}))

    with jax.named_scope("tree_energy_attention"):
        return jax.grad(total)(args["zeta"])


def on_mesh_plan(
    sharding: SequenceSharding,
    local: Dims,
    kv_total: int,
    scale,
    causal,
    reduction,
    at_zero,
    has_mask,
    window: Window | None = None,
) -> OnMesh:
    cfg = Sharded(local, scale, kv_total, sharding.axis_name, reduction, at_zero)
    return OnMesh(sharding, cfg, causal, has_mask, window)
