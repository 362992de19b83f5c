"""The KV cache: a fixed-size pytree, one buffer per layer, head-major or sequence-major,
optionally sharded round-robin over devices; and the linear-attention cache, one
`LinearState` per layer."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from .._native import WRITE_TARGET, load_kernel
from .._numerics import LAYOUTS, Layout
from .._sharding import SequenceSharding
from ..decode import AttentionBackend
from ..energy import Energy, LinearKernel, LinearState


class KVCache(eqx.Module):
    """Keys and values of the tokens seen so far, preallocated to `max_len` slots.

    **Layout.** `layout="bhsd"` (the default) stores them head-major, `k[..., kv_heads,
    max_len, qk]`: the layout a decode step streams at memory speed on CPU (the `"cpu"` and
    `"xla"` kernels). `layout="bshd"` stores `k[..., max_len, kv_heads, qk]`: the layout of
    `jax.nn.dot_product_attention`, cuDNN and flash-attn, and of the `"energy"` and
    `"reference"` backends, which would otherwise transpose a head-major cache on every call.
    Leading axes are batch axes (`generate` adds one per prompt under `jax.vmap`). A cache is
    passed into a layer and returned updated, never mutated; its shapes never change, so a
    decode step never recompiles.

    **One buffer per layer.** A model's cache (`KVCache.create(..., layers=n)`,
    `Transformer.init_cache`) holds `k` and `v` as tuples of `n` separate arrays and one
    `length` shared by the layers; `cache.layer(i)` is layer i's cache (no copy) and
    `cache.with_layers(...)` puts the updated layers back. Separate buffers, not one array
    with a layer axis: XLA materialises a slice of a stacked array before a matrix product or
    a kernel reads it, which would copy every layer's cache on every step; a buffer of its own
    is updated in place (`dynamic_update_slice` on the donated cache) and read where it lies.

    **Sharded caches.** With `devices = p > 1`, the slots are split into p contiguous shards
    (one per device along the mesh axis) and tokens are appended round-robin in blocks of
    `block` tokens: token t goes to shard `(t // block) % p`, so the shards fill evenly and every
    device has the same amount of attention to do at any length. `positions()` gives the token
    position held by each slot (what `tree_decode(kv_positions=...)` needs for a causal chunk
    of queries); `shard_lengths()` gives how many slots of each shard are filled (all a decode
    step needs: the fused GPU kernels take it, and refuse positions).

    **Overflow.** Writing past `max_len` never wraps around. `prefill`, `decode_step`,
    `generate` and an eager model call check on the host, before running, and raise a
    `ValueError`; they know the length of a cache they returned without waiting for the device,
    so the check does not stall the decode loop. Inside a compiled program (a cache traced
    under `jit`), a single-device cache raises at run time (`equinox.error_if`). A sharded
    cache cannot: an error raised on one device would leave the others waiting in a
    collective. There the overflowing tokens are not written, `length` still counts them
    (`length > max_len` flags the overflow) and `Transformer` returns NaN logits.

    **Eviction.** `evict(scores, keep=..., recent=...)` drops the keys that received the
    least attention (H2O) and compacts the kept ones into the first slots, in position order.
    `length` then counts the filled slots (what `append`, the overflow checks and `kv_length`
    read) and `dropped` the tokens evicted, so the next token sits at position
    `next_position = length + dropped`; `slot_positions` records the true position of every
    slot (per layer, and per kv head when each head kept its own keys), the slots not yet
    written holding `slot + dropped`, so an append writes no position. Rotary was applied to
    the cached keys at their true positions and attention is told the slots' positions
    (`keys()`), so attention over an evicted cache is attention over the kept keys at their
    true positions. A cache never evicted has `slot_positions = dropped = None`: no leaf, no
    work in a decode step.
    """

    k: Float[Array, "*batch kv_heads max_len qk"] | tuple[Float[Array, ...], ...]
    v: Float[Array, "*batch kv_heads max_len vo"] | tuple[Float[Array, ...], ...]
    length: Int[Array, "*batch"] | Int[np.ndarray, "*batch"]
    slot_positions: (
        Int[Array, "*batch max_len"]
        | Int[Array, "*batch kv_heads max_len"]
        | tuple[Int[Array, ...], ...]
        | None
    ) = None
    """After an eviction: each slot's token position, per layer (a tuple in a model's
    cache), `[*batch, max_len]`, or `[*batch, kv_heads, max_len]` when each kv head kept its
    own keys. None: slot `a` holds position `a` (see `positions()`)."""
    dropped: Int[Array, "*batch"] | None = None
    """After an eviction: the tokens evicted so far (None: none)."""
    sharding: SequenceSharding | None = eqx.field(static=True, default=None)
    block: int = eqx.field(static=True, default=1)
    layout: Layout = eqx.field(static=True, default="bhsd")
    checked: bool = eqx.field(static=True, default=False)
    """The next append is known to fit (the host or the model checked it once for every
    layer): the append itself does not check again, which keeps a check per layer off a
    decode step."""

    @classmethod
    def create(
        cls,
        kv_heads: int,
        max_len: int,
        qk: int,
        vo: int | None = None,
        *,
        layers: int | None = None,
        dtype=jnp.float32,
        mesh: Mesh | None = None,
        kv_axis: str | tuple[str, ...] | None = None,
        block: int | None = 16,
        layout: Layout = "bhsd",
        batch: int | None = None,
    ) -> KVCache:
        """An empty cache: one layer's, or with `layers=n` a model's (`n` buffers, one
        length). `layout` is `"bhsd"` (head-major) or `"bshd"`. With `mesh` and `kv_axis`, the
        slots are sharded over that axis and `max_len` is rounded up to a multiple of
        `devices * block`; `block=None` gives each shard one contiguous range of positions
        (the slots in position order, which an ordered energy such as `StickBreaking` needs
        across devices; the shards then fill one after another). With `batch=b`, every buffer
        and the length get a leading axis of `b` rows (one cache per row, for a model vmapped
        over a batch, as in `generate`). The buffers are allocated where they live, shard by
        shard."""
        if layout not in LAYOUTS:
            raise ValueError(f"KVCache.create: layout must be one of {LAYOUTS}, got {layout!r}")
        if layers is not None and layers < 1:
            raise ValueError(f"KVCache.create: layers must be at least 1, got {layers}")
        if batch is not None and batch < 1:
            raise ValueError(f"KVCache.create: batch must be at least 1, got {batch}")
        rows = () if batch is None else (batch,)
        vo = qk if vo is None else vo
        sharding = None
        if mesh is not None and kv_axis is not None:
            sharding = SequenceSharding.create("KVCache.create", mesh, kv_axis)
            if sharding.devices == 1:
                sharding = None
        devices = 1 if sharding is None else sharding.devices
        if devices > 1 and block is None:  # one block per shard: the slots in position order
            block = -(-max_len // devices)
        if devices > 1:
            assert block is not None
            max_len = -(-max_len // (devices * block)) * devices * block
        else:
            block = max_len

        def buffer(d):
            shape = (kv_heads, max_len, d) if layout == "bhsd" else (max_len, kv_heads, d)
            shape = rows + shape
            if devices == 1:
                return jnp.zeros(shape, dtype)
            assert mesh is not None and kv_axis is not None
            spec = P(None, kv_axis, None) if layout == "bhsd" else P(kv_axis, None, None)
            sharding = NamedSharding(mesh, P(*(None,) * len(rows), *spec))
            # Each device allocates its own shard: no full buffer on one device first.
            return jnp.zeros(shape, dtype, device=sharding)

        if layers is None:
            k, v = buffer(qk), buffer(vo)
        else:
            k = tuple(buffer(qk) for _ in range(layers))
            v = tuple(buffer(vo) for _ in range(layers))
        length = np.zeros(rows, np.int32)  # held on the host (see `held`)
        return cls(k=k, v=v, length=length, sharding=sharding, block=block, layout=layout)

    @property
    def devices(self) -> int:
        """The devices the slots are sharded over (1: not sharded)."""
        return 1 if self.sharding is None else self.sharding.devices

    @property
    def in_order(self) -> bool:
        """Whether slot `a` holds position `a` (one device, or one block per shard)."""
        return self.devices == 1 or self.block * self.devices == self.max_len

    @property
    def layers(self) -> int | None:
        """The number of layers of a model's cache; `None` for one layer's."""
        return len(self.k) if isinstance(self.k, tuple) else None

    @property
    def seq_axis(self) -> int:
        """The slot axis of K and V, counted from the end."""
        return -2 if self.layout == "bhsd" else -3

    def _first(self) -> Array:
        return self.k[0] if isinstance(self.k, tuple) else self.k

    @property
    def max_len(self) -> int:
        return self._first().shape[self.seq_axis]

    @property
    def dtype(self):
        return self._first().dtype

    @property
    def next_position(self) -> Int[Array, "*batch"] | Int[np.ndarray, "*batch"]:
        """The position of the next token: `length`, plus the tokens evicted (`dropped`)."""
        return self.length if self.dropped is None else self.length + self.dropped

    def layer(self, i: int) -> KVCache:
        """Layer `i` of a model's cache: its own buffers (not a copy) and the shared length."""
        if not isinstance(self.k, tuple) or not isinstance(self.v, tuple):
            raise ValueError("KVCache.layer: this is one layer's cache (created without layers=)")
        pos = self.slot_positions
        pos = pos[i] if isinstance(pos, tuple) else pos
        return dataclasses.replace(self, k=self.k[i], v=self.v[i], slot_positions=pos)

    def with_layers(self, layers: Sequence[KVCache]) -> KVCache:
        """A model's cache from its updated layers (each advanced by the same tokens)."""
        if len(layers) != self.layers:
            raise ValueError(
                f"KVCache.with_layers: {len(layers)} layers for a cache of {self.layers}"
            )
        k = tuple(c.k for c in layers)
        v = tuple(c.v for c in layers)
        pos = None if self.slot_positions is None else tuple(c.slot_positions for c in layers)
        return dataclasses.replace(
            self, k=k, v=v, length=layers[-1].length, slot_positions=pos, checked=False
        )

    def check(self, n: int) -> KVCache:
        """The cache with its next append of `n` tokens checked once, for every layer: on one
        device an overflow raises when the program runs (`equinox.error_if`); a sharded cache
        cannot raise (see "Overflow") and is not checked."""
        length = self.length
        if self.devices == 1 and not self.checked:
            overflow = length + n > self.max_len
            length = eqx.error_if(length, overflow, _overflow_message(n, None, self.max_len))
        return dataclasses.replace(self, length=length, checked=True)

    def slots(self, positions: Int[Array, " n"]) -> Int[Array, " n"]:
        """The slot holding each token position."""
        if self.devices == 1:
            return positions
        p, b, shard = self.devices, self.block, self.max_len // self.devices
        return ((positions // b) % p) * shard + (positions // (b * p)) * b + positions % b

    def positions(self) -> np.ndarray:
        """The token position held by each slot, `[max_len]` (a constant), in a cache never
        evicted (after an eviction they are `slot_positions`)."""
        s = np.arange(self.max_len)
        if self.devices == 1:
            return s
        p, b, shard = self.devices, self.block, self.max_len // self.devices
        d, j = s // shard, s % shard
        return ((j // b) * p + d) * b + j % b

    def shard_lengths(self) -> Int[Array, "*batch devices"]:
        """The filled slots of each shard, `[devices]` (`[*batch, devices]` for a batched
        cache): what `tree_decode(shard_lengths=...)` takes where every query sees every
        filled key. Within a shard the slots are in position order and fill from its front, so
        the filled slots of shard d are its first `shard_lengths()[..., d]`. Tokens past
        `max_len` are not written (see "Overflow"): they are not counted."""
        p, b = self.devices, self.block
        n = jnp.clip(self.length, 0, self.max_len)[..., None]
        shard = jnp.arange(p, dtype=jnp.int32)
        # Full rounds of p blocks, then what the last round gave shard d.
        rounds, rest = n // (b * p), n % (b * p)
        return (rounds * b + jnp.clip(rest - shard * b, 0, b)).astype(jnp.int32)

    def keys(
        self, backend: AttentionBackend, *, all_seen: bool, energy: Energy, windowed: bool = False
    ) -> dict:
        """How `backend` is told which token each slot holds: the arguments of
        `AttentionBackend.attend` that describe this cache.

        An evicted cache (one layer's, unbatched): where every query sees every filled key
        and the energy reads no position, the filled `kv_length` (the slots are in position
        order); otherwise also `slot_positions` as `kv_positions`, the round-robin cache's
        path. A cache whose kv heads kept different keys gives one position per slot: the
        latest over the heads, exact for causality (every kept key precedes every query, and
        the slots written since hold the same token in every head), refused for a sliding
        window (`windowed`) or an energy that reads positions.

        A sharded cache on a backend sharded over the same devices, where every query sees
        every filled key (`all_seen`: one query after the cache, or no causality; no window)
        and the energy reads neither the keys' positions nor their order: each shard's fill
        count, `shard_lengths()` (which the fused GPU kernels take). A cache in position order
        (`in_order`): the filled `kv_length`. Otherwise the filled length and every slot's
        position."""
        if self.slot_positions is not None:
            return self._evicted_keys(all_seen=all_seen, energy=energy, windowed=windowed)
        if self.sharding is None:
            return {"kv_length": self.length}
        if backend.sharded:
            theirs = backend.sharding
            assert theirs is not None
            if (theirs.mesh, theirs.axis_name) != (self.sharding.mesh, self.sharding.axis_name):
                raise ValueError(
                    f"the KV cache is sharded over {self.sharding.axis_name!r} of "
                    f"{self.sharding.user_mesh}, the attention backend over "
                    f"{theirs.axis_name!r} of {theirs.user_mesh}: make the cache with the "
                    "backend's mesh (Transformer.init_cache does by default)"
                )
            if all_seen and energy.monoid.commutative and not energy.reads_positions:
                return {"shard_lengths": self.shard_lengths()}
        if self.in_order:
            return {"kv_length": self.length}
        positions = jnp.asarray(self.positions(), jnp.int32)
        return {"kv_length": self.length, "kv_positions": positions}

    def _evicted_keys(self, *, all_seen: bool, energy: Energy, windowed: bool) -> dict:
        pos = self.slot_positions
        assert pos is not None and not isinstance(pos, tuple)
        if all_seen and not energy.reads_positions:
            return {"kv_length": self.length}
        if pos.ndim == 2:  # [kv_heads, max_len]: each head kept its own keys
            if windowed or energy.reads_positions:
                raise ValueError(
                    "KVCache: this cache was evicted per kv head (evict(per_head=True)); a layer "
                    f"with a sliding window or an energy that reads positions "
                    f"({type(energy).__name__}) needs one position per slot: evict it with "
                    "per_head=False"
                )
            pos = jnp.max(pos, axis=0)
        # With positions, `kv_length` bounds the positions (filled: `pos < kv_length`); the
        # slots not yet written hold positions from `next_position` on.
        return {"kv_length": self.next_position, "kv_positions": pos}

    def evict(
        self,
        scores: Float[Array, "*batch layers slots kv_heads"]
        | Float[Array, "*batch slots kv_heads"],
        keep: int,
        *,
        recent: int = 0,
        per_head: bool = True,
    ) -> KVCache:
        r"""H2O eviction (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"): keep the `keep`
        cached keys that received the most attention and the `recent` most recent ones, drop
        the others.

        The kept keys and values move to the first slots, in position order; their true
        positions are recorded (`slot_positions`) and later tokens are appended after them
        at their own positions (`next_position`), so attention afterwards equals attention
        over the kept keys at their true positions (rotary was applied when they were
        cached). With `per_head=True` (H2O's choice) each kv head keeps its own keys (the
        layout stores every head's slots apart, so a gather per head compacts them);
        `per_head=False` keeps one set per layer, by the scores summed over the kv heads
        (needed for a layer with a sliding window or an energy that reads positions, which
        take one position per slot).

        **Arguments:**

        - `scores`: the attention each cached key received, per layer and kv head,
          `[layers, slots, kv_heads]` for a model's cache (`[slots, kv_heads]` for one
          layer's), with a leading batch axis for a batched cache; slot `a < length` is read
          from `scores[..., a, :]` (`slots >= length`). After a prefill into an empty cache
          the slots are the prompt's tokens: `treeattn.models.attention_scores(model,
          prompt)` gives them.
        - `keep`: heavy hitters kept, `1 <= keep <= length` (`keep = length` keeps all).
        - `recent`: the most recent tokens always kept, besides (H2O's recent window).
        - `per_head`: one set of kept keys per kv head (True) or per layer.

        **Returns:** the cache holding `min(length, keep + recent)` tokens in each row. A
        sharded cache (round-robin slots) is refused. Runs eagerly, on the host's length.
        """
        fn = "KVCache.evict"
        if self.devices > 1:
            raise ValueError(f"{fn}: a cache sharded over devices cannot be evicted")
        length = held(self)
        if length is None:
            raise ValueError(f"{fn}: the cache's length must be concrete (evict outside jit)")
        if not isinstance(keep, int | np.integer) or keep < 1:
            raise ValueError(f"{fn}: keep must be an int >= 1, got {keep!r}")
        if not isinstance(recent, int | np.integer) or recent < 0:
            raise ValueError(f"{fn}: recent must be an int >= 0, got {recent!r}")
        shortest = int(np.min(length)) if length.size else 0
        if keep > shortest:
            raise ValueError(f"{fn}: keep={keep} must be at most the cache's length {shortest}")
        layers = self.layers
        k0 = self._first()
        batch = k0.shape[: k0.ndim - 3]
        heads = k0.shape[-3 if self.layout == "bhsd" else -2]
        scores = jnp.asarray(scores)
        lead = (*batch, *(() if layers is None else (layers,)))
        if (
            scores.ndim != len(lead) + 2
            or scores.shape[: len(lead)] != lead
            or scores.shape[-1] != heads
            or scores.shape[-2] < int(np.max(length))
            or scores.shape[-2] > self.max_len
        ):
            want = ", ".join(str(d) for d in lead) + (", " if lead else "")
            raise ValueError(
                f"{fn}: scores must have shape [{want}slots, kv_heads={heads}] with "
                f"{int(np.max(length))} <= slots <= max_len={self.max_len}, got "
                f"{tuple(scores.shape)}"
            )
        kept = min(int(np.max(length)), keep + recent)
        width = kept  # slots rewritten per row (a row holding fewer keeps its own length)
        one = functools.partial(
            _evict_layer,
            keep=keep,
            recent=recent,
            width=width,
            per_head=per_head,
            layout=self.layout,
        )
        ks = self.k if isinstance(self.k, tuple) else (self.k,)
        vs = self.v if isinstance(self.v, tuple) else (self.v,)
        pos = self.slot_positions
        poss = pos if isinstance(pos, tuple) else (pos,) * len(ks)
        per_layer = scores if layers is not None else scores[..., None, :, :]
        dropped = jnp.zeros(batch, jnp.int32) if self.dropped is None else self.dropped
        n = jnp.asarray(length, jnp.int32)
        new_k, new_v, new_pos = [], [], []
        for i, (k, v, p) in enumerate(zip(ks, vs, poss, strict=True)):
            s = per_layer[..., i, :, :]
            if p is None:
                p = jnp.broadcast_to(
                    jnp.arange(self.max_len, dtype=jnp.int32), (*batch, self.max_len)
                )
            run = one
            for _ in batch:
                run = jax.vmap(run)
            k, v, p = run(k, v, p, s.astype(jnp.float32), n, dropped)
            new_k.append(k)
            new_v.append(v)
            new_pos.append(p)
        new_length = np.minimum(length, keep + recent).astype(np.int32)
        new_dropped = dropped + jnp.asarray(length - new_length, jnp.int32)
        if layers is None:
            k_out, v_out, p_out = new_k[0], new_v[0], new_pos[0]
        else:
            k_out, v_out, p_out = tuple(new_k), tuple(new_v), tuple(new_pos)
        return dataclasses.replace(
            self,
            k=k_out,
            v=v_out,
            slot_positions=p_out,
            dropped=new_dropped,
            length=new_length,
            checked=False,
        )

    def append(self, k: Float[Array, "n kv_heads qk"], v: Float[Array, "n kv_heads vo"]) -> KVCache:
        """Write `n` new tokens after the `length` already cached (one layer's cache; a
        model's appends through `layer(i)`). Writing past `max_len` never wraps around: see
        "Overflow" above. Shapes are checked before anything runs."""
        if isinstance(self.k, tuple) or isinstance(self.v, tuple):
            raise ValueError(
                f"KVCache.append: this cache holds {self.layers} layers; append to "
                "cache.layer(i) and put the layers back with cache.with_layers(...)"
            )
        axis = self.k.ndim + self.seq_axis
        heads = self.k.shape[-3 if self.layout == "bhsd" else -2]
        qk, vo = self.k.shape[-1], self.v.shape[-1]
        if k.ndim != 3 or v.ndim != 3 or k.shape[1:] != (heads, qk) or v.shape[1:] != (heads, vo):
            raise ValueError(
                f"KVCache.append: k{tuple(k.shape)} and v{tuple(v.shape)} must be "
                f"[n, kv_heads={heads}, {qk}] and [n, kv_heads={heads}, {vo}] for this cache "
                f"(k{tuple(self.k.shape)}, v{tuple(self.v.shape)}, {self.layout})"
            )
        n = k.shape[0]
        if v.shape[0] != n:
            raise ValueError(f"KVCache.append: k has {n} tokens, v has {v.shape[0]}")
        if n > self.max_len:
            raise ValueError(_overflow_message(n, None, self.max_len))
        overflow = self.length + n > self.max_len
        if self.layout == "bhsd":
            k, v = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)  # the new tokens only
        k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        if self.devices == 1:
            length = jnp.asarray(self.length)
            if not self.checked:
                length = eqx.error_if(length, overflow, _overflow_message(n, None, self.max_len))
            # The new tokens take consecutive slots: a slice update, in place when the cache
            # is donated or carried by a loop, and under vmap too (see `write_at`).
            new_k = write_at(self.k, k, length, axis)
            new_v = write_at(self.v, v, length, axis)
        else:
            # A scatter that drops out-of-bounds slots (the overflow): each device writes the
            # tokens that fall in its shard, in place. (Reading back a slot's old value with a
            # dynamic slice instead made XLA all-gather the sharded cache on every step.)
            slots = self.slots(jnp.asarray(self.length) + jnp.arange(n, dtype=jnp.int32))
            slots = jnp.where(overflow, self.max_len, slots)  # out of bounds: dropped
            new_k = _scatter_slots(self.k, slots, k, self.layout)
            new_v = _scatter_slots(self.v, slots, v, self.layout)
        return dataclasses.replace(self, k=new_k, v=new_v, length=self.length + n)


@functools.partial(jax.jit, static_argnames=("keep", "recent", "width", "per_head", "layout"))
def _evict_layer(k, v, pos, scores, length, dropped, *, keep, recent, width, per_head, layout):
    """One row of one layer: the `width` slots kept (each row: the `keep` best-scored before
    its `recent` last, and those), moved to the front in position order; `pos` the slots'
    positions (`[max_len]` or `[kv_heads, max_len]`), returned per head when either the input
    or `per_head` is."""
    if layout == "bshd":
        k, v = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)  # [kv_heads, max_len, d]
    heads, max_len = k.shape[0], k.shape[1]
    slots = jnp.arange(max_len, dtype=jnp.int32)
    score = jnp.zeros((heads, max_len), jnp.float32).at[:, : scores.shape[0]].set(scores.T)
    if not per_head:
        score = jnp.broadcast_to(jnp.sum(score, axis=0), (heads, max_len))
    start = jnp.maximum(length - recent, 0)  # the recent window: kept whatever its scores
    # Ranks: the recent window first, then the heavy hitters; unfilled slots last.
    rank = jnp.where(slots < start, score, jnp.inf)
    rank = jnp.where(slots < length, rank, -jnp.inf)
    _, best = jax.lax.top_k(rank, width)  # [heads, width]
    kept = jnp.minimum(length, keep + recent)
    # Kept slots in position order (slot order is position order), the surplus after them.
    order = jnp.where(jnp.arange(width) < kept, 0, max_len)
    best = jnp.sort(jnp.where(order == 0, best, max_len + best), axis=-1) % max_len
    if per_head or pos.ndim == 2:
        pos = jnp.broadcast_to(pos, (heads, max_len))
        kept_pos = jnp.take_along_axis(pos, best, axis=-1)
    else:
        kept_pos = pos[best[0]]
    new_dropped = dropped + length - kept
    rest = slots + new_dropped  # where tokens appended later will sit
    front = jnp.arange(width) < kept
    take = functools.partial(jnp.take_along_axis, axis=1)
    k_front = take(k, best[:, :, None])
    v_front = take(v, best[:, :, None])
    k = k.at[:, :width].set(jnp.where(front[None, :, None], k_front, k[:, :width]))
    v = v.at[:, :width].set(jnp.where(front[None, :, None], v_front, v[:, :width]))
    front_pos = jnp.where(front, kept_pos, rest[:width])
    pos = jnp.broadcast_to(rest, kept_pos.shape[:-1] + (max_len,))
    pos = pos.at[..., :width].set(front_pos)
    if layout == "bshd":
        k, v = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)
    return k, v, pos.astype(jnp.int32)


def _scatter_slots(buffer: Array, slots: Array, update: Array, layout: str) -> Array:
    """`buffer` with `update` written at `slots` along the sequence axis, dropping slots out of
    bounds. A 16-bit float buffer is scattered as its bits (integers): XLA:CPU has no scatter
    of bfloat16 or float16 and would convert the whole buffer to float32 and back."""
    narrow = jnp.issubdtype(buffer.dtype, jnp.floating) and buffer.dtype.itemsize < 4
    if narrow:
        bits = jnp.dtype(f"uint{8 * buffer.dtype.itemsize}")
        out = _scatter_slots(
            jax.lax.bitcast_convert_type(buffer, bits),
            slots,
            jax.lax.bitcast_convert_type(update, bits),
            layout,
        )
        return jax.lax.bitcast_convert_type(out, buffer.dtype)
    if layout == "bhsd":
        return buffer.at[..., slots, :].set(update, mode="drop")
    return buffer.at[..., slots, :, :].set(update, mode="drop")


def write_at(
    buffer: Float[Array, "*dims"], update: Float[Array, "*upd"], start: Int[Array, ""], axis: int
) -> Float[Array, "*dims"]:
    """`buffer` with `update` written at `start` along `axis` (and at 0 along the other axes):
    `lax.dynamic_update_slice_in_dim`, whose batched form stays an in-place slice update.

    Under `jax.vmap` with one start per row (a batch of caches of different lengths), JAX
    lowers a slice update to a scatter; XLA:CPU has no scatter of bfloat16 or float16 and then
    converts the whole buffer to float32 and back, on every decode step. Here each row is one
    slice write of the batched buffer instead (`_write_slices`), in place on a donated or
    loop-carried buffer, for every dtype (on CPU by treeattn's C++ write for a 16-bit float
    buffer or more than one row: one call for all the rows).
    Start indices are clamped so the update fits, as in `lax.dynamic_update_slice`.
    Differentiable (the tangent is the same write of the tangents)."""
    starts = jnp.zeros((buffer.ndim,), jnp.int32).at[axis].set(jnp.asarray(start, jnp.int32))
    return _write(buffer, update, starts)


@jax.custom_jvp
def _write(buffer, update, starts):
    return _write_rows(buffer, update, starts)


@_write.defjvp
def _write_jvp(primals, tangents):
    buffer, update, starts = primals
    d_buffer, d_update, _ = tangents
    # A plain slice update: linear, so reverse mode transposes it.
    d_out = jax.lax.dynamic_update_slice(d_buffer, d_update, tuple(starts))
    return _write(buffer, update, starts), d_out


def _write_rows(buffer, update, starts):
    return _write_slices(buffer, update[None], starts[None])


def _narrow(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def _whole_bytes(dtype) -> bool:
    """Whether elements of `dtype` fill whole bytes (the C++ write copies bytes; int4 or
    float4 would be packed two to a byte)."""
    d = jnp.dtype(dtype)
    if jnp.issubdtype(d, jnp.integer):
        return jnp.iinfo(d).bits == 8 * d.itemsize
    if jnp.issubdtype(d, jnp.floating):
        return jnp.finfo(d).bits == 8 * d.itemsize
    return True


@jax.custom_batching.custom_vmap
def _write_slices(buffer, updates, starts):
    """`buffer` with each `updates[r]` written at `starts[r]` (`[rows, buffer.ndim]`, clamped
    so that it fits): on XLA:CPU, when it is built, by treeattn's C++ write, in place, for a
    16-bit float buffer or more than one row (one call instead of a slice update per row, each
    an operation of its own: a batch of 8 adds 16 per layer and step); else one slice update
    per row."""
    updates = updates.astype(buffer.dtype)
    native = _narrow(buffer.dtype) or updates.shape[0] > 1
    if native and _whole_bytes(buffer.dtype) and load_kernel() is None:
        return jax.lax.platform_dependent(
            buffer, updates, starts, cpu=_native_write, default=_slice_updates
        )
    return _slice_updates(buffer, updates, starts)


def _native_write(buffer, updates, starts):
    # The result is the buffer itself (aliased): XLA:CPU writes only the updates' bytes. The
    # updates go as rows of elements, their shape an attribute: reshaped with unit axes (one
    # token's keys), XLA:CPU copied them first.
    out = jax.ShapeDtypeStruct(buffer.shape, buffer.dtype)
    dims = np.array(updates.shape, np.int64)
    return jax.ffi.ffi_call(WRITE_TARGET, out, input_output_aliases={0: 0})(
        buffer,
        updates.reshape(len(updates), math.prod(updates.shape[1:])),
        starts.astype(jnp.int32),
        dims=dims,
    )


def _slice_updates(buffer, updates, starts):
    """One `lax.dynamic_update_slice` per row (a loop over a handful of rows, unrolled).
    XLA:CPU widens a slice update of a 16-bit float to float32 (the whole buffer, there and
    back); of the same bits as integers it writes the slice, though still through a pass over
    the buffer (what `_native_write` avoids)."""
    narrow = _narrow(buffer.dtype)
    bits = jnp.dtype(f"uint{8 * buffer.dtype.itemsize}") if narrow else buffer.dtype

    def as_bits(x):
        return jax.lax.bitcast_convert_type(x, bits) if narrow else x

    out = as_bits(buffer)

    def row(i, out):
        return jax.lax.dynamic_update_slice(out, as_bits(updates[i]), tuple(starts[i]))

    if updates.shape[0] <= _UNROLL_ROWS:
        for i in range(updates.shape[0]):
            out = row(i, out)
    else:
        out = jax.lax.fori_loop(0, updates.shape[0], row, out)
    return jax.lax.bitcast_convert_type(out, buffer.dtype) if narrow else out


@_write_slices.def_vmap
def _write_slices_vmap(axis_size, in_batched, buffer, updates, starts):
    # Every row of every vmapped buffer is one slice write of the batched buffer: its index
    # along the new axis joins the starts.
    buffer_batched, updates_batched, starts_batched = in_batched
    if not buffer_batched:  # one buffer written differently per row: a buffer per row
        buffer = jnp.broadcast_to(buffer, (axis_size, *buffer.shape))
    if not updates_batched:
        updates = jnp.broadcast_to(updates, (axis_size, *updates.shape))
    if not starts_batched:
        starts = jnp.broadcast_to(starts, (axis_size, *starts.shape))
    rows = updates.shape[1]
    index = jnp.broadcast_to(
        jnp.arange(axis_size, dtype=jnp.int32)[:, None, None], (axis_size, rows, 1)
    )
    starts = jnp.concatenate([index, starts.astype(jnp.int32)], axis=2).reshape(-1, buffer.ndim)
    updates = updates.reshape(-1, 1, *updates.shape[2:])
    return _write_slices(buffer, updates, starts), True


_UNROLL_ROWS = 16


NO_STOP = np.iinfo(np.int32).max
"""`LinearCache.stop` when every token is absorbed."""


class LinearCache(eqx.Module):
    r"""The cache of a model with [`LinearKernel`][treeattn.energy.LinearKernel] attention: per
    layer a [`LinearState`][treeattn.energy.LinearState] ($S = \sum_a \phi(k_a) v_a^\top$,
    $z = \sum_a \phi(k_a)$ per kv head) instead of the keys and values.

    Its size does not depend on the number of tokens, so a decode step against it takes
    constant time and memory (`[kv_heads, features, dv + 1]` numbers per layer, in float32).
    It has the interface of a model's `KVCache` — `length` (the tokens absorbed, which set the
    positions of the next ones), `layers`, `layer(i)`, `with_layers(...)`, `max_len` — so
    `prefill`, `decode_step` and `generate` take either. `max_len` bounds the positions as for
    a `KVCache` (they refuse to pass it, on the host, before running); the state does not grow
    with it, and inside a program nothing is lost past it.

    `stop[*batch]`: tokens at positions `>= stop` are not absorbed (the padding after a
    shorter prompt of a batch, which a `KVCache` overwrites later but a sum cannot forget);
    `NO_STOP` (the default) absorbs every token.

    A layer with a sliding window cannot be served by a sum over every past key: such a model
    gets a `KVCache` from `Transformer.init_cache`.
    """

    state: LinearState | tuple[LinearState, ...]
    length: Int[Array, "*batch"] | Int[np.ndarray, "*batch"]
    stop: Int[Array, "*batch"] | Int[np.ndarray, "*batch"]
    max_len: int = eqx.field(static=True)

    @classmethod
    def create(
        cls,
        kv_heads: int,
        max_len: int,
        qk: int,
        vo: int | None = None,
        *,
        energy: LinearKernel | None = None,
        layers: int | None = None,
        dtype=jnp.float32,
        batch: int | None = None,
    ) -> LinearCache:
        """An empty cache: one layer's, or with `layers=n` a model's (`n` states, one
        length), for keys of size `qk` and values of size `vo` (default `qk`) under
        `energy` (default `LinearKernel()`). `dtype` is that of the keys; the states
        accumulate in at least float32. With `batch=b`, every array gets a leading axis of
        `b` rows."""
        if max_len < 1:
            raise ValueError(f"LinearCache.create: max_len must be at least 1, got {max_len}")
        if layers is not None and layers < 1:
            raise ValueError(f"LinearCache.create: layers must be at least 1, got {layers}")
        if batch is not None and batch < 1:
            raise ValueError(f"LinearCache.create: batch must be at least 1, got {batch}")
        vo = qk if vo is None else vo

        def one():
            return LinearState.empty(kv_heads, qk, vo, energy=energy, dtype=dtype, batch=batch)

        state = one() if layers is None else tuple(one() for _ in range(layers))
        rows = () if batch is None else (batch,)
        length = np.zeros(rows, np.int32)  # held on the host (see `held`)
        stop = np.full(rows, NO_STOP, np.int32)
        return cls(state=state, length=length, stop=stop, max_len=max_len)

    @property
    def next_position(self) -> Int[Array, "*batch"] | Int[np.ndarray, "*batch"]:
        """The position of the next token: `length` (a linear state evicts nothing)."""
        return self.length

    @property
    def devices(self) -> int:
        """1: a linear state is not sharded (a sharded one is a `psum` of the shards')."""
        return 1

    @property
    def layers(self) -> int | None:
        """The number of layers of a model's cache; `None` for one layer's."""
        return len(self.state) if isinstance(self.state, tuple) else None

    @property
    def dtype(self):
        """The dtype the states accumulate in."""
        first = self.state[0] if isinstance(self.state, tuple) else self.state
        return first.S.dtype

    def layer(self, i: int) -> LinearCache:
        """Layer `i` of a model's cache: its state and the shared length."""
        if not isinstance(self.state, tuple):
            raise ValueError(
                "LinearCache.layer: this is one layer's cache (created without layers=)"
            )
        return dataclasses.replace(self, state=self.state[i])

    def with_layers(self, layers: Sequence[LinearCache]) -> LinearCache:
        """A model's cache from its updated layers (each advanced by the same tokens)."""
        if len(layers) != self.layers:
            raise ValueError(
                f"LinearCache.with_layers: {len(layers)} layers for a cache of {self.layers}"
            )
        state = tuple(c.state for c in layers)
        assert all(isinstance(s, LinearState) for s in state)
        return dataclasses.replace(self, state=state, length=layers[-1].length)  # pyright: ignore[reportArgumentType]


Cache = KVCache | LinearCache
"""What a model's layers carry from call to call."""


def prompt_padding(cache: Cache, lengths: Int[Array, " batch"] | None) -> Cache:
    """Before a batched prefill of padded prompts: a `LinearCache` absorbs only each row's
    first `lengths` tokens (a `KVCache` overwrites the padding later)."""
    if lengths is None or not isinstance(cache, LinearCache):
        return cache
    return dataclasses.replace(cache, stop=cache.length + lengths)


def after_prompts(cache: Cache, lengths: Int[Array, " batch"]) -> Cache:
    """After a batched prefill: each row holds its own prompt's `lengths` tokens."""
    if isinstance(cache, LinearCache):
        return dataclasses.replace(cache, length=lengths, stop=jnp.full_like(lengths, NO_STOP))
    return dataclasses.replace(cache, length=lengths)


def _overflow_message(n: int, length: int | None, max_len: int) -> str:
    held = "" if length is None else f" after the {length} cached"
    return (
        f"KVCache.append: writing {n} token(s){held} would overflow the cache of max_len={max_len}"
    )


def held(cache: Cache) -> np.ndarray | None:
    """The cache's length `[*batch]` on the host, or None when it is traced (then the program
    checks it). A length the host holds (NumPy: a cache made by `create`, or returned by
    `prefill`, `decode_step` or a `Decoder`) is read as it is; a device length is read from the
    device (which waits for the program computing it)."""
    length = cache.length
    if isinstance(length, Tracer):
        return None
    if not isinstance(length, np.ndarray | np.generic):
        # Replicated: any one copy will do (in a multi-process run not every copy is local).
        if not getattr(length, "is_fully_addressable", True):
            length = length.addressable_data(0)
    return np.asarray(length, np.int32)


def reserve(cache: Cache, n: int) -> np.ndarray | None:
    """Check on the host that `n` more tokens fit into `cache`; the lengths they will bring
    it to (host), or None for a traced cache (checked in the program instead)."""
    if n > cache.max_len:
        raise ValueError(_overflow_message(n, None, cache.max_len))
    length = held(cache)
    if length is None:
        return None
    most = int(np.max(length)) if length.size else 0
    if most + n > cache.max_len:
        raise ValueError(_overflow_message(n, most, cache.max_len))
    return length + np.int32(n)


def on_host(cache: Cache, length: np.ndarray | None) -> Cache:
    """`cache` with its length held on the host (when known), so the next call checks it
    without waiting for the device."""
    if length is None:
        return cache
    return dataclasses.replace(cache, length=np.asarray(length, np.int32))


def empty_rows(template: Cache, batch: int) -> Cache:
    """An empty cache like `template` (a cache, or its `jax.eval_shape`) with a leading axis
    of `batch` rows, allocated in place: nothing of `template` is read or copied."""
    if isinstance(template, LinearCache):
        return _linear_rows(template, batch)
    first = template.k[0] if isinstance(template.k, tuple) else template.k
    second = template.v[0] if isinstance(template.v, tuple) else template.v
    heads = first.shape[-3 if template.layout == "bhsd" else -2]
    return KVCache.create(
        heads,
        template.max_len,
        first.shape[-1],
        second.shape[-1],
        layers=template.layers,
        dtype=first.dtype,
        mesh=None if template.sharding is None else template.sharding.user_mesh,
        kv_axis=None if template.sharding is None else template.sharding.axis_name,
        block=template.block,
        layout=template.layout,
        batch=batch,
    )


def _linear_rows(template: LinearCache, batch: int) -> LinearCache:
    one = template.state[0] if isinstance(template.state, tuple) else template.state

    def state():
        return LinearState(
            S=jnp.zeros((batch, *one.S.shape[-3:]), one.S.dtype),
            z=jnp.zeros((batch, *one.z.shape[-2:]), one.z.dtype),
            energy=one.energy,
        )

    layers = template.layers
    states = state() if layers is None else tuple(state() for _ in range(layers))
    length = np.zeros((batch,), np.int32)
    stop = np.full((batch,), NO_STOP, np.int32)
    return LinearCache(state=states, length=length, stop=stop, max_len=template.max_len)
