"""Kimi K3's KDA in MLX ops (deltafin/mlx/kda.py): the decode step and the chunked prefill against Deltafin's
recurrence reference (``models.kda.recurrent``, float32 torch) on random normalised inputs with strong and weak
decays, a non-zero incoming state, and lengths that end mid-chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltafin.kernels import mlx as km
from deltafin.models import kda

pytestmark = pytest.mark.skipif(bool(km.available()), reason=km.available() or "mlx present")


def _inputs(T: int, H: int = 3, K: int = 16, V: int = 8, seed: int = 0, lo: float = -5.0):
    gen = torch.Generator().manual_seed(seed)
    q = kda.l2norm(torch.randn(T, H, K, generator=gen)) * K**-0.5
    k = kda.l2norm(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, H, V, generator=gen)
    g = lo * torch.rand(T, H, K, generator=gen)  # log-decays in (lo, 0)
    beta = torch.rand(T, H, generator=gen)
    S = torch.randn(H, K, V, generator=gen) * 0.5
    return q, k, v, g, beta, S


def _mx(*ts):
    m = km.mx()
    return [m.array(t.numpy()) for t in ts]


@pytest.mark.parametrize("lo", [-0.05, -5.0])
def test_decode_step_matches_the_recurrence(lo):
    from deltafin.mlx import kda as mk

    ins = _inputs(7, lo=lo)
    o_ref, S_ref = kda.recurrent(*ins)
    o, S = mk.recurrent(*_mx(*ins))
    assert np.allclose(np.array(o), o_ref.numpy(), atol=1e-5, rtol=1e-4)
    assert np.allclose(np.array(S), S_ref.numpy(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("T,chunk", [(64, 64), (100, 64), (37, 16)])
@pytest.mark.parametrize("lo", [-0.05, -5.0])
def test_chunked_prefill_matches_the_recurrence(T, chunk, lo):
    from deltafin.mlx import kda as mk

    ins = _inputs(T, seed=T, lo=lo)
    o_ref, S_ref = kda.recurrent(*ins)
    o, S = mk.chunked(*_mx(*ins), chunk=chunk)
    scale = o_ref.abs().max().item()
    assert np.abs(np.array(o) - o_ref.numpy()).max() <= 1e-4 * scale
    assert np.abs(np.array(S) - S_ref.numpy()).max() <= 1e-4 * S_ref.abs().max().item()
    # then decode on from the chunked state, as the engine does after a prefill
    nxt = _inputs(3, seed=T + 1, lo=lo)
    o2_ref, _ = kda.recurrent(*nxt[:5], S_ref)
    o2, _ = mk.recurrent(*_mx(*nxt[:5]), S)
    assert np.abs(np.array(o2) - o2_ref.numpy()).max() <= 1e-4 * o2_ref.abs().max().item()
