"""The small fused Triton kernels (kernels/triton_small.py) against the torch forms they replace: float32 in
(the same math, sums in another order: 1e-6 relative) and bf16 on the kernel path (within one bf16 rounding
of the output). Without a GPU they run under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from deltafin.kernels import cuda as kc  # noqa: E402
from deltafin.kernels import triton_small as S  # noqa: E402
from deltafin.models.base import rms_norm  # noqa: E402
from deltafin.models.kimi_k3 import attn_res_mix, mix_norm, situ_glu  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _rand(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEV)


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setenv("DELTAFIN_KERNELS", "triton" if DEV == "cuda" else "interpret")


@pytest.mark.parametrize("shape", [(1, 7168), (3, 512), (2, 5, 128)])
def test_rms_norm_matches_torch_form(shape):
    x, w = _rand(*shape, seed=1, scale=3.0), 1 + 0.1 * _rand(shape[-1], seed=2)
    ref = rms_norm(x, w, 1e-5)  # float32: the torch form
    assert _rel(S.rms_norm(x, w, 1e-5), ref) < 1e-6


@pytest.mark.parametrize("S_, T", [(1, 1), (4, 1), (9, 3)])
def test_mix_norm_matches_torch_form(S_, T):
    D = 1000  # not a power of two: the masked tail
    V = _rand(S_, T, D, seed=3) * _rand(S_, 1, 1, seed=4, scale=2.0)  # rows of different sizes
    wm, wn = 0.3 * _rand(D, seed=5), 1 + 0.1 * _rand(D, seed=6)
    ref = mix_norm(V[-1], list(V[:-1]), wm, wn, 1e-5)  # float32: the torch forms
    assert _rel(S.mix_norm(V, wm, wn, 1e-5, 1e-5), ref) < 1e-6


def test_situ_glu_matches_torch_form():
    g, u = _rand(3, 3000, seed=7, scale=8.0), _rand(3, 3000, seed=8, scale=40.0)  # both tanh saturate somewhere
    assert _rel(S.situ_glu(g, u, 4.0, 25.0), situ_glu(g, u, 4.0, 25.0)) < 1e-6


def test_bf16_kernel_path_dispatches_and_stays_within_bf16_rounding(kernel_path):
    kc.USED.clear()
    x, w = _rand(2, 7168, seed=9, scale=2.0).bfloat16(), 1 + 0.1 * _rand(7168, seed=10)
    V = _rand(5, 1, 7168, seed=11).bfloat16()
    wm = 0.3 * _rand(7168, seed=12)
    g, u = _rand(1, 3072, seed=13, scale=4.0).bfloat16(), _rand(1, 3072, seed=14, scale=4.0).bfloat16()
    out = {"rms": rms_norm(x, w, 1e-5), "mix": mix_norm(V[-1], list(V[:-1]), wm, w, 1e-5),
           "situ": situ_glu(g, u, 4.0, 25.0)}
    assert {"triton:rms_norm", "triton:mix_norm", "triton:situ_glu"} <= kc.USED
    xf = x.float()
    ref = {"rms": w * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5),
           "mix": rms_norm(attn_res_mix(V[-1].float(), [b.float() for b in V[:-1]], wm, 1e-5), w, 1e-5),
           "situ": situ_glu(g.float(), u.float(), 4.0, 25.0)}
    for k in out:
        assert out[k].dtype == torch.bfloat16
        assert _rel(out[k], ref[k]) < 8e-3, k
