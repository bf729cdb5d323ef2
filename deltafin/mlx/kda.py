"""Kimi Delta Attention's recurrence in MLX ops: the decode step and the chunked prefill (WY form), the same
contracts as ``models.kda.recurrent`` and ``models.kda.chunked_reference`` (its float32 reference), and the short
conv and L2 norm before it, for the MLX engine's Kimi K3 KDA and Qwen3-Next Gated DeltaNet layers. Letters:
T tokens, H heads, K key width, V value width, c chunk length.

Per token (../shared/specs/KIMI_K3.md §3.1 step 7): S <- Diag(alpha) S; u = S^T k; S <- S + beta k (v - u)^T;
o = S^T q. A chunk: with Gamma the cumulative log-decay, L = beta_r k_r.k_s e^(Gamma_r - Gamma_s) (s < r) and
P = q_r.k_s e^(Gamma_r - Gamma_s) (s <= r), (I + L) [W | U] = diag(beta) [e^Gamma k | v] by forward substitution,
V' = U - W S, o = (q e^Gamma) S + P V', S <- Diag(e^Gamma_c) S + (k e^(Gamma_c - Gamma))^T V'. Only differences
Gamma_r - Gamma_s with s <= r are exponentiated (masked to -inf elsewhere), so nothing overflows.
"""

from __future__ import annotations

from deltafin.kernels import mlx as km
from deltafin.models.kda import L2_EPS

CHUNK = 64


def recurrent(q, k, v, g, beta, S):
    """q, k [T, H, K], v [T, H, V], g [T, H, K] log-decay, beta [T, H], S [H, K, V] -> (o [T, H, V], S)."""
    m = km.mx()
    out = []
    for t in range(q.shape[0]):
        S = S * m.exp(g[t])[:, :, None]  # decay the rows
        u = (k[t][:, None, :] @ S)[:, 0]  # [H, V]
        S = S + (beta[t][:, None] * k[t])[:, :, None] * (v[t] - u)[:, None, :]
        out.append((q[t][:, None, :] @ S)[:, 0])
    return m.stack(out), S


def chunked(q, k, v, g, beta, S, chunk: int = CHUNK):
    """The same as ``recurrent`` in chunks of ``chunk`` tokens (the last may be shorter)."""
    m = km.mx()
    outs = []
    for c0 in range(0, q.shape[0], chunk):
        sl = slice(c0, c0 + chunk)
        o, S = _chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], S)
        outs.append(o)
    return m.concatenate(outs), S


def _unit_lower_solve(L, rhs):
    """X with (I + L) X = rhs, L [H, c, c] strictly lower: forward substitution, one row at a time."""
    m = km.mx()
    rows = [rhs[:, 0]]
    for r in range(1, L.shape[1]):
        done = m.stack(rows, axis=1)  # [H, r, n]
        rows.append(rhs[:, r] - (L[:, r : r + 1, :r] @ done)[:, 0])
    return m.stack(rows, axis=1)


def _chunk(q, k, v, g, beta, S):
    m = km.mx()
    q, k, v, g = (m.transpose(t, (1, 0, 2)) for t in (q, k, v, g))  # [H, c, *]
    b = m.transpose(beta, (1, 0))[:, :, None]  # [H, c, 1]
    c, K = q.shape[1], q.shape[2]
    G = m.cumsum(g, axis=1)  # [H, c, K]
    causal = m.tril(m.ones((c, c), dtype=m.bool_))
    diff = G[:, :, None, :] - G[:, None, :, :]  # [H, r, s, K]
    decay = m.exp(m.where(causal[None, :, :, None], diff, -float("inf")))  # 0 above the diagonal
    Lmat = b * m.tril((k[:, :, None, :] * k[:, None, :, :] * decay).sum(-1), -1)  # [H, c, c]
    WU = _unit_lower_solve(Lmat, b * m.concatenate([k * m.exp(G), v], axis=-1))
    W, U = WU[..., :K], WU[..., K:]
    Vn = U - W @ S  # [H, c, V]
    P = (q[:, :, None, :] * k[:, None, :, :] * decay).sum(-1)  # [H, c, c]
    o = (q * m.exp(G)) @ S + P @ Vn
    last = G[:, -1:]  # [H, 1, K]
    S = S * m.exp(m.transpose(last, (0, 2, 1))) + m.transpose(k * m.exp(last - G), (0, 2, 1)) @ Vn
    return m.transpose(o, (1, 0, 2)), S


def short_conv(x, w, hist):
    """Causal depthwise conv over time then SiLU (§3.1 step 2; ``models.kda.short_conv``): x [T, C], w [C, W],
    hist [W-1, C] -> (y, hist)."""
    m = km.mx()
    T, W = x.shape[0], w.shape[1]
    xx = m.concatenate([hist, x])  # [W-1+T, C]
    y = sum(xx[j : j + T] * w[:, j] for j in range(W))  # tap W-1 multiplies the current token
    return y * m.sigmoid(y), xx[T:]


def l2norm(x):
    m = km.mx()
    return x / m.sqrt((x * x).sum(-1, keepdims=True) + L2_EPS)

