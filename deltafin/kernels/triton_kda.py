"""Chunked KDA prefill in Triton: the in-chunk products in one pass, and the state loop in one launch.

``kda_products(q, k, G, b, sub)`` computes ``kda._products`` (L and P of every chunk and head) reading q, k
and the cumulative log-decays once, where the torch form makes several passes over [c, K]-sized factors;
the decays are factored per sub-block exactly as ``kda._intra`` documents.

``kda_states(W, U, kd, decay, S)`` computes, for chunks n = 0..N-1 of every head (the letters of
``models/kda.py``): V'_n = U_n - W_n S_n and S_n+1 = Diag(decay_n) S_n + kd_n V'_n, returning every incoming
state S_in [N+1, H, K, V] and V' [N, H, c, V], like ``kda._states`` (the torch loop, the reference). One
program holds a [K, BV] slice of one head's state in registers for the whole sequence, so the loop costs no
launches; products are full float32 (no TF32), so only the summation order differs from the torch loop.
Measured on the H200 at K3 widths (``python -m deltafin.bench.kda --parts``, 4,096 tokens): the products
kernel 1.4 ms vs 2.9 ms for the torch form, so the model uses it on the fast CUDA path; the state loop 4.6 ms
vs 3.9 ms for the torch loop, so the model keeps the torch loop (this kernel stays for tuning and tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafin.kernels.triton_tiles import INTERPRET

BV = 32  # value columns per program: 96 heads x 128 / 32 = 384 programs, ~3 per H200 multiprocessor
WARPS, STAGES = 4, 1  # one stage: the [c, K] tiles of W and kd (32 KB each) are not multi-buffered


@triton.jit
def _step(n, h, S, w_ptr, u_ptr, kd_ptr, d_ptr, sin_ptr, vn_ptr, H, oc, ok, kv, cv,
          C: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Chunk n of head h: store S_n, V'_n = U_n - W_n S_n, return S_n+1 = Diag(d_n) S_n + kd_n V'_n."""
    nh = n * H + h
    tl.store(sin_ptr + nh * K * V + kv, S)
    w = tl.load(w_ptr + nh * C * K + oc[:, None] * K + ok[None, :])  # [C, K]
    vn = tl.load(u_ptr + nh * C * V + cv) - tl.dot(w, S, input_precision="ieee")  # [C, BV]
    tl.store(vn_ptr + nh * C * V + cv, vn)
    kd = tl.load(kd_ptr + nh * C * K + oc[None, :] * K + ok[:, None])  # [K, C]: kd stored [C, K]
    d = tl.load(d_ptr + nh * K + ok)  # [K]
    return S * d[:, None] + tl.dot(kd, vn, input_precision="ieee")


@triton.jit
def _states_kernel(w_ptr, u_ptr, kd_ptr, d_ptr, s_ptr, sin_ptr, vn_ptr, N, H,
                   C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, INTERP: tl.constexpr):
    h, vb = tl.program_id(0), tl.program_id(1)
    oc, ok = tl.arange(0, C), tl.arange(0, K)
    ov = vb * BV + tl.arange(0, BV)
    kv = ok[:, None] * V + ov[None, :]  # [K, BV] offsets in one [K, V] state
    cv = oc[:, None] * V + ov[None, :]  # [C, BV] offsets in one [C, V] block
    S = tl.load(s_ptr + h * K * V + kv)
    if INTERP:  # the interpreter cannot range() over a runtime scalar (numpy >= 2.4); same steps
        n = 0
        while n < N:
            S = _step(n, h, S, w_ptr, u_ptr, kd_ptr, d_ptr, sin_ptr, vn_ptr, H, oc, ok, kv, cv, C, K, V)
            n += 1
    else:
        for n in range(N):  # a for loop, so the compiler can prefetch the next chunk's W, U and kd
            S = _step(n, h, S, w_ptr, u_ptr, kd_ptr, d_ptr, sin_ptr, vn_ptr, H, oc, ok, kv, cv, C, K, V)
    tl.store(sin_ptr + (N * H + h) * K * V + kv, S)


@triton.jit
def _products_kernel(q_ptr, k_ptr, g_ptr, b_ptr, l_ptr, p_ptr,
                     C: tl.constexpr, K: tl.constexpr, SUB: tl.constexpr, LIMIT: tl.constexpr):
    """Row sub-block i of one (chunk, head): its [SUB, C] rows of L and P."""
    nh, i = tl.program_id(0), tl.program_id(1)
    ok, orow = tl.arange(0, K), i * SUB + tl.arange(0, SUB)
    base = nh * C * K
    rows = base + orow[:, None] * K + ok[None, :]
    ref = tl.load(g_ptr + base + i * SUB * K + ok)  # [K] Gamma at the sub-block's first row
    e = tl.exp(tl.load(g_ptr + rows) - ref[None, :])  # in [e^-(SUB-1)|lo|, 1]
    lk, lq = tl.load(k_ptr + rows) * e, tl.load(q_ptr + rows) * e
    beta = tl.load(b_ptr + nh * C + orow)
    for j in tl.static_range(C // SUB):
        ocol = j * SUB + tl.arange(0, SUB)
        out = nh * C * C + orow[:, None] * C + ocol[None, :]
        if j <= i:
            cols = base + ocol[:, None] * K + ok[None, :]
            # e^(ref - Gamma_s): <= 1 before the sub-block, <= e^((SUB-1)|lo|) inside it (the clamp never binds)
            r = tl.load(k_ptr + cols) * tl.exp(tl.minimum(ref[None, :] - tl.load(g_ptr + cols), LIMIT))
            rt = tl.trans(r)
            akk = tl.dot(lk, rt, input_precision="ieee")
            aqk = tl.dot(lq, rt, input_precision="ieee")
            tl.store(l_ptr + out, tl.where(orow[:, None] > ocol[None, :], akk * beta[:, None], 0.0))
            tl.store(p_ptr + out, tl.where(orow[:, None] >= ocol[None, :], aqk, 0.0))
        else:
            zero = tl.zeros((SUB, SUB), dtype=tl.float32)
            tl.store(l_ptr + out, zero)
            tl.store(p_ptr + out, zero)


def products_fit(C: int, K: int, sub: int) -> bool:
    return sub >= 16 and sub & (sub - 1) == 0 and C % sub == 0 and K >= 16 and K & (K - 1) == 0


def kda_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, b: torch.Tensor, sub: int,
                 limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, G [N, H, c, K], b [N, H, c, 1], float32 -> (L, P) [N, H, c, c] as ``kda._products``."""
    N, H, C, K = k.shape
    assert products_fit(C, K, sub) and all(t.dtype == torch.float32 for t in (q, k, G, b))
    L = k.new_empty(N, H, C, C)
    P = torch.empty_like(L)
    _products_kernel[(N * H, C // sub)](q.contiguous(), k.contiguous(), G.contiguous(), b.contiguous(), L, P,
                                        C=C, K=K, SUB=sub, LIMIT=limit, num_warps=4)
    return L, P


def fits(C: int, K: int, V: int, bv: int = BV) -> bool:
    """tl.dot needs power-of-two tiles of at least 16."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (C, K, min(bv, V))) and V % min(bv, V) == 0


def kda_states(W: torch.Tensor, U: torch.Tensor, kd: torch.Tensor, decay: torch.Tensor, S: torch.Tensor,
               bv: int = BV, warps: int = WARPS, stages: int = STAGES) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, H, c, K], U [N, H, c, V], kd [N, H, K, c], decay [N, H, K, 1], S [H, K, V], all float32."""
    N, H, C, K = W.shape
    V = U.shape[-1]
    bv = min(bv, V)
    assert fits(C, K, V, bv) and all(t.dtype == torch.float32 for t in (W, U, kd, decay, S))
    S_in = S.new_empty(N + 1, H, K, V)
    Vn = torch.empty_like(U)
    kd_rows = kd.transpose(-1, -2).contiguous()  # [N, H, c, K]: a no-op for kda's transposed view
    _states_kernel[(H, V // bv)](W.contiguous(), U.contiguous(), kd_rows, decay.reshape(N, H, K).contiguous(),
                                 S.contiguous(), S_in, Vn, N, H, C=C, K=K, V=V, BV=bv, INTERP=INTERPRET,
                                 num_warps=warps, num_stages=stages)
    return S_in, Vn
