r"""The Ring Attention baseline for decoding (the paper's point of comparison).

K/V shards travel around the ring of devices with `lax.ppermute`, one hop per step, for p - 1
steps; every device merges the partial `(out, lse)` of each shard as it passes, so after the
last step each holds the full result. Exact, like tree decoding, but it moves whole K/V shards
(paper eq. 31: $2btd$ elements per step) and holds two of them at once (eq. 29).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .._numerics import Layout
from .._partials import Reduction, merge_partials
from ..energy import Energy
from ._energies import SOFTMAX
from ._plan import DecodePlan, run_sharded
from ._registry import Backend


def ring_decode(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    *,
    mesh: Mesh,
    kv_axis: str | tuple[str, ...],
    kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    scale: float | None = None,
    backend: Backend | Sequence[Backend] = "auto",
    reduction: Reduction | None = None,
    kv_layout: Layout = "bshd",
    causal: bool = False,
    q_offset: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    kv_positions: Int[Array, " kv_seq"] | Int[Array, "batch kv_seq"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    mask: Bool[Array, "#batch #heads #q_seq #kv_seq"] | None = None,
    bias: Float[Array, "#batch #heads #q_seq #kv_seq"] | None = None,
    shard_lengths: Int[Array, " devices"] | Int[Array, "batch devices"] | None = None,
    energy: Energy | None = SOFTMAX,
    kv_finite: bool = False,
    q_segment_ids: Int[Array, "#batch q_seq"] | None = None,
    kv_segment_ids: Int[Array, "#batch kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
) -> Float[Array, "batch q_seq heads dv"]:
    r"""The Ring Attention baseline: same arguments and result as
    [`tree_decode`][treeattn.decode.tree_decode].

    Each of the p devices starts with its own shard; at every step it computes the local
    attention of the shard it holds, merges it into its running `(out, lse)` with
    [`merge_partials`][treeattn.energy.merge_partials], and passes the shard to the next device
    (`lax.ppermute`), p - 1 times. `reduction` is accepted for a drop-in swap with
    `tree_decode` and ignored: the ring is the schedule.

    With `energy` other than `Softmax()` (see `tree_decode`), each device lifts every shard
    that passes to the energy's monoid state and folds the p states — by shard position for an
    ordered monoid (stick-breaking) — then reads out $F$; the output is its gradient in
    $\zeta$, complete on every device (no reduction). This is the baseline tree decoding of an
    energy is measured against: it moves whole K/V shards where the tree moves states.
    """
    args = dict(locals())  # every argument, as given
    args["reduction"] = None  # the ring is the schedule
    return run_sharded("ring_decode", "ring", _ring, **args)


@jax.named_scope("ring_decode")
def _ring(plan: DecodePlan, q, k, v, offsets, lengths, positions, mask, bias, *, scale, reduction):
    del reduction  # the ring is the schedule
    p = plan.devices
    ring = [(i, (i + 1) % p) for i in range(p)]

    def local(q, k, v, offsets, lengths, positions, mask, bias):
        me = plan.local_shard()

        def attend(shard_kv, step):
            # After `step` hops this device holds the shard that started on device me - step.
            shard = (me - step) % p
            k, v, positions, mask, bias = shard_kv
            return plan.attend(shard, q, k, v, offsets, lengths, positions, mask, bias, scale=scale)

        def step(i, carry):
            shard_kv, out, lse = carry
            # One hop: receive the previous device's shard, with its key positions, mask and
            # bias (p - 1 hops in all).
            shard_kv = lax.ppermute(shard_kv, plan.axis_name, perm=ring)
            b_out, b_lse = attend(shard_kv, i)
            out, lse = merge_partials(out, lse, b_out, b_lse)
            return shard_kv, out, lse

        shard_kv = (k, v, positions, mask, bias)
        out, lse = attend(shard_kv, 0)
        _, out, lse = lax.fori_loop(1, p, step, (shard_kv, out, lse))
        return out.astype(q.dtype)

    return plan.shard_map(local)(q, k, v, offsets, lengths, positions, mask, bias)
