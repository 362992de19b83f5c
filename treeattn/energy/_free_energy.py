r"""The free energy of attention and attention as its gradient (paper, section 4).

For one query $q$ and keys/values $(k_a, v_a)$ the free energy is the cumulant-generating
function of the values under the attention distribution,

$$F(\zeta) = \log \sum_a \exp(s\, q\cdot k_a + \zeta\cdot v_a),$$

and attention is its gradient at the source $\zeta = 0$:
$\partial F/\partial\zeta|_0 = \sum_a p_a v_a$ with $p = \mathrm{softmax}(s\, q\cdot k)$.
Many queries and heads add up (eqs. 16, 18-19): $F_\mathrm{tot} = \sum_{i,h} F_{i,h}(\zeta_{i,h})$,
so one gradient gives every output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._numerics import (
    MASKING_ARGUMENTS,
    as_position,
    compute_dtype,
    default_scale,
    from_rows,
    masked_logsumexp as masked_logsumexp,
    visibility,
)
from ._checks import check_problem, dims_of
from ._energies import (
    SOFTMAX,
    Energy,
    check_block_size,
    check_energy,
    is_plain_softmax,
    make_context,
)
from ._generic import attention, cumulant, total_energy
from ._local import bad_logits, finite_kv, reference_terms, scaled_logits


# ---------------------------------------------------------------------------------------------
# The shared core
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Public energies
# ---------------------------------------------------------------------------------------------


def free_energy(
    q: Float[Array, " qk"],
    k: Float[Array, "kv qk"],
    v: Float[Array, "kv dv"],
    zeta: Float[Array, " dv"],
    *,
    mask: Bool[Array, " kv"] | None = None,
    scale: float | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, ""]:
    r"""The free energy of one query (eq. 15).

    $$F(\zeta) = \log \sum_{a\,:\,\mathrm{mask}_a} \exp\big(s\, q\cdot k_a + \zeta\cdot v_a\big)$$

    computed as a max-shifted log-sum-exp (Appendix 11), in at least float32. Its gradient in
    $\zeta$ at 0 is the attention output, its Hessian the covariance of the values.

    **Arguments:**

    - `q`: the query, `[qk]`.
    - `k`, `v`: keys `[kv, qk]` and values `[kv, dv]`.
    - `zeta`: the source $\zeta$, `[dv]`.
    - `mask`: optional boolean `[kv]`, True where the key is visible.
    - `scale`: $s$, default $1/\sqrt{qk}$.
    - `energy`: the [`Energy`][treeattn.energy.Energy], default `Softmax()` (the formula above).

    **Returns:** the scalar $F$ in float32 (float64 for float64 inputs). With no visible key the
    partition function is empty and $F = -\infty$; its derivatives are 0.

    ```python
    q, k, v = jnp.ones(4), jnp.ones((3, 4)), jnp.arange(6.0).reshape(3, 2)
    out = jax.grad(free_energy, argnums=3)(q, k, v, jnp.zeros(2))  # = v.mean(0)
    ```
    """
    fn = "free_energy"
    if jnp.ndim(q) != 1:
        raise ValueError(f"{fn}: q must have shape [qk], got shape {jnp.shape(q)}")
    if jnp.ndim(k) != 2 or jnp.ndim(v) != 2:
        raise ValueError(
            f"{fn}: k must have shape [kv, qk] and v [kv, dv], got {jnp.shape(k)} and "
            f"{jnp.shape(v)}"
        )
    if jnp.ndim(zeta) != 1:
        raise ValueError(f"{fn}: zeta must have shape [dv], got shape {jnp.shape(zeta)}")
    if mask is not None and jnp.ndim(mask) != 1:
        raise ValueError(f"{fn}: mask must have shape [kv], got shape {jnp.shape(mask)}")
    mask = None if mask is None else jnp.asarray(mask)[None]
    args = dict(q=q[None, None], k=k[:, None], v=v[:, None], zeta=zeta[None, None])
    return _multihead(fn, **args, causal=False, mask=mask, scale=scale, q_offset=0, energy=energy)


def causal_free_energy(
    q: Float[Array, "q_seq qk"],
    k: Float[Array, "kv_seq qk"],
    v: Float[Array, "kv_seq dv"],
    zeta: Float[Array, "q_seq dv"],
    *,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, ""]:
    r"""The causal free energy $F_\mathrm{tot}$ of eq. (16), one source per query.

    $$F_\mathrm{tot} = \sum_i \log \sum_{a \le q_\mathrm{offset} + i}
      \exp\big(s\, q_i\cdot k_a + \zeta_i\cdot v_a\big)$$

    Masking is bottom-right aligned by absolute position: query $i$ sits at position
    `q_offset + i`, so a chunk of queries appended after a cache of $n$ tokens passes
    `q_offset=n` (JAX's own `is_causal` aligns top-left and would let the first such query see
    only key 0). `q_offset` may be traced, so a decode loop does not recompile.

    **Arguments:** `q[q_seq, qk]`, `k[kv_seq, qk]`, `v[kv_seq, dv]`, `zeta[q_seq, dv]`, `scale`
    (default $1/\sqrt{qk}$), `q_offset` (int or integer scalar array), `local_window_size`
    (a sliding window, see `multihead_free_energy`; `(w, 0)` keeps the last `w + 1` tokens),
    the segment ids, `prefix_length`, `chunk_size` and `mask_mod` of `multihead_free_energy`,
    `energy` (default `Softmax()`).

    **Returns:** the scalar $F_\mathrm{tot}$ in float32 (float64 for float64 inputs).
    """
    fn = "causal_free_energy"
    for name, x, want in (
        ("q", q, "[q_seq, qk]"),
        ("k", k, "[kv_seq, qk]"),
        ("v", v, "[kv_seq, dv]"),
        ("zeta", zeta, "[q_seq, dv]"),
    ):
        if jnp.ndim(x) != 2:
            raise ValueError(f"{fn}: {name} must have shape {want}, got shape {jnp.shape(x)}")
    args = {name: x[:, None] for name, x in dict(q=q, k=k, v=v, zeta=zeta).items()}
    kw: dict[str, Any] = dict(scale=scale, q_offset=q_offset, energy=energy)
    kw |= dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    kw |= dict(prefix_length=prefix_length, chunk_size=chunk_size, mask_mod=mask_mod)
    return _multihead(fn, **args, causal=True, mask=None, local_window_size=local_window_size, **kw)


def multihead_free_energy(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    zeta: Float[Array, "q_seq heads dv"],
    *,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
    block_size: int | None = None,
) -> Float[Array, ""]:
    r"""The multi-head free energy of eqs. (18-19), with grouped key/value heads.

    $$F_\mathrm{tot} = \sum_{i,h} \log \sum_{a\ \mathrm{visible}}
      \exp\big(s\, q_{i,h}\cdot k_{a,g(h)} + \zeta_{i,h}\cdot v_{a,g(h)}\big)$$

    where query head $h$ reads key/value head $g(h) = \lfloor h\, \mathrm{kv\_heads} /
    \mathrm{heads}\rfloor$: `heads == kv_heads` is MHA, `kv_heads == 1` MQA, anything between GQA.

    **Arguments:**

    - `q`: `[q_seq, heads, qk]`; `k`: `[kv_seq, kv_heads, qk]`; `v`: `[kv_seq, kv_heads, dv]`.
    - `zeta`: the sources, `[q_seq, heads, dv]`.
    - `causal`: bottom-right causal mask by absolute position (see `causal_free_energy`).
    - `mask`: boolean `[q_seq, kv_seq]` (all heads) or `[heads, q_seq, kv_seq]`; True = visible.
      Combined with `causal` by "and".
    - `scale`: default $1/\sqrt{qk}$. `q_offset`: position of query 0 (int or traced scalar).
    - `local_window_size`: a sliding window by absolute position (jax's meaning): `(left,
      right)` lets query position $i$ see keys $j$ with $i - \mathrm{left} \le j \le i +
      \mathrm{right}$; an int `w` is `(w, w)`. Combined with `causal` and `mask` by "and".
    - `q_segment_ids[q_seq]`, `kv_segment_ids[kv_seq]` (integers, both or neither): packed
      sequences; a query sees only the keys of its own segment.
    - `prefix_length` (int or traced scalar): prefix-LM; keys at positions below it are seen by
      every query, whatever `causal`, the window or `chunk_size` say.
    - `chunk_size` (a Python int): chunked attention; the query at position $i$ sees keys $j$
      with $\lfloor i/C\rfloor = \lfloor j/C\rfloor$ only (with `causal`: Llama 4's local
      layers).
    - `mask_mod(b, h, q_idx, kv_idx) -> bool`: FlexAttention's mask function of the query
      head and the absolute positions (`b` is 0), for scalars; a plain function is compared
      by identity (a new one recompiles), a `jax.tree_util.Partial` or Equinox module traces
      the arrays it holds. Every rule joins the others by "and"; blocks of keys that no query
      of a tile sees are skipped in blockwise evaluation (forward and backward).
    - `energy`: the [`Energy`][treeattn.energy.Energy]; default `Softmax()`, the formula above.
    - `block_size`: evaluate in blocks of this many keys, in O(N d) memory with an exact
      gradient (a custom VJP). By default every energy does so by itself above 2^26
      logits, or 2^23 for causal self-attention (as many queries as keys).

    **Returns:** the scalar $F_\mathrm{tot}$ in float32 (float64 for float64 inputs). A query
    with no visible key has $F_{i,h} = -\infty$ (an empty partition function), which makes
    $F_\mathrm{tot} = -\infty$; gradients stay finite and are 0 for that query.
    """
    return _multihead("multihead_free_energy", **locals())


def _multihead(
    fn,
    q,
    k,
    v,
    zeta,
    *,
    causal,
    mask,
    scale,
    q_offset,
    local_window_size=None,
    energy: Energy = SOFTMAX,
    block_size=None,
    **rules,
) -> Array:
    checked = dict(zeta=zeta, mask=mask, scale=scale, q_offset=q_offset)
    _, window, masking = check_problem(
        fn, q, k, v, **checked, local_window_size=local_window_size, **rules
    )
    check_energy(fn, energy)
    check_block_size(fn, block_size)
    kw = {"causal": causal, "scale": scale, "block_size": block_size, "window": window}
    return total_energy(energy, q, k, v, zeta, mask, as_position(q_offset), **kw, masking=masking)


def _problem(args: dict) -> dict:
    """A public function's arguments (its `locals()`) that `check_problem` checks."""
    names = ("q", "k", "v", "mask", "scale", "q_offset", "local_window_size", *MASKING_ARGUMENTS)
    return {name: args[name] for name in names}


# ---------------------------------------------------------------------------------------------
# Attention as a gradient, and its reference twin
# ---------------------------------------------------------------------------------------------


@overload
def energy_attention(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = ...,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = ...,
    scale: float | None = ...,
    q_offset: int | Int[Array, ""] = ...,
    local_window_size: int | tuple[int, int] | None = ...,
    q_segment_ids: Int[Array, " q_seq"] | None = ...,
    kv_segment_ids: Int[Array, " kv_seq"] | None = ...,
    prefix_length: int | Int[Array, ""] | None = ...,
    chunk_size: int | None = ...,
    mask_mod: Callable[..., Any] | None = ...,
    energy: Energy = ...,
    block_size: int | None = ...,
    return_free_energy: Literal[False] = ...,
) -> Float[Array, "q_seq heads dv"]: ...


@overload
def energy_attention(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = ...,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = ...,
    scale: float | None = ...,
    q_offset: int | Int[Array, ""] = ...,
    local_window_size: int | tuple[int, int] | None = ...,
    q_segment_ids: Int[Array, " q_seq"] | None = ...,
    kv_segment_ids: Int[Array, " kv_seq"] | None = ...,
    prefix_length: int | Int[Array, ""] | None = ...,
    chunk_size: int | None = ...,
    mask_mod: Callable[..., Any] | None = ...,
    energy: Energy = ...,
    block_size: int | None = ...,
    return_free_energy: Literal[True],
) -> tuple[Float[Array, "q_seq heads dv"], Float[Array, "q_seq heads"]]: ...


def energy_attention(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
    block_size: int | None = None,
    return_free_energy: bool = False,
) -> (
    Float[Array, "q_seq heads dv"]
    | tuple[Float[Array, "q_seq heads dv"], Float[Array, "q_seq heads"]]
):
    r"""Multi-head attention computed as the gradient of the free energy at $\zeta = 0$.

    $$z_{i,h} = \frac{\partial F_\mathrm{tot}}{\partial \zeta_{i,h}}\Big|_{\zeta=0}
      = \sum_a \mathrm{softmax}_a(s\, q_{i,h}\cdot k_{a,g(h)})\, v_{a,g(h)}$$

    This is `jax.grad` of [`multihead_free_energy`][treeattn.energy.multihead_free_energy] in
    $\zeta$, evaluated at the point $\zeta = 0$, which is known at trace time: the source term
    $\zeta\cdot v_a$ is 0 there and is not computed (a custom JVP supplies its exact derivative),
    so the cost is that of ordinary attention rather than 1.5x. The result is differentiable in
    q, k and v (a second derivative of $F$), so models train through it.

    **Arguments:** as [`multihead_free_energy`][treeattn.energy.multihead_free_energy], without
    `zeta`. With another `energy`, the output is that energy's $\partial F/\partial\zeta$ at 0
    (e.g. $\sum_a \sigma(x_a + b)\,v_a$ for [`Sigmoid`][treeattn.energy.Sigmoid]). Above 2^26
    logits (2^23 for causal self-attention), or with `block_size`, every energy (the default
    too) is evaluated in tiles of queries and keys with a custom VJP of its own, so that
    training through the output holds
    O(N d) memory rather than the logits (see the energies page). `return_free_energy=True`
    also returns $F_{i,h}(0)$, the free energy of every query and head (for softmax the
    log-sum-exp of its logits, jax's `return_residual`), differentiable like the output.

    **Returns:** `[q_seq, heads, dv]` in the dtype of the inputs (arithmetic in float32 or
    wider); with `return_free_energy`, `(out, F)`, `F[q_seq, heads]` in float32 (float64 for
    float64 inputs). A query with no visible key gets 0 (and $F = -\infty$ for softmax).

    ```python
    q = jax.random.normal(jax.random.key(0), (5, 8, 16))
    k = v = jax.random.normal(jax.random.key(1), (5, 2, 16))   # GQA: 8 query heads, 2 kv heads
    out = energy_attention(q, k, v, causal=True)               # [5, 8, 16]
    ```
    """
    _, window, masking = check_problem("energy_attention", **_problem(locals()))
    check_energy("energy_attention", energy)
    check_block_size("energy_attention", block_size)
    if not isinstance(return_free_energy, bool):
        raise ValueError(
            f"energy_attention: return_free_energy must be a bool, got {return_free_energy!r}"
        )
    kw = {"causal": causal, "scale": scale, "block_size": block_size, "window": window}
    # A jitted core: called eagerly it compiles once per shape (rather than op by op), and a
    # new `q_offset` does not recompile.
    return attention(
        energy,
        q,
        k,
        v,
        mask,
        as_position(q_offset),
        **kw,
        with_energy=return_free_energy,
        masking=masking,
    )


def attention_reference(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads dv"]:
    r"""Attention written out in float32: the twin of
    [`energy_attention`][treeattn.energy.energy_attention], with the same signature.

    With the default `Softmax()`, the softmax in closed form,

    $$z_{i,h} = \sum_a \frac{e^{s\,q_{i,h}\cdot k_{a,g(h)}}}{\sum_b e^{s\,q_{i,h}\cdot
      k_{b,g(h)}}}\, v_{a,g(h)}.$$

    With another `energy`, from the energy's own definition key by key: its logits $x_a$ and
    elements $e(x_a, t_a)$ are materialised for a tilt $t_a$ per key, the monoid folds them one
    key at a time in key order (after the once-only term), and the weight of key $a$ is
    $w_a = \partial F/\partial t_a$ at $t = 0$, so that $z = \sum_a w_a v_a$ (meant for
    small shapes: the fold is sequential in the keys).

    **Returns:** `[q_seq, heads, dv]` in the dtype of the inputs; 0 for a query with no visible
    key.
    """
    _, window, masking = check_problem("attention_reference", **_problem(locals()))
    check_energy("attention_reference", energy)
    kw = {"causal": causal, "scale": scale, "window": window, "masking": masking}
    if is_plain_softmax(energy):
        return _attention_reference(q, k, v, mask, as_position(q_offset), **kw)
    return _energy_reference(energy, q, k, v, mask, as_position(q_offset), **kw)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "window"))
def _attention_reference(
    q, k, v, mask, q_offset, *, causal, scale, window=None, masking=None
) -> Array:
    dims = dims_of(q, k, v)
    vis = visibility(
        dims, causal=causal, mask=mask, q_offset=q_offset, window=window, masking=masking
    )
    ct = compute_dtype(q.dtype)
    k, v, bad = finite_kv(k, v)
    shape = (dims.kv_heads, dims.group, dims.q_seq, dims.kv_seq)
    logits = bad_logits(scaled_logits(q, k, dims, default_scale(dims.qk, scale)), bad)
    logits = logits.reshape(shape)
    if vis is not None:
        logits = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    rows = dims.kv_heads, dims.rows, dims.kv_seq
    out = jnp.einsum("kms,skv->kmv", p.reshape(rows), v.astype(ct))
    return from_rows(out, dims).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "window"))
def _energy_reference(
    energy, q, k, v, mask, q_offset, *, causal, scale, window=None, masking=None
) -> Array:
    dims = dims_of(q, k, v)
    vis = visibility(
        dims, causal=causal, mask=mask, q_offset=q_offset, window=window, masking=masking
    )
    ctx = make_context(dims, default_scale(dims.qk, scale), q_offset, 0, dims.kv_seq)
    return reference_terms(energy, q, k, v, vis, ctx)[0]


# ---------------------------------------------------------------------------------------------
# Higher cumulants of the values: repeated derivatives of F in the source (eq. 12)
# ---------------------------------------------------------------------------------------------
#
# F_{i,h}(zeta) is the cumulant-generating function of the values under query (i, h)'s
# attention distribution p, so its n-th derivative at 0 is the n-th cumulant: the mean
# (attention), the covariance, the third central moment, and so on.


def value_moments(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    order: int,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads *dv"]:
    r"""The `order`-th cumulant tensor of the values, for every query and head.

    $$\kappa^{(n)}_{i,h} = \frac{\partial^n F_{i,h}}{\partial\zeta^n}\Big|_{\zeta=0},$$

    computed by differentiating the free energy `order` times (reverse mode once, then forward
    mode). Because $F_\mathrm{tot}$ is a sum of independent per-query terms, its derivative tensor
    is block diagonal; differentiating along a source shared by all queries,
    $\zeta_{i,h} = u$, yields every block at once for the cost of $dv^{n-1}$ gradients, so this
    is meant for small `dv`.

    **Arguments:** as [`energy_attention`][treeattn.energy.energy_attention], plus `order >= 1`.
    With another `energy`, the derivatives of that energy's $F$ (see its docstring for what
    they mean).

    **Returns:** `[q_seq, heads, dv, ..., dv]` (`order` trailing `dv` axes) in the dtype of the
    inputs: `order=1` is attention, `order=2` the covariance, `order=3` the third central moment.
    A query with no visible key gets 0.
    """
    if not isinstance(order, int) or isinstance(order, bool) or order < 1:
        raise ValueError(f"value_moments: order must be an integer >= 1, got {order!r}")
    rules = dict(
        local_window_size=local_window_size,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        prefix_length=prefix_length,
        chunk_size=chunk_size,
        mask_mod=mask_mod,
    )
    return _cumulant(
        "value_moments", q, k, v, order, causal, mask, scale, q_offset, energy, **rules
    )


def _cumulant(
    fn, q, k, v, order, causal, mask, scale, q_offset, energy, local_window_size, **rules
) -> Array:
    checked = dict(mask=mask, scale=scale, q_offset=q_offset, local_window_size=local_window_size)
    _, window, masking = check_problem(fn, q, k, v, **checked, **rules)
    check_energy(fn, energy)
    q_pos = as_position(q_offset)
    kw = {"order": order, "causal": causal, "scale": scale, "window": window}
    return cumulant(energy, q, k, v, mask, q_pos, **kw, masking=masking)


def value_covariance(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads dv dv"]:
    r"""The covariance of the values under each query's attention distribution.

    $$\Sigma_{i,h} = \frac{\partial^2 F_{i,h}}{\partial\zeta^2}\Big|_{\zeta=0}
      = \sum_a p_a (v_a - \mu)(v_a - \mu)^\top, \qquad \mu = \sum_a p_a v_a,$$

    the Hessian of the free energy in the source (the second cumulant of eq. 12). Its trace says
    how spread out the values a head averages are: 0 when attention picks one key (or all the
    keys it sees carry the same value), large when it mixes distant values.

    **Arguments:** as [`energy_attention`][treeattn.energy.energy_attention]. With another
    `energy`, its Hessian in $\zeta$ (for [`Sigmoid`][treeattn.energy.Sigmoid]
    $\sum_a \sigma(1-\sigma)\,v_a v_a^\top$).

    **Returns:** `[q_seq, heads, dv, dv]`, symmetric positive semi-definite, in the dtype of the
    inputs; 0 for a query with no visible key.
    """
    rules = dict(
        local_window_size=local_window_size,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        prefix_length=prefix_length,
        chunk_size=chunk_size,
        mask_mod=mask_mod,
    )
    return _cumulant("value_covariance", q, k, v, 2, causal, mask, scale, q_offset, energy, **rules)
