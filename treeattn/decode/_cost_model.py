r"""An alpha-beta model of one decode step, ring vs tree, on a two-level GPU cluster.

A message of $m$ bytes over a link costs $\alpha + m/\beta$ (latency, bandwidth). A cluster has
nodes of $g$ devices with a fast intra-node link and a slower inter-node one (one NIC per
device, as in a DGX). One decode step over a context of $N$ tokens sharded over $p = n g$
devices, hidden size $D = n_h d$, element size $e$ bytes:

- **local attention** on $N/p$ tokens reads the shard's K and V, $2 N D e / p$ bytes, at the
  device's memory bandwidth (or takes a measured time);
- **tree** (the all-reduce schedule): local attention, then two all-reduces (a max of the
  $b\,n_h$ lse values, a sum of $b(D + n_h)$ partials, float32), each hierarchical as NCCL runs
  them on such clusters: a ring inside the node, then across nodes;
- **ring** (the baseline): $p - 1$ steps, each passing a whole K/V shard to the next device
  over the slowest link of the ring while (at best) overlapping the attention of the shard in
  hand: $t_\mathrm{attn} + (p-1)\max(t_\mathrm{attn}, \alpha + 2NDe/(p\beta_\mathrm{slow}))$.

Everything here is a model: no GPU was measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A two-level cluster (bandwidths in bytes/s per device and direction, latencies in s).

    `overhead` is a fixed cost per communication step (a collective call or a ring step:
    kernel launches and synchronisation) on top of the link latency.
    """

    name: str
    devices_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    memory_bandwidth: float
    overhead: float = 0.0


# NVLink 4 (900 GB/s per GPU, both directions together), 8 x 400 Gb/s InfiniBand NDR per node
# (one 50 GB/s NIC per GPU), H100 SXM HBM3 at 3.35 TB/s.
DGX_H100 = Cluster(
    name="DGX H100",
    devices_per_node=8,
    intra_bandwidth=450e9,
    intra_latency=3e-6,
    inter_bandwidth=50e9,
    inter_latency=10e-6,
    memory_bandwidth=3.35e12,
)


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    """Modelled seconds of one decode step and bytes each device sends."""

    context: int
    devices: int
    attention: float
    tree: float
    ring: float
    tree_bytes: float
    ring_bytes: float

    @property
    def speedup(self) -> float:
        """ring / tree."""
        return self.ring / self.tree


def _allreduce(nbytes: float, devices: int, c: Cluster) -> tuple[float, float]:
    """(seconds, bytes sent per device) of one hierarchical all-reduce of `nbytes`."""
    g = min(devices, c.devices_per_node)
    nodes = math.ceil(devices / g)
    t = sent = 0.0
    if g > 1:  # ring reduce-scatter + all-gather inside the node
        steps = 2 * (g - 1)
        t += steps * (c.intra_latency + nbytes / g / c.intra_bandwidth)
        sent += steps * nbytes / g
    if nodes > 1:  # each device all-reduces its 1/g slice with its peers of the other nodes
        part = nbytes / g
        rounds = 2 * math.ceil(math.log2(nodes))
        t += rounds * c.inter_latency + 2 * (nodes - 1) / nodes * part / c.inter_bandwidth
        sent += 2 * (nodes - 1) / nodes * part
    return t + c.overhead, sent


def cost_model(
    context: int,
    devices: int,
    *,
    cluster: Cluster = DGX_H100,
    heads: int = 16,
    head_dim: int = 128,
    batch: int = 1,
    itemsize: int = 2,
    local_attention: Callable[[int], float] | float | None = None,
) -> DecodeCost:
    """Modelled time of one decode step of `context` tokens over `devices`, ring vs tree.

    **Arguments:**

    - `context`, `devices`: the KV cache length and the number of devices it is sharded over.
    - `cluster`: link and memory figures ([`DGX_H100`][treeattn.decode.DGX_H100] by default).
    - `heads`, `head_dim`, `batch`, `itemsize`: the attention block (the paper's: 16 heads of
      128, batch 1, bfloat16).
    - `local_attention`: seconds of the local attention on one shard — a number, a function of
      the shard's token count, or `None` to assume it streams K and V at the memory bandwidth.

    **Returns:** a [`DecodeCost`][treeattn.decode.DecodeCost].
    """
    if devices < 1 or context < devices:
        raise ValueError(f"cost_model: need 1 <= devices <= context, got {devices}, {context}")
    shard = context / devices
    shard_bytes = 2 * batch * shard * heads * head_dim * itemsize  # K and V
    if local_attention is None:
        t_attn = shard_bytes / cluster.memory_bandwidth
    elif callable(local_attention):
        t_attn = float(local_attention(math.ceil(shard)))
    else:
        t_attn = float(local_attention)
    if devices == 1:
        return DecodeCost(context, 1, t_attn, t_attn, t_attn, 0.0, 0.0)
    lse_bytes = 4 * batch * heads
    t_max, b_max = _allreduce(lse_bytes, devices, cluster)
    t_sum, b_sum = _allreduce(4 * batch * (heads * head_dim + heads), devices, cluster)
    tree = t_attn + t_max + t_sum
    crosses_nodes = devices > cluster.devices_per_node
    bandwidth = cluster.inter_bandwidth if crosses_nodes else cluster.intra_bandwidth
    latency = cluster.inter_latency if crosses_nodes else cluster.intra_latency
    step = latency + cluster.overhead + shard_bytes / bandwidth
    ring = t_attn + (devices - 1) * max(t_attn, step)
    return DecodeCost(
        context=context,
        devices=devices,
        attention=t_attn,
        tree=tree,
        ring=ring,
        tree_bytes=b_max + b_sum,
        ring_bytes=(devices - 1) * shard_bytes,
    )
