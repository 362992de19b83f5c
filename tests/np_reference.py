"""An independent float64 NumPy implementation of multi-head attention and its free energy.

Written from the definitions, with loops where that is clearest; it imports nothing from
treeattn. Head h reads key/value head h // (heads // kv_heads) (GQA/MQA).
"""

import numpy as np


def f64(x):
    """Any array (bfloat16 included) as float64 NumPy."""
    return np.asarray(x).astype(np.float64)


def visible(q_seq, kv_seq, heads, *, causal=False, mask=None, q_offset=0):
    """Boolean [heads, q_seq, kv_seq]: which keys each (head, query) sees."""
    vis = np.ones((heads, q_seq, kv_seq), dtype=bool)
    if causal:
        for i in range(q_seq):
            for a in range(kv_seq):
                vis[:, i, a] = a <= q_offset + i
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        vis &= mask if mask.ndim == 3 else mask[None]
    return vis


def logits(q, k, scale=None):
    """s q_{i,h}·k_{a,g(h)} as [heads, q_seq, kv_seq]."""
    q, k = f64(q), f64(k)
    q_seq, heads, qk = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / np.sqrt(qk) if scale is None else scale
    out = np.empty((heads, q_seq, k.shape[0]))
    for h in range(heads):
        out[h] = scale * q[:, h, :] @ k[:, h // group, :].T
    return out


def weights(q, k, *, scale=None, **vis_kwargs):
    """Attention probabilities [heads, q_seq, kv_seq]; all-zero rows where nothing is visible."""
    x = logits(q, k, scale)
    heads, q_seq, kv_seq = x.shape
    vis = visible(q_seq, kv_seq, heads, **vis_kwargs)
    p = np.zeros_like(x)
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            if row.any():
                e = np.exp(x[h, i, row] - x[h, i, row].max())
                p[h, i, row] = e / e.sum()
    return p


def values_for_heads(v, heads):
    """v[kv_seq, kv_heads, dv] -> [heads, kv_seq, dv] by the GQA mapping."""
    v = f64(v)
    group = heads // v.shape[1]
    return np.stack([v[:, h // group, :] for h in range(heads)])


def attention(q, k, v, **kw):
    """Softmax attention [q_seq, heads, dv] in float64."""
    p = weights(q, k, **kw)
    vh = values_for_heads(v, p.shape[0])
    return np.einsum("hts,hsd->thd", p, vh)


def free_energy_terms(q, k, v, zeta, *, scale=None, **vis_kwargs):
    """F_{i,h}(zeta_{i,h}) = log sum_visible exp(s q.k + zeta.v), [q_seq, heads]; -inf if empty."""
    x = logits(q, k, scale)
    heads, q_seq, kv_seq = x.shape
    vh = values_for_heads(v, heads)
    zeta = f64(zeta)
    vis = visible(q_seq, kv_seq, heads, **vis_kwargs)
    out = np.full((q_seq, heads), -np.inf)
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            if row.any():
                y = x[h, i, row] + vh[h, row] @ zeta[i, h]
                out[i, h] = y.max() + np.log(np.exp(y - y.max()).sum())
    return out


def tilted_mean(q, k, v, zeta, *, scale=None, **vis_kwargs):
    """dF/dzeta at zeta: the mean of v under p_a ∝ exp(s q.k_a + zeta.v_a), [q_seq, heads, dv]."""
    x = logits(q, k, scale)
    heads, q_seq, kv_seq = x.shape
    vh = values_for_heads(v, heads)
    zeta = f64(zeta)
    vis = visible(q_seq, kv_seq, heads, **vis_kwargs)
    out = np.zeros((q_seq, heads, vh.shape[-1]))
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            if row.any():
                y = x[h, i, row] + vh[h, row] @ zeta[i, h]
                p = np.exp(y - y.max())
                out[i, h] = (p / p.sum()) @ vh[h, row]
    return out


def tilted_covariance(q, k, v, zeta, *, scale=None, **vis_kwargs):
    """d2F/dzeta2 at zeta: the covariance of v under p_a ∝ exp(s q.k_a + zeta.v_a),
    [q_seq, heads, dv, dv] (0 for a query that sees no key)."""
    x = logits(q, k, scale)
    heads, q_seq, kv_seq = x.shape
    vh = values_for_heads(v, heads)
    zeta = f64(zeta)
    vis = visible(q_seq, kv_seq, heads, **vis_kwargs)
    dv = vh.shape[-1]
    out = np.zeros((q_seq, heads, dv, dv))
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            if row.any():
                y = x[h, i, row] + vh[h, row] @ zeta[i, h]
                p = np.exp(y - y.max())
                p /= p.sum()
                centred = vh[h, row] - p @ vh[h, row]
                out[i, h] = (p[:, None] * centred).T @ centred
    return out


def cumulants(q, k, v, order, **kw):
    """Central moments of v under the attention weights: order 1 (mean), 2, 3 (= cumulants)."""
    p = weights(q, k, **kw)
    heads, q_seq, _ = p.shape
    vh = values_for_heads(v, heads)
    dv = vh.shape[-1]
    out = np.zeros((q_seq, heads) + (dv,) * order)
    for h in range(heads):
        for i in range(q_seq):
            mu = p[h, i] @ vh[h]
            if order == 1:
                out[i, h] = mu
                continue
            d = vh[h] - mu
            if order == 2:
                out[i, h] = np.einsum("a,ai,aj->ij", p[h, i], d, d)
            elif order == 3:
                out[i, h] = np.einsum("a,ai,aj,ak->ijk", p[h, i], d, d, d)
            else:
                raise NotImplementedError(order)
            if p[h, i].sum() == 0:
                out[i, h] = 0.0
    return out


def rel_err(actual, expected):
    """Normwise relative error max|a - b| / max|b| (absolute when b is all zero)."""
    a, b = f64(actual), f64(expected)
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if b.size else 0.0
    return diff / scale if scale > 0 else diff
