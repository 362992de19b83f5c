"""Tree decoding for an energy other than softmax: the energy's own sharded path.

The fused kernels compute softmax partials only; any other energy is served by
`treeattn.energy.tree_energy_attention`, whose monoid supplies the merge across devices.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

from ..energy import Energy, tree_energy_attention


def energy_tree_decode(
    fn: str,
    energy: Energy,
    q,
    k,
    v,
    *,
    mesh: Mesh,
    kv_axis,
    kv_length,
    scale,
    reduction,
    kv_layout,
    causal,
    q_offset,
    kv_positions,
):
    """`tree_decode` of batch rows one by one with `tree_energy_attention` (checked arguments)."""
    if kv_positions is not None:
        raise ValueError(f"{fn}: kv_positions is not supported with energy={type(energy).__name__}")
    if kv_layout == "bhsd":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    batch, q_seq = q.shape[:2]
    kv_seq = k.shape[1]
    lengths = jnp.broadcast_to(jnp.asarray(kv_seq if kv_length is None else kv_length), (batch,))
    offsets = lengths - q_seq if q_offset is None else q_offset
    offsets = jnp.broadcast_to(jnp.asarray(offsets), (batch,))
    pos = jnp.arange(kv_seq)
    outs = []
    for b in range(batch):
        mask = jnp.broadcast_to(pos[None, :] < lengths[b], (q_seq, kv_seq))
        if causal:
            mask = mask & (pos[None, :] <= offsets[b] + jnp.arange(q_seq)[:, None])
        kw = {"mesh": mesh, "kv_axis": kv_axis, "scale": scale, "reduction": reduction}
        outs.append(tree_energy_attention(q[b], k[b], v[b], mask=mask, energy=energy, **kw))
    return jnp.stack(outs)
