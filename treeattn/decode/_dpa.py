r"""`jax.nn.dot_product_attention`'s signature and semantics, served by treeattn's kernels.

Swapping `jax.nn.dot_product_attention` for `treeattn.decode.dot_product_attention` is the
whole migration: same arguments, shapes, broadcasting, top-left `is_causal`, window, sequence
lengths and residual. The one choice jax makes that treeattn does not share by default — what a
query that sees no key gets — is the `empty_rows` keyword.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._numerics import Masking, check_choice, check_masking, check_window
from ._flash import flash_attention
from ._registry import BACKENDS, Backend


EmptyRows = Literal["average", "zero"]
r"""What a query that sees no key gets: `"average"` (jax's result: the plain average of all the
values, residual $\approx -2.4\cdot 10^{38}$) or `"zero"` (treeattn's: output 0, residual
$-\infty$, the identity of the merge of partial results)."""
EMPTY_ROWS: tuple[EmptyRows, ...] = get_args(EmptyRows)

# jax's stand-in logit of a masked key: -0.7 times the largest float32 (its softmax runs in
# float32); a row with every key masked is uniform over them, with lse = this + log(kv_seq).
_JAX_MASKED_LOGIT = -0.7 * float(np.finfo(np.float32).max)


def _backend(fn: str, implementation) -> Backend | Sequence[Backend]:
    """jax's `implementation` as a treeattn backend: None is `"auto"`, `"xla"` and `"cudnn"`
    keep their meaning; any treeattn backend name (or ordered sequence of them) is accepted."""
    if implementation is None:
        return "auto"
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    for name in names:
        if name not in BACKENDS:
            raise ValueError(
                f"{fn}: implementation must be None, 'xla', 'cudnn' or a treeattn backend "
                f"{BACKENDS}, got {implementation!r}"
            )
    return implementation  # type: ignore[return-value]  # names checked above


def _lengths(fn: str, name: str, x, batch: int):
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (batch,):
        raise ValueError(
            f"{fn}: {name} must be an integer array of shape [batch] = ({batch},), got dtype "
            f"{x.dtype} and shape {x.shape}"
        )
    return x.astype(jnp.int32)


def dot_product_attention(
    query: Float[ArrayLike, "*batch q_seq heads qk"],
    key: Float[ArrayLike, "*batch kv_seq kv_heads qk"],
    value: Float[ArrayLike, "*batch kv_seq kv_heads dv"],
    bias: Float[ArrayLike, "*#shape"] | None = None,
    mask: Bool[ArrayLike, "*#shape"] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[ArrayLike, " batch"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, " batch"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Backend | Sequence[Backend] | Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
    empty_rows: EmptyRows = "average",
    q_segment_ids: Int[ArrayLike, "*#batch q_seq"] | None = None,
    kv_segment_ids: Int[ArrayLike, "*#batch kv_seq"] | None = None,
    prefix_length: int | Int[ArrayLike, "*#batch"] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
) -> Float[Array, "*batch q_seq heads dv"] | tuple[Float[Array, "*batch q_seq heads dv"], Array]:
    r"""Scaled dot-product attention with `jax.nn.dot_product_attention`'s signature and
    semantics, run by [`flash_attention`][treeattn.decode.flash_attention]'s kernels.

    $$\mathrm{out}_{b,t,n} = \sum_s \mathrm{softmax}_s\big(s\,q_{b,t,n}\cdot k_{b,s,g(n)} +
      \mathrm{bias}_{b,n,t,s}\big)\, v_{b,s,g(n)}$$

    over the keys the query sees: `mask` (True = attend), with `is_causal` key $s \le t$
    (aligned top-left, as jax's: query $t$ sits at position $t$), with `local_window_size =
    (left, right)` $t - \mathrm{left} \le s \le t + \mathrm{right}$ (an int `w` is `(w, w)`),
    $s$ < `key_value_seq_lengths[b]`, and $t$ < `query_seq_lengths[b]` (queries past it get 0).

    **Arguments:** as jax's —

    - `query` `[batch, q_seq, heads, qk]` (or without `batch`), `key`/`value`
      `[batch, kv_seq, kv_heads, d]`; `heads` a multiple of `kv_heads` (GQA, MQA).
    - `bias`, `mask`: broadcastable to `[batch, heads, q_seq, kv_seq]` (missing leading axes
      added); the bias is added to the scaled logits and is differentiable.
    - `scale`: a Python float, default $1/\sqrt{qk}$.
    - `query_seq_lengths`, `key_value_seq_lengths`: integer `[batch]`.
    - `implementation`: None (treeattn's `"auto"`: the best kernel for the platform that takes
      the call), `"xla"`, `"cudnn"`, or any treeattn backend (`"cpu"`, `"pallas"`,
      `"reference"`, ...) or an ordered sequence of them; a backend that cannot run the call
      raises `BackendUnavailable` saying why.
    - `return_residual`: also return the log-sum-exp `[batch, q_seq, heads]` in the input
      dtype, under `stop_gradient` (as jax; `flash_attention` gives a float32,
      differentiable one).
    - `empty_rows`: what a query that sees no key gets. `"average"` (the default, jax's
      result): the plain average of all `kv_seq` values and a residual of
      $-0.7\cdot\mathrm{finfo(float32).max} + \log(\mathrm{kv\_seq})$; `"zero"`: treeattn's
      convention, output 0 and residual $-\infty$.

    **treeattn's extensions** (keyword only; jax has none of them): `q_segment_ids`
    `[batch, q_seq]` and `kv_segment_ids` `[batch, kv_seq]` (packed sequences: a query sees
    only the keys of its own segment, splash attention's `SegmentIds`), `prefix_length`
    (prefix-LM), `chunk_size` (chunked attention) and `mask_mod(b, h, q_idx, kv_idx)`
    (FlexAttention's mask function), as in [`flash_attention`][treeattn.decode.flash_attention].
    They need no `[q_seq, kv_seq]` mask in memory; the `"energy"` kernel (`None` picks it) and
    `"reference"` take them.

    **Returns:** the output, shaped like `query` (with `value`'s last dim), and with
    `return_residual` the pair `(output, residual)`.

    ```python
    from treeattn.decode import dot_product_attention

    q = jax.random.normal(jax.random.key(0), (2, 5, 8, 16))
    k = v = jax.random.normal(jax.random.key(1), (2, 7, 2, 16))
    out = dot_product_attention(q, k, v, is_causal=True)        # [2, 5, 8, 16]
    ```
    """
    fn = "dot_product_attention"
    check_choice(fn, "empty_rows", empty_rows, EMPTY_ROWS)
    backend = _backend(fn, implementation)
    q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if not (q.ndim == k.ndim == v.ndim and q.ndim in (3, 4)):
        raise ValueError(
            f"{fn}: query, key and value must all be [batch, seq, heads, dim] or all "
            f"[seq, heads, dim], got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    batch = q.shape[0]
    q_lengths = _lengths(fn, "query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = _lengths(fn, "key_value_seq_lengths", key_value_seq_lengths, batch)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.ndim > 4:
            raise ValueError(f"{fn}: mask must have at most 4 dims, got shape {mask.shape}")
        if mask.dtype != jnp.bool_:
            raise ValueError(f"{fn}: mask must be boolean (True = attend), got dtype {mask.dtype}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.ndim > 4:
            raise ValueError(f"{fn}: bias must have at most 4 dims, got shape {bias.shape}")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.float32)  # jax adds any bias to float32 logits
    window = check_window(fn, local_window_size)
    masking = check_masking(
        fn,
        q_seq=q.shape[1],
        kv_seq=k.shape[1],
        batch=batch,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        prefix_length=prefix_length,
        chunk_size=chunk_size,
        mask_mod=mask_mod,
    )
    backend = backend if isinstance(backend, str) else tuple(backend)
    result = _attend(
        q,
        k,
        v,
        bias,
        mask,
        q_lengths,
        kv_lengths,
        causal=is_causal,
        scale=scale,
        backend=backend,
        window=window,
        empty_rows=empty_rows,
        return_residual=return_residual,
        masking=masking,
    )
    if unbatched:
        return jax.tree.map(lambda x: x[0], result)
    return result


# Jitted as a whole: called eagerly it compiles once per shape, and only its results are
# checked under `jax.debug_infs` (the -inf of an empty row inside it is not an error).
@functools.partial(
    jax.jit,
    static_argnames=("causal", "scale", "backend", "window", "empty_rows", "return_residual"),
)
def _attend(
    q,
    k,
    v,
    bias,
    mask,
    q_lengths,
    kv_lengths,
    *,
    causal,
    scale,
    backend,
    window,
    empty_rows,
    return_residual,
    masking: Masking | None = None,
):
    q_seq, kv_seq = q.shape[1], k.shape[1]
    q_valid = None
    rules = {} if masking is None else masking.arguments()
    out, lse = flash_attention(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        q_offset=0,
        kv_length=kv_lengths,
        backend=backend,
        local_window_size=window,
        mask=mask,
        bias=bias,
        **rules,
    )
    if q_lengths is not None:
        # Queries past their row's length see no key: jax gives them 0 (not the average of
        # an empty row) and the residual of an empty row. Computed, then overwritten, so the
        # call needs no mask (which every kernel takes).
        q_valid = (jnp.arange(q_seq, dtype=jnp.int32)[None, :] < q_lengths[:, None])[..., None]
        out = jnp.where(q_valid[..., None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(q_valid, lse, -jnp.inf)
    if empty_rows == "average":
        empty = jnp.isneginf(lse)  # [batch, q_seq, heads]
        group = q.shape[2] // k.shape[2]
        mean = jnp.mean(v.astype(lse.dtype), axis=1)  # [batch, kv_heads, dv]
        mean = jnp.repeat(mean, group, axis=1)[:, None].astype(out.dtype)
        if q_valid is not None:
            empty = empty & q_valid  # padded queries keep their 0
        out = jnp.where(empty[..., None], mean, out)
        masked = jnp.asarray(_JAX_MASKED_LOGIT + np.log(max(kv_seq, 1)), lse.dtype)
        lse = jnp.where(jnp.isneginf(lse), masked, lse)
    if not return_residual:
        return out
    return out, jax.lax.stop_gradient(lse.astype(k.dtype))
