"""Kimi Delta Attention (KDA): the gated delta rule with per-channel decay, as Kimi K3 uses it.

Pure math on float32 tensors (../shared/specs/KIMI_K3.md §3.1). Letters: T tokens, H heads,
K key width, V value width, C channels (H*K), W conv taps, c chunk length.

State per head is S [K, V]. Per token, in this order (§3.1 step 7):
S <- Diag(alpha) S;  u = S^T k;  S <- S + beta k (v - u)^T;  o = S^T q (read from the updated state).
``recurrent`` runs that literally; ``chunked`` computes the same thing in the WY form for prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # §3.1 step 4 (fla l2norm): x / sqrt(sum(x^2) + 1e-6), eps added to the sum, not the mean
CHUNK = 64  # §3.1 chunked prefill: fla naive_chunk_kda uses 64-token chunks


@dataclass(slots=True)
class KDAState:
    """One sequence's KDA layer state; neither part grows with the context."""

    conv: torch.Tensor  # [3, W-1, C] the last W-1 pre-conv inputs of q, k and v (fp32)
    S: torch.Tensor  # [H, K, V] recurrent state (fp32)

    @classmethod
    def zeros(cls, H: int, K: int, V: int, W: int, device: torch.device | str = "cpu") -> KDAState:
        f32 = torch.float32
        return cls(torch.zeros(3, W - 1, H * K, dtype=f32, device=device), torch.zeros(H, K, V, dtype=f32, device=device))


def short_conv(x: torch.Tensor, w: torch.Tensor, hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over time, then SiLU (§3.1 step 2). The last tap multiplies the current token.

    x [T, C], w [C, W], hist [W-1, C] (earlier inputs, zeros before the first token).
    Returns (y [T, C], new hist [W-1, C]).
    """
    T = x.shape[0]
    xx = torch.cat([hist, x], 0)  # [W-1+T, C]
    win = xx.unfold(0, w.shape[-1], 1)  # [T, C, W]: window j holds token t-(W-1)+j
    return F.silu((win * w).sum(-1)), xx[T:].clone()


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def lower_bound_gate(z: torch.Tensor, A_log: torch.Tensor, bound: float) -> torch.Tensor:
    """Log-decay a = bound * sigmoid(exp(A_log[h]) * z) in (bound, 0) (§3.1 step 5; not a clamp).

    z [T, H, K] (already + dt_bias), A_log [H] (one per head, broadcast over the K channels).
    """
    return bound * torch.sigmoid(A_log.exp()[:, None] * z)


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one token at a time.

    q, k [T, H, K] (normalised, q scaled), v [T, H, V], g [T, H, K] log-decay, beta [T, H], S [H, K, V].
    Returns (o [T, H, V], final S).
    """
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)  # decay the rows
        u = (k[t].unsqueeze(1) @ S).squeeze(1)  # [H, V]  S^T k
        S = S + (beta[t, :, None] * k[t]).unsqueeze(-1) * (v[t] - u).unsqueeze(1)
        out.append((q[t].unsqueeze(1) @ S).squeeze(1))  # [H, V]  S^T q
    return torch.stack(out), S


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`recurrent`, computed chunk by chunk in the WY form (§3.1, chunked prefill)."""
    outs = []
    for c0 in range(0, q.shape[0], chunk):
        sl = slice(c0, c0 + chunk)
        o, S = _chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], S)
        outs.append(o)
    return torch.cat(outs), S


def _chunk(q, k, v, g, beta, S) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk. Only decay differences Gamma_r - Gamma_s with s <= r are exponentiated, so nothing overflows."""
    q, k, v, g = (t.transpose(0, 1) for t in (q, k, v, g))  # [H, c, *]
    b = beta.transpose(0, 1).unsqueeze(-1)  # [H, c, 1]
    c = q.shape[1]
    G = g.cumsum(1)  # [H, c, K] cumulative log-decay Gamma_r
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # s <= r
    diff = G.unsqueeze(2) - G.unsqueeze(1)  # [H, r, s, K]
    decay = diff.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()  # e^(Gamma_r - Gamma_s), 0 above
    Lmat = b * torch.einsum("hrk,hsk,hrsk->hrs", k, k, decay).tril(-1)  # [H, c, c] strictly lower
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    # (I + L) [W | U] = diag(beta) [e^Gamma * K | V]  ->  W = M (e^Gamma * K), U = M V
    rhs = b * torch.cat([k * G.exp(), v], -1)
    WU = torch.linalg.solve_triangular(eye + Lmat, rhs, upper=False, unitriangular=True)
    W, U = WU.split([k.shape[-1], v.shape[-1]], -1)
    Vn = U - W @ S  # [H, c, V] the effective new values V'
    P = torch.einsum("hrk,hsk,hrsk->hrs", q, k, decay)  # [H, c, c] lower incl. diagonal
    o = (q * G.exp()) @ S + P @ Vn  # [H, c, V]
    last = G[:, -1:]  # [H, 1, K]
    S = S * last.transpose(1, 2).exp() + (k * (last - G).exp()).transpose(1, 2) @ Vn
    return o.transpose(0, 1), S
