r"""Tree decoding (paper, Algorithm 3) and the shared set-up of sequence-sharded decoding.

Every device runs [`flash_attention`][treeattn.decode.flash_attention] on its shard of the KV
cache, giving a partial `(out, lse)`; the partials are merged across devices with
[`allreduce_partials`][treeattn.energy.allreduce_partials] — by default a `pmax` of lse and one
packed `psum` of $(o\,e^{\mathrm{lse}-m}, e^{\mathrm{lse}-m})$, never $e^{\mathrm{lse}}$.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from ..energy import allreduce_partials
from ..energy._merge import check_reduction
from ..energy._sharded import auto_mesh
from ._backends import flash_attention, select_backend
from ._flash import DecodeDims, check_decode, per_row


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A decode call laid out over the devices of `kv_axis`."""

    mesh: Mesh
    axis_name: str | tuple[str, ...]
    devices: int
    dims: DecodeDims  # of one shard
    causal: bool
    kv_layout: str
    backend: str  # resolved for one shard
    positional: bool  # the keys carry explicit positions (kv_positions), sharded with K/V

    def shard_map(self, local):
        """`shard_map` over the cache layout: q, offsets, lengths replicated; K, V (and the key
        positions) sharded along the sequence.

        The replication checker is off: it cannot follow results replicated by construction
        (butterfly, ring) or Pallas kernels (which need output axis types), and under `vmap`
        with batched K/V (a batch of KV caches) it rejects the local kernel's arithmetic on
        jax 0.10 ("varying manual axes to match"). Every schedule ends in a collective that
        replicates its result, and the tests compare all of them against NumPy.
        """
        kv = self.kv_spec()
        pos = P(None, self.axis_name) if self.positional else None
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(), kv, kv, P(), P(), pos),
            out_specs=P(),
            check_vma=False,
        )

    def kv_spec(self) -> P:
        if self.kv_layout == "bshd":
            return P(None, self.axis_name, None, None)
        return P(None, None, self.axis_name, None)

    def local_view(self, q_offset: Array, kv_length: Array, shard: Array | int):
        """(q_offset, kv_length) of shard `shard` relative to its first key; unchanged when the
        keys carry their own positions."""
        if self.positional:
            return q_offset, kv_length
        start = shard * self.dims.kv_seq
        return q_offset - start, jnp.clip(kv_length - start, 0, self.dims.kv_seq)


def setup(
    fn,
    q,
    k,
    v,
    *,
    mesh,
    kv_axis,
    kv_length,
    q_offset,
    causal,
    kv_layout,
    reduction,
    backend,
    kv_positions,
):
    """Validate, pad the cache to a multiple of the device count if it must, and describe the
    layout. Returns (Sharded, q, k, v, q_offset[batch], kv_length[batch], positions)."""
    dims = check_decode(
        fn,
        q,
        k,
        v,
        kv_layout=kv_layout,
        kv_length=kv_length,
        q_offset=0 if q_offset is None else q_offset,
    )
    axes = (kv_axis,) if isinstance(kv_axis, str) else tuple(kv_axis)
    for a in axes:
        if a not in mesh.shape:
            raise ValueError(
                f"{fn}: kv_axis {a!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})"
            )
    axis_name = axes[0] if len(axes) == 1 else axes
    if reduction is not None:
        check_reduction(fn, reduction, axis_name)
    p = math.prod(mesh.shape[a] for a in axes)
    lengths = per_row(kv_length, dims.batch, dims.kv_seq)
    positions = None
    if kv_positions is None:
        lengths = jnp.minimum(lengths, dims.kv_seq)
    else:
        if not jnp.issubdtype(jnp.result_type(kv_positions), jnp.integer) or jnp.shape(
            kv_positions
        ) not in ((dims.kv_seq,), (dims.batch, dims.kv_seq)):
            raise ValueError(
                f"{fn}: kv_positions must be integer with shape [kv_seq] = ({dims.kv_seq},) or "
                f"[batch, kv_seq] = {(dims.batch, dims.kv_seq)}, got {jnp.shape(kv_positions)}"
            )
        positions = jnp.broadcast_to(
            jnp.asarray(kv_positions).astype(jnp.int32), (dims.batch, dims.kv_seq)
        )
    if q_offset is None:
        # By default the queries are the last filled positions (decode / chunked decode).
        offsets = lengths - dims.q_seq if causal else per_row(0, dims.batch, 0)
    else:
        offsets = per_row(q_offset, dims.batch, 0)
    pad = -dims.kv_seq % p
    if pad:
        # A cache whose length divides the device count avoids this copy.
        axis = 1 if kv_layout == "bshd" else 2
        widths = [(0, 0)] * 4
        widths[axis] = (0, pad)
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)
        if positions is not None:  # padding slots sit beyond any length
            big = jnp.iinfo(jnp.int32).max
            positions = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=big)
    local = dataclasses.replace(dims, kv_seq=(dims.kv_seq + pad) // p)
    name = select_backend(
        backend,
        local,
        jnp.result_type(q),
        causal=causal,
        has_length=True,
        q_offset=None,
        has_positions=positions is not None,
    )
    layout = Sharded(
        auto_mesh(mesh), axis_name, p, local, causal, kv_layout, name, positions is not None
    )
    return layout, q, k, v, offsets, lengths, positions


def tree_decode(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    *,
    mesh: Mesh,
    kv_axis: str | tuple[str, ...],
    kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    scale: float | None = None,
    backend: str = "auto",
    reduction: str = "allreduce",
    kv_layout: str = "bshd",
    causal: bool = False,
    q_offset: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    kv_positions: Int[Array, " kv_seq"] | Int[Array, "batch kv_seq"] | None = None,
) -> Float[Array, "batch q_seq heads dv"]:
    r"""Attention over a KV cache sharded along the sequence: the paper's Algorithm 3.

    K and V are split along the sequence over the mesh axis `kv_axis` (one name, or
    `(slow, fast)` for `reduction="hierarchical"`); `q` is replicated. Each device computes
    `(out, lse)` of its shard with [`flash_attention`][treeattn.decode.flash_attention] (the
    `backend`), then the devices merge the partials with the `reduction` schedule of
    [`allreduce_partials`][treeattn.energy.allreduce_partials]. Per device this moves
    $2\frac{p-1}{p}(b\,d + 2\,b\,n_h)$ elements (paper eq. 35) whatever the context length.

    **Arguments:**

    - `q`: `[batch, q_seq, heads, dim]`; `k`, `v` in `kv_layout` (`"bshd"`
      `[batch, kv_seq, kv_heads, dim]`, or head-major `"bhsd"`, the one that streams on CPU).
    - `kv_length`: filled length of the cache per row (default: all of it); shards past it
      hold no valid key and contribute nothing.
    - `causal`, `q_offset`: for several queries per row (chunked or speculative decoding):
      query `i` sits at `q_offset + i` and sees keys up to there. `q_offset` defaults to
      `kv_length - q_seq` (the queries are the last filled positions).
    - `kv_positions`: absolute position of each cache slot (`[kv_seq]` or `[batch, kv_seq]`),
      for caches whose slots are not in position order — e.g. appended round-robin over the
      devices so that the shards fill evenly; sharded along with K and V (xla and reference
      backends).
    - `scale`, `backend`, `reduction`, `kv_layout`: see `flash_attention` and the schedules.

    A cache length that does not divide the device count is padded (a copy per call): allocate
    caches in multiples of it.

    **Returns:** `[batch, q_seq, heads, dv]` in the input dtype, replicated.
    """
    layout, q, k, v, offsets, lengths, positions = setup(
        "tree_decode",
        q,
        k,
        v,
        mesh=mesh,
        kv_axis=kv_axis,
        kv_length=kv_length,
        q_offset=q_offset,
        causal=causal,
        kv_layout=kv_layout,
        reduction=reduction,
        backend=backend,
        kv_positions=kv_positions,
    )
    return _tree(layout, q, k, v, offsets, lengths, positions, scale=scale, reduction=reduction)


@jax.named_scope("tree_decode")
def _tree(layout: Sharded, q, k, v, offsets, lengths, positions, *, scale, reduction):
    def local(q, k, v, offsets, lengths, positions):
        q_off, kv_len = layout.local_view(offsets, lengths, lax.axis_index(layout.axis_name))
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
        # lse is [batch, heads, q_seq]; the merge wants it beside out's [batch, q_seq, heads].
        merged, _ = allreduce_partials(
            out.astype(jnp.float32),
            jnp.swapaxes(lse, 1, 2),
            axis_name=layout.axis_name,
            reduction=reduction,
        )
        assert merged is not None
        return merged.astype(q.dtype)

    mapped = layout.shard_map(local)
    return mapped(q, k, v, offsets, lengths, positions)
