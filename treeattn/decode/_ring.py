r"""The Ring Attention baseline for decoding (the paper's point of comparison).

K/V shards travel around the ring of devices with `lax.ppermute`, one hop per step, for p - 1
steps; every device merges the partial `(out, lse)` of each shard as it passes, so after the
last step each holds the full result. Exact, like tree decoding, but it moves whole K/V shards
(paper eq. 31: $2btd$ elements per step) and holds two of them at once (eq. 29).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from ..energy import merge_partials
from ._backends import flash_attention
from ._tree import Sharded, setup


def ring_decode(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    *,
    mesh: Mesh,
    kv_axis: str | tuple[str, ...],
    kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    scale: float | None = None,
    backend: str = "auto",
    reduction: str | None = None,
    kv_layout: str = "bshd",
    causal: bool = False,
    q_offset: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    kv_positions: Int[Array, " kv_seq"] | Int[Array, "batch kv_seq"] | None = None,
) -> Float[Array, "batch q_seq heads dv"]:
    """The Ring Attention baseline: same arguments and result as
    [`tree_decode`][treeattn.decode.tree_decode].

    Each of the p devices starts with its own shard; at every step it computes
    `flash_attention` of the shard it holds, merges it into its running `(out, lse)` with
    [`merge_partials`][treeattn.energy.merge_partials], and passes the shard to the next device
    (`lax.ppermute`), p - 1 times. `reduction` is accepted for a drop-in swap with
    `tree_decode` and ignored: the ring is the schedule.
    """
    del reduction
    layout, q, k, v, offsets, lengths, positions = setup(
        "ring_decode",
        q,
        k,
        v,
        mesh=mesh,
        kv_axis=kv_axis,
        kv_length=kv_length,
        q_offset=q_offset,
        causal=causal,
        kv_layout=kv_layout,
        reduction=None,
        backend=backend,
        kv_positions=kv_positions,
    )
    return _ring(layout, q, k, v, offsets, lengths, positions, scale=scale)


@jax.named_scope("ring_decode")
def _ring(layout: Sharded, q, k, v, offsets, lengths, positions, *, scale):
    p = layout.devices
    ring = [(i, (i + 1) % p) for i in range(p)]

    def local(q, k, v, offsets, lengths, positions):
        me = lax.axis_index(layout.axis_name)

        def attend(k, v, positions, step):
            # After `step` hops this device holds the shard that started on device me - step.
            q_off, kv_len = layout.local_view(offsets, lengths, (me - step) % p)
            out, lse = flash_attention(
                q,
                k,
                v,
                causal=layout.causal,
                scale=scale,
                q_offset=q_off,
                kv_length=kv_len,
                backend=layout.backend,
                kv_layout=layout.kv_layout,
                kv_positions=positions,
            )
            return out.astype(jnp.float32), jnp.swapaxes(lse, 1, 2)

        def step(i, carry):
            k, v, positions, out, lse = carry
            # One hop: receive the previous device's shard (p - 1 hops in all).
            k, v, positions = lax.ppermute((k, v, positions), layout.axis_name, perm=ring)
            b_out, b_lse = attend(k, v, positions, i)
            out, lse = merge_partials(out, lse, b_out, b_lse)
            return k, v, positions, out, lse

        out, lse = attend(k, v, positions, 0)
        _, _, _, out, lse = lax.fori_loop(1, p, step, (k, v, positions, out, lse))
        return out.astype(q.dtype)

    mapped = layout.shard_map(local)
    return mapped(q, k, v, offsets, lengths, positions)
