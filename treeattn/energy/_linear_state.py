r"""The decoding state of normalised linear attention: $\sum_a \phi(k_a) v_a^\top$ and
$\sum_a \phi(k_a)$, a sum monoid whose size does not depend on the number of keys (with
position-aware features, $\phi$ of each key at its position)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from .._numerics import compute_dtype
from ._energies import LinearKernel


def _check_kv(fn: str, k, v, kv_heads: int | None = None, qk: int | None = None) -> None:
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"{fn}: k and v must be [n, kv_heads, qk] and [n, kv_heads, dv] with the same n and "
            f"kv_heads, got k{tuple(k.shape)} and v{tuple(v.shape)}"
        )
    if kv_heads is not None and k.shape[1] != kv_heads:
        raise ValueError(f"{fn}: k{tuple(k.shape)} has {k.shape[1]} kv heads, the state {kv_heads}")
    if qk is not None and k.shape[2] != qk:
        raise ValueError(
            f"{fn}: k{tuple(k.shape)} has head size {k.shape[2]}, the state's keys {qk}"
        )


def _positions(fn: str, energy: LinearKernel, n: int, positions) -> Int[Array, " n"] | None:
    """The absolute positions of `n` queries or keys, which position-aware features need."""
    if positions is None:
        if energy.features_read_positions:
            raise ValueError(
                f"{fn}: {type(energy).__name__}'s features depend on positions: pass "
                f"positions=[{n}] (the absolute positions of the tokens)"
            )
        return None
    if jnp.shape(positions) != (n,) or not jnp.issubdtype(jnp.result_type(positions), jnp.integer):
        raise ValueError(
            f"{fn}: positions must be integer [n={n}], got {jnp.result_type(positions)}"
            f"{tuple(jnp.shape(positions))}"
        )
    return jnp.asarray(positions).astype(jnp.int32)


def _absorbed(fn: str, n: int, mask, length) -> Bool[Array, " n"] | None:
    """Which of `n` keys enter the state: `mask[n]` and the first `length`."""
    keep = None
    if mask is not None:
        if jnp.shape(mask) != (n,) or jnp.result_type(mask) != jnp.bool_:
            raise ValueError(f"{fn}: mask must be boolean [n={n}], got {jnp.shape(mask)}")
        keep = jnp.asarray(mask)
    if length is not None:
        first = jnp.arange(n, dtype=jnp.int32) < jnp.asarray(length).astype(jnp.int32)
        keep = first if keep is None else keep & first
    return keep


class LinearState(eqx.Module):
    r"""What normalised linear attention keeps of its keys: per key/value head
    $S = \sum_a \phi(k_a)\,v_a^\top$ (`S`, `[kv_heads, features, dv]`) and
    $z = \sum_a \phi(k_a)$ (`z`, `[kv_heads, features]`), accumulated in float32 (float64 for
    float64 inputs) whatever the dtype of the keys.

    Attention of a query against it is
    $$o = \frac{\phi(q)^\top S}{\phi(q)\cdot z}
        = \frac{\sum_a \phi(q)\cdot\phi(k_a)\,v_a}{\sum_a \phi(q)\cdot\phi(k_a)},$$
    the attention of its `energy` (a [`LinearKernel`][treeattn.energy.LinearKernel]) over the
    same keys (`energy_attention(energy=state.energy)`), at a cost of
    $O(\mathrm{features}\cdot d_v)$ per query and head, independent of the number of keys: a
    decode step against it takes constant time. A state with no keys gives 0 (never NaN).
    An energy whose features read positions ([`CosFormer`][treeattn.energy.CosFormer]) takes
    the absolute `positions` of the keys it absorbs and of the queries that attend.

    States form a **sum monoid**: the state of two blocks of keys is the sum of theirs
    (`a + b`), in any order, and the empty state is its identity. The state of a sequence
    sharded over devices is therefore one all-reduce of the shards' states:
    `treeattn.energy.allreduce_sum(state, axis_name=...)` (a single `psum` of both arrays)
    inside `shard_map`.

    Unbatched; batch with `jax.vmap` (or create with `batch=b` for a leading axis).

    ```python
    k = jax.random.normal(jax.random.key(0), (10, 2, 16))     # [n, kv_heads, qk]
    v = jax.random.normal(jax.random.key(1), (10, 2, 8))      # [n, kv_heads, dv]
    q = jax.random.normal(jax.random.key(2), (1, 4, 16))      # [q_seq, heads, qk] (GQA)
    state = LinearState.from_keys(k, v)
    out = state.attend(q)                                      # [1, 4, 8]
    ```
    """

    S: Float[Array, "*batch kv_heads features dv"]
    z: Float[Array, "*batch kv_heads features"]
    energy: LinearKernel

    def __init__(
        self,
        S: Float[Array, "*batch kv_heads features dv"],
        z: Float[Array, "*batch kv_heads features"],
        energy: LinearKernel | None = None,
        *,
        feature_map: Callable[[Array], Array] | None = None,
    ):
        if callable(energy) and not isinstance(energy, LinearKernel):  # LinearState(S, z, f)
            energy, feature_map = None, energy
        if feature_map is not None:  # the state held its feature map before it held an energy
            if energy is not None:
                raise ValueError("LinearState: pass energy= or feature_map=, not both")
            warnings.warn(
                "LinearState(feature_map=f) is deprecated: pass energy=LinearKernel(f)",
                DeprecationWarning,
                stacklevel=2,
            )
            energy = LinearKernel(feature_map=feature_map)
        self.S, self.z = S, z
        self.energy = _energy("LinearState", energy)

    @property
    def feature_map(self) -> Callable[[Array], Array]:
        """The energy's feature map."""
        return self.energy.feature_map

    @classmethod
    def empty(
        cls,
        kv_heads: int,
        qk: int,
        dv: int,
        *,
        energy: LinearKernel | None = None,
        dtype=jnp.float32,
        batch: int | None = None,
    ) -> LinearState:
        """The state of no keys for keys of size `qk` and values of size `dv` under `energy`
        (default `LinearKernel()`; as many features as its features of one key). `dtype` is the
        dtype of the keys; the state accumulates in at least float32."""
        energy = _energy("LinearState.empty", energy)
        ct = compute_dtype(dtype)
        one, at = jax.ShapeDtypeStruct((qk,), ct), jax.ShapeDtypeStruct((), jnp.int32)
        features = jax.eval_shape(energy.features, one, at).shape[-1]
        rows = () if batch is None else (batch,)
        return cls(
            S=jnp.zeros((*rows, kv_heads, features, dv), ct),
            z=jnp.zeros((*rows, kv_heads, features), ct),
            energy=energy,
        )

    @classmethod
    def from_keys(
        cls,
        k: Float[Array, "n kv_heads qk"],
        v: Float[Array, "n kv_heads dv"],
        *,
        energy: LinearKernel | None = None,
        mask: Bool[Array, " n"] | None = None,
        length: Int[Array, ""] | int | None = None,
        positions: Int[Array, " n"] | None = None,
    ) -> LinearState:
        """The state of the keys `k` and values `v` (only those where `mask` is True and among
        the first `length`, if given) at `positions` (needed by position-aware features)."""
        _check_kv("LinearState.from_keys", k, v)
        state = cls.empty(k.shape[1], k.shape[2], v.shape[2], energy=energy, dtype=k.dtype)
        return state.update(k, v, mask=mask, length=length, positions=positions)

    def _phi(self, x: Array, positions: Array | None) -> Array:
        """Features of `x[n, heads, d]` at `positions[n]` (None: features that ignore them)."""
        at = jnp.zeros((), jnp.int32) if positions is None else positions[:, None]
        return self.energy.features(x.astype(self.S.dtype), at)

    def serves(self, energy: LinearKernel) -> bool:
        """Whether the state holds keys under `energy`'s features: the same class with the same
        static fields (feature map, horizon)."""
        mine = self.energy
        return type(energy) is type(mine) and jax.tree.structure(energy) == jax.tree.structure(mine)

    def _delta(self, k, v, keep, positions):
        phi_k = self._phi(k, positions)  # [n, kv_heads, features]
        if keep is not None:
            phi_k = jnp.where(keep[:, None, None], phi_k, jnp.zeros((), phi_k.dtype))
            # A key that is not absorbed never reaches the state, even when it holds NaN.
            v = jnp.where(keep[:, None, None], v, jnp.zeros((), v.dtype))
        s = jnp.einsum("nkf,nkd->kfd", phi_k, v.astype(self.S.dtype))
        return s, jnp.sum(phi_k, axis=0)

    def update(
        self,
        k: Float[Array, "n kv_heads qk"],
        v: Float[Array, "n kv_heads dv"],
        *,
        mask: Bool[Array, " n"] | None = None,
        length: Int[Array, ""] | int | None = None,
        positions: Int[Array, " n"] | None = None,
    ) -> LinearState:
        r"""The state with `n` more keys: $S + \sum_a \phi(k_a) v_a^\top$, $z + \sum_a
        \phi(k_a)$ over the keys where `mask` is True and among the first `length`, at
        `positions` (needed by position-aware features)."""
        _check_kv("LinearState.update", k, v, self.S.shape[-3])
        if v.shape[2] != self.S.shape[-1]:
            raise ValueError(
                f"LinearState.update: v{tuple(v.shape)} has value size {v.shape[2]}, the "
                f"state {self.S.shape[-1]}"
            )
        keep = _absorbed("LinearState.update", k.shape[0], mask, length)
        at = _positions("LinearState.update", self.energy, k.shape[0], positions)
        s, z = self._delta(k, v, keep, at)
        return eqx.tree_at(lambda t: (t.S, t.z), self, (self.S + s, self.z + z))

    def __add__(self, other: LinearState) -> LinearState:
        """The state of both blocks of keys (the sum monoid)."""
        if not isinstance(other, LinearState) or not self.serves(other.energy):
            return NotImplemented
        return eqx.tree_at(lambda t: (t.S, t.z), self, (self.S + other.S, self.z + other.z))

    def _rows(self, q, positions):
        """`phi(q)` `[q_seq, heads, qk]` grouped by kv head: `[q_seq, kv_heads, group, f]`."""
        kv_heads = self.S.shape[-3]
        if q.ndim != 3 or q.shape[1] % kv_heads:
            raise ValueError(
                f"LinearState: q must be [q_seq, heads, qk] with heads a multiple of "
                f"kv_heads={kv_heads}, got q{tuple(q.shape)}"
            )
        phi_q = self._phi(q, positions)
        if phi_q.shape[-1] != self.S.shape[-2]:
            raise ValueError(
                f"LinearState: q{tuple(q.shape)} gives {phi_q.shape[-1]} features, the state "
                f"holds {self.S.shape[-2]}"
            )
        return phi_q.reshape(q.shape[0], kv_heads, -1, phi_q.shape[-1])

    def attend(
        self, q: Float[Array, "q_seq heads qk"], *, positions: Int[Array, " q_seq"] | None = None
    ) -> Float[Array, "q_seq heads dv"]:
        r"""Attention of every query (at `positions`, for position-aware features) against the
        state, $\phi(q)^\top S / \phi(q)\cdot z$ (0 where the denominator is 0: no keys).
        Head $h$ reads kv head $h / (\mathrm{heads}/\mathrm{kv\_heads})$ (GQA).
        **Returns:** `[q_seq, heads, dv]` in the dtype of `q`."""
        at = _positions("LinearState.attend", self.energy, q.shape[0], positions)
        phi_q = self._rows(q, at)
        num = jnp.einsum("tkgf,kfd->tkgd", phi_q, self.S)
        den = jnp.einsum("tkgf,kf->tkg", phi_q, self.z)
        out = _divide(num, den)
        return out.reshape(q.shape[0], -1, out.shape[-1]).astype(q.dtype)

    def attend_causal(
        self,
        q: Float[Array, "n heads qk"],
        k: Float[Array, "n kv_heads qk"],
        v: Float[Array, "n kv_heads dv"],
        *,
        mask: Bool[Array, " n"] | None = None,
        positions: Int[Array, " n"] | None = None,
        block_size: int = 256,
    ) -> tuple[Float[Array, "n heads dv"], LinearState]:
        r"""A causal chunk after the state: query $i$ of the chunk attends to the state's keys
        and to the chunk's keys $j \le i$ (those where `mask` is True); `positions` are the
        tokens' (one query per key), needed by position-aware features,
        $$o_i = \frac{\phi(q_i)^\top S + \sum_{j\le i} \phi(q_i)\cdot\phi(k_j)\,v_j}
                     {\phi(q_i)\cdot z + \sum_{j\le i} \phi(q_i)\cdot\phi(k_j)}:$$
        within blocks of `block_size` keys the weights are formed (as attention forms them),
        and the state before each block enters as one more term of the sum. Memory is
        $O(n\cdot\mathrm{block})$, time $O(n\cdot\mathrm{block} + n\cdot f\cdot d_v)$.

        **Returns:** the outputs `[n, heads, dv]` (dtype of `q`) and the state with the chunk's
        keys added.
        """
        _check_kv("LinearState.attend_causal", k, v, self.S.shape[-3])
        n = k.shape[0]
        if q.shape[0] != n:
            raise ValueError(
                f"LinearState.attend_causal: q{tuple(q.shape)} and k{tuple(k.shape)} must hold "
                "the same tokens (one query per key)"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(
                f"LinearState.attend_causal: block_size must be a positive int, got {block_size!r}"
            )
        keep = _absorbed("LinearState.attend_causal", n, mask, None)
        keep = jnp.ones((n,), bool) if keep is None else keep
        at = _positions("LinearState.attend_causal", self.energy, n, positions)
        phi_q, phi_k = self._rows(q, at), self._phi(k, at)
        v = v.astype(self.S.dtype)
        c = min(block_size, max(n, 1))
        blocks = -(-n // c)
        pad = blocks * c - n

        def cut(x):  # [n, ...] -> [blocks, c, ...], padded with keys that are not absorbed
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
            return x.reshape(blocks, c, *x.shape[1:])

        causal = jnp.tril(jnp.ones((c, c), bool))

        def block(carry, xs):
            s, z = carry
            pq, pk, vb, kb = xs
            pk = jnp.where(kb[:, None, None], pk, jnp.zeros((), pk.dtype))
            vb = jnp.where(kb[:, None, None], vb, jnp.zeros((), vb.dtype))
            w = jnp.einsum("ikgf,jkf->kgij", pq, pk)
            w = jnp.where(causal, w, jnp.zeros((), w.dtype))
            num = jnp.einsum("kgij,jkd->ikgd", w, vb) + jnp.einsum("ikgf,kfd->ikgd", pq, s)
            den = jnp.einsum("kgij->ikg", w) + jnp.einsum("ikgf,kf->ikg", pq, z)
            s = s + jnp.einsum("jkf,jkd->kfd", pk, vb)
            return (s, z + jnp.sum(pk, axis=0)), _divide(num, den)

        (s, z), out = lax.scan(block, (self.S, self.z), (cut(phi_q), cut(phi_k), cut(v), cut(keep)))
        out = out.reshape(blocks * c, -1, out.shape[-1])[:n]
        new = eqx.tree_at(lambda t: (t.S, t.z), self, (s, z))
        return out.astype(q.dtype), new


def _divide(num, den):
    """`num / den` where `den > 0`, else 0 (no keys, or features that are all 0)."""
    ok = den > 0
    return jnp.where(ok[..., None], num / jnp.where(ok, den, 1.0)[..., None], 0.0)


def _energy(fn: str, energy) -> LinearKernel:
    if energy is None:
        return LinearKernel()
    if not isinstance(energy, LinearKernel):
        raise ValueError(f"{fn}: energy must be a LinearKernel, got {type(energy).__name__}")
    return energy
