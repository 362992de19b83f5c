"""Decoding: a `Decoder` that owns a model's prepared weights, its KV cache and the cache's
length on the host; and `prefill`, `decode_step` and `generate`, built on the same programs."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._native import load_kernel
from ..decode import AttentionBackend, AttentionName
from ._cache import (
    Cache,
    KVCache,
    _overflow_message,
    after_prompts,
    empty_rows,
    held,
    on_host,
    prompt_padding,
    reserve,
)
from ._checks import check_token_ids, check_token_type
from ._layers import PackedWeight


if TYPE_CHECKING:
    from ._llama import Transformer


# ---------------------------------------------------------------------------------------------
# A model as decoding reads it
# ---------------------------------------------------------------------------------------------


def packed_weights(model: Transformer) -> Transformer:
    """`model` with every projection's weight (and a tied embedding, which the logits read as
    a weight) a `PackedWeight`, where it can be packed. The layers come out as a tuple whose
    projections of one kind share one stack of packed weights (layer `i` reads
    `PackedWeight(stack, out, i)`), packed one kind at a time: beside the model, the peak holds
    the stacks packed so far (and, for layers given as a tuple, one kind's weights stacked)."""

    def is_linear(m):
        return isinstance(m, eqx.nn.Linear)

    def packable(w, ndim):
        if not isinstance(w, jax.Array) or w.ndim != ndim:
            return False
        return PackedWeight.packs(jax.ShapeDtypeStruct(w.shape[-2:], w.dtype))

    def with_weight(m, w):
        return eqx.tree_at(lambda linear: linear.weight, m, w)

    n = model.config.num_hidden_layers
    if isinstance(model.layers, tuple):
        flat = [jax.tree.flatten(b, is_leaf=is_linear) for b in model.layers]
        layers = model.layers
        if len({f[1] for f in flat}) == 1:  # alike layers: each kind of projection stacked
            columns = []
            for column in zip(*(f[0] for f in flat), strict=True):
                ws = [m.weight for m in column if is_linear(m)]
                if (
                    len(ws) == len(column)
                    and all(packable(w, 2) for w in ws)
                    and (len({(w.shape, w.dtype) for w in ws}) == 1)
                ):
                    panels = _stacked_panels(ws)
                    out = ws[0].shape[0]
                    column = [
                        with_weight(m, PackedWeight(panels, out, i)) for i, m in enumerate(column)
                    ]
                columns.append(column)
            layers = tuple(
                jax.tree.unflatten(flat[0][1], [c[i] for c in columns]) for i in range(n)
            )
    else:
        # Each stacked projection's weight replaced by its packed stack (`outs`: by `id`, its
        # output count); layer i then reads `PackedWeight(stack, out, i)` and a row of the rest.
        leaves, tree = jax.tree.flatten(model.layers, is_leaf=is_linear)
        outs: dict[int, int] = {}
        for j, m in enumerate(leaves):
            if is_linear(m) and packable(m.weight, 3):
                panels = _stacked_panels(m.weight)
                outs[id(panels)] = m.weight.shape[1]
                leaves[j] = with_weight(m, panels)
        stack = jax.tree.unflatten(tree, leaves)

        def take(x, i):
            if id(x) in outs:
                return PackedWeight(x, outs[id(x)], i)
            return x[i] if eqx.is_array(x) else x

        layers = tuple(jax.tree.map(functools.partial(take, i=i), stack) for i in range(n))
    model = eqx.tree_at(lambda m: m.layers, model, layers)

    def pack(m):  # the rest: the logits' head, and any projection not stacked above
        if is_linear(m) and PackedWeight.packs(m.weight):
            return with_weight(m, PackedWeight.of(m.weight))
        return m

    model = jax.tree.map(pack, model, is_leaf=is_linear)
    table = model.embed_tokens.weight
    if model.lm_head is None and PackedWeight.packs(table):
        model = eqx.tree_at(lambda m: m.embed_tokens.weight, model, PackedWeight.of(table))
    return model


@jax.jit
def _stacked_panels(w: Float[Array, "layers out n"] | list[Float[Array, "out n"]]) -> Array:
    """Every layer's `w` packed: `PackedWeight.of(w[i]).panels` stacked (a list of layers'
    weights is stacked in the same program, so the stack and the packing are one pass)."""
    return jax.vmap(PackedWeight.of)(jnp.stack(w) if isinstance(w, list) else w).panels


def packs_here() -> bool:
    """Whether decoding packs weights by default: on CPU, where the C++ product is built."""
    return jax.default_backend() == "cpu" and load_kernel() is None


class Prepared:
    """A model as decoding reads it, made once per model: on CPU its weights packed for the
    C++ product (`PackedWeight`, unless `packed=False`), every layer's projections of one
    kind read in place from one stack (no slice: XLA materialises a slice of a stacked weight
    before a product reads it); else every layer with arrays of its own (a stacked layer is
    copied here, once, never per step). Its parameters are flattened once, each array once
    (the layers' vectors, norms and biases, stacked: a program's argument costs its dispatch
    about a microsecond), and it holds the compiled programs that run it (their static part
    is closed over, so a call hashes nothing)."""

    def __init__(self, model: Transformer, packed: bool | None = None):
        if packed is None:
            packed = packs_here()
        model = packed_weights(model) if packed else model.unstack_layers()
        self.packed = packed
        params, self.static = eqx.partition(model, eqx.is_array)
        leaves, self.treedef = jax.tree.flatten(params)
        # The programs take each array once: a stack the layers share (packed weights) once,
        # and the layers' vectors (norms, biases) stacked, each layer's read by a slice that
        # XLA fuses into its reader. `_where[n]`: leaf n is `weights()[j]`, or its row `i`.
        stacked = _stacked_vectors(model) if isinstance(model.layers, tuple) else {}
        first: dict[int, int] = {}
        self.leaves = []
        self._where: list[tuple[int, int | None]] = []
        for x in leaves:
            x, i = stacked.get(id(x), (x, None))
            if id(x) not in first:
                first[id(x)] = len(self.leaves)
                self.leaves.append(x)
            self._where.append((first[id(x)], i))
        self.config = model.config
        self.backend = model.backend.decoding
        self.energy = model.energy
        self._model = model
        self._programs: dict[Any, Callable] = {}
        self._placed: dict[Any, list] = {}

    @property
    def model(self) -> Transformer:
        return self._model

    def program(self, kind: str, backend: AttentionBackend, **options) -> Any:
        """The compiled program `kind` (`"forward"` or `"generate"`) on `backend`, made once."""
        key = (kind, backend, tuple(sorted(options.items())))
        if key not in self._programs:
            build = _forward if kind == "forward" else _generate_loop
            self._programs[key] = build(self, backend, **options)
        return self._programs[key]

    def weights(self, backend: AttentionBackend) -> list:
        """The flat weights as `backend`'s programs take them: on its mesh, replicated, placed
        once per mesh (a program given weights on one device would copy them to every device
        of the mesh on every call)."""
        mesh = backend.mesh
        if mesh is None:
            return self.leaves
        if mesh not in self._placed:
            self._placed[mesh] = jax.device_put(self.leaves, _replicated(mesh))
        return self._placed[mesh]

    def combine(self, leaves) -> Transformer:
        """The model from `weights()` (each array once) as `run` takes them."""
        every = [leaves[j] if i is None else leaves[j][i] for j, i in self._where]
        return eqx.combine(jax.tree.unflatten(self.treedef, every), self.static)


def _stacked_vectors(model: Transformer) -> dict[int, tuple[Array, int]]:
    """For each layer's vector (a norm's weight, a bias: 1-d arrays, alike in every layer),
    by `id`, the stack of them all and its layer."""
    assert isinstance(model.layers, tuple)
    blocks = [jax.tree.leaves(eqx.filter(b, eqx.is_array)) for b in model.layers]
    out: dict[int, tuple[Array, int]] = {}
    if len({len(b) for b in blocks}) != 1:
        return out
    for alike in zip(*blocks, strict=True):
        first = alike[0]
        if first.ndim != 1 or any(x.shape != first.shape or x.dtype != first.dtype for x in alike):
            continue
        if len({id(x) for x in alike}) != len(alike):
            continue  # shared already
        stack = jnp.stack(alike)
        out.update({id(x): (stack, i) for i, x in enumerate(alike)})
    return out


_PREPARED: dict[tuple[int, bool], tuple[weakref.ref, Prepared]] = {}


def prepared(model: Transformer | Prepared, packed: bool | None = None) -> Prepared:
    """`model` prepared for decoding (weights packed or not, default `packs_here()`), once per
    model object (a new object, e.g. after `eqx.tree_at`, is prepared anew)."""
    if isinstance(model, Prepared):
        if packed is not None and packed != model.packed:
            raise ValueError(
                f"prepared: packed={packed} for a model prepared with packed={model.packed}"
            )
        return model
    # The cache first: a step of a prepared model looks for no trace (that check dispatches an
    # operation and walks every leaf, tens of microseconds per call).
    choice = packs_here() if packed is None else packed
    key = (id(model), choice)
    known = _PREPARED.get(key)
    if known is not None and known[0]() is model:
        return known[1]
    if _tracing(model):
        # Inside a trace (a user's `jit` or `vmap` around `decode_step`, say) the prepared
        # arrays would be the trace's: packing would add a pass over every weight to each
        # call, and a cached result would leak the trace's values into later calls.
        return Prepared(model, bool(packed))
    result = Prepared(model, choice)
    _PREPARED[key] = (weakref.ref(model, lambda _: _PREPARED.pop(key, None)), result)
    return result


def _replicated(mesh) -> NamedSharding:
    """Every device of `mesh` holds the whole array: how the programs take the weights and
    return a cache's length."""
    return NamedSharding(mesh, PartitionSpec())


def _tracing(model) -> bool:
    """Whether this runs inside a JAX trace, or `model` holds a trace's values."""
    if isinstance(jnp.zeros(()), Tracer):
        return True
    return any(isinstance(x, Tracer) for x in jax.tree.leaves(model))


def _host_checked(cache: Cache) -> Cache:
    """The cache as the programs take it: its next append checked on the host (no check in the
    program), its length on the device like every other input."""
    checked = {"checked": True} if isinstance(cache, KVCache) else {}
    return dataclasses.replace(cache, length=jnp.asarray(cache.length), **checked)


def _forward(
    prep: Prepared, backend: AttentionBackend, *, cache_def, rows: bool, keep: int, step: bool
) -> Callable:
    """`(leaves, tokens, cache_leaves) -> (logits, cache_leaves)`: the model over `tokens`
    after the cache (`cache_def` with `cache_leaves`, which are donated: updated in place);
    every row of a batch under `vmap` when `rows`. `keep`: `logits_to_keep`; `step`: one token
    (per row) in, the logits of the next out. The host checked that the tokens fit, so the
    program checks nothing. The cache goes in and out as a flat list: a call builds no Python
    object of it."""

    def run(leaves, tokens, cache_leaves):
        model = prep.combine(leaves)
        cache = _keep_checked(jax.tree.unflatten(cache_def, cache_leaves))

        def one(tokens, cache):
            if step:
                logits, cache = model(tokens[None], cache, backend=backend)
                return logits[0], cache
            return model(tokens, cache, backend=backend, logits_to_keep=keep)

        logits, cache = jax.vmap(one)(tokens, cache) if rows else one(tokens, cache)
        return logits, jax.tree.leaves(cache)

    return jax.jit(run, donate_argnums=(2,))


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------


class Decoder:
    r"""A model ready to decode: its weights prepared once, its KV cache, and the cache's length
    on the host.

    Made by [`Transformer.decoder`][treeattn.models.Transformer.decoder]. Every layer reads its
    weights where they lie: on CPU laid out once in panels for treeattn's C++ product
    ([`PackedWeight`][treeattn.models.PackedWeight]), one stack per kind of projection that
    the product reads layer by layer in place (a second copy of the weights while the model
    object itself is alive); with `packed=False` the model's matrices, a stacked model's
    copied once per layer here, never per step (the layers' vectors, norms and biases, are
    stacked either way). Every step reads
    each weight and each cached key and value once and writes the new token's keys and values
    in place, and the host knows the cache's length, so a step that would overflow it is
    refused before it runs and the program itself checks
    nothing. Calls compile once per shape.

    `backend` defaults to the model's for decoding (`AttentionBackend.decoding`): a model on
    the default `"energy"` backend decodes on `"flash"`, the same attention through a fused
    kernel (the gradient of the free energy materialises every logit of a step);
    `backend="energy"` decodes through the gradient itself.

    ```python
    decoder = model.decoder(max_len=256)
    logits = decoder.prefill(prompt, logits_to_keep=1)      # [1, vocab]
    token = jnp.argmax(logits[-1])
    for _ in range(20):
        token = jnp.argmax(decoder.step(token))            # [vocab] -> the next token
    tokens = decoder.generate(prompt2, max_new_tokens=20)   # continues after what it holds
    ```

    **Attributes:** `cache` (the current cache), `length` (the tokens it holds, on the host:
    an int, or `[batch]`), `max_len`, `batch` (None: one sequence), `backend`, `packed`
    (whether the weights are packed).
    """

    def __init__(
        self,
        model: Transformer | Prepared,
        *,
        max_len: int,
        batch: int | None = None,
        backend: AttentionName | AttentionBackend | None = None,
        mesh=None,
        kv_axis=None,
        dtype=None,
        layout=None,
        block: int | None = None,
        packed: bool | None = None,
    ):
        if packed is not None and not isinstance(packed, bool):
            raise ValueError(f"Decoder: packed must be None, True or False, got {packed!r}")
        prep = prepared(model, packed)
        if backend is None and (mesh is not None or kv_axis is not None):
            raise ValueError("Decoder: mesh= and kv_axis= go with backend='tree' or 'ring'")
        be = prep.backend if backend is None else AttentionBackend.of(backend, mesh, kv_axis)
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"Decoder: max_len must be a positive int, got {max_len!r}")
        if batch is not None and (not isinstance(batch, int) or batch < 1):
            raise ValueError(f"Decoder: batch must be None or a positive int, got {batch!r}")
        self._prep = prep
        self.packed = prep.packed
        self.backend = be
        self.batch = batch
        attn = prep.model.block(0).self_attn
        kw = dict(mesh=be.mesh, kv_axis=be.kv_axis, dtype=dtype, block=block)
        kw["layout"] = attn.cache_layout(dtype, backend=be) if layout is None else layout
        init = functools.partial(prep.model.init_cache, max_len, **kw)
        # Allocated where it lives (shard by shard, row by row), nothing of it read or copied.
        cache = init() if batch is None else empty_rows(jax.eval_shape(init), batch)
        self.max_len = cache.max_len
        self._set(cache)

    def _set(self, cache: Cache, like: list | None = None) -> None:
        """Hold `cache` as the programs take it: a flat list of device arrays (its length among
        them), and the length apart, on the host. With `like` (the decoder's leaves, of the
        same structure), each array goes where its counterpart lies."""
        length = held(cache)
        assert length is not None
        self._length = length
        mesh = self.backend.mesh
        if mesh is None:
            device_length = jnp.asarray(cache.length)
        else:  # as the programs return it, not on one device
            device_length = jax.device_put(np.asarray(cache.length), _replicated(mesh))
        device = dataclasses.replace(cache, length=device_length)
        leaves, self._cache_def = jax.tree.flatten(device)
        # Committed where the programs take them (no copy where they already lie): a program
        # compiles for its inputs' placement, and its outputs are committed, so a cache
        # assigned from elsewhere (by `device_put`, from the host, read back from `cache`)
        # would otherwise cost more compiles. On a mesh, only what lies over its devices: a
        # linear state made on one device stays uncommitted (committed there, it would clash
        # with the mesh's weights).
        where = leaves if like is None else like
        devices = None if mesh is None else set(mesh.devices.flat)
        arrays = [
            i
            for i, x in enumerate(where)
            if isinstance(x, jax.Array) and (devices is None or x.sharding.device_set == devices)
        ]
        targets = [where[i].sharding for i in arrays]
        placed = jax.device_put([leaves[i] for i in arrays], targets)
        for i, x in zip(arrays, placed, strict=True):
            leaves[i] = x
        self._leaves = leaves

    @property
    def cache(self) -> Cache:
        """The cache as it stands (its length on the host). Assign a cache of the same
        structure, shapes and dtypes (e.g. one filled elsewhere, or this one read back) to
        continue from it: its arrays are placed where the decoder's lie (no copy where they
        lie already, so the compiled programs serve it) and are then the decoder's (donated
        to its next call)."""
        return on_host(jax.tree.unflatten(self._cache_def, self._leaves), self._length)

    @cache.setter
    def cache(self, cache: Cache) -> None:
        def spec(cache):
            leaves, treedef = jax.tree.flatten(cache)
            return treedef, [(np.shape(x), jnp.result_type(x)) for x in leaves]

        mine, theirs = spec(self.cache), spec(cache)
        if mine != theirs:
            raise ValueError(
                f"Decoder.cache: the cache must have the structure, shapes and dtypes of the "
                f"decoder's, {mine[1]}; got {theirs[1]}"
            )
        length = held(cache)
        if length is None or int(np.max(length, initial=0)) > self.max_len:
            raise ValueError(
                f"Decoder.cache: the cache's length must be concrete and at most "
                f"max_len={self.max_len}, got {cache.length}"
            )
        self._set(on_host(cache, length), like=self._leaves)

    @property
    def length(self) -> int | np.ndarray:
        """The tokens the cache holds (host): an int, or one per row `[batch]`."""
        return int(self._length) if self.batch is None else self._length.copy()

    def reset(self) -> None:
        """Forget every token: the cache is empty again (its buffers are reused)."""
        rows = () if self.batch is None else (self.batch,)
        empty: dict[str, Any] = dict(length=np.zeros(rows, np.int32))
        if isinstance(self.cache, KVCache):
            empty.update(slot_positions=None, dropped=None)  # undo an eviction
        self._set(dataclasses.replace(self.cache, **empty))

    def evict(self, scores: Array, keep: int, *, recent: int = 0, per_head: bool = True) -> None:
        """Evict the cache's least-attended keys ([`KVCache.evict`][treeattn.models.KVCache.evict],
        whose arguments these are; scores from
        [`attention_scores`][treeattn.models.attention_scores]). The next call compiles once
        for the evicted cache (it carries its slots' positions)."""
        cache = self.cache
        if not isinstance(cache, KVCache):
            raise ValueError("Decoder.evict: a LinearCache holds no keys to evict")
        self._set(cache.evict(scores, keep, recent=recent, per_head=per_head))

    def _tokens(self, name: str, tokens, ndim: int) -> Array:
        ndim += self.batch is not None
        tokens = tokens if hasattr(tokens, "ndim") else jnp.asarray(tokens)
        check_token_type(f"Decoder.{name}", tokens, self._prep.config.vocab_size, ndim=ndim)
        if self.batch is not None and tokens.shape[0] != self.batch:
            raise ValueError(
                f"Decoder.{name}: tokens must have a leading batch axis of {self.batch} rows, "
                f"got shape {tokens.shape}"
            )
        return tokens

    def _run(self, tokens, n: int, keep: int, step: bool):
        most = int(np.max(self._length)) if self._length.size else 0
        if most + n > self.max_len:
            raise ValueError(_overflow_message(n, most, self.max_len))
        weights = self._prep.weights(self.backend)
        logits, self._leaves = self._program(keep, step)(weights, tokens, self._leaves)
        self._length = self._length + np.int32(n)
        return logits

    def compiled_step(self) -> jax.stages.Compiled:
        """The program `step` runs, compiled for inspection: its `as_text()` and
        `memory_analysis()` show what a step computes and what it holds (e.g. that no weight
        or cache buffer is copied)."""
        rows = self.batch is not None
        run = self._program(keep=0, step=True)
        token = jax.ShapeDtypeStruct((self.batch,) if rows else (), jnp.int32)
        leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in self._leaves]
        return run.lower(self._prep.weights(self.backend), token, leaves).compile()

    def _program(self, keep: int, step: bool) -> Any:
        return self._prep.program(
            "forward",
            self.backend,
            cache_def=self._cache_def,
            rows=self.batch is not None,
            keep=keep,
            step=step,
        )

    def prefill(
        self,
        tokens: Int[Array, " seq"] | Int[Array, "batch seq"],
        *,
        logits_to_keep: int = 0,
    ) -> Float[Array, "keep vocab"] | Float[Array, "batch keep vocab"]:
        """Run `tokens` after what the cache holds; return their logits (`logits_to_keep` as
        in `Transformer`: 0 every position, `k` the last `k`). Concrete ids outside
        `[0, vocab_size)` and tokens that would not fit raise a `ValueError` before anything
        runs."""
        tokens = self._tokens("prefill", tokens, 1)
        check_token_ids("Decoder.prefill", tokens, self._prep.config.vocab_size)
        return self._run(tokens, tokens.shape[-1], logits_to_keep, step=False)

    def step(
        self, token: Int[Array, ""] | Int[Array, " batch"]
    ) -> Float[Array, " vocab"] | Float[Array, "batch vocab"]:
        """One token in (one per row), next-token logits out. The id is not checked, so that a
        token sampled on the device need not reach the host; an id outside
        `[0, vocab_size)` reads a clamped embedding row (see `Transformer`)."""
        return self._run(self._tokens("step", token, 0), 1, 0, step=True)

    def generate(
        self,
        prompt: Int[Array, " prompt"] | Int[Array, "batch prompt"],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        key: PRNGKeyArray | None = None,
        attention_mask: Array | None = None,
    ) -> Int[Array, " total"] | Int[Array, "batch total"]:
        """`max_new_tokens` after `prompt`, appended to what the cache holds: one compiled
        program for the prompt and every step (see `treeattn.models.generate`, whose
        arguments these are). The cache then holds the prompt and every new token but the
        last (sampled, not run), and decoding can continue with `step`.

        **Returns:** the prompt (as given) followed by the new tokens."""
        prep, vocab = self._prep, self._prep.config.vocab_size
        _check_sampling("generate", temperature, top_k, vocab)
        if temperature != 0.0 and key is None:
            raise ValueError("generate: sampling (temperature > 0) needs key=")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be at least 1, got {max_new_tokens}")
        prompt = self._tokens("generate", prompt, 1)
        if prompt.shape[-1] == 0:
            raise ValueError(f"generate: the prompt is empty (shape {prompt.shape})")
        check_token_ids("generate", prompt, vocab)
        prompts = prompt if self.batch is not None else prompt[None]
        mask = _prompt_mask(attention_mask, prompt.shape)
        n = prompts.shape[1] + max_new_tokens - 1  # the last token is sampled, not run
        before = self._length
        most = int(np.max(before))
        if most + n > self.max_len:
            holds = f" after the {most} it holds" if most else ""
            raise ValueError(
                f"generate: a prompt of {prompts.shape[1]} token(s) and "
                f"max_new_tokens={max_new_tokens} need a cache of {most + n} tokens{holds}, "
                f"more than max_len={self.max_len}"
            )
        rows = prompts.shape[0]
        keys = jax.random.split(key, rows) if key is not None else jnp.zeros((rows,), jnp.uint32)
        run = prep.program(
            "generate",
            self.backend,
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_k=top_k,
            rows=self.batch is not None,
        )
        out, cache = run(prep.weights(self.backend), prompts, mask, _host_checked(self.cache), keys)
        # The host knows what each row now holds without waiting for the loop.
        added = np.full((rows,), prompts.shape[1]) if mask is None else np.sum(mask, axis=1)
        added = added if self.batch is not None else added[0]
        self._leaves = jax.tree.leaves(cache)
        self._length = (before + added + max_new_tokens - 1).astype(np.int32)
        return out if self.batch is not None else out[0]


# ---------------------------------------------------------------------------------------------
# The functional calls
# ---------------------------------------------------------------------------------------------


def prefill(
    model: Transformer,
    tokens: Int[Array, " seq"],
    cache: Cache,
    *,
    backend: AttentionName | AttentionBackend | None = None,
) -> tuple[Float[Array, "seq vocab"], Cache]:
    """Run `tokens` after what `cache` holds; return their logits and the updated cache.

    The model's weights are prepared for decoding once per model (see `Decoder`; on CPU,
    packed: a second copy while the model is alive), whether its layers are stacked or not;
    inside a trace (a `jit` around this call) they are used as they are. The cache passed in
    is donated (its buffers are updated in place and become the returned cache's): use the
    returned one from then on; it holds its length on the host, so the next call checks it
    without waiting for the device.

    Raises a `ValueError` before running if the tokens are not integers, if a concrete
    `tokens` holds ids outside `[0, vocab_size)`, or if they do not fit into the cache (see
    `KVCache`, "Overflow").
    """
    check_token_type("prefill", tokens, model.config.vocab_size, ndim=1)
    check_token_ids("prefill", tokens, model.config.vocab_size)
    return _call(model, tokens, cache, backend)


def decode_step(
    model: Transformer,
    token: Int[Array, ""],
    cache: Cache,
    *,
    backend: AttentionName | AttentionBackend | None = None,
) -> tuple[Float[Array, " vocab"], Cache]:
    """One token in, next-token logits out. Shapes never change, so this compiles once.

    The step reads each weight and each cached key and value once and writes only the new
    token's keys and values, in place: the cache passed in is donated (use the returned one).
    The model's weights are prepared for decoding once per model (a stacked model is unstacked
    once, not per step; on CPU they are packed, a second copy while the model is alive; inside a
    trace they are used as they are; see `Decoder`, which also owns the cache).

    A full cache raises a `ValueError` before running (see `KVCache`, "Overflow"). The token
    id's value is not checked, so that a token sampled on the device need not be copied to the
    host; an id outside `[0, vocab_size)` reads a clamped embedding row (see `Transformer`).
    """
    check_token_type("decode_step", token, model.config.vocab_size, ndim=0)
    logits, cache = _call(model, token[None], cache, backend)
    return logits[0], cache


def _call(model, tokens, cache, backend):
    prep = prepared(model)
    be = prep.backend if backend is None else AttentionBackend.of(backend)
    length = reserve(cache, tokens.shape[0])
    if length is None:  # a traced cache: the model checks it in the program
        return cast(tuple[Array, Cache], prep.model(tokens, cache, backend=be))
    leaves, cache_def = jax.tree.flatten(_host_checked(cache))
    run = prep.program("forward", be, cache_def=cache_def, rows=False, keep=0, step=False)
    logits, leaves = run(prep.weights(be), tokens, leaves)
    return logits, on_host(jax.tree.unflatten(cache_def, leaves), length)


def sample(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray | None,
    *,
    temperature: float,
    top_k: int | None,
) -> Int[Array, ""]:
    """Greedy when `temperature == 0`; otherwise softmax sampling, optionally from the top k
    (`1 <= top_k <= vocab`)."""
    _check_sampling("sample", temperature, top_k, logits.shape[-1])
    if temperature == 0.0:
        return jnp.argmax(logits).astype(jnp.int32)
    assert key is not None
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def generate(
    model: Transformer,
    prompt: Int[Array, " prompt"] | Int[Array, "batch prompt"],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: PRNGKeyArray | None = None,
    backend: AttentionName | AttentionBackend | None = None,
    mesh=None,
    kv_axis=None,
    max_len: int | None = None,
    attention_mask: Array | None = None,
) -> Int[Array, " total"] | Int[Array, "batch total"]:
    """Generate `max_new_tokens` after `prompt` (one sequence, or a batch).

    Prefills the prompt into a fresh KV cache, then decodes token by token inside one compiled
    `lax.scan`, every row of a batch at once (one kernel call per layer and step, not a loop
    over rows). `temperature=0` is greedy decoding; otherwise a `key` is needed. With
    `backend="tree"` (and `mesh`, `kv_axis`), the cache is sharded along the sequence over the
    mesh axis, tokens are appended round-robin so the shards fill evenly, and attention is
    `tree_decode` (`"ring"`: `ring_decode`, the baseline). This is `Decoder.generate` on a
    decoder made for the call; the model's weights are prepared (on CPU, packed) once per model,
    not per call.

    **Prompts of different lengths.** As with transformers, pad them to one length and pass
    `attention_mask` (`[batch, prompt]`, 1 or True for a prompt token, 0 for padding, on
    either side): each row then keeps its own length in the cache, its tokens sit at positions
    0, 1, ... (what transformers computes from the mask), and no padding is attended to.

    The arguments are checked before anything runs, with a `ValueError` that names the value:
    a prompt that is empty, not integer, or (when concrete) holds ids outside
    `[0, vocab_size)`; an `attention_mask` of another shape or with a row of padding only;
    `temperature < 0`; `top_k` outside `[1, vocab_size]`; and a `max_len` too small for the
    prompt and the new tokens (`prompt + max_new_tokens - 1` tokens are cached: the last one
    is sampled, not run).

    **Returns:** the prompt (as given, padding included) followed by the new tokens,
    `[prompt + max_new_tokens]` (with a leading batch axis if the prompt had one).
    """
    vocab = model.config.vocab_size
    _check_sampling("generate", temperature, top_k, vocab)
    if backend is None and (mesh is not None or kv_axis is not None):
        raise ValueError("generate: mesh= and kv_axis= go with backend='tree'")
    if not hasattr(prompt, "ndim"):
        prompt = jnp.asarray(prompt)
    if prompt.ndim not in (1, 2):
        raise ValueError(
            f"generate: prompt must be [prompt] or [batch, prompt], got shape {prompt.shape}"
        )
    check_token_type("generate", prompt, vocab, ndim=prompt.ndim)
    if prompt.shape[-1] == 0 or prompt.size == 0:
        raise ValueError(f"generate: the prompt is empty (shape {prompt.shape})")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be at least 1, got {max_new_tokens}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"generate: max_len must be at least 1, got {max_len}")
    total = prompt.shape[-1] + max_new_tokens
    batch = prompt.shape[0] if prompt.ndim == 2 else None
    be = None if backend is None else AttentionBackend.of(backend, mesh, kv_axis)
    decoder = Decoder(model, max_len=max_len or total - 1, batch=batch, backend=be)
    return decoder.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        key=key,
        attention_mask=attention_mask,
    )


def _prompt_mask(mask, shape) -> np.ndarray | None:
    """A transformers-style attention mask as booleans `[batch, prompt]` (None: all full)."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"generate: attention_mask must have the prompt's shape {tuple(shape)}, "
            f"got {tuple(mask.shape)}"
        )
    mask = (mask != 0).reshape(-1, shape[-1])
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise ValueError(f"generate: attention_mask rows {empty.tolist()} hold no prompt token")
    return mask


def _check_sampling(name: str, temperature: float, top_k: int | None, vocab: int) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{name}: temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"{name}: top_k must be in [1, vocab_size={vocab}], got {top_k}")


def _generate_loop(
    prep: Prepared,
    backend: AttentionBackend,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    rows: bool,
) -> Callable:
    """`(leaves, prompts, mask, cache, keys) -> (tokens, cache, lengths)`: the prompt of every
    row prefilled after what its cache holds, then `max_new_tokens - 1` steps in one
    `lax.scan`, every row at once under `vmap`. The cache (one per row) is donated: the loop
    updates its buffers in place and holds no copy of them (checked from the compiled HLO in
    tests/test_model_decode.py)."""
    sampling = temperature != 0.0

    def run(leaves, prompts, mask, cache, keys):
        model = prep.combine(leaves)
        if not rows:  # one sequence: a row of one (a unit axis, no copy of the cache)
            cache = jax.tree.map(lambda x: x[None], cache)
        batch, n_prompt = prompts.shape
        start = cache.length
        if mask is None:
            tokens, lengths = prompts, jnp.full((batch,), n_prompt, jnp.int32)
        else:
            # Each row's prompt tokens moved to its front, in order (stable): position i of a
            # row is its i-th prompt token, as transformers numbers them from the mask.
            order = jnp.argsort(~mask, axis=1, stable=True)
            tokens = jnp.take_along_axis(prompts, order, axis=1)
            lengths = jnp.sum(mask, axis=1, dtype=jnp.int32)
        forward = jax.vmap(lambda tokens, cache: model(tokens, cache, backend=backend))

        def pick(logits, i):
            subs = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys) if sampling else None
            draw = functools.partial(sample, temperature=temperature, top_k=top_k)
            if subs is None:
                return jax.vmap(lambda lg: draw(lg, None))(logits)
            return jax.vmap(draw)(logits, subs)

        def step(carry, i):
            logits, cache = carry
            token = pick(logits, i)
            next_logits, cache = forward(token[:, None], cache)
            return (next_logits[:, 0], _keep_checked(cache)), token

        # Only each row's last prompt token is sampled from: the prefill computes its logits
        # alone.
        prefill = jax.vmap(
            lambda tokens, cache, last: model(
                tokens, cache, backend=backend, logits_to_keep=last[None]
            )
        )
        padded = prompt_padding(cache, None if mask is None else lengths)
        logits, cache = prefill(tokens, padded, lengths - 1)
        # A shorter row's padding was run after its prompt; it is not counted: the row's next
        # token overwrites it, and nothing attends to it before then (a linear state never
        # absorbed it).
        cache = _keep_checked(after_prompts(cache, start + lengths))
        first = logits[:, 0]
        # The last token needs no forward pass of its own: scan one step fewer, then sample it.
        (last, cache), new = jax.lax.scan(step, (first, cache), jnp.arange(max_new_tokens - 1))
        final = pick(last, max_new_tokens - 1)
        out = jnp.concatenate([prompts.astype(jnp.int32), new.T, final[:, None]], axis=1)
        if not rows:
            cache = jax.tree.map(lambda x: x[0], cache)
        return out, cache

    return jax.jit(run, donate_argnums=(3,))


def _keep_checked(cache: Cache) -> Cache:
    """Inside the generation loop, whose length the host checked before it ran: the model's
    appends need no check of their own."""
    if isinstance(cache, KVCache):
        return dataclasses.replace(cache, checked=True)
    return cache
