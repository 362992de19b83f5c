r"""Fused local attention that returns `(out, lse)`: the per-device step of tree decoding.

`lse` is the free energy of the local keys at $\zeta = 0$, $\log\sum_a e^{s\,q\cdot k_a}$, so two
results over disjoint keys merge exactly with `treeattn.energy.merge_partials`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._numerics import (
    MASKING_ARGUMENTS,
    Layout,
    Masking,
    check_masking,
    compute_dtype,
    default_scale,
)
from ..energy import Energy, is_plain_softmax
from ._checks import check_call, per_row, positions_per_row
from ._energies import SOFTMAX, check_energy
from ._registry import Backend, Choice, differentiable, dispatch, kernel_call, resolve
from ._xla import Static, fused


def flash_attention(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    *,
    causal: bool = False,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] | Int[Array, " batch"] = 0,
    kv_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    backend: Backend | Sequence[Backend] = "auto",
    kv_layout: Layout = "bshd",
    block_size: int | None = None,
    kv_positions: Int[Array, " kv_seq"] | Int[Array, "batch kv_seq"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    mask: Bool[Array, "#batch #heads #q_seq #kv_seq"] | None = None,
    bias: Float[Array, "#batch #heads #q_seq #kv_seq"] | None = None,
    energy: Energy | None = SOFTMAX,
    kv_finite: bool = False,
    q_segment_ids: Int[Array, "#batch q_seq"] | None = None,
    kv_segment_ids: Int[Array, "#batch kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | Int[Array, " batch"] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
) -> tuple[Float[Array, "batch q_seq heads dv"], Float[Array, "batch q_seq heads"]]:
    r"""Fused attention of local keys, returning the output and its log-sum-exp.

    $$o_{b,i,h} = \sum_a p_a v_a, \qquad \mathrm{lse}_{b,i,h} = \log\sum_a e^{x_a},
      \qquad x_a = s\,q\cdot k_a + \mathrm{bias}_{b,h,i,a}$$

    over the keys a row can see: `a < kv_length[b]` (the filled part of a cache), when
    `causal`, `a <= q_offset[b] + i` (bottom-right by absolute position), within the sliding
    window, and allowed by `mask`. `lse` is the free
    energy at $\zeta = 0$ of these keys, so partial results over disjoint key sets merge exactly
    with [`merge_partials`][treeattn.energy.merge_partials]; a row with no visible key gets
    `out = 0`, `lse = -inf`. Keys and values a row does not see never reach it, whatever they
    hold (an unfilled cache slot may hold NaN); a NaN it does see gives NaN.

    **Arguments:**

    - `q`: `[batch, q_seq, heads, dim]`; `k`, `v`: `[batch, kv_seq, kv_heads, dim]`
      (`kv_layout="bshd"`) or head-major `[batch, kv_heads, kv_seq, dim]` (`"bhsd"`, which
      streams at memory speed on CPU). `heads % kv_heads == 0` (GQA/MQA).
    - `causal`, `q_offset`: bottom-right causal mask; `q_offset` (int, scalar or `[batch]`,
      not negative) is the position of query 0.
    - `kv_length`: int, scalar or `[batch]`, not negative: keys at or past it are ignored.
      (Traced values are not checked: a negative length sees no key.)
    - `scale`: a Python float, default $1/\sqrt{dim}$.
    - `backend`: `"auto"`, `"flash_attn_jax"`, `"cudnn"`, `"pallas"`, `"cpu"` (a C++ kernel
      for XLA:CPU, built on first use), `"xla"`, `"energy"` (the gradient of the energy's
      free energy, any energy), `"reference"` (written out in plain `jnp`), or an ordered
      sequence of them (the first eligible one runs, e.g. `("pallas", "auto")`); see
      `docs/decode.md`. When none can run the call, raises `BackendUnavailable` saying why.
    - `kv_positions`: absolute position of each key slot (`[kv_seq]` or `[batch, kv_seq]`), for
      caches not stored in position order (round-robin over devices); default: slot `a` holds
      position `a`. A key counts when its position is below `kv_length` (and, when causal, not
      after the query). Only the `"cpu"`, `"xla"` and `"reference"` backends take it.
    - `block_size`: keys per block of the `"xla"` kernel (and of every backend's backward);
      default: as many as keep a block's logits under 64 MB.
    - `local_window_size`: a sliding window by absolute position, jax's meaning: `(left,
      right)` lets query position $i$ see key positions $j$ with
      $i - \mathrm{left} \le j \le i + \mathrm{right}$; an int `w` is `(w, w)`. Combined
      with `causal` (a causal window of `w + 1` tokens is `(w, 0)`). The `"cpu"`, `"xla"` and
      `"reference"` backends take it.
    - `mask`: boolean, broadcastable to `[batch, heads, q_seq, kv_seq]`, True = attend; `bias`:
      added to the scaled logits, same shapes, differentiable. The `"xla"` and `"reference"`
      backends take them.
    - `energy`: the [`Energy`][treeattn.energy.Energy]; default `Softmax()` (None means the
      same). Another energy is served by the `"energy"` kernel (`"auto"` picks it) or by
      `"reference"`: every batch row's $o = \partial F/\partial\zeta|_0$ through
      [`energy_partial`][treeattn.energy.energy_partial], with the energy's logits at
      absolute query and key positions (ALiBi), its monoid over the visible keys (the same
      lengths, causality, window, mask and `kv_positions`; an ordered monoid folds the keys in
      position order, whatever slots hold them); a row of more than $2^{24}$ logits without
      `kv_positions` goes blockwise (`energy_attention`). `bias` is refused with another
      energy (its logits are its own). The second result is then the energy's free energy at
      $\zeta = 0$ (the log-sum-exp for softmax-like energies; partials of other energies merge
      with the energy's monoid, not `merge_partials`).
    - `kv_finite`: True promises that every key and value is finite (a zero-initialised KV
      cache): the `"energy"` kernel then reads a cache without the pass that keeps a NaN in a
      slot a row does not see from reaching it (the fused kernels need no such pass).
    - `q_segment_ids` `[#batch, q_seq]`, `kv_segment_ids` `[#batch, kv_seq]` (integers, both
      or neither; a leading batch axis of 1 or none broadcasts): packed sequences, a query sees
      only the keys of its own segment. `prefix_length` (int, scalar or `[batch]`): prefix-LM,
      keys before it are seen whatever `causal`, the window or `chunk_size` say. `chunk_size`:
      chunked attention, positions $i$ and $j$ see each other only when $\lfloor i/C\rfloor =
      \lfloor j/C\rfloor$. `mask_mod(b, h, q_idx, kv_idx) -> bool`: FlexAttention's mask
      function of the batch row, query head and absolute positions. See
      [`multihead_free_energy`][treeattn.energy.multihead_free_energy]; the `"energy"` kernel
      (`"auto"` picks it) and `"reference"` take them, with every energy.

    **Returns:** `(out, lse)`: `out[batch, q_seq, heads, dv]` in the input dtype, `lse`
    float32 (float64 for float64 inputs) `[batch, q_seq, heads]` — the layout of
    `jax.nn.dot_product_attention`'s residual. Differentiable in q, k, v (and through lse) in
    reverse mode for every backend: the fused ones share a blockwise backward;
    `backend="reference"` is differentiated by JAX in either mode.
    """
    fn = "flash_attention"
    given = dict(locals())
    rules = {name: given.pop(name) for name in MASKING_ARGUMENTS}
    dims, window, mask, bias = check_call(**given)
    masking = check_masking(fn, q_seq=dims.q_seq, kv_seq=dims.kv_seq, batch=dims.batch, **rules)
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"{fn}: block_size must be a positive integer or None, got {block_size!r}")
    positions = positions_per_row(kv_positions, dims)
    energy = check_energy(fn, energy)
    call = kernel_call(
        dims,
        jnp.result_type(q),
        causal=causal,
        has_length=kv_length is not None,
        q_offset=q_offset,
        has_positions=positions is not None,
        window=window,
        has_mask=mask is not None,
        has_bias=bias is not None,
        energy=energy,
        has_masking=masking is not None,
    )
    choice = resolve(fn, backend, call)
    static = Static(
        dims,
        causal,
        window,
        default_scale(dims.qk, scale),
        block_size,
        has_length=kv_length is not None,
        kv_finite=bool(kv_finite),
    )
    offsets = per_row(q_offset, dims.batch, 0)
    lengths = per_row(kv_length, dims.batch, dims.kv_seq)
    if positions is None:
        lengths = jnp.minimum(lengths, dims.kv_seq)
    args = (q, k, v, offsets, lengths, positions, mask, bias)
    # Softmax is the kernels' own (None): its Python-number fields are not traced operands.
    general = None if is_plain_softmax(energy) else energy
    try:
        return run_kernel(choice, *args, energy=general, masking=masking, static=static)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        raise TypeError(
            f"{fn}: forward-mode differentiation (jax.jvp, jax.jacfwd) is not defined for the "
            f"fused kernels ({'/'.join(sorted({n for _, n in choice.kernels}))}), whose gradient "
            "is a custom VJP; use reverse mode (jax.grad, jax.vjp, jax.jacrev), or "
            "backend='energy' or 'reference', which JAX differentiates in either mode"
        ) from e


@functools.partial(jax.jit, static_argnames=("choice", "static"))
def run_kernel(
    choice: Choice,
    q,
    k,
    v,
    q_offset,
    kv_length,
    kv_pos,
    mask=None,
    bias=None,
    *,
    energy: Energy | None = None,
    masking: Masking | None = None,
    static: Static,
):
    """The kernels of `choice` (one per lowering platform, picked when the program is lowered)
    on checked arguments: offsets and lengths int32 `[batch]`, positions int32
    `[batch, kv_seq]` or None, mask and bias `[batch, #heads, #q_seq, kv_seq]` or None,
    `energy` (None: `Softmax()`, which must be passed as None), `masking` (its arrays with a
    batch axis: segment ids `[batch, seq]`, prefix `[batch]`; None when the call has no
    rule beyond those), and the call's `Static`
    part. Returns `(out, lse)` (see `flash_attention`). Lowering for a platform where
    `choice` has no kernel raises `BackendUnavailable`."""
    dims = static.dims
    if dims.kv_seq == 0 and energy is None and masking is None:
        # No key at all: the identity of the merge, by construction (another energy reads out
        # its own identity, a sink included).
        out = jnp.zeros((dims.batch, dims.q_seq, dims.heads, dims.dv), q.dtype)
        return out, jnp.full(out.shape[:-1], -jnp.inf, compute_dtype(q.dtype))
    # A traced negative length or offset sees no key / no earlier key: clipped, not refused.
    kv_length = jnp.maximum(kv_length, 0)
    names = {name for _, name in choice.kernels}
    forward = dispatch(choice)
    with jax.named_scope("flash_attention_" + "_".join(sorted(names))):
        if differentiable(choice):
            args = (q, k, v, q_offset, kv_length, kv_pos, mask, bias, energy, masking)
            return forward(*args, static=static)
        return fused(forward, q, k, v, q_offset, kv_length, kv_pos, mask, bias, static)


def flash_attention_reference(
    q: Float[Array, "batch q_seq heads qk"],
    k: Float[Array, "batch kv_seq kv_heads qk"] | Float[Array, "batch kv_heads kv_seq qk"],
    v: Float[Array, "batch kv_seq kv_heads dv"] | Float[Array, "batch kv_heads kv_seq dv"],
    **kwargs,
) -> tuple[Float[Array, "batch q_seq heads dv"], Float[Array, "batch q_seq heads"]]:
    """The float32 twin of [`flash_attention`][treeattn.decode.flash_attention], with its
    arguments but `backend` and `block_size`: all logits written out, plain `jnp`,
    differentiated by JAX; written independently of the kernels. With another `energy`, its
    definition folded key by key
    ([`energy_partial_reference`][treeattn.energy.energy_partial_reference])."""
    for name in ("backend", "block_size"):
        if name in kwargs:
            raise TypeError(f"flash_attention_reference: {name} is not an argument of the twin")
    return flash_attention(q, k, v, backend="reference", **kwargs)
