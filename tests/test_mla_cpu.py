"""MLA's one-token absorbed projections on the CPU's fast path: per-head int8 GEMVs (``cpu.int8_heads``) instead
of a float copy of kv_b_proj every step, against the torch form."""

from __future__ import annotations

import pytest
import torch

from deltafin import kernels
from deltafin.kernels import cpu
from deltafin.models import mla
from deltafin.quant import int8 as q8
from deltafin.quant.record import QTensor

pytestmark = pytest.mark.skipif(not cpu.i16_enabled(), reason="no int16-activation int8 kernels on this build")


def _kv_b(H: int, dn: int, dv: int, R: int, seed: int = 0) -> QTensor:
    w = torch.randn(H * (dn + dv), R, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, s = q8.quantize(w)
    return QTensor("int8", tuple(w.shape), q, s)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_int8_heads_is_each_heads_gemv():
    """Strided heads with their own scales, and unit scales: each head's rows times its own x, within the int16
    activations' rounding (1e-4 relative)."""
    g = torch.Generator().manual_seed(1)
    n, R, C = 5, 24, 160
    q = torch.randint(-127, 128, (n, R + 8, C), dtype=torch.int8, generator=g)[:, 4:4 + R]  # heads strided
    s = torch.rand(n, R + 3, generator=g)[:, :R] + 0.01
    x = torch.randn(n, C, generator=g)
    want = torch.einsum("nrc,nc->nr", q.double() * s.double()[..., None], x.double())
    assert _rel(cpu.int8_heads(x, q, s), want) < 1e-4
    assert _rel(cpu.int8_heads(x, q.contiguous(), None), torch.einsum("nrc,nc->nr", q.double(), x.double())) < 1e-4


@pytest.mark.parametrize("pos", [0, 9])
def test_attend_absorbed_on_the_fast_path_matches_the_torch_form(pos):
    H, dn, dv, r, R = 4, 32, 16, 8, 64
    w = _kv_b(H, dn, dv, R)
    g = torch.Generator().manual_seed(2)
    qn, qr = torch.randn(1, H, dn, generator=g), torch.randn(1, H, r, generator=g)
    rows = torch.randn(pos + 1, R + r, generator=g)
    want = mla.attend_absorbed(qn, qr, rows, w, dn, dv, 0.2, pos)
    cpu.USED.clear()
    with kernels.fast():
        got = mla.attend_absorbed(qn, qr, rows, w, dn, dv, 0.2, pos)
        again = mla.attend_absorbed(qn, qr, rows, w, dn, dv, 0.2, pos)
    assert "int8_heads" in cpu.USED
    assert got.shape == want.shape == (1, H * dv) and torch.equal(got, again)
    assert _rel(got, want) < 1e-4


def test_bench_kernels_times_the_absorbed_projections_at_k3_widths(capsys):
    """`bench kernels`' MLA row: kv_b's bytes a token through the per-head GEMVs and through the torch form, timed
    in the same run, and printed over the bandwidth."""
    from deltafin.bench import kernels as bk

    r = bk._mla_row("cpu", 0.05)
    assert r["weight_bytes"] == 96 * 256 * 512 + 4 * 96 * 256
    assert r["fused_GBps"] > r["torch_GBps"] > 0  # the torch form widens 12.6 MB of int8 to float every step
    r |= {"fused_over_bandwidth": 0.5, "torch_over_bandwidth": 0.01}
    bk._print({"device": "cpu", "backend": "cpu", "threads": 1, "bandwidth_GBps": 1.0, "cases": [], "mla": r,
               "worst_one_token_fraction": 1.0, "target": 0.5, "prefill": [], "gated_expert": []})
    assert "k3 mla absorbed x1 tok" in capsys.readouterr().out
