"""KDA's Triton kernel (in-chunk products) against the torch form and the recurrence.

Without a GPU the kernel runs under Triton's interpreter (small shapes, a few seconds); with one (``-m gpu``)
it runs compiled at Kimi K3's widths. Tolerance as in test_kda.py: float32 products in both, only the
summation order differs, so 2e-5 of max(1, |reference|) holds with a wide margin.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from deltafin.kernels import cuda as kc  # noqa: E402
from deltafin.kernels import triton_kda  # noqa: E402
from deltafin.models import kda  # noqa: E402
from tests.test_kda import F32_TOL, _close, _inputs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shift", [0.0, 8.0])  # 8: decays at the gate's lower bound (largest in-block factors)
def test_products_kernel_matches_torch(shift):
    T, H, K, c, sub = 128, 2, 32, 64, 16
    q, k, v, g, beta, S = (t.float() for t in _inputs(T, H, K, K, seed=14, shift=shift))
    N = T // c
    qb, kb, gb = (kda._blocks(t, N, c).to(DEV) for t in (q, k, g))
    b = kda._blocks(beta, N, c).unsqueeze(-1).to(DEV)
    G = gb.cumsum(2)
    want = kda._products(qb, kb, G, b, sub)
    got = triton_kda.kda_products(qb, kb, G, b, sub, kda.EXP_LIMIT)
    for a, w in zip(got, want, strict=True):
        assert torch.isfinite(a).all() and (a - w).abs().max() <= 1e-6 * max(1.0, w.abs().max().item())


def test_chunked_with_the_kernel_matches_recurrence():
    x = [t.float().to(DEV) for t in _inputs(150, 2, 16, 16, seed=15, shift=4.0)]
    want = kda.recurrent(*(t.cpu() for t in x))
    got = kda.chunked(*x, chunk=32, gate_bound=-5.0, products=kc.kda_products)
    assert "triton:kda_products" in kc.USED
    _close([t.cpu() for t in got], want, F32_TOL)


def test_dispatch_declines_shapes_the_kernel_cannot_tile():
    x = _inputs(40, 1, 8, 16, seed=12, dtype=torch.float32)
    _close(kda.chunked(*x, products=kc.kda_products), kda.recurrent(*x), F32_TOL)
    assert kc.kda_products(*(torch.zeros(1, 1, 64, 16),) * 3, torch.zeros(1, 1, 64, 1), sub=8) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_products_kernel_at_k3_widths():
    x = [t.float().cuda() for t in _inputs(1000, 96, 128, 128, seed=13, dtype=torch.float32)]
    _close(kda.chunked(*x, products=kc.kda_products), kda.chunked(*x), F32_TOL)
