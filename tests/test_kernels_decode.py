"""The one-token kernels of kernels/triton_decode.py (MLA's absorbed projections, the router in one launch)
against the torch forms they replace. Without a GPU they run under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from deltafin.kernels import cuda as kc  # noqa: E402
from deltafin.kernels import triton_decode as D  # noqa: E402
from deltafin.models import mla  # noqa: E402
from deltafin.models.common import ROUTER_RENORM_EPS, sigmoid_topk  # noqa: E402
from deltafin.quant import int8 as q8  # noqa: E402
from deltafin.quant.record import QTensor  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEV)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _kv_b(fmt: str, H: int, dn: int, dv: int, R: int) -> QTensor:
    w = _rand(H * (dn + dv), R, seed=3, scale=0.1)
    if fmt == "int8":
        q, s = q8.quantize(w)
        return QTensor("int8", tuple(w.shape), q, s).to(DEV)
    return QTensor("bf16", tuple(w.shape), w.bfloat16())


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize("R", [64, 96])
def test_absorbed_projections_match_the_torch_form(fmt, R):
    """float32 in: the products are exact either way, only the sums' order differs (within 1e-6); a latent
    width that is not a power of two exercises the masks."""
    H, dn, dv = 3, 32, 16
    w = _kv_b(fmt, H, dn, dv, R)
    wd = w.data.float() * w.scale.float()[:, None] if fmt == "int8" else w.data.float()
    wh = wd.view(H, dn + dv, R)
    qn, o = _rand(1, H, dn, seed=1), _rand(1, H, R, seed=2)
    s = w.scale.float() if fmt == "int8" else None
    ref_q = torch.einsum("thd,hdr->thr", qn.double(), wh[:, :dn].double())
    ref_o = torch.einsum("thr,hvr->thv", o.double(), wh[:, dn:].double()).reshape(1, H * dv)
    assert _rel(D.mla_absorb_q(qn, w.data, s, dn, dv), ref_q) < 1e-6
    assert _rel(D.mla_absorb_out(o, w.data, s, dn, dv), ref_o) < 1e-6


def test_attend_absorbed_on_the_kernel_path_stays_within_bf16_rounding(monkeypatch):
    """One bf16 decode token through the kernels against the torch form on the same inputs (which rounds kv_b to
    bf16 first): within a few bf16 roundings; the kernels ran."""
    H, dn, dv, r, R, S = 4, 32, 32, 16, 64, 9
    w = _kv_b("int8", H, dn, dv, R)
    qn, qr = _rand(1, H, dn, seed=4).bfloat16(), _rand(1, H, r, seed=5).bfloat16()
    rows = _rand(S, R + r, seed=6).bfloat16()
    monkeypatch.setenv("DELTAFIN_KERNELS", "torch")
    want = mla.attend_absorbed(qn.float(), qr.float(), rows.float(), w, dn, dv, 0.1, S - 1)
    monkeypatch.setenv("DELTAFIN_KERNELS", "triton" if DEV == "cuda" else "interpret")
    kc.USED.clear()
    got = mla.attend_absorbed(qn, qr, rows, w, dn, dv, 0.1, S - 1)
    assert {"triton:mla_absorb_q", "triton:mla_absorb_out"} <= kc.USED
    assert got.dtype == torch.bfloat16 and got.shape == (1, H * dv)
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("pos,r", [(0, 16), (37, 16), (255, 16), (256, 8), (699, 16)])
def test_attention_over_the_latent_rows_matches_the_softmax(pos, r):
    """One token over a buffer of 700 rows (three splits; 20 heads, not a multiple of a head group; a rope part
    narrower than a dot, padded), its
    position as a device tensor (the rows past it masked) or an int over the rows up to it: both the float64
    softmax within bf16 rounding (the probabilities are rounded to bf16 before they meet the values, as the
    torch form does), the same bits on a second call."""
    H, R, C = 20, 64, 700
    ql, qr = _rand(1, H, R, seed=14).bfloat16(), _rand(1, H, r, seed=15).bfloat16()
    rows = _rand(C, R + r, seed=16).bfloat16()
    q = torch.cat((ql, qr), -1).double()[0]
    ref = (torch.softmax(q @ rows[:pos + 1].double().T * 0.1, -1) @ rows[:pos + 1, :R].double())[None]
    at = D.mla_attend(ql, qr, rows, torch.tensor([pos], device=DEV), 0.1)
    assert at.shape == (1, H, R) and at.dtype == torch.bfloat16
    assert _rel(at, ref) < 1e-2
    assert torch.equal(at, D.mla_attend(ql, qr, rows, torch.tensor([pos], device=DEV), 0.1))
    upto = D.mla_attend(ql, qr, rows[:pos + 1], pos, 0.1)
    assert _rel(upto, ref) < 1e-2


@pytest.mark.parametrize("bias,renorm,scaling", [(True, True, 2.5), (False, False, 1.0), (True, False, 0.7)])
def test_router_picks_and_weighs_as_sigmoid_topk(bias, renorm, scaling):
    """Two tokens, 100 experts (not a power of two), top 8: the same experts in the same order, the weights
    within float32 rounding (the logits' sums run in another order)."""
    T, E, Dm, k = 2, 100, 300, 8
    x = _rand(T, Dm, seed=7).bfloat16()
    w = _rand(E, Dm, seed=8, scale=0.05).bfloat16()
    b = _rand(E, seed=9, scale=0.05) if bias else None
    ids, wts = D.router_topk(x, w, b, k, renorm, scaling, ROUTER_RENORM_EPS)
    rid, rwt = sigmoid_topk(x.float() @ w.float().T, b, k, renorm, scaling)
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32
    assert torch.equal(ids.cpu(), rid.cpu())
    torch.testing.assert_close(wts, rwt, rtol=1e-5, atol=1e-7)


def test_router_breaks_ties_to_the_lower_index_and_is_repeatable():
    """Experts 3 and 7 with the same row score alike: 3 comes first, and every call gives the same bits."""
    E, Dm, k = 16, 64, 4
    w = _rand(E, Dm, seed=10, scale=0.01)
    w[3] = w[7] = 0.5
    x = _rand(1, Dm, seed=11).abs().bfloat16()
    w = w.bfloat16()
    ids, wts = D.router_topk(x, w, None, k, True, 1.0, ROUTER_RENORM_EPS)
    assert ids[0, :2].tolist() == [3, 7]
    again = D.router_topk(x, w, None, k, True, 1.0, ROUTER_RENORM_EPS)
    assert torch.equal(ids, again[0]) and torch.equal(wts, again[1])


def test_router_hook_declines_what_the_kernel_does_not_take(monkeypatch):
    monkeypatch.setenv("DELTAFIN_KERNELS", "triton" if DEV == "cuda" else "interpret")
    x = _rand(1, 64, seed=12).bfloat16()
    w = QTensor("bf16", (16, 64), _rand(16, 64, seed=13).bfloat16())
    assert kc.router_topk(x, w, None, 4, True, 1.0, ROUTER_RENORM_EPS) is not None
    assert kc.router_topk(x.float(), w, None, 4, True, 1.0, ROUTER_RENORM_EPS) is None  # float32: the reference
    assert kc.router_topk(x.expand(5, 64), w, None, 4, True, 1.0, ROUTER_RENORM_EPS) is None  # prefill
    assert kc.router_topk(x, w, None, 3, True, 1.0, ROUTER_RENORM_EPS) is None  # k not a power of two
