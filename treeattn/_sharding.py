"""One object for a sequence sharded over mesh axes: the axis check, the device count, padding,
and `shard_map` with its specs and its replication-check policy, stated once.

Used by the energy on global arrays (`tree_free_energy`), tree and ring decoding, and the
sharded KV cache of the models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array

from ._partials import AxisName


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis in Auto mode.

    From jax 0.9 on, `jax.make_mesh` makes Explicit axes by default, and `shard_map` then
    refuses inputs whose sharding type does not already match `in_specs`; treeattn shards its
    inputs itself, so it runs its `shard_map`s on the Auto view of the mesh.
    """
    axis_type = getattr(jax.sharding, "AxisType", None)
    types = getattr(mesh, "axis_types", None)
    if axis_type is None or types is None or all(t == axis_type.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * len(types))


@dataclasses.dataclass(frozen=True)
class SequenceSharding:
    """A sequence split into `devices` equal contiguous shards over the mesh axes `axis_name`
    (one name, or a tuple such as `(slow, fast)`). Hashable: a static argument."""

    mesh: Mesh  # the Auto view of `user_mesh`
    axis_name: AxisName
    devices: int
    user_mesh: Mesh  # as given (its axes may be Explicit)

    @classmethod
    def create(cls, fn: str, mesh: Mesh, kv_axis: AxisName | Sequence[str]) -> SequenceSharding:
        """Check that every name in `kv_axis` is an axis of `mesh`."""
        if not isinstance(mesh, Mesh):
            raise ValueError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        axes = (kv_axis,) if isinstance(kv_axis, str) else tuple(kv_axis)
        if not axes:
            raise ValueError(f"{fn}: kv_axis must name at least one mesh axis")
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(
                    f"{fn}: kv_axis {a!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})"
                )
        axis_name = axes[0] if len(axes) == 1 else axes
        devices = math.prod(mesh.shape[a] for a in axes)
        return cls(auto_mesh(mesh), axis_name, devices, mesh)

    def padding(self, length: int) -> int:
        """Slots to append so that `length` splits evenly over the devices."""
        return -length % self.devices

    def pad(self, x: Array, axis: int, value: Any = 0) -> Array:
        """`x` padded along `axis` to a multiple of the device count (a copy; none if it
        divides already)."""
        pad = self.padding(x.shape[axis])
        if not pad:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        return jnp.pad(x, widths, constant_values=value)

    def spec(self, ndim: int, seq_axis: int) -> P:
        """The partition spec of an array sharded along its axis `seq_axis`."""
        parts: list[Any] = [None] * ndim
        parts[seq_axis] = self.axis_name
        return P(*parts)

    def shard_map(self, f: Callable, in_specs, out_specs) -> Callable:
        """`jax.shard_map` over this mesh.

        The replication checker is off for every caller: results are replicated by
        construction (every schedule ends in a collective that gives each device the same
        value — the butterfly and the ring included, which the checker cannot follow), Pallas
        kernels carry no axis types, and under `vmap` with batched K/V the checker rejects the
        local kernel's arithmetic on jax 0.10 ("varying manual axes to match"). The tests
        compare every schedule against float64 NumPy instead.
        """
        return jax.shard_map(
            f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
