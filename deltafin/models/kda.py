"""Kimi Delta Attention (KDA): the gated delta rule with per-channel decay, as Kimi K3 uses it.

Pure math on float32 tensors (../shared/specs/KIMI_K3.md §3.1). Letters: T tokens, H heads,
K key width, V value width, C channels (H*K), W conv taps, c chunk length.

State per head is S [K, V]. Per token, in this order (§3.1 step 7):
S <- Diag(alpha) S;  u = S^T k;  S <- S + beta k (v - u)^T;  o = S^T q (read from the updated state).
``recurrent`` runs that literally; ``chunked`` computes the same thing in the WY form for prefill, every
chunk's state-independent part at once, and ``chunked_reference`` is that form one chunk at a time with the
full [c, c, K] decay tensor (slow, the float32 reference in tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltafin.kernels import EXP_LIMIT, exp_

L2_EPS = 1e-6  # §3.1 step 4 (fla l2norm): x / sqrt(sum(x^2) + 1e-6), eps added to the sum, not the mean
CHUNK = 64  # §3.1 chunked prefill: fla naive_chunk_kda uses 64-token chunks
SUB = 16  # sub-block of a chunk inside which decays are factored through one reference (see _intra)
ProductsFn = Callable[..., tuple[torch.Tensor, torch.Tensor] | None]  # a kernel backend's kda_products
SEGMENT = 8192  # tokens whose chunks are batched at once (bounds the temporaries: ~12 x T*H*K floats)


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
    gate_bound: float | None = None,
    products: ProductsFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`recurrent`, in the WY form with every chunk's S-independent part computed at once.

    Only the state update passes from chunk to chunk (two batched matmuls each). ``gate_bound`` is a lower
    bound of g (the config's gate_lower_bound); None takes min(g), which costs one device sync. ``products``
    may stand in for :func:`_products` (a fused kernel of the same contract; it returns None where it does not
    apply, and the torch form runs).
    """
    T, H, K = q.shape
    if T == 0:
        return v.new_zeros(0, H, v.shape[-1]), S
    lo = min(float(g.min()), 0.0) if gate_bound is None else gate_bound
    sub = sub_block(chunk, lo)
    seg = max(chunk, SEGMENT // chunk * chunk)
    outs = []
    for t0 in range(0, T, seg):
        sl = slice(t0, t0 + seg)
        o, S = _segment(q[sl], k[sl], v[sl], g[sl], beta[sl], S, chunk, sub, products)
        outs.append(o)
    return torch.cat(outs), S


def sub_block(chunk: int, lo: float) -> int:
    """Sub-block length for the factored decays: the largest divisor of chunk (at most SUB) whose in-block
    exponent range (sub-1) * |lo| stays within EXP_LIMIT, so no factor over- or underflows float32."""
    return next(s for s in range(min(SUB, chunk), 0, -1) if chunk % s == 0 and (s - 1) * -lo <= EXP_LIMIT)


def chunked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The WY form one chunk at a time with the full [c, c, K] decay tensor: slow, kept as the reference."""
    outs = []
    for c0 in range(0, q.shape[0], chunk):
        sl = slice(c0, c0 + chunk)
        o, S = _chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], S)
        outs.append(o)
    return torch.cat(outs), S


def _blocks(x: torch.Tensor, N: int, c: int) -> torch.Tensor:
    """[T, H, *] -> [N, H, c, *], zero-padded to N*c tokens (a zero k, v, beta and g leaves S unchanged)."""
    if N * c > x.shape[0]:
        x = F.pad(x, [0, 0] * (x.dim() - 1) + [0, N * c - x.shape[0]])
    return x.reshape(N, c, *x.shape[1:]).transpose(1, 2).contiguous()


def _segment(q, k, v, g, beta, S, c: int, sub: int, products) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    N = -(-T // c)
    q, k, v, g = (_blocks(x, N, c) for x in (q, k, v, g))  # [N, H, c, *]
    b = _blocks(beta, N, c).unsqueeze(-1)  # [N, H, c, 1]
    G = g.cumsum(2)  # [N, H, c, K] cumulative log-decay Gamma_r within the chunk
    eG = exp_(G.clone())  # in (0, 1]; an underflow to 0 stands for a decay below e^-87, negligible beside 1
    LP = products(q, k, G, b, sub) if products is not None else None
    L, P = LP if LP is not None else _products(q, k, G, b, sub)
    M = unit_lower_inverse(L, sub) * b.transpose(-1, -2)  # (I + L)^-1 diag(beta)
    W, U = M @ (k * eG), M @ v  # the WY factors
    last = G[:, :, -1:]  # [N, H, 1, K]
    kd = (k * exp_(last - G)).transpose(-1, -2)  # [N, H, K, c]
    decay = exp_(last.transpose(-1, -2).clone())  # [N, H, K, 1]
    S_in, Vn = _states(W, U, kd, decay, S)
    o = torch.baddbmm((P @ Vn).flatten(0, 1), (q * eG).flatten(0, 1), S_in[:N].flatten(0, 1))
    return o.view(N, H, c, -1).transpose(1, 2).reshape(N * c, H, -1)[:T], S_in[N].clone()


def _products(q, k, G, b, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L = beta_r k_r.k_s e^(Gamma_r - Gamma_s) for s < r, and P = q_r.k_s e^(Gamma_r - Gamma_s) for s <= r,
    zero elsewhere: [N, H, c, c] each (q, k, G [N, H, c, K], b [N, H, c, 1])."""
    Akk, Aqk = _intra(q, k, G, sub)
    return (b * Akk).tril(-1), Aqk.tril()


def _intra(q, k, G, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k_r.k_s and q_r.k_s weighted by e^(Gamma_r - Gamma_s) for s <= r, every chunk and head: [N, H, c, c]
    each (entries above the diagonal are junk, masked by the caller).

    Rows of sub-block i use the reference Gamma_f (f its first row): e^(Gamma_r - Gamma_s) =
    e^(Gamma_r - Gamma_f) * e^(Gamma_f - Gamma_s). With g >= lo per token the first factor lies in
    [e^(-(sub-1)|lo|), 1]; the second in (0, 1] for s before the sub-block and in [1, e^((sub-1)|lo|)]
    inside it: within e^+-EXP_LIMIT by the choice of sub, so nothing overflows, and a factor that
    underflows stands for a product below e^-87. Columns after the sub-block are never formed.
    """
    N, H, c, K = k.shape
    A = k.new_zeros(N, H, c // sub, 2 * sub, c)
    for i in range(c // sub):
        rows, cols = slice(i * sub, (i + 1) * sub), slice(0, (i + 1) * sub)
        ref = G[:, :, i * sub : i * sub + 1]  # [N, H, 1, K]
        e = exp_(G[:, :, rows] - ref)
        left = torch.cat([k[:, :, rows] * e, q[:, :, rows] * e], 2)  # [N, H, 2sub, K]
        right = exp_(ref - G[:, :, cols]).mul_(k[:, :, cols])  # [N, H, (i+1)sub, K]
        A[:, :, i, :, cols] = left @ right.transpose(-1, -2)
    return A[:, :, :, :sub].reshape(N, H, c, c), A[:, :, :, sub:].reshape(N, H, c, c)


def unit_lower_inverse(L: torch.Tensor, sub: int) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., c, c]: forward substitution inside the sub x sub
    diagonal blocks (all at once), then block forward substitution across them (stable like a triangular
    solve; no powers of L)."""
    c = L.shape[-1]
    n = c // sub
    Ln = -L
    X = torch.zeros_like(L)
    blocks = torch.diagonal(X.unflatten(-1, (n, sub)).unflatten(-3, (n, sub)), dim1=-4, dim2=-2)  # view
    diag = torch.diagonal(Ln.unflatten(-1, (n, sub)).unflatten(-3, (n, sub)), dim1=-4, dim2=-2)
    blocks.copy_(_unit_lower_inverse_small(diag.movedim(-1, -3).contiguous()).movedim(-3, -1))
    for i in range(1, n):  # X[i, :i] = X[i, i] (-L[i, :i]) X[:i, :i]
        r, p = slice(i * sub, (i + 1) * sub), slice(0, i * sub)
        X[..., r, p] = X[..., r, r] @ (Ln[..., r, p] @ X[..., p, p])
    return X


def _unit_lower_inverse_small(Ln: torch.Tensor) -> torch.Tensor:
    """(I - Ln)^-1 for strictly lower-triangular -Ln [..., s, s], row by row."""
    s = Ln.shape[-1]
    X = torch.eye(s, dtype=Ln.dtype, device=Ln.device).expand(Ln.shape).clone()
    for r in range(1, s):  # row r of the inverse: e_r - L[r, :r] X[:r, :r]
        X[..., r, :r] = (Ln[..., r : r + 1, :r] @ X[..., :r, :r]).squeeze(-2)
    return X


def _states(W, U, kd, decay, S) -> tuple[torch.Tensor, torch.Tensor]:
    """The one sequential part: V'_n = U_n - W_n S_n; S_n+1 = Diag(decay_n) S_n + kd_n V'_n.
    Returns every chunk's incoming state S_in [N+1, H, K, V] (the last is the final state) and V' [N, H, c, V].
    Three kernels per chunk, in place on views unbound once (the loop is launch-bound on a GPU)."""
    N = W.shape[0]
    S_in = S.new_empty(N + 1, *S.shape)
    S_in[0] = S
    Vn = U.clone()
    Ss, Vs, Ws, kds, ds = S_in.unbind(0), Vn.unbind(0), W.unbind(0), kd.unbind(0), decay.unbind(0)
    for n in range(N):
        Vs[n].baddbmm_(Ws[n], Ss[n], alpha=-1)
        torch.mul(Ss[n], ds[n], out=Ss[n + 1]).baddbmm_(kds[n], Vs[n])
    return S_in, Vn


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
