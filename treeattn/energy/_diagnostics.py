r"""Diagnostics read from the free energy: the entropy of attention and the attention each key
receives, as derivatives of $F$ in two more sources.

Both come from a private energy that wraps the user's: one scales the logits of every query
row by an inverse temperature $\beta_{i,h}$, the other adds a bias $b_{a,h}$ to the tilt of
every key. $F$ is then evaluated by the path that evaluates it anyway (materialised, blockwise,
or sharded over a mesh), and one reverse-mode gradient in $\beta$ or $b$ at $\beta = 1$, $b =
0$ gives the diagnostic of every query or key at once: exact in blocks and across devices,
since both sources are indexed by the rows and absolute key positions each block is told.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from .._numerics import (
    Dims,
    as_position,
    compute_dtype,
)
from .._partials import LOGSUMEXP, AxisName, Reduction
from ._blockwise import GRADIENT_ELEMENTS, choose_block
from ._checks import check_problem, dims_of
from ._energies import (
    SOFTMAX,
    Context,
    Energy,
    Softmax,
    check_block_size,
    check_energy,
)
from ._generic import OnMesh, free_energy_terms, mesh_terms
from ._sharded import check_on_mesh, mesh_problem


# ---------------------------------------------------------------------------------------------
# The two wrapper energies
# ---------------------------------------------------------------------------------------------


class _Tempered(Energy):
    r"""`inner` with the logits of query $(i, h)$ (at position `start + i`) multiplied by
    `beta[i, h]`; a once-only
    term of a log-sum-exp energy (a sink: one more log-weight) is multiplied too. Everything
    else is `inner`'s."""

    inner: Energy
    beta: Float[Array, "q_seq heads"]
    start: Int[Array, ""]  # the first query's position

    @property
    def monoid(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.inner.monoid

    def _rows(self, ctx: Context, dtype) -> Array:
        # By absolute position: blockwise evaluation cuts the queries into chunks (and pads the
        # last one, whose rows read 1).
        rows = (ctx.q_pos - as_position(self.start))[None, :]
        return self.beta.astype(dtype).at[rows, ctx.head].get(mode="fill", fill_value=1)

    def logits(self, q, k, ctx):
        # Every part of the logits (a composite energy's are a tuple) at the same temperature.
        x = self.inner.logits(q, k, ctx)
        return jax.tree.map(lambda part: part * self._rows(ctx, part.dtype)[..., None], x)

    @property
    def reads_positions(self) -> bool:
        return self.inner.reads_positions

    def elements(self, x, tilt, ctx):
        return self.inner.elements(x, tilt, ctx)

    def once(self, ctx):
        first = self.inner.once(ctx)
        if first is None or self.inner.monoid is not LOGSUMEXP:
            return first
        return first * self._rows(ctx, jnp.result_type(first))

    def readout(self, state, ctx):
        return self.inner.readout(state, ctx)

    def _scaled_tilt(self, ctx, dtype):
        return self.inner._scaled_tilt(ctx, dtype)

    def _hides_itself(self):
        return self.inner._hides_itself()

    def _unit_weights_at_zero(self):
        return self.inner._unit_weights_at_zero()

    def _lift_at_zero(self, x, tilt, visible, ctx):
        # The logits are already tempered; the elements are the inner energy's.
        return self.inner._lift_at_zero(x, tilt, visible, ctx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _over_queries(b: Array, shape: tuple[int, int, int, int]) -> Array:
    """`b[kv_heads, group, kv]` repeated for every query, `[kv_heads, group, q_seq, kv]`."""
    return jnp.broadcast_to(b[:, :, None, :], shape)


def _over_queries_fwd(b, shape):
    return _over_queries(b, shape), None


def _over_queries_bwd(shape, _, ct):
    # The sum over the queries as a product with ones: left to autodiff it is a column
    # reduction that XLA:CPU fuses with the softmax's row reductions (exp recomputed), ~10x
    # slower than attention itself at 1-2K tokens.
    return (jnp.einsum("kgqa,q->kga", ct, jnp.ones((shape[2],), ct.dtype)),)


_over_queries.defvjp(_over_queries_fwd, _over_queries_bwd)


class _KeyBiased(Energy):
    r"""`inner` with `bias[h, a]` added to the tilt of key $a$ (absolute position) in every row
    of query head $h$: $\partial F_{i,h}/\partial b_{h,a}$ is then the weight $w_{i,h,a}$ that
    attention gives key $a$ (its derivative in the tilt). Everything else is `inner`'s."""

    inner: Energy
    bias: Float[Array, "heads kv_seq"]

    @property
    def monoid(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.inner.monoid

    def _rows(self, ctx: Context, dtype) -> Array:
        dims = ctx.dims
        # Padding keys (positions past the sequence) read 0, and their cotangent is dropped.
        b = self.bias.astype(dtype).at[:, ctx.k_pos].get(mode="fill", fill_value=0)
        # Rows layout: row r of kv head g is query head g * group + r // q_seq.
        b = b.reshape(dims.kv_heads, dims.group, -1)
        spread: Array = _over_queries(b, (dims.kv_heads, dims.group, dims.q_seq, b.shape[-1]))
        return spread.reshape(dims.kv_heads, dims.rows, -1)

    def logits(self, q, k, ctx):
        return self.inner.logits(q, k, ctx)

    @property
    def reads_positions(self) -> bool:
        return True

    def elements(self, x, tilt, ctx):
        return self.inner.elements(x, tilt + self._rows(ctx, x.dtype), ctx)

    def once(self, ctx):
        return self.inner.once(ctx)

    def readout(self, state, ctx):
        return self.inner.readout(state, ctx)

    def _hides_itself(self):
        return self.inner._hides_itself()

    def _unit_weights_at_zero(self):
        return self.inner._unit_weights_at_zero()

    def _lift_at_zero(self, x, tilt, visible, ctx):
        # The bias is 0 in value (only its derivative is read), so zeta = 0 still holds.
        return self.inner._lift_at_zero(x, tilt + self._rows(ctx, x.dtype), visible, ctx)


def _temperature(energy: Energy, heads: int, dtype) -> Array:
    """`Softmax`'s own inverse temperature per head (its F is in units of $1/\beta$), else 1."""
    if isinstance(energy, Softmax):
        return jnp.broadcast_to(jnp.asarray(energy.beta, dtype), (heads,))
    return jnp.ones((heads,), dtype)


def _entropy(energy: Energy, terms, dims: Dims, ct, start) -> Array:
    r"""$\beta_0 (F - \partial F/\partial\beta)$ at $\beta = 1$, `[q_seq, heads]`, from `terms`
    (the wrapped energy to $F$ of every row; the first query at position `start`); 0 where
    $F = -\infty$ (no key seen)."""
    beta = jnp.ones((dims.q_seq, dims.heads), ct)
    f, pull = jax.vjp(lambda b: terms(_Tempered(energy, b, start)), beta)
    (d_beta,) = pull(jnp.ones_like(f))
    h = jnp.where(f == -jnp.inf, jnp.zeros((), f.dtype), f - d_beta)
    return h * _temperature(energy, dims.heads, f.dtype)


def _received(energy: Energy, terms, dims: Dims, ct, start) -> Array:
    r"""$\partial\sum_{i,h} F_{i,h}/\partial b_{h,a}$ at $b = 0$, as `[kv_seq, heads]`."""
    del start  # the bias is indexed by the keys' absolute positions
    bias = jnp.zeros((dims.heads, dims.kv_seq), ct)
    d_bias = jax.grad(lambda b: jnp.sum(terms(_KeyBiased(energy, b))))(bias)
    return d_bias.T


_KINDS = {"entropy": _entropy, "received": _received}


@functools.partial(jax.jit, static_argnames=("kind", "causal", "scale", "block_size", "window"))
def _diagnose(
    energy, q, k, v, mask, q_offset, *, kind, causal, scale, block_size, window, masking=None
):
    dims = dims_of(q, k, v)
    ct = compute_dtype(q.dtype)
    block = choose_block(dims, block_size, GRADIENT_ELEMENTS) or 0  # 0: materialised

    def terms(e):
        args = (e, q, k, v, None, mask, q_offset, causal, scale, True, block, window)
        return free_energy_terms(*args, masking)

    with jax.named_scope(f"attention_{kind}"):
        return _KINDS[kind](energy, terms, dims, ct, q_offset)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _diagnose_on_mesh(kind: str, plan: OnMesh, dims: Dims, energy, args: dict):
    ct = compute_dtype(args["q"].dtype)
    with jax.named_scope(f"tree_attention_{kind}"):
        terms = functools.partial(mesh_terms, plan, args=args)
        return _KINDS[kind](energy, terms, dims, ct, args["q_offset"])


def _no_keys(kind: str, dims: Dims, ct) -> Array:
    """No key anywhere: every query sees nothing (entropy 0), and there is no key to receive."""
    shape = (dims.q_seq, dims.heads) if kind == "entropy" else (0, dims.heads)
    return jnp.zeros(shape, ct)


def _single(fn: str, kind: str, q, k, v, *, causal, mask, scale, q_offset, **rest) -> Array:
    energy, block_size = rest["energy"], rest["block_size"]
    dims, window, masking = check_problem(
        fn, q, k, v, mask=mask, scale=scale, q_offset=q_offset, **rest
    )
    check_energy(fn, energy)
    check_block_size(fn, block_size)
    if dims.kv_seq == 0:
        return _no_keys(kind, dims, compute_dtype(q.dtype))
    kw: dict[str, Any] = dict(causal=causal, scale=scale, block_size=block_size, window=window)
    q_pos = as_position(q_offset)
    return _diagnose(energy, q, k, v, mask, q_pos, kind=kind, **kw, masking=masking)


def _on_mesh(fn: str, kind: str, q, k, v, *, mesh, kv_axis, mask, q_offset, **rest) -> Array:
    causal, scale, energy, reduction = (
        rest["causal"],
        rest["scale"],
        rest["energy"],
        rest["reduction"],
    )
    dims, window, masking, sharding = check_on_mesh(
        fn, q, k, v, None, mesh=mesh, kv_axis=kv_axis, mask=mask, q_offset=q_offset, **rest
    )
    if dims.kv_seq == 0:
        return _no_keys(kind, dims, compute_dtype(q.dtype))
    plan, args = mesh_problem(
        sharding, dims, q, k, v, None, mask, q_offset, scale, causal, reduction, window, masking
    )
    return _diagnose_on_mesh(kind, plan, dims, energy, args)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def attention_entropy(
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
) -> Float[Array, "q_seq heads"]:
    r"""The entropy of each query's attention, read from the free energy's derivative in an
    inverse temperature.

    With the logits of query $(i, h)$ scaled by $\beta$, $F_{i,h}(\beta) = \log\sum_a
    e^{\beta x_a}$ and

    $$H_{i,h} = F_{i,h} - \beta\,\frac{\partial F_{i,h}}{\partial\beta}\Big|_{\beta=1}
      = \log\sum_a e^{x_a} - \sum_a p_a x_a = -\sum_a p_a \log p_a .$$

    One reverse-mode gradient in a $\beta$ per (query, head) gives every row at once, through
    the path that evaluates $F$ (blockwise above 2^22 logits or with `block_size`: O(N d)
    memory).

    What it is for each energy ($\beta$ multiplies the energy's own logits $x_a$, after its
    soft-cap and ALiBi): for [`Softmax`][treeattn.energy.Softmax] (any `beta`, whose $F$ is in
    units of $1/\beta_0$, so the result is multiplied by $\beta_0$) the Shannon entropy of
    its distribution; for [`SoftmaxWithSink`][treeattn.energy.SoftmaxWithSink] that of the
    distribution with the sink as one more outcome (its logit is scaled too). For the others it
    is the formula's value, not an entropy of the weights: [`Sigmoid`][treeattn.energy.Sigmoid]
    gives $\sum_a [\mathrm{softplus}(z_a) - \sigma(z_a)\,x_a]$, $z_a = x_a + b$ (the binary
    entropies of the gates plus $b\sum_a\sigma(z_a)$);
    [`LinearKernel`][treeattn.energy.LinearKernel] $\log\sum_a \phi(q)\cdot\phi(k_a) - 1$;
    [`StickBreaking`][treeattn.energy.StickBreaking] 0 (its $F(0)$ is 0 for every logit).

    **Arguments:** as [`energy_attention`][treeattn.energy.energy_attention].

    **Returns:** `[q_seq, heads]` in float32 (float64 for float64 inputs); 0 for a query that
    sees no key.

    ```python
    h = attention_entropy(q, k, v, causal=True)   # [q_seq, heads], in [0, log(i + 1)]
    ```
    """
    return _single("attention_entropy", "entropy", **locals())


def received_attention(
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
) -> Float[Array, "kv_seq heads"]:
    r"""The attention each key receives from all queries, per query head (H2O's heavy-hitter
    score).

    With a bias $b_{h,a}$ added to the tilt $\zeta\cdot v_a$ of key $a$ in every row of head $h$,

    $$r_{a,h} = \frac{\partial}{\partial b_{h,a}} \sum_i F_{i,h}\Big|_{b=0} = \sum_i w_{i,h,a},$$

    the weight $w = \partial F/\partial t_a$ attention gives key $a$ (for softmax $p_{i,h,a}$)
    summed over the queries: one reverse-mode gradient for every key. It holds for every
    energy ($\sum_a \sigma(z_a)$'s terms for [`Sigmoid`][treeattn.energy.Sigmoid], the stick's
    shares for [`StickBreaking`][treeattn.energy.StickBreaking]). Per query head, since
    H2O scores each head; a GQA cache evicts per key/value head, so sum the group:
    `r.reshape(kv_seq, kv_heads, -1).sum(-1)`.

    **Arguments:** as [`energy_attention`][treeattn.energy.energy_attention].

    **Returns:** `[kv_seq, heads]` in float32 (float64 for float64 inputs); 0 for a key no query
    sees. For softmax, the sum over keys is the number of (query, head) rows that see a key.
    """
    return _single("received_attention", "received", **locals())


def tree_attention_entropy(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    mesh: Mesh,
    kv_axis: AxisName,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    reduction: Reduction = "allreduce",
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, "q_seq heads"]:
    r"""[`attention_entropy`][treeattn.energy.attention_entropy] of a sequence sharded over
    the mesh axis `kv_axis`, as [`tree_free_energy`][treeattn.energy.tree_free_energy] shards
    it.

    $F$'s reductions (with `"allreduce"` and softmax: a max and a sum of `[q_seq, heads]`),
    then its gradient's one reduction, of $\partial F/\partial\beta$ `[q_seq, heads]`: the
    traffic does not grow with the sequence.

    **Returns:** `[q_seq, heads]` in float32 (float64 for float64 inputs), replicated.
    """
    return _on_mesh("tree_attention_entropy", "entropy", **locals())


def tree_received_attention(
    q: Float[Array, "q_seq heads qk"],
    k: Float[Array, "kv_seq kv_heads qk"],
    v: Float[Array, "kv_seq kv_heads dv"],
    *,
    mesh: Mesh,
    kv_axis: AxisName,
    causal: bool = False,
    mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "heads q_seq kv_seq"] | None = None,
    scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    reduction: Reduction = "allreduce",
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: Int[Array, " q_seq"] | None = None,
    kv_segment_ids: Int[Array, " kv_seq"] | None = None,
    prefix_length: int | Int[Array, ""] | None = None,
    chunk_size: int | None = None,
    mask_mod: Callable[..., Any] | None = None,
    energy: Energy = SOFTMAX,
) -> Float[Array, "kv_seq heads"]:
    r"""[`received_attention`][treeattn.energy.received_attention] of a sequence sharded over
    the mesh axis `kv_axis`, as [`tree_free_energy`][treeattn.energy.tree_free_energy] shards
    it.

    $F$'s reductions, then its gradient's one reduction. The bias is replicated, so that
    reduction adds up every device's `[heads, kv_seq]` cotangent (zero outside its own keys):
    its size grows with the sequence, unlike the entropy's.

    **Returns:** `[kv_seq, heads]` in float32 (float64 for float64 inputs), replicated.
    """
    return _on_mesh("tree_received_attention", "received", **locals())
