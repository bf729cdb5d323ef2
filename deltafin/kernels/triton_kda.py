"""Chunked KDA prefill in Triton: the in-chunk products in one pass.

``kda_products(q, k, G, b, sub)`` computes ``kda._products`` (L and P of every chunk and head) reading q, k
and the cumulative log-decays once, where the torch form makes several passes over [c, K]-sized factors;
the decays are factored per sub-block exactly as ``kda._intra`` documents.

Measured on the H200 at K3 widths (``python -m deltafin.bench.kda --parts``, 4,096 tokens): 1.4 ms vs 2.9 ms
for the torch form, so the model uses it on the fast CUDA path. A state loop in one launch (a [K, BV] slice of
a head's state held in registers across chunks) measured slower than the torch loop (4.6 vs 3.9 ms) and was
not kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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

