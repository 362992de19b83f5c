"""Float64 NumPy attention: the independent reference of `treeattn demo` and `treeattn verify`."""

from __future__ import annotations

import numpy as np


def softmax_attention_f64(q, k, v, vis, scale, *, covariance: bool = True):
    """Softmax attention in float64 NumPy: [q, h, d] x [kv, hk, d] -> [q, h, dv], with the
    covariance of the values under the weights, [q, h, dv, dv], unless `covariance=False`.
    `vis` (broadcastable to [h, q, kv]) says which keys each query sees."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    logits = np.einsum("thd,shd->hts", q, k) * scale
    logits = np.where(vis, logits, -np.inf)
    m = np.max(logits, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m)
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
    mean = np.einsum("hts,shd->thd", p, v)
    if not covariance:
        return mean
    # E[v v^T] - mu mu^T; in float64 the cancellation is harmless.
    second = np.einsum("hts,shij->thij", p, v[..., :, None] * v[..., None, :], optimize=True)
    cov = second - mean[..., :, None] * mean[..., None, :]
    return mean, cov
