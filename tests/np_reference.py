"""An independent float64 NumPy implementation of multi-head attention and its free energy.

Written from the definitions, with loops where that is clearest; it imports nothing from
treeattn. Head h reads key/value head h // (heads // kv_heads) (GQA/MQA).

Unbatched problems are q [q_seq, heads, qk], k [kv_seq, kv_heads, qk], v [kv_seq, kv_heads, dv];
the `decode*` functions take treeattn.decode's batched form, q [batch, q_seq, heads, dim] and
k, v [batch, kv_seq, kv_heads, dim] (bshd); `energy_attention` covers every energy of
treeattn.energy by the distribution it puts on the values.
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


# ---------------------------------------------------------------------------------------------
# Batched decoding: filled lengths, windows, masks and additive biases
# ---------------------------------------------------------------------------------------------


def decode(q, k, v, kv_length, *, causal=False, q_offset=None):
    """(out [batch, q_seq, heads, dv], lse [batch, q_seq, heads]) of each batch row over its
    first kv_length[b] keys (lse = F at zeta = 0, -inf for a row that sees nothing)."""
    batch, q_seq, heads, _ = q.shape
    kv_seq = k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        n = int(np.broadcast_to(kv_length, (batch,))[b])
        mask = np.zeros((q_seq, kv_seq), bool)
        mask[:, :n] = True
        off = 0 if q_offset is None else int(np.broadcast_to(q_offset, (batch,))[b])
        kw = dict(mask=mask, causal=causal, q_offset=off)
        outs.append(attention(q[b], k[b], v[b], **kw))
        terms = free_energy_terms(q[b], k[b], v[b], np.zeros((q_seq, heads, v.shape[-1])), **kw)
        lses.append(terms)  # [q_seq, heads], jax's residual layout
    return np.stack(outs), np.stack(lses)


def decode_visible(batch, q_seq, heads, kv_seq, *, kv_length, q_offset, causal, window, mask):
    """Visibility [batch, heads, q_seq, kv_seq], from the definitions: key slot a (position a)
    is seen by query i (position q_offset + i) iff a < kv_length, (causal) a <= position,
    (window) position - left <= a <= position + right, and the mask allows."""
    vis = np.zeros((batch, heads, q_seq, kv_seq), bool)
    lengths = np.broadcast_to(np.asarray(kv_length), (batch,))
    offsets = np.broadcast_to(np.asarray(q_offset), (batch,))
    for b in range(batch):
        for i in range(q_seq):
            at = int(offsets[b]) + i
            for a in range(kv_seq):
                ok = a < lengths[b] and (not causal or a <= at)
                if window is not None:
                    ok = ok and at - window[0] <= a <= at + window[1]
                vis[b, :, i, a] = ok
    if mask is not None:
        vis &= np.broadcast_to(np.asarray(mask, bool), vis.shape)
    return vis


def decode_attention(q, k, v, vis, bias=None, scale=None):
    """(out [b, q, h, dv], lse [b, q, h]) with logits s q.k + bias over the keys `vis`
    ([batch, heads, q_seq, kv_seq]) shows; a row that sees nothing gives (0, -inf)."""
    q, k, v = f64(q), f64(k), f64(v)
    batch, q_seq, heads, dim = q.shape
    group = heads // k.shape[2]
    scale = 1.0 / np.sqrt(dim) if scale is None else scale
    bias = np.zeros(()) if bias is None else f64(bias)
    bias = np.broadcast_to(bias, (batch, heads, q_seq, k.shape[1]))
    out = np.zeros((batch, q_seq, heads, v.shape[-1]))
    lse = np.full((batch, q_seq, heads), -np.inf)
    for b in range(batch):
        for h in range(heads):
            x = scale * q[b, :, h] @ k[b, :, h // group].T + bias[b, h]
            for i in range(q_seq):
                seen = vis[b, h, i]
                if not seen.any():
                    continue
                m = x[i, seen].max()
                e = np.exp(x[i, seen] - m)
                out[b, i, h] = e @ v[b, seen, h // group] / e.sum()
                lse[b, i, h] = m + np.log(e.sum())
    return out, lse


# ---------------------------------------------------------------------------------------------
# Every energy: per (head, query) row, the distribution it puts on the values
# ---------------------------------------------------------------------------------------------


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _phi(x):  # elu + 1
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _row_weights(family, params, x, h, i_pos, pos, qf, kf, n_total):
    """Weights of the visible keys of one row (key positions `pos`, logits `x`), and the
    curvature that turns them into the Hessian: a scalar for a distribution (whose Hessian is
    a covariance), per key for a sum."""
    if family in ("softmax", "sink"):
        beta = params.get("beta", 1.0)
        if params.get("softcap") is not None:
            c = params["softcap"]
            x = c * np.tanh(x / c)
        if params.get("alibi") is not None:
            x = x - params["alibi"][h] * np.abs(i_pos - pos)
        y = beta * x
        m = y.max() if y.size else 0.0
        e = np.exp(y - m)
        z = e.sum()
        if family == "sink":
            sink = np.broadcast_to(params["sink"], (params["heads"],))[h]
            z = z + np.exp(beta * sink - m)
        return (e / z if y.size else e), beta
    if family == "sigmoid":
        b = -np.log(n_total) if params.get("bias") is None else params["bias"]
        s = _sigmoid(x + b)
        return s, s * (1 - s)
    if family == "linear":
        w = _phi(kf) @ _phi(qf)
        return (w / w.sum() if w.size else w), 1.0
    if family == "cosformer":  # relu features re-weighted by cos(pi/2 (i - a) / M)
        w = np.maximum(kf, 0.0) @ np.maximum(qf, 0.0)
        w = w * np.cos(0.5 * np.pi * (i_pos - pos) / params["horizon"])
        return (w / w.sum() if w.sum() > 0 else np.zeros_like(w)), 1.0
    if family == "stick":
        beta = _sigmoid(x)
        order = np.argsort(pos)
        a = np.zeros_like(beta)
        remaining = 1.0
        for j in order[::-1]:  # the latest key breaks its share off first
            a[j] = beta[j] * remaining
            remaining *= 1 - beta[j]
        return a, 1.0
    if family == "relu2":
        return np.maximum(x, 0.0), (x > 0).astype(float)
    raise ValueError(family)


def energy_attention(family, params, q, k, v, *, causal=False, mask=None, q_offset=0):
    """Attention [q_seq, heads, dv] of the energy `family` ("softmax", "sink", "sigmoid",
    "linear", "cosformer", "stick", "relu2", or a composite one: "differential",
    "forgetting", "softpick") with `params` (beta, softcap, alibi, sink, bias, lam, horizon),
    and the Hessian of F_{i,h} in zeta at 0, [q_seq, heads, dv, dv]."""
    vis_kw = {"causal": causal, "mask": mask, "q_offset": q_offset}
    if family == "differential":
        return differential_attention(q, k, v, params["lam"], **vis_kw)
    if family == "softpick":
        return softpick_attention(q, k, v, **vis_kw)
    if family == "forgetting":  # c in the last channel of q and k, the scale of their width
        qf, kf = f64(q), f64(k)
        c_k = kf[..., -1]  # [kv_seq, kv_heads]
        c_q = qf[..., -1]  # [q_seq, heads]
        s = 1.0 / np.sqrt(qf.shape[-1])
        return decayed_attention(qf[..., :-1], kf[..., :-1], v, c_q, c_k, scale=s, **vis_kw)
    x = logits(q, k)
    qf, kf = f64(q), f64(k)
    heads, q_seq, kv_seq = x.shape
    group = heads // kf.shape[1]
    vh = values_for_heads(v, heads)
    vis = visible(q_seq, kv_seq, heads, causal=causal, mask=mask, q_offset=q_offset)
    dv = vh.shape[-1]
    out = np.zeros((q_seq, heads, dv))
    hess = np.zeros((q_seq, heads, dv, dv))
    params = {**params, "heads": heads}
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            pos = np.arange(kv_seq)[row]
            w, curv = _row_weights(
                family,
                params,
                x[h, i, row],
                h,
                q_offset + i,
                pos,
                qf[i, h],
                kf[row, h // group],
                kv_seq,
            )
            vals = vh[h, row]
            out[i, h] = w @ vals
            if family in ("sigmoid", "relu2"):  # a sum: Hessian sum_a F''_a v v^T
                hess[i, h] = np.einsum("a,ai,aj->ij", curv, vals, vals)
            else:  # a distribution (sinks and the rest of the stick carry the value 0)
                second = np.einsum("a,ai,aj->ij", w, vals, vals)
                hess[i, h] = curv * (second - np.outer(out[i, h], out[i, h]))
    return out, hess


def rules_visible(
    q_pos,
    k_pos,
    heads,
    *,
    causal=False,
    window=None,
    chunk=None,
    prefix=None,
    q_segments=None,
    kv_segments=None,
    mask_mod=None,
    batch=0,
):
    """Boolean [heads, q_seq, kv_seq] of the masking rules, pair by pair: query position
    q_pos[i] sees key position k_pos[a] by position (causal, a (left, right) window, the
    same chunk; all waived below `prefix`), within its segment, and where `mask_mod(batch, h,
    i, j)` says so."""
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    vis = np.ones((heads, len(q_pos), len(k_pos)), dtype=bool)
    for i, qi in enumerate(q_pos):
        for a, kj in enumerate(k_pos):
            by_position = True
            if causal:
                by_position &= kj <= qi
            if window is not None:
                by_position &= qi - window[0] <= kj <= qi + window[1]
            if chunk is not None:
                by_position &= qi // chunk == kj // chunk
            if prefix is not None and kj < prefix:
                by_position = True
            seen = by_position
            if q_segments is not None:
                seen &= q_segments[i] == kv_segments[a]
            for h in range(heads):
                vis[h, i, a] = seen and (mask_mod is None or bool(mask_mod(batch, h, qi, kj)))
    return vis


# ---------------------------------------------------------------------------------------------
# Composite energies, from their papers' formulas
# ---------------------------------------------------------------------------------------------


def _distribution_moments(p, vals):
    """Mean and covariance of the values `vals[n, dv]` under weights `p[n]` summing to 1."""
    mean = p @ vals
    centred = vals - mean
    return mean, (p[:, None] * centred).T @ centred


def differential_attention(q, k, v, lam, *, scale=None, causal=False, mask=None, q_offset=0):
    """Differential attention (Ye et al., 2024): softmax(s q1.k1) v - lam softmax(s q2.k2) v
    with q = [q1 | q2], k = [k1 | k2] (halves of the last axis), `lam` a scalar or [heads];
    and the Hessian of F1 - lam F2, Cov_p1(v) - lam Cov_p2(v). The scale defaults to
    1/sqrt(qk) of the whole width. Rows that see no key give 0."""
    qf, kf = f64(q), f64(k)
    q_seq, heads, qk = qf.shape
    half = qk // 2
    s = 1.0 / np.sqrt(qk) if scale is None else scale
    x1 = logits(qf[..., :half], kf[..., :half], s)
    x2 = logits(qf[..., half:], kf[..., half:], s)
    lam = np.broadcast_to(np.asarray(lam, np.float64), (heads,))
    vh = values_for_heads(v, heads)
    vis = visible(q_seq, kf.shape[0], heads, causal=causal, mask=mask, q_offset=q_offset)
    dv = vh.shape[-1]
    out, hess = np.zeros((q_seq, heads, dv)), np.zeros((q_seq, heads, dv, dv))
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            if not row.any():
                continue
            parts = []
            for x in (x1[h, i, row], x2[h, i, row]):
                e = np.exp(x - x.max())
                parts.append(_distribution_moments(e / e.sum(), vh[h, row]))
            out[i, h] = parts[0][0] - lam[h] * parts[1][0]
            hess[i, h] = parts[0][1] - lam[h] * parts[1][1]
    return out, hess


def decayed_attention(q, k, v, c_q, c_k, *, scale=None, causal=False, mask=None, q_offset=0):
    """Softmax over the logits s q_i.k_j + c_q[i, h] - c_k[j, g(h)], and its covariance."""
    qf, kf = f64(q), f64(k)
    q_seq, heads, qk = qf.shape
    group = heads // kf.shape[1]
    s = 1.0 / np.sqrt(qk) if scale is None else scale
    x = logits(qf, kf, s)
    vh = values_for_heads(v, heads)
    vis = visible(q_seq, kf.shape[0], heads, causal=causal, mask=mask, q_offset=q_offset)
    dv = vh.shape[-1]
    out, hess = np.zeros((q_seq, heads, dv)), np.zeros((q_seq, heads, dv, dv))
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            if not row.any():
                continue
            y = x[h, i, row] + f64(c_q)[i, h] - f64(c_k)[row, h // group]
            e = np.exp(y - y.max())
            out[i, h], hess[i, h] = _distribution_moments(e / e.sum(), vh[h, row])
    return out, hess


def forgetting_attention(q, k, v, log_forget, *, scale=None, mask=None, q_offset=0):
    """Causal Forgetting-Transformer attention (Lin et al., 2025) from the gates themselves:
    query i (at position q_offset + i) weighs key j <= its position by
    exp(s q_i.k_j) prod_{l=j+1}^{i} f_l, i.e. the logit s q_i.k_j + sum_{l=j+1}^{i} log f_l,
    with `log_forget[kv_seq, kv_heads]` (one gate per key/value head). Returns
    (out [q_seq, heads, dv], Hessian)."""
    qf, kf, lf = f64(q), f64(k), f64(log_forget)
    q_seq, heads, qk = qf.shape
    kv_seq, kv_heads = lf.shape
    group = heads // kv_heads
    s = 1.0 / np.sqrt(qk) if scale is None else scale
    x = logits(qf, kf, s)
    for h in range(heads):
        for i in range(q_seq):
            at = q_offset + i
            for j in range(min(at + 1, kv_seq)):
                x[h, i, j] += sum(lf[m, h // group] for m in range(j + 1, at + 1))
    vh = values_for_heads(v, heads)
    vis = visible(q_seq, kv_seq, heads, causal=True, mask=mask, q_offset=q_offset)
    dv = vh.shape[-1]
    out, hess = np.zeros((q_seq, heads, dv)), np.zeros((q_seq, heads, dv, dv))
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            if row.any():
                e = np.exp(x[h, i, row] - x[h, i, row].max())
                out[i, h], hess[i, h] = _distribution_moments(e / e.sum(), vh[h, row])
    return out, hess


def softpick_attention(q, k, v, *, scale=None, causal=False, mask=None, q_offset=0):
    """Softpick (Zuhri et al., 2025): w_a = relu(e^x_a - 1) / sum_b |e^x_b - 1| over the
    visible keys (masked keys contribute nothing), and the Hessian in zeta of
    F = log(sum_{x>0} (e^x - 1) e^{zeta.v} + sum_{x<=0} (1 - e^x)): sum_a w_a v_a v_a^T - o o^T.
    A row whose weights are all 0 gives 0."""
    x = logits(q, k, scale)
    heads, q_seq, kv_seq = x.shape
    vh = values_for_heads(v, heads)
    vis = visible(q_seq, kv_seq, heads, causal=causal, mask=mask, q_offset=q_offset)
    dv = vh.shape[-1]
    out, hess = np.zeros((q_seq, heads, dv)), np.zeros((q_seq, heads, dv, dv))
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            e = np.exp(x[h, i, row]) - 1.0
            denom = np.abs(e).sum()
            if denom == 0:
                continue
            w = np.maximum(e, 0.0) / denom
            vals = vh[h, row]
            out[i, h] = w @ vals
            hess[i, h] = np.einsum("a,ai,aj->ij", w, vals, vals) - np.outer(out[i, h], out[i, h])
    return out, hess


# ---------------------------------------------------------------------------------------------
# Diagnostics: the entropy of each query's attention, the attention each key receives
# ---------------------------------------------------------------------------------------------


def attention_entropy(q, k, **kw):
    """-sum_a p_a log p_a of softmax attention, [q_seq, heads]; 0 where nothing is visible."""
    p = weights(q, k, **kw)
    safe = np.where(p > 0, p, 1.0)
    return -np.sum(p * np.log(safe), axis=-1).T


def received_attention(q, k, **kw):
    """sum_i p_{i,h,a} of softmax attention, [kv_seq, heads]."""
    return weights(q, k, **kw).sum(axis=1).T


def energy_diagnostics(family, params, q, k, *, causal=False, mask=None, q_offset=0):
    """(entropy [q_seq, heads], received attention [kv_seq, heads]) of the energy `family`, as
    treeattn defines them: received attention sums the weights each key gets; the entropy is
    Shannon's for softmax (with the sink as one more outcome), and the value of F - dF/dbeta
    (beta scaling the logits) for the others: sigmoid sum_a softplus(z_a) - sigmoid(z_a) x_a
    (z = x + b), linear log sum_a phi(q).phi(k_a) - 1, stick-breaking 0."""
    x = logits(q, k)
    qf, kf = f64(q), f64(k)
    heads, q_seq, kv_seq = x.shape
    group = heads // kf.shape[1]
    vis = visible(q_seq, kv_seq, heads, causal=causal, mask=mask, q_offset=q_offset)
    entropy = np.zeros((q_seq, heads))
    received = np.zeros((kv_seq, heads))
    params = {**params, "heads": heads}
    for h in range(heads):
        for i in range(q_seq):
            row = vis[h, i]
            pos = np.arange(kv_seq)[row]
            xr, kr = x[h, i, row], kf[row, h // group]
            w, _ = _row_weights(family, params, xr, h, q_offset + i, pos, qf[i, h], kr, kv_seq)
            received[row, h] += w
            if family in ("softmax", "sink"):
                parts = np.append(w, 1.0 - w.sum()) if family == "sink" else w
                parts = parts[parts > 0]
                entropy[i, h] = -np.sum(parts * np.log(parts))
            elif family == "sigmoid":
                b = -np.log(kv_seq) if params.get("bias") is None else params["bias"]
                z = xr + b
                softplus = np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z)))
                entropy[i, h] = np.sum(softplus - _sigmoid(z) * xr)
            elif family == "linear" and row.any():
                entropy[i, h] = np.log(np.sum(_phi(kr) @ _phi(qf[i, h]))) - 1.0
            elif family == "cosformer" and row.any():
                cos = np.cos(0.5 * np.pi * (q_offset + i - pos) / params["horizon"])
                total = np.sum((np.maximum(kr, 0.0) @ np.maximum(qf[i, h], 0.0)) * cos)
                entropy[i, h] = np.log(total) - 1.0 if total > 0 else -np.inf
    return entropy, received
