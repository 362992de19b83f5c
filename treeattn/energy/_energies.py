r"""Energies as values: the base class `Energy` and the energies treeattn ships.

An energy says how one query scores each key (its *logits*), how the source $\zeta$ tilts a
key (the per-key *elements* built from a logit $x_a$ and the tilt $t_a = \zeta\cdot v_a$), an
optional term added once per query (a sink), and the `Monoid` its elements reduce with. From
these alone treeattn computes the free energy $F(\zeta)$, attention as
$\partial F/\partial\zeta|_{\zeta=0}$, the cumulants of the values as higher derivatives, and
the sharded and tree forms (each monoid carries its collective schedule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._numerics import Dims, as_position, compute_dtype
from .._partials import LOG_AFFINE, LOGSUMEXP, SUM, Monoid, affine_lift_unit_damped


Logits = Float[Array, "kv_heads rows kv"] | tuple[Float[Array, "kv_heads rows kv"], ...]
"""The logits of a block of keys: one array, or one per part of an energy's state."""


class Context(NamedTuple):
    """Where a block of logits sits: sizes, scale and absolute positions.

    `q_pos[rows]` is the absolute position of each query row (rows layout, see
    `treeattn._numerics.to_rows`), `k_pos[kv]` that of each key of the block, `head[kv_heads,
    rows]` the query head of each row, and `kv_total` the number of keys of the whole sequence
    (all shards and blocks together).
    """

    dims: Dims
    scale: float
    q_pos: Int[Array, " rows"]
    k_pos: Int[Array, " kv"]
    head: np.ndarray
    kv_total: int


def make_context(dims: Dims, scale: float, q_offset, kv_offset, kv_total: int) -> Context:
    """The context of a block of `dims.kv_seq` keys starting at absolute position `kv_offset`."""
    q_pos = as_position(q_offset) + jnp.arange(dims.q_seq, dtype=jnp.int32)
    k_pos = as_position(kv_offset) + jnp.arange(dims.kv_seq, dtype=jnp.int32)
    group_of_row = np.arange(dims.rows) // max(dims.q_seq, 1)
    head = np.arange(dims.kv_heads)[:, None] * dims.group + group_of_row[None, :]
    return Context(dims, scale, jnp.tile(q_pos, dims.group), k_pos, head, kv_total)


def per_head(x, ctx: Context, dtype) -> Array:
    """A scalar or a `[heads]` parameter as one value per query row, `[kv_heads, rows]`."""
    x = jnp.asarray(x, dtype)
    if x.ndim == 0:
        return jnp.broadcast_to(x, ctx.head.shape)
    return x[ctx.head]


class Energy(eqx.Module):
    r"""An energy of attention: subclass it, set `monoid`, and write `elements`.

    For one query row the free energy is
    $F(\zeta) = \mathrm{readout}\big(\mathrm{once} \oplus \bigoplus_a
    \mathrm{lift}(e(x_a, \zeta\cdot v_a))\big)$, where $x_a$ are `logits`, $e$ is `elements`
    and $\oplus$ the `monoid`'s combine, in key order. Attention is its gradient in $\zeta$ at
    0, and the $n$-th derivative the $n$-th cumulant of the values.

    Learnable parameters are array fields (Equinox): `jax.grad` reaches them through every
    function that takes `energy=`.

    **Methods to override:**

    - `elements(x, tilt, ctx)` (required): per-key elements, one leaf per part of the monoid's
      state, each `[kv_heads, rows, kv]`, from logits `x` and the tilt $t_a = \zeta\cdot v_a$
      (exactly 0 at $\zeta = 0$; its derivative is supplied without computing the product).
    - `logits(q, k, ctx)`: `q[kv_heads, rows, qk]` (rows layout), `k[kv, kv_heads, qk]`;
      default $s\,q\cdot k$. Logit transforms (soft-capping, position biases) live here, with
      absolute positions from `ctx` so that shards and blocks agree. It may return a pytree of
      such arrays (several logits per key, e.g. `Differential`'s two halves): `elements` then
      receives that pytree.
    - `once(ctx)`: a state added exactly once per query row (a sink), or None.
    - `readout(state, ctx)`: the free energy of each row; default the monoid's.
    - `reads_positions` (a property): whether `logits` reads `ctx.q_pos` / `ctx.k_pos`;
      default True for a subclass with its own `logits`.

    ```python
    class ReLU2(Energy):
        monoid = SUM  # F = sum_a relu(x_a + zeta.v_a)^2 / 2

        def elements(self, x, tilt, ctx):
            return 0.5 * jax.nn.relu(x + tilt) ** 2
    ```
    """

    monoid: ClassVar[Monoid] = LOGSUMEXP

    def logits(
        self, q: Float[Array, "kv_heads rows qk"], k: Float[Array, "kv kv_heads qk"], ctx: Context
    ) -> Logits:
        return jnp.einsum("kmd,skd->kms", q * jnp.asarray(ctx.scale, q.dtype), k)

    def elements(self, x: Any, tilt, ctx: Context) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define elements(x, tilt, ctx)")

    def once(self, ctx: Context) -> Any:
        return None

    def readout(self, state: Any, ctx: Context) -> Float[Array, "kv_heads rows"]:
        return self.monoid.readout(state)

    @property
    def reads_positions(self) -> bool:
        """Whether the logits depend on the absolute positions of the queries and keys
        (`ctx.q_pos`, `ctx.k_pos`). Every path gives an energy that reads them the keys' true
        positions; a call that cannot (`treeattn.decode.tree_decode(shard_lengths=...)`, whose
        shards carry fill counts only) refuses it. Default: True when a subclass defines its
        own `logits` (which may read them); override it to say otherwise."""
        return type(self).logits is not Energy.logits

    @property
    def max_distance(self) -> int | None:
        """The largest distance between a query and a key for which the energy is defined
        (a [`CosFormer`][treeattn.energy.CosFormer]'s weights vanish at its horizon and turn
        negative past it); None: any. A model's `init_cache` refuses a `max_len` that reaches
        beyond it; positions that keep growing after `Decoder.evict` are not checked."""
        return None

    def _scaled_tilt(self, ctx: Context, dtype) -> tuple[Array, Callable[..., Any]] | None:
        """`(c, e)` when `elements(x, t)` equals `e(x, c t)` for a per-row factor `c[kv_heads,
        rows]`: the tilt is then built from `c ζ` (a factor on the rows of ζ rather than on every
        logit, which under `jax.grad` keeps the weights in one fusion with their product with
        V). None (the default): `elements` is called as it is."""
        return None

    def _hides_itself(self) -> bool:
        r"""True when the `elements` of a hidden key (its logit set to 0) at $\zeta = 0$ are
        already the monoid's identity with zero derivatives: the lift then need not mask them
        again (one select less in the gradient, where it would keep the weights out of the
        fusion with V)."""
        return False

    def _lift_at_zero(self, x: Any, tilt: Array, visible: Array | None, ctx: Context) -> Any:
        r"""The monoid state of a block at $\zeta = 0$ straight from its logits, or None (the
        default: `elements`, then the monoid's lift). `tilt` is exactly 0 there but carries
        its derivatives, which the state must keep to every order; `visible` (None: every key)
        says which keys enter. For an energy whose log-domain elements cost transcendentals
        and passes that its weights do not (`Softpick`), or operations that the state does not
        need (`StickBreaking`: $\log r_a$ added to each key's log-weight and taken off again)."""
        return None

    def _unit_weights_at_zero(self) -> bool:
        r"""True when at $\zeta = 0$ the weights of the elements are at most 1 (log-weights
        $\le 0$): the monoid's `lift_unit` then lifts them without a running maximum."""
        return False


def _alibi_and_softcap(x, softcap, alibi_slopes, ctx: Context):
    if softcap is not None:
        c = jnp.asarray(softcap, x.dtype)
        x = c * jnp.tanh(x / c)
    if alibi_slopes is not None:
        slopes = per_head(alibi_slopes, ctx, x.dtype)
        distance = jnp.abs(ctx.q_pos[:, None] - ctx.k_pos[None, :]).astype(x.dtype)
        x = x - slopes[..., None] * distance
    return x


class Softmax(Energy):
    r"""Softmax attention with inverse temperature $\beta$ (the modern Hopfield energy).

    $$F(\zeta) = \beta^{-1}\log\sum_a \exp\big(\beta\,(x_a + \zeta\cdot v_a)\big)$$

    with $x_a = s\,q\cdot k_a$, optionally soft-capped to $c\tanh(x_a/c)$ (`softcap`, Gemma 2)
    and shifted by ALiBi, $-m_h\,|i - j|$ (`alibi_slopes`, one slope per head). Monoid:
    log-sum-exp. Its Hessian in $\zeta$ is $\beta$ times the covariance of the values under
    $p = \mathrm{softmax}(\beta x)$. `Softmax()` is treeattn's default energy: the functions
    without `energy=` compile to the same program.
    """

    beta: Any = 1.0
    softcap: Any = None
    alibi_slopes: Any = None
    monoid: ClassVar[Monoid] = LOGSUMEXP

    def logits(self, q, k, ctx):
        x = super().logits(q, k, ctx)
        return _alibi_and_softcap(x, self.softcap, self.alibi_slopes, ctx)

    @property
    def reads_positions(self) -> bool:
        """ALiBi reads the distance between query and key positions."""
        return type(self).logits is not Softmax.logits or self.alibi_slopes is not None

    def elements(self, x, tilt, ctx):
        beta = jnp.asarray(self.beta, x.dtype)
        return beta * (x + tilt)

    def readout(self, state, ctx):
        return state / jnp.asarray(self.beta, state.dtype)

    def _scaled_tilt(self, ctx, dtype):
        if type(self).elements is not Softmax.elements:  # a subclass redefined the elements
            return None
        beta = per_head(self.beta, ctx, dtype)
        return beta, lambda x, scaled_tilt: beta[..., None] * x + scaled_tilt


class SoftmaxWithSink(Softmax):
    r"""Softmax with an attention sink: a logit $\sigma_h$ per head that takes weight but
    carries no value (gpt-oss); `sink=0.0` is softmax1.

    $$F(\zeta) = \beta^{-1}\log\Big(e^{\beta\sigma_h} + \sum_a e^{\beta(x_a + \zeta\cdot v_a)}
    \Big)$$

    The sink enters once per query, after every shard and block is merged. `sink` is a scalar
    or `[heads]` (learnable as an array). Monoid: log-sum-exp. The Hessian is the covariance of
    the values under the attention distribution with the sink as one more outcome of value 0.
    """

    sink: Any = 0.0

    def once(self, ctx):
        wide = (
            jnp.result_type(self.sink) == jnp.float64 or jnp.result_type(self.beta) == jnp.float64
        )
        dtype = jnp.float64 if wide else jnp.float32
        return per_head(self.beta, ctx, dtype) * per_head(self.sink, ctx, dtype)


@jax.custom_jvp
def _softplus(x: Array) -> Array:
    # log(1 + e^x) = max(x, 0) + log1p(e^{-|x|}): exact for every x, NaN for NaN.
    return jnp.maximum(x, 0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    # The derivative is the logistic function itself: one transcendental per logit, where
    # differentiating softplus's own formula costs three (exp, log1p and exp again).
    (x,), (dx,) = primals, tangents
    return _softplus(x), jax.nn.sigmoid(x) * dx


class Sigmoid(Energy):
    r"""Sigmoid attention: each key is weighted independently, $\sigma(x_a + b)$.

    $$F(\zeta) = \sum_a \mathrm{softplus}(x_a + b + \zeta\cdot v_a),$$

    with bias $b$ (default $-\log n$, $n$ the number of key slots of the whole sequence — with
    a partly filled cache that counts every slot, so pass `bias` explicitly when decoding).
    Monoid: a sum — no running max, one all-reduce across devices. Its gradient at 0 is $\sum_a
    \sigma(x_a + b)\, v_a$ and its Hessian $\sum_a \sigma(1-\sigma)\, v_a v_a^\top$.
    """

    bias: Any = None
    monoid: ClassVar[Monoid] = SUM

    def elements(self, x, tilt, ctx):
        b = -np.log(max(ctx.kv_total, 1)) if self.bias is None else self.bias
        return _softplus(x + jnp.asarray(b, x.dtype) + tilt)


def elu_plus_one(x: Array) -> Array:
    r"""$\phi(x) = \mathrm{elu}(x) + 1 > 0$, the feature map of Katharopoulos et al. (2020)."""
    return jax.nn.elu(x) + 1.0


@jax.custom_jvp
def _log_of_sum(s: Array) -> Array:
    """log s of a sum of non-negative weights: -inf for an empty row (s = 0), NaN for NaN."""
    return jnp.log(jnp.maximum(s, jnp.zeros((), s.dtype)))


@_log_of_sum.defjvp
def _log_of_sum_jvp(primals, tangents):
    # ds / s with 1/max(s, floor) on the rows: XLA then takes the row scaling out of the
    # product with V (a mask or a select on 1/s leaves a pass over the weights, 1.5x the time
    # of CosFormer's attention). A row of no weight (hidden keys, or ReLU features that meet
    # no key's) has s = 0 and ds = 0 and gets 0.
    (s,), (ds,) = primals, tangents
    return _log_of_sum(s), ds * _reciprocal(s)


def _reciprocal_floor(dtype) -> float:
    """tiny / eps of the compute dtype (2^-103 ~ 1e-31 in float32, 2^-970 in float64): 1/s of
    a sum below it is 1/floor, so a cotangent it scales overflows only beyond 2^25 (float32;
    2^54 in float64); at 1/tiny one of 4 would, and 0 * inf is NaN in the derivatives of a row
    of no weight."""
    info = jnp.finfo(compute_dtype(dtype))
    return float(info.tiny) / float(info.eps)


@jax.custom_jvp
def _reciprocal(s: Array) -> Array:
    """1 / s for s >= tiny / eps (`_reciprocal_floor`); a row whose weights sum to less (a
    row of no weight: s = 0) reads 1/floor, so its attention, ds / floor, is 0 for s = 0 and
    scaled down by s / floor below the floor (F = log s stays exact, and a `LinearState`
    divides exactly)."""
    return 1 / jnp.maximum(s, _reciprocal_floor(s.dtype))


@_reciprocal.defjvp
def _reciprocal_jvp(primals, tangents):
    # -ds / s^2, 0 below the floor (where 1/s is constant); ordered so that 1/floor^2 is never
    # formed.
    (s,), (ds,) = primals, tangents
    r = _reciprocal(s)
    above = s >= _reciprocal_floor(s.dtype)
    return r, jnp.where(above, -(r * ds) * r, jnp.zeros((), r.dtype))


class LinearKernel(Energy):
    r"""Normalised linear (kernel) attention with a feature map $\phi \ge 0$.

    $$F(\zeta) = \log\sum_a \phi(q)\cdot\phi(k_a)\; e^{\zeta\cdot v_a},$$

    so attention is $\sum_a \phi(q)\cdot\phi(k_a)\, v_a / \sum_a \phi(q)\cdot\phi(k_a)$ (the
    scale is not used). Monoid: a sum (read out with a logarithm), no running max. The Hessian
    is the covariance of the values under the weights $\phi(q)\cdot\phi(k_a)$.
    """

    feature_map: Callable[[Array], Array] = eqx.field(static=True, default=elu_plus_one)
    monoid: ClassVar[Monoid] = SUM

    def features(
        self, x: Float[Array, "*lead d"], positions: Int[Array, "*#lead"]
    ) -> Float[Array, "*lead f"]:
        r"""$\phi(x)$ of queries or keys `x` at absolute `positions` (broadcast against
        `x.shape[:-1]`); the weight of key $a$ for a query is $\phi(q)\cdot\phi(k_a)$. The
        feature map alone here; a subclass may make features depend on positions
        ([`CosFormer`][treeattn.energy.CosFormer]), and a decoding state then needs them."""
        del positions
        return self.feature_map(x)

    def logits(self, q, k, ctx):
        phi_q = self.features(q, ctx.q_pos[None, :])
        return jnp.einsum("kmf,skf->kms", phi_q, self.features(k, ctx.k_pos[:, None]))

    @property
    def features_read_positions(self) -> bool:
        """Whether `features` depends on the positions (a subclass that defines its own), so
        that a decoding state must be given them."""
        return type(self).features is not LinearKernel.features

    @property
    def reads_positions(self) -> bool:
        return type(self).logits is not LinearKernel.logits or self.features_read_positions

    def elements(self, x, tilt, ctx):
        return x * jnp.exp(tilt)

    def _hides_itself(self):
        # A hidden key has x = 0: element x e^0 = 0 (the sum's identity), derivatives 0.
        return type(self).elements is LinearKernel.elements

    def readout(self, state, ctx):
        return _log_of_sum(state)


class CosFormer(LinearKernel):
    r"""cosFormer attention (Qin et al., 2022): linear attention re-weighted by the distance
    between query and key, with constant-time decoding through a
    [`LinearState`][treeattn.energy.LinearState].

    $$w_{ia} = \phi(q_i)\cdot\phi(k_a)\,\cos\Big(\frac{\pi}{2}\,\frac{i - a}{M}\Big),
      \qquad F_i(\zeta) = \log\sum_a w_{ia}\, e^{\zeta\cdot v_a},$$

    with $i, a$ absolute positions, $M$ the `horizon` and $\phi$ the `feature_map` (default
    ReLU, as in the paper). Since $\cos(\theta_i - \theta_a) = \cos\theta_i\cos\theta_a
    + \sin\theta_i\sin\theta_a$ with $\theta_p = \pi p / 2M$, the weights are those of a
    `LinearKernel` with the position-aware features
    $[\phi(x)\cos\theta_p,\ \phi(x)\sin\theta_p]$ (twice as many): a decoding state stays
    $O(\mathrm{features}\cdot d_v)$ whatever the number of keys. Attention over keys forms the
    weights directly (one cosine of the integer gap per logit, half the product of the
    features); the state uses the features. The weights are
    positive for $|i - a| < M$: the horizon must exceed the longest distance attended over
    (a model's `init_cache` refuses a `max_len` beyond it; `energy_attention` does not check).
    """

    horizon: int = eqx.field(static=True, kw_only=True)

    def __init__(self, horizon: int, feature_map: Callable[[Array], Array] = jax.nn.relu):
        if isinstance(horizon, bool) or not isinstance(horizon, int | np.integer) or horizon < 1:
            raise ValueError(f"CosFormer: horizon must be a positive int, got {horizon!r}")
        self.horizon = int(horizon)
        self.feature_map = feature_map

    def logits(self, q, k, ctx):
        # The weights themselves, phi(q).phi(k) cos(pi/2 (i - a) / M): half the product of the
        # features (which a decoding state needs), and the angle from the exact integer gap.
        x = jnp.einsum("kmd,skd->kms", self.feature_map(q), self.feature_map(k))
        gap = (ctx.q_pos[:, None] - ctx.k_pos[None, :]).astype(compute_dtype(x.dtype))
        # Floored at 0: float32's cos(pi/2) is -4e-8, which would make a lone key at the
        # horizon a negative weight.
        cos = jnp.maximum(jnp.cos((jnp.pi / (2 * self.horizon)) * gap), 0)
        return x * cos.astype(x.dtype)

    def features(self, x, positions):
        phi = self.feature_map(x)
        # The angle in at least float32: bfloat16 cannot tell position 1000 from 1004.
        ct = compute_dtype(phi.dtype)
        theta = (jnp.pi / (2 * self.horizon)) * jnp.asarray(positions).astype(ct)[..., None]
        cos, sin = jnp.cos(theta).astype(phi.dtype), jnp.sin(theta).astype(phi.dtype)
        return jnp.concatenate([phi * cos, phi * sin], axis=-1)

    @property
    def max_distance(self) -> int | None:
        return self.horizon - 1  # at the horizon the weight is cos(pi/2) = 0


class StickBreaking(Energy):
    r"""Stick-breaking attention (Tan et al., 2024): the latest key breaks off its share first.

    With $\beta_a = \sigma(x_a)$ over the visible keys in position order, key $a$ gets weight
    $A_a = \beta_a \prod_{b > a} (1 - \beta_b)$ and the rest of the stick,
    $R = \prod_a (1-\beta_a)$, goes to no value (a value of 0). Then

    $$F(\zeta) = \log\Big(R + \sum_a A_a\, e^{\zeta\cdot v_a}\Big),$$

    whose gradient at 0 is $\sum_a A_a v_a$ (since $R + \sum_a A_a = 1$) and whose Hessian is
    the covariance of that distribution. Monoid: ordered affine maps (associative, not
    commutative); across devices it folds by the position of each block.
    """

    monoid: ClassVar[Monoid] = LOG_AFFINE

    def elements(self, x, tilt, ctx):
        log_r = -_softplus(x)  # log(1 - beta_a); log beta_a = x_a + log(1 - beta_a)
        return x + log_r + tilt, log_r

    def _unit_weights_at_zero(self):
        # log A_a = log beta_a + sum_{b > a} log(1 - beta_b) <= 0 at zeta = 0 (a stick of length 1).
        return type(self).elements is StickBreaking.elements

    def _lift_at_zero(self, x, tilt, visible, ctx):
        # log A_a = x_a + sum_{b >= a} log(1 - beta_b): the inclusive suffix sum, so that
        # log(1 - beta_a) is neither added to every key's log-weight nor subtracted again.
        if type(self).elements is not StickBreaking.elements:
            return None
        return affine_lift_unit_damped(x + tilt, -_softplus(x), visible)


class ScoreMod(Energy):
    r"""Softmax over logits rewritten by a FlexAttention `score_mod`.

    $$F(\zeta) = \log\sum_a \exp\big(\mathrm{score\_mod}(s\,q\cdot k_a,\ b,\ h,\ i,\ j_a)
      + \zeta\cdot v_a\big)$$

    with `score_mod(score, b, h, q_idx, kv_idx)` written for scalars as in PyTorch's
    FlexAttention: `h` the query head, `q_idx` and `kv_idx` absolute positions (so blocks and
    shards agree), `b` 0 (treeattn's cores are per row; batch with `vmap`). It is vectorised
    with `vmap`. A plain function is compared by identity (a new one recompiles); tables it
    reads are learnable when it is an Equinox module or a `jax.tree_util.Partial` holding
    them (`ScoreMod(Partial(fn, table))`): `jax.grad` then reaches them through every path.
    Monoid: log-sum-exp. Masks go to `mask_mod=` of the attention functions, not here.

    ```python
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(score.dtype)

    out = energy_attention(q, k, v, causal=True, energy=ScoreMod(alibi))
    ```
    """

    score_mod: Any
    monoid: ClassVar[Monoid] = LOGSUMEXP

    def __init__(self, score_mod: Callable[..., Any]):
        if not callable(score_mod):
            raise ValueError(
                f"ScoreMod: score_mod must be callable, got {type(score_mod).__name__}"
            )
        if jax.tree_util.treedef_is_leaf(jax.tree.structure(score_mod)):
            # A plain function: as a `Partial` it is a pytree with no leaves.
            score_mod = jax.tree_util.Partial(score_mod)
        self.score_mod = score_mod

    def logits(self, q, k, ctx):
        x = cast(Array, super().logits(q, k, ctx))  # the scaled dot products, one array

        def one(score, h, i, j):
            return self.score_mod(score, jnp.zeros((), jnp.int32), h, i, j)

        per_key = jax.vmap(one, in_axes=(0, None, None, 0))
        per_row = jax.vmap(per_key, in_axes=(0, 0, 0, None))
        per_kv_head = jax.vmap(per_row, in_axes=(0, 0, None, None))
        head = jnp.asarray(ctx.head, jnp.int32)
        out = per_kv_head(x, head, ctx.q_pos, ctx.k_pos)
        if out.shape != x.shape:
            raise ValueError(
                f"ScoreMod: score_mod must return one score per (score, b, h, q_idx, kv_idx), "
                f"got shape {tuple(out.shape)} for logits of shape {tuple(x.shape)}"
            )
        return out.astype(x.dtype)

    def elements(self, x, tilt, ctx):
        return x + tilt


def is_plain_softmax(energy: Energy) -> bool:
    """`Softmax()` with every default (Python numbers, not arrays): the energy the fused
    decoding kernels serve, with the results of the functions called without `energy=` (which
    evaluate it through the same path as every other energy)."""
    return (
        type(energy) is Softmax
        and isinstance(energy.beta, int | float)
        and energy.beta == 1
        and energy.softcap is None
        and energy.alibi_slopes is None
    )


def check_energy(fn: str, energy) -> None:
    """`energy` is an `Energy` instance."""
    if not isinstance(energy, Energy):
        raise ValueError(
            f"{fn}: energy must be a treeattn.energy.Energy (e.g. Softmax()), got "
            f"{type(energy).__name__}"
        )


def check_block_size(fn: str, block_size) -> None:
    """`block_size` is None or a positive Python int."""
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{fn}: block_size must be a positive int or None, got {block_size!r}")


def combine_once(energy: Energy, state, ctx: Context):
    """The merged state with the energy's once-only term (a sink) folded in first."""
    once = energy.once(ctx)
    if once is None:
        return state
    once = jax.tree.map(lambda o, s: jnp.broadcast_to(o, s.shape).astype(s.dtype), once, state)
    return energy.monoid.combine(once, state)


SOFTMAX = Softmax()
"""The default energy of every function that takes `energy=`."""
