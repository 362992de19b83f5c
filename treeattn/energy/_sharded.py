r"""The free energy with keys and values sharded along the sequence (paper, Algorithms 1 and 2).

Each device reduces its shard of keys to the partial free energy of every query,
$\mathrm{lse}^{(d)}_{i,h} = \log\sum_{a \in \mathrm{shard}\ d} e^{x_{i,h,a}}$, and the devices merge
these with associative reductions (Algorithm 1: a max, then a sum). Attention is the gradient of
the merged energy at $\zeta = 0$; a custom VJP implements Algorithm 2: the forward saves the
merged energy $F$ (which holds the max), and the gradient needs **one** more sum across devices,
of $\sum_{a\in\mathrm{shard}} e^{x_a - F} v_a$ (and of the query gradient, packed with it).
"""

from __future__ import annotations

from jax import lax
from jaxtyping import Array, Bool, Float, Int

from .._numerics import (
    as_position,
    check_window,
    default_scale,
    visibility,
)
from .._partials import (
    AxisName,
    Reduction,
    check_bound_axes,
    check_reduction,
)
from ._checks import check_multihead, check_q_offset
from ._energies import SOFTMAX, Energy, check_energy
from ._generic import sharded_attention, sharded_total


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
    args = (q, k, v, zeta, vis, as_position(q_offset), as_position(kv_offset))
    return sharded_total(energy, *args, dims, s, axis_name, reduction)


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
    args = (q, k, v, vis, as_position(q_offset), as_position(kv_offset))
    return sharded_attention(energy, *args, dims, s, axis_name, reduction)
