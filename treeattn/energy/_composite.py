r"""Composite energies: differential attention, the Forgetting Transformer's decayed softmax,
and softpick. Each is an ordinary `Energy` (logits, elements, a monoid, a readout), so every
path — materialised, blockwise, sharded, decoding through a cache, the model layer — serves it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .._partials import LOGSUMEXP, Monoid, product
from ._energies import Energy, _log_of_sum, per_head


PAIR_LOGSUMEXP = product(LOGSUMEXP, LOGSUMEXP)
"""Two log-sum-exps side by side, state `(lse_1, lse_2)` (differential attention)."""


class Differential(Energy):
    r"""Differential attention (Ye et al., 2024, "Differential Transformer"): the difference
    of two softmax attentions over the two halves of the query and key channels, with shared
    values.

    With $q = [q_1 \mid q_2]$ and $k_a = [k_{1,a} \mid k_{2,a}]$ (the last axis cut in two
    equal halves) and $F_j(\zeta) = \log\sum_a e^{s\,q_j\cdot k_{j,a} + \zeta\cdot v_a}$,

    $$F(\zeta) = F_1(\zeta) - \lambda F_2(\zeta),\qquad
      \partial_\zeta F|_0 = \mathrm{softmax}(s\,q_1\cdot k_1)\,v
        - \lambda\,\mathrm{softmax}(s\,q_2\cdot k_2)\,v .$$

    $s$ is the call's scale: its default $1/\sqrt{qk}$ counts both halves; the paper's
    $1/\sqrt{d}$ is `scale=(qk // 2) ** -0.5`. `lam` ($\lambda$) is a scalar or one value per
    head (`[heads]`), learnable as an array (the paper's reparameterisation of $\lambda$ and
    the per-head normalisation after attention belong to the layer, not the energy). Monoid:
    the product of two log-sum-exps. The Hessian is
    $\mathrm{Cov}_{p_1}(v) - \lambda\,\mathrm{Cov}_{p_2}(v)$ (not a covariance). A row that sees
    no key reads out $-\infty$ and attends to nothing.
    """

    lam: Any = 0.8
    monoid: ClassVar[Monoid] = PAIR_LOGSUMEXP

    def logits(self, q, k, ctx):
        qk = q.shape[-1]
        if qk % 2:
            raise ValueError(
                f"Differential: the query/key size qk={qk} must be even (q = [q1 | q2], "
                "k = [k1 | k2])"
            )
        half = qk // 2
        qs = q * jnp.asarray(ctx.scale, q.dtype)
        x1 = jnp.einsum("kmd,skd->kms", qs[..., :half], k[..., :half])
        x2 = jnp.einsum("kmd,skd->kms", qs[..., half:], k[..., half:])
        return x1, x2

    @property
    def reads_positions(self) -> bool:
        return type(self).logits is not Differential.logits

    def elements(self, x, tilt, ctx):
        x1, x2 = x
        return x1 + tilt, x2 + tilt

    def readout(self, state, ctx):
        lse1, lse2 = state
        lam = per_head(self.lam, ctx, lse1.dtype)
        # A row without keys has lse1 = lse2 = -inf: it reads out -inf (never -inf + inf),
        # and its cotangents (of lam too) are 0.
        lse2 = jnp.where(lse2 == -jnp.inf, jnp.zeros((), lse2.dtype), lse2)
        return lse1 - lam * lse2


class Forgetting(Energy):
    r"""The Forgetting Transformer's attention (FoX; Lin et al., 2025): softmax with a
    data-dependent decay, logits $x_{ij} = s\,q_i\cdot k_j + c_i - c_j$, where
    $c_i = \sum_{l \le i} \log f_l$ is the cumulative sum of the log forget gates
    ($\log f_l \le 0$), so that $e^{c_i - c_j} = \prod_{l=j+1}^{i} f_l$ for $j \le i$.

    $$F(\zeta) = \log\sum_a e^{s\,q\cdot k_a + c_i - c_a + \zeta\cdot v_a}.$$

    **Channels:** $c$ travels in the last channel of the queries and keys, $q = [q \mid c_i]$
    and $k = [k \mid c_j]$ (see [`forgetting_inputs`][treeattn.energy.forgetting_inputs]), so
    that every shard, block and cache slot has what its logits need, with no position
    arithmetic. The scale multiplies the product of the leading channels only; its default
    $1/\sqrt{qk}$ counts the extra channel, so pass `scale=d ** -0.5` for the paper's. With
    grouped heads the gate is one per key/value head. Keep $c$ in float32 or wider: it grows
    with the sequence and only differences of it matter. Monoid: log-sum-exp; the Hessian is
    the covariance of the values under the decayed softmax.
    """

    monoid: ClassVar[Monoid] = LOGSUMEXP

    def logits(self, q, k, ctx):
        qs = q[..., :-1] * jnp.asarray(ctx.scale, q.dtype)
        x = jnp.einsum("kmd,skd->kms", qs, k[..., :-1])
        return x + q[..., -1][..., None] - jnp.swapaxes(k[..., -1], 0, 1)[:, None, :]

    @property
    def reads_positions(self) -> bool:
        return type(self).logits is not Forgetting.logits

    def elements(self, x, tilt, ctx):
        return x + tilt


def forgetting_inputs(
    q: Float[Array, "*batch q_seq heads d"],
    k: Float[Array, "*batch kv_seq kv_heads d"],
    log_forget: Float[Array, "*batch kv_seq kv_heads"],
    *,
    start: Float[Array, "*batch kv_heads"] | float = 0.0,
) -> tuple[Float[Array, "*batch q_seq heads d+1"], Float[Array, "*batch kv_seq kv_heads d+1"]]:
    r"""Queries and keys for [`Forgetting`][treeattn.energy.Forgetting]: $c$ appended as one
    more channel, $q = [q \mid c_i]$, $k = [k \mid c_j]$, with
    $c_j = \mathrm{start} + \sum_{l \le j} \log f_l$ (a cumulative sum over the keys).

    The queries are the last `q_seq` positions of the keys (self-attention: `q_seq = kv_seq`;
    a chunk after a cache: its `start` is the $c$ of the last cached key). Query head $h$
    reads the gate of its key/value head. $c$ is cast to the dtype of `q` and `k`.

    **Returns:** `(q[..., q_seq, heads, d + 1], k[..., kv_seq, kv_heads, d + 1])`.
    """
    q_seq, heads = q.shape[-3], q.shape[-2]
    kv_seq, kv_heads = k.shape[-3], k.shape[-2]
    if log_forget.shape[-2:] != (kv_seq, kv_heads) or q_seq > kv_seq or heads % kv_heads:
        raise ValueError(
            f"forgetting_inputs: log_forget must be [..., kv_seq, kv_heads] = [..., {kv_seq}, "
            f"{kv_heads}] and q [..., q_seq <= kv_seq, heads (a multiple of kv_heads), d]; got "
            f"log_forget{tuple(log_forget.shape)}, q{tuple(q.shape)}, k{tuple(k.shape)}"
        )
    start = jnp.asarray(start, log_forget.dtype)
    c = jnp.cumsum(log_forget, axis=-2) + (start[..., None, :] if start.ndim else start)
    c_q = jnp.repeat(c[..., kv_seq - q_seq :, :], heads // kv_heads, axis=-1)
    q = jnp.concatenate([q, c_q[..., None].astype(q.dtype)], axis=-1)
    k = jnp.concatenate([k, c[..., None].astype(k.dtype)], axis=-1)
    return q, k


@jax.custom_jvp
def _expm1_at_zero(t: Array) -> Array:
    r"""$e^t - 1$ for a $t$ known to be exactly 0 (a tilt at $\zeta = 0$): $t$ itself, no
    transcendental; its rule returns this function as its own primal and
    $(1 + (e^t - 1))\,\dot t$ as the tangent, so derivatives of every order are exact there
    (cumulants)."""
    return t


@_expm1_at_zero.defjvp
def _expm1_at_zero_jvp(primals, tangents):
    (t,), (dt,) = primals, tangents
    out = _expm1_at_zero(t)  # itself, so that the next derivative is taken by this rule too
    return out, (1 + out) * dt


@jax.custom_jvp
def _log_abs_expm1(x: Array) -> Array:
    r"""$\log|e^x - 1| = \max(x, 0) + \log(1 - e^{-|x|})$: no overflow, $-\infty$ at 0."""
    return jnp.maximum(x, 0) + jnp.log(-jnp.expm1(-jnp.abs(x)))


@_log_abs_expm1.defjvp
def _log_abs_expm1_jvp(primals, tangents):
    # d/dx = e^x / (e^x - 1) = sign(x) e^{min(x, 0)} / (1 - e^{-|x|}): 0 at x = 0 (a weight of
    # 0 with a kink: any subgradient), the divisor floored so that no tangent is infinite.
    (x,), (dx,) = primals, tangents
    u = jnp.maximum(-jnp.expm1(-jnp.abs(x)), jnp.finfo(x.dtype).tiny)
    return _log_abs_expm1(x), jnp.sign(x) * jnp.exp(jnp.minimum(x, 0)) / u * dx


_SOFTPICK_HEADROOM = 60.0
"""Softpick's weights at zeta = 0 are shifted only above this logit: e^60 per key leaves room
for 1e12 keys in a float32 sum."""


class Softpick(Energy):
    r"""Softpick (Zuhri et al., 2025): rectified weights over an absolute normaliser,

    $$w_a = \frac{\mathrm{relu}(e^{x_a} - 1)}{\sum_b |e^{x_b} - 1|},$$

    which may sum to less than 1 (a row whose logits are all $\le 0$ attends to nothing). As
    a free energy, with $P$ the keys of positive logit,

    $$F(\zeta) = \log\Big(\sum_{a \in P} (e^{x_a} - 1)\,e^{\zeta\cdot v_a}
      + \sum_{a \notin P} (1 - e^{x_a})\Big),$$

    whose gradient at 0 is $\sum_a w_a v_a$. It is one log-sum-exp of the per-key elements
    $\log|e^{x_a} - 1| + [x_a > 0]\,\zeta\cdot v_a$ (computed as
    $\max(x, 0) + \log(1 - e^{-|x|})$, never $e^x$): shifted by a running maximum, merged
    across shards and blocks like softmax. At $\zeta = 0$ (attention, cumulants) a block is
    lifted from the weights $|e^{x_a} - 1|\,e^{-m}$ themselves (one transcendental per
    logit, $m = \max(0, \max_a x_a - 60)$), in one pass.
    The Hessian is the covariance of
    $[x_a > 0]\,v_a$ under $p_a = |e^{x_a} - 1| / \sum_b |e^{x_b} - 1|$: the keys of negative
    logit act as sinks of value 0. No $\epsilon$ is added to the normaliser; masked keys
    contribute nothing (as a logit of 0 does).
    """

    monoid: ClassVar[Monoid] = LOGSUMEXP

    def elements(self, x, tilt, ctx):
        return _log_abs_expm1(x) + (x > 0).astype(x.dtype) * tilt

    def _lift_at_zero(self, x, tilt, visible, ctx):
        # At zeta = 0 the weights straight from the logits, in one transcendental per logit:
        # t = e^-m (e^x - 1) = expm1(x - m) + (1 - e^-m), whose magnitude is the weight and
        # whose positive part carries the tilt (e^t' - 1 for the tilt t', which is 0 here).
        # The shift m is 0 unless the row's largest logit exceeds `_SOFTPICK_HEADROOM` (then
        # |t| <= e^headroom still sums without overflow), so a row of small logits keeps
        # expm1's relative precision (e^(x - s) - e^-s, one exp too, loses it near x = 0).
        # No select: XLA keeps the weights in one fusion with the reduction and the product
        # with V. A hidden key reads x = 0: t = 0 exactly.
        if type(self).elements is not Softpick.elements:
            return None
        if visible is not None:
            x = jnp.where(visible, x, jnp.zeros((), x.dtype))
        largest = lax.stop_gradient(jnp.max(x, axis=-1, initial=0))  # 0 for a block of no keys
        m = jax.nn.relu(largest - _SOFTPICK_HEADROOM)
        t = jnp.expm1(x - m[..., None]) - jnp.expm1(-m)[..., None]
        carried = jax.nn.relu(t) * _expm1_at_zero(tilt)
        return m + _log_of_sum(jnp.sum(jnp.abs(t) + carried, axis=-1))
