r"""Tree decoding (paper, Algorithm 3).

Every device runs the local kernel of [`flash_attention`][treeattn.decode.flash_attention] on
its shard of the KV cache, giving a partial `(out, lse)`; the partials are merged across devices
with [`allreduce_partials`][treeattn.energy.allreduce_partials] — by default a `pmax` of lse and
one packed `psum` of $(o\,e^{\mathrm{lse}-m}, e^{\mathrm{lse}-m})$, never $e^{\mathrm{lse}}$.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .._numerics import Layout
from .._partials import Reduction, merge_across
from ..energy import Energy
from ._energies import SOFTMAX
from ._plan import DecodePlan, run_sharded
from ._registry import Backend


def tree_decode(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    *,
    mesh: Mesh,
    kv_axis: str | tuple[str, ...],
    kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    scale: float | None = None,
    backend: Backend | Sequence[Backend] = "auto",
    reduction: Reduction = "allreduce",
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
    r"""Attention over a KV cache sharded along the sequence: the paper's Algorithm 3.

    K and V are split along the sequence over the mesh axis `kv_axis` (one name, or
    `(slow, fast)` for `reduction="hierarchical"`); `q` is replicated. Each device computes
    `(out, lse)` of its shard with the kernel of
    [`flash_attention`][treeattn.decode.flash_attention] (`backend`), then the devices merge
    the partials with the `reduction` schedule of
    [`allreduce_partials`][treeattn.energy.allreduce_partials]. Per device this moves
    $2\frac{p-1}{p}(b\,d + 2\,b\,n_h)$ elements (paper eq. 35) whatever the context length.

    **Arguments:**

    - `q`: `[batch, q_seq, heads, dim]`; `k`, `v` in `kv_layout` (`"bshd"`
      `[batch, kv_seq, kv_heads, dim]`, or head-major `"bhsd"`, the one that streams on CPU).
    - `kv_length`: filled length of the cache per row (default: all of it); shards past it
      hold no valid key and contribute nothing, whatever their slots hold.
    - `causal`, `q_offset`: for several queries per row (chunked or speculative decoding):
      query `i` sits at `q_offset + i` and sees keys up to there. `q_offset` defaults to
      `kv_length - q_seq` (the queries are the last filled positions).
    - `kv_positions`: absolute position of each cache slot (`[kv_seq]` or `[batch, kv_seq]`),
      for caches whose slots are not in position order — e.g. appended round-robin over the
      devices so that the shards fill evenly; sharded along with K and V (cpu, xla and
      reference kernels).
    - `local_window_size`, `mask`, `bias`: as in `flash_attention` (mask and bias broadcast
      to `[batch, heads, q_seq, kv_seq]`, `kv_seq` the whole cache's). The window is by
      absolute position, so each shard applies it to its own keys; the mask and bias are split
      along `kv_seq` with the cache (padded with hidden slots when the cache is).
    - `shard_lengths`: instead of `kv_length`/`kv_positions`, the number of filled slots at
      the front of each of the p shards (`[devices]` or `[batch, devices]`, in `kv_axis`
      order): shard $d$ attends to its slots $a < \ell_d$,
      $$o = \frac{\sum_d \sum_{a < \ell_d} e^{s\,q\cdot k_{d,a}} v_{d,a}}
             {\sum_d \sum_{a < \ell_d} e^{s\,q\cdot k_{d,a}}}.$$
      For calls in which every query sees every filled key (one query after the cache — a
      decode step, where `causal=True` is allowed — or any non-causal call); a round-robin
      cache is in position order within each shard, so this is the same attention as its
      `kv_positions`, told by a length that the fused GPU kernels (cuDNN, Pallas) take.
      Excludes `kv_length`, `q_offset` and `kv_positions`; `kv_seq` must divide by p. Values
      must lie in `[0, kv_seq / p]` (checked when concrete; traced ones are clipped).
    - `scale`, `backend`, `reduction`, `kv_layout`: see `flash_attention` and the schedules.
    - `energy`: the [`Energy`][treeattn.energy.Energy] (default `Softmax()`, through the
      kernels; None means the same). Any other energy runs on the `"energy"` kernel
      ([`energy_partial`][treeattn.energy.energy_partial], every batch row under `vmap`): each
      shard's keys lift to the energy's monoid state, with absolute key positions (ALiBi) and
      the same visibility (lengths, causality, window, mask, `kv_positions`), and the states
      merge with the monoid's schedule for `reduction` — a log-sum-exp with a max and a sum, a
      sum with one all-reduce, an ordered monoid (stick-breaking) with one all-gather folded
      by shard position. `backend` must then allow `"auto"` or `"energy"`; `bias` is
      refused (an energy's logits are its own). An ordered monoid on more than one device
      refuses `kv_positions` (a round-robin cache's shards interleave, so no shard order is
      the position order); `shard_lengths` (fill counts, no positions) refuses an ordered
      monoid and an energy whose logits read positions (`energy.reads_positions`).
    - `kv_finite`: as in `flash_attention` (every key and value is finite).
    - `q_segment_ids`, `kv_segment_ids` (`kv_seq` the whole cache's, split with it),
      `prefix_length`, `chunk_size`, `mask_mod`: as in `flash_attention`; such a call runs on
      the `"energy"` kernel (each shard's visibility from the rules, the states merged by the
      monoid's schedule). Not with `shard_lengths`.

    A cache length that does not divide the device count is padded (a copy per call): allocate
    caches in multiples of it.

    **Returns:** `[batch, q_seq, heads, dv]` in the input dtype, replicated.
    """
    args = dict(locals())  # every argument, as given
    args["reduction"] = reduction
    return run_sharded("tree_decode", "tree", _tree, **args)


@jax.named_scope("tree_decode")
def _tree(plan: DecodePlan, q, k, v, offsets, lengths, positions, mask, bias, *, scale, reduction):
    def local(q, k, v, offsets, lengths, positions, mask, bias):
        out, lse = plan.attend(
            plan.local_shard(), q, k, v, offsets, lengths, positions, mask, bias, scale=scale
        )
        merged, _ = merge_across(out, lse, axis_name=plan.axis_name, reduction=reduction)
        assert merged is not None
        return merged.astype(q.dtype)

    return plan.shard_map(local)(q, k, v, offsets, lengths, positions, mask, bias)
