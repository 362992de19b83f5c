"""`MultiheadAttention`: a drop-in `equinox.nn.MultiheadAttention` whose attention runs in
`treeattn.decode`, on any backend and energy, with a KV cache."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._numerics import Dims, Window, check_window, visibility
from ..decode import AttentionBackend, AttentionName, cache_layout
from ..energy import Energy, LinearKernel, Softmax, received_attention
from ._cache import Cache, KVCache, LinearCache
from ._layers import RMSNorm, RotaryEmbedding, apply_linear, apply_linears, qkv_block, qkv_fuses


SOFTMAX = Softmax()


def check_layer_mask(mask, q_seq: int, kv_seq: int, heads: int) -> None:
    """A layer's `mask`: boolean `[q_seq, kv_seq]` or `[num_heads, q_seq, kv_seq]`."""
    if mask is None:
        return
    dtype = jnp.result_type(mask)
    if dtype != jnp.bool_:
        raise ValueError(f"MultiheadAttention: mask must be boolean (True = attend), got {dtype}")
    allowed = ((q_seq, kv_seq), (heads, q_seq, kv_seq))
    if tuple(jnp.shape(mask)) not in allowed:
        raise ValueError(
            f"MultiheadAttention: mask must have shape [q_seq, kv_seq] = {allowed[0]} or "
            f"[num_heads, q_seq, kv_seq] = {allowed[1]}, got {tuple(jnp.shape(mask))}"
        )


class MultiheadAttention(eqx.Module):
    r"""Multi-head attention, a drop-in replacement for `equinox.nn.MultiheadAttention`.

    Same constructor arguments, field names and shapes (so weights move over with
    `eqx.tree_at`), same call signature and results, plus:

    - `num_kv_heads`: grouped-query attention (GQA; `1` is MQA). `key_proj` and `value_proj` then
      have `num_kv_heads * qk_size` and `num_kv_heads * vo_size` outputs.
    - `causal`: a causal mask aligned bottom-right by absolute position.
    - `local_window_size`: a sliding window by absolute position, jax's meaning: `(left, right)`
      lets the query at position $i$ see keys at $i - \mathrm{left} \le j \le i +
      \mathrm{right}$ (an int `w` is `(w, w)`); Mistral's `sliding_window=W` is `(W - 1, 0)`
      with `causal=True`.
    - `rotary`: a [`RotaryEmbedding`][treeattn.models.RotaryEmbedding] applied to queries and keys
      at their absolute positions.
    - `qk_norm_eps`: an [`RMSNorm`][treeattn.models.RMSNorm] with this epsilon over each head of
      the queries (`query_norm`) and keys (`key_norm`) after the projections, before the
      rotary embedding (Qwen3).
    - `cache`: a [`KVCache`][treeattn.models.KVCache]; the call then appends the new keys and
      values, attends over everything cached, and returns `(output, new_cache)`.
    - `backend`: where attention runs, a [`treeattn.decode.AttentionBackend`][] or its name:
      `"energy"` (default; attention as `jax.grad` of the free energy), `"reference"`,
      `"flash"`, `"tree"`, `"ring"` (with `mesh=`, `kv_axis=`); overridable per call. Every
      call goes through `treeattn.decode` (`flash_attention`, `tree_decode`, `ring_decode`).
    - `energy`: the [`Energy`][treeattn.energy.Energy] whose gradient is the attention; None
      (default) is `Softmax()`. Any other energy is a field of the layer (its array
      parameters — β, a sink logit, a bias — train with the weights) and runs on the decode
      kernels that compute it (`"energy"`, the default of every backend for it, and
      `"reference"`).

    Dtypes follow Equinox: each projection runs in the promotion of its weights' and its
    input's dtypes (float32 weights and bfloat16 inputs: heads, attention and the output
    projection in float32, and a float32 result), and query and key/value heads of different
    dtypes are promoted to one, as `jnp.result_type` would under standard promotion (also when
    `jax_numpy_dtype_promotion="strict"`).

    Dropout on the attention weights (`dropout_p`, or `dropout.p` set to an array, traced or
    not, e.g. with `eqx.tree_at`) runs on every backend: in training the weights
    $\mathrm{softmax}(q k^\top / \sqrt{d})$ are then formed explicitly, one dropout key per
    head as in Equinox; in inference (or with a Python `p == 0`) the backend's fused path runs.

    Differences from Equinox: a query that may attend to nothing gets output 0 (Equinox averages
    every value).
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    rotary: RotaryEmbedding | None
    query_norm: RMSNorm | None
    key_norm: RMSNorm | None
    energy: Energy | None

    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    local_window_size: Window | None = eqx.field(static=True)
    backend: AttentionBackend = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: float = 0.0,
        inference: bool = False,
        dtype=None,
        *,
        num_kv_heads: int | None = None,
        causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        rotary: RotaryEmbedding | None = None,
        qk_norm_eps: float | None = None,
        backend: AttentionName | AttentionBackend = "energy",
        mesh: Mesh | None = None,
        kv_axis: str | tuple[str, ...] | None = None,
        energy: Energy | None = None,
        key: PRNGKeyArray,
    ):
        if energy is not None and not isinstance(energy, Energy):
            raise ValueError(
                "MultiheadAttention: energy must be a treeattn.energy.Energy (e.g. Sigmoid()) "
                f"or None, got {type(energy).__name__}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"MultiheadAttention: num_heads={num_heads} must be a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        qkey, kkey, vkey, okey = jax.random.split(key, 4)
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        output_size = query_size if output_size is None else output_size
        if rotary is not None and rotary.dim != qk_size:
            raise ValueError(f"MultiheadAttention: rotary dim {rotary.dim} != qk_size {qk_size}")
        lin = eqx.nn.Linear
        self.query_proj = lin(
            query_size, num_heads * qk_size, use_bias=use_query_bias, dtype=dtype, key=qkey
        )
        self.key_proj = lin(
            key_size, num_kv_heads * qk_size, use_bias=use_key_bias, dtype=dtype, key=kkey
        )
        self.value_proj = lin(
            value_size, num_kv_heads * vo_size, use_bias=use_value_bias, dtype=dtype, key=vkey
        )
        self.output_proj = lin(
            num_heads * vo_size, output_size, use_bias=use_output_bias, dtype=dtype, key=okey
        )
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)
        self.rotary = rotary
        self.query_norm, self.key_norm = (
            (None, None)
            if qk_norm_eps is None
            else (
                RMSNorm(qk_size, qk_norm_eps, dtype=dtype),
                RMSNorm(qk_size, qk_norm_eps, dtype=dtype),
            )
        )
        self.energy = energy
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.query_size, self.key_size, self.value_size = query_size, key_size, value_size
        self.output_size, self.qk_size, self.vo_size = output_size, qk_size, vo_size
        self.use_query_bias, self.use_key_bias = use_query_bias, use_key_bias
        self.use_value_bias, self.use_output_bias = use_value_bias, use_output_bias
        self.causal = causal
        self.local_window_size = check_window("MultiheadAttention", local_window_size)
        self.backend = AttentionBackend.of(backend, mesh, kv_axis)

    def _project(self, query, key_, value):
        """The query, key and value projections (flat); self-attention's three projections of
        one input are one product call."""
        projs = (self.query_proj, self.key_proj, self.value_proj)
        if query is key_ and key_ is value:
            return apply_linears(projs, query)
        return tuple(apply_linear(p, x) for p, x in zip(projs, (query, key_, value), strict=True))

    def _heads(
        self, query, key_, value, *, process_heads=None, cache=None, segment_ids=None, norm=None
    ):
        """The heads attention reads, as every call makes them: projected (from `norm(x)` when
        `norm` is given: self-attention of one `x`), in one dtype, through the q/k norms and
        `process_heads`, rotated at their absolute positions. Also returns that dtype, the
        queries' offset and the documents of a packed row (`[1, seq]`, or None). The one place
        a call forms its heads (`Transformer.attention_inputs` too)."""
        q_seq, kv_seq = query.shape[0], key_.shape[0]
        # Absolute positions: after a cache of n tokens the new ones are n, n+1, ...; without a
        # cache the queries are the last q_seq positions of the key sequence (bottom-right).
        if cache is None:
            k_pos = jnp.arange(kv_seq, dtype=jnp.int32)
            q_offset = kv_seq - q_seq
        else:
            q_offset = jnp.asarray(cache.next_position)  # after an eviction, > length
            k_pos = q_offset + jnp.arange(kv_seq, dtype=jnp.int32)
        q_pos = q_offset + jnp.arange(q_seq, dtype=jnp.int32)
        packed = None  # the documents of a packed row, [1, seq]
        if segment_ids is not None:
            segment_ids = _check_segment_ids(segment_ids, q_seq, kv_seq, cache)
            k_pos = q_pos = positions_in_segments(segment_ids)
            packed = segment_ids[None]
        projs = (self.query_proj, self.key_proj, self.value_proj)
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        if norm is not None:
            if (
                process_heads is None
                and self.query_norm is None
                and self.rotary is not None
                and self.rotary.dim == self.qk_size
                and qkv_fuses(query, norm, projs, self.rotary)
            ):
                # Already rotated; on CPU one call where XLA ran seven operations per layer.
                ys = qkv_block(query, norm, projs, self.rotary, q_pos)
                q, k, v = (y.reshape(q_seq, h, -1) for y, h in zip(ys, heads, strict=True))
                return q, k, v, q.dtype, q_offset, packed
            query = key_ = value = norm(query)
        ys = self._project(query, key_, value)
        q, k, v = (y.reshape(y.shape[0], h, -1) for y, h in zip(ys, heads, strict=True))
        # Query and key/value heads of different dtypes: one dtype, as Equinox's einsums promote.
        with jax.numpy_dtype_promotion("standard"):
            heads_dtype = jnp.result_type(q, k, v)
        q, k, v = q.astype(heads_dtype), k.astype(heads_dtype), v.astype(heads_dtype)
        if self.query_norm is not None and self.key_norm is not None:
            with jax.numpy_dtype_promotion("standard"):
                q, k = self.query_norm(q).astype(heads_dtype), self.key_norm(k).astype(heads_dtype)
        if process_heads is not None:
            shapes = (q.shape, k.shape, v.shape)
            q, k, v = process_heads(q, k, v)
            if (q.shape, k.shape, v.shape) != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")
        if self.rotary is not None:
            # Self-attention's queries and keys sit at the same positions: one set of angles.
            q_angles = self.rotary.angles(q_pos)
            k_angles = q_angles if kv_seq == q_seq else self.rotary.angles(k_pos)
            q, k = self.rotary.rotate(q, q_angles), self.rotary.rotate(k, k_angles)
        return q, k, v, heads_dtype, q_offset, packed

    def received_attention(self, x: Float[Array, "seq size"]) -> Float[Array, "seq kv_heads"]:
        r"""The attention each token of self-attention over `x` (no cache, positions
        $0, 1, \dots$) receives from every query, summed over the query heads of each kv head:
        H2O's heavy-hitter score, as [`received_attention`][treeattn.energy.received_attention]
        computes it (the gradient of $\sum F$ in a per-key bias) with the layer's causality,
        window and energy. **Returns:** `[seq, num_kv_heads]`, float32."""
        q, k, v, *_ = self._heads(x, x, x)
        r = received_attention(
            q,
            k,
            v,
            causal=self.causal,
            local_window_size=self.local_window_size,
            energy=SOFTMAX if self.energy is None else self.energy,
        )
        return r.reshape(x.shape[0], self.num_kv_heads, -1).sum(-1)

    @jax.named_scope("treeattn.models.MultiheadAttention")
    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "num_heads q_seq kv_seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: Callable | None = None,
        cache: Cache | None = None,
        backend: AttentionName | AttentionBackend | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
        norm: Callable[[Array], Array] | None = None,
    ) -> Float[Array, "q_seq o_size"] | tuple[Float[Array, "q_seq o_size"], Cache]:
        """**Arguments:** as `equinox.nn.MultiheadAttention.__call__` (`query`, `key_`, `value`,
        `mask`, `key`, `inference`, `deterministic`, `process_heads`), plus `cache` (the KV cache
        of this layer: the new keys and values are appended, and attention runs over all cached
        tokens, the queries at the positions after them; or, with a `LinearKernel` energy, a
        `LinearCache`: the new keys are added to its linear state, which the queries attend
        to in constant time), `backend` (overrides the layer's; a linear state runs the same
        on every backend) and `segment_ids` (packed sequences, self-attention without a
        cache: integer document ids `[seq]`, each document contiguous; a query sees only the
        keys of its own document, and rotary positions restart at 0 in each) and `norm` (a
        pre-norm block's norm, self-attention only: the heads are projected from `norm(x)`
        for `query = key_ = value = x`; with an [`RMSNorm`][treeattn.models.RMSNorm], packed
        weights (a [`Decoder`][treeattn.models.Decoder]'s) and a rotary embedding, the norm,
        the three projections and the rotation are one call of treeattn's C++ kernel on CPU).

        **Returns:** `[q_seq, output_size]`, or `(output, new_cache)` when `cache` is given.
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "MultiheadAttention()(deterministic=...) is deprecated in favour of "
                "MultiheadAttention()(inference=...)",
                stacklevel=2,
            )
        q_seq, kv_seq = query.shape[0], key_.shape[0]
        if value.shape[0] != kv_seq:
            raise ValueError("key and value must both be sequences of equal length.")
        check_layer_mask(mask, q_seq, kv_seq, self.num_heads)
        if norm is not None and not (query is key_ and key_ is value):
            raise ValueError(
                "MultiheadAttention: norm= is a pre-norm of self-attention; pass one array as "
                f"query, key_ and value (got shapes {query.shape}, {key_.shape}, {value.shape})"
            )
        be = self.backend if backend is None else AttentionBackend.of(backend)
        q, k, v, heads_dtype, q_offset, packed = self._heads(
            query,
            key_,
            value,
            process_heads=process_heads,
            cache=cache,
            segment_ids=segment_ids,
            norm=norm,
        )
        # Equinox's rule: dropout is off in inference and for a Python rate of 0; a rate held
        # as an array (possibly traced) is applied as it is.
        p = self.dropout.p
        dropout_on = not (self.dropout.inference if inference is None else inference) and not (
            isinstance(p, int | float) and p == 0
        )
        energy = SOFTMAX if self.energy is None else self.energy
        if dropout_on and self.energy is not None:
            raise ValueError(
                f"MultiheadAttention: attention dropout forms softmax weights; it cannot be "
                f"combined with energy={type(self.energy).__name__}(...) (set dropout_p=0)"
            )
        if cache is not None:
            if dropout_on:
                raise ValueError("attention dropout is for training, not for a KV cache")
            if mask is not None:
                raise ValueError(
                    "MultiheadAttention: mask= cannot be combined with cache= (with a cache, "
                    "keys are masked by the filled length and, if causal, by position)"
                )
        window = self.local_window_size
        if cache is None:
            new_cache = None
            if dropout_on:
                if segment_ids is not None:
                    raise ValueError(
                        "MultiheadAttention: attention dropout is not combined with "
                        "segment_ids (set dropout_p=0 or inference=True)"
                    )
                attn = self._attend_with_dropout(q, k, v, mask, q_offset, key, inference)
            else:
                if mask is not None:  # [batch, #heads, q_seq, kv_seq]
                    mask = mask[None, None] if mask.ndim == 2 else mask[None]
                attn = be.attend(
                    q[None],
                    k[None],
                    v[None],
                    causal=self.causal,
                    # Without causality the alignment of queries to keys is moot; more
                    # queries than keys would give the kernels a negative offset.
                    q_offset=q_offset if self.causal or window else 0,
                    mask=mask,
                    local_window_size=window,
                    energy=energy,
                    q_segment_ids=packed,
                    kv_segment_ids=packed,
                )[0]
        elif isinstance(cache, LinearCache):
            attn, new_cache = self._attend_linear_state(q, k, v, cache)
        else:
            new_cache = cache.append(k, v)
            assert not isinstance(new_cache.k, tuple) and not isinstance(new_cache.v, tuple)
            q = q.astype(new_cache.k.dtype)  # a cache may be kept in another dtype
            all_seen = (q_seq == 1 or not self.causal) and window is None
            keys = new_cache.keys(be, all_seen=all_seen, energy=energy, windowed=window is not None)
            # A cache's slots hold zeros until written, and the model writes finite keys and
            # values: the energy kernel reads it without a pass over non-finite slots.
            attn = be.attend(
                q[None],
                new_cache.k[None],
                new_cache.v[None],
                causal=self.causal,
                q_offset=q_offset,
                local_window_size=window,
                kv_layout=new_cache.layout,
                energy=energy,
                kv_finite=True,
                **keys,
            )[0]
        # In the heads' dtype (a cache may hold another), then projected as Equinox does.
        out = apply_linear(self.output_proj, attn.reshape(q_seq, -1).astype(heads_dtype))
        return out if new_cache is None else (out, new_cache)

    @property
    def uses_linear_state(self) -> bool:
        """Whether a [`LinearCache`][treeattn.models.LinearCache] can serve this layer: its
        energy is a `LinearKernel` and it has no sliding window (a sum over every past key
        cannot forget the keys that leave a window)."""
        return isinstance(self.energy, LinearKernel) and self.local_window_size is None

    def init_cache(
        self,
        max_len: int,
        *,
        dtype=None,
        linear_state: bool | None = None,
        layers: int | None = None,
        **kwargs,
    ) -> Cache:
        """An empty cache for this layer (or with `layers=n`, for `n` layers like it): a
        `LinearCache` when `uses_linear_state` (unless `linear_state=False`), else a `KVCache`
        (`kwargs` go to `KVCache.create`: `mesh` and `kv_axis`, default the backend's; `block`,
        default 16, one contiguous block per shard for an ordered energy; `layout`, default
        what the backend reads in place; `batch`). `dtype` defaults to the query projection's."""
        dtype = dtype or self.query_proj.weight.dtype
        reach = None if self.energy is None else self.energy.max_distance
        if reach is not None and max_len - 1 > reach:
            raise ValueError(
                f"init_cache: {type(self.energy).__name__}'s weights are defined up to a distance "
                f"of {reach} tokens; a cache of max_len={max_len} reaches {max_len - 1}"
            )
        if linear_state is None:
            linear_state = self.uses_linear_state
        sizes = (self.num_kv_heads, max_len, self.qk_size, self.vo_size)
        if linear_state:
            if not self.uses_linear_state:
                raise ValueError(
                    "init_cache: linear_state=True needs energy=LinearKernel(...) without a "
                    f"sliding window, got energy={type(self.energy).__name__} and "
                    f"local_window_size={self.local_window_size}"
                )
            assert isinstance(self.energy, LinearKernel)
            batch = kwargs.get("batch")
            return LinearCache.create(
                *sizes, energy=self.energy, dtype=dtype, layers=layers, batch=batch
            )
        if self.backend.sharded and kwargs.get("mesh") is None:
            kwargs.update(mesh=self.backend.mesh, kv_axis=self.backend.kv_axis)
        if kwargs.get("block") is None:
            # Round-robin blocks of 16 fill the shards evenly; an ordered energy folds the
            # shards in position order, so each holds one contiguous range instead.
            ordered = self.energy is not None and not self.energy.monoid.commutative
            kwargs["block"] = None if ordered else 16
        if kwargs.get("layout") is None:
            kwargs["layout"] = self.cache_layout(dtype)
        return KVCache.create(*sizes, dtype=dtype, layers=layers, **kwargs)

    def cache_layout(self, dtype=None, backend: AttentionName | AttentionBackend | None = None):
        """The layout of a KV cache that `backend` (default: the layer's) reads where it
        lies, for this layer's heads and energy (`treeattn.decode.cache_layout`)."""
        be = self.backend if backend is None else AttentionBackend.of(backend)
        return cache_layout(
            be,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.qk_size,
            dtype=dtype or self.query_proj.weight.dtype,
            energy=self.energy,
        )

    def _attend_linear_state(self, q, k, v, cache: LinearCache):
        """Attention against the layer's linear state, which absorbs the new keys first (not
        causal) or along the chunk (causal: query i sees the state and the chunk's keys up to
        i). Tokens at positions `>= cache.stop` (padding) are not absorbed."""
        state = cache.state
        if isinstance(state, tuple):
            raise ValueError(
                "MultiheadAttention: this LinearCache holds a model's layers; pass cache.layer(i)"
            )
        if not self.uses_linear_state:
            raise ValueError(
                "MultiheadAttention: a LinearCache serves energy=LinearKernel(...) without a "
                f"sliding window; this layer has energy={type(self.energy).__name__} and "
                f"local_window_size={self.local_window_size} (use a KVCache)"
            )
        assert isinstance(self.energy, LinearKernel)
        if not state.serves(self.energy):
            raise ValueError(
                f"MultiheadAttention: the LinearCache was made for {state.energy!r}, not the "
                "layer's energy (create it with energy=layer.energy)"
            )
        n = k.shape[0]
        positions = jnp.asarray(cache.length) + jnp.arange(n, dtype=jnp.int32)
        absorbed = positions < cache.stop
        if self.causal:
            if q.shape[0] != n:
                raise ValueError(
                    f"MultiheadAttention: a causal call with a LinearCache takes as many queries "
                    f"as keys, got {q.shape[0]} and {n}"
                )
            out, state = state.attend_causal(q, k, v, mask=absorbed, positions=positions)
        else:
            state = state.update(k, v, mask=absorbed, positions=positions)
            # The queries sit after the cached tokens, as the keys do (`_heads`).
            at = jnp.asarray(cache.length) + jnp.arange(q.shape[0], dtype=jnp.int32)
            out = state.attend(q, positions=at)
        length = cache.length + n
        return out, dataclasses.replace(cache, state=state, length=length)

    def _attend_with_dropout(self, q, k, v, mask, q_offset, key, inference):
        """Softmax attention with dropout on the weights (Equinox's semantics)."""
        group = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        logits = jnp.einsum("shd,Shd->hsS", q, k).astype(jnp.float32) / jnp.sqrt(self.qk_size)
        dims = Dims(q.shape[0], k.shape[0], self.num_heads, self.num_heads, q.shape[-1], 1)
        vis = visibility(
            dims, causal=self.causal, q_offset=q_offset, mask=mask, window=self.local_window_size
        )
        visible = jnp.ones(logits.shape, bool) if vis is None else vis.reshape(-1, *vis.shape[2:])
        visible = jnp.broadcast_to(visible, logits.shape)
        logits = jnp.where(visible, logits, -jnp.inf)
        weights = jax.nn.softmax(logits, axis=-1, where=visible)
        weights = jnp.where(jnp.isfinite(weights), weights, 0.0).astype(q.dtype)
        # One dropout key per head, as Equinox splits them.
        keys = None if key is None else jax.random.split(key, self.num_heads)
        with jax.numpy_dtype_promotion("standard"):  # a rate held as a float32 array
            weights = jax.vmap(lambda w, k: self.dropout(w, key=k, inference=inference))(
                weights, keys
            )
        weights = weights.astype(q.dtype)
        return jnp.einsum("hsS,Shd->shd", weights, v)


def positions_in_segments(segment_ids: Int[Array, " seq"]) -> Int[Array, " seq"]:
    """The position of each token within its segment (packed documents, each contiguous):
    0 at the first token of every segment."""
    index = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), segment_ids[1:] != segment_ids[:-1]])
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=0)


def _check_segment_ids(segment_ids, q_seq: int, kv_seq: int, cache) -> Array:
    if cache is not None:
        raise ValueError(
            "MultiheadAttention: segment_ids pack documents for training or a prefill without "
            "a cache; with cache= the keys are the cached ones"
        )
    shape = tuple(jnp.shape(segment_ids))
    if q_seq != kv_seq or not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
        raise ValueError(
            f"MultiheadAttention: segment_ids are for self-attention over one packed row "
            f"(q_seq == kv_seq, integer ids), got q_seq={q_seq}, kv_seq={kv_seq}, dtype "
            f"{jnp.result_type(segment_ids)}"
        )
    if shape != (q_seq,):
        raise ValueError(
            f"MultiheadAttention: segment_ids must have shape [seq] = ({q_seq},), got {shape}"
        )
    return jnp.asarray(segment_ids).astype(jnp.int32)
