"""The 4-bit GEMM with 8-bit activations (``GW_U8``: AVX2 builds without VNNI, built with -DGW_U8=1; off by default,
see cpu_kernels.c), against a plain-torch restatement.

Each token's row is quantized as the one-token Q8 loop's (per block of 32: d = max|x| / 127, q = round(x x (127 /
max|x|)), nearest-even, all in float32), the weights are read as their integers v (MXFP4 2 x E2M1, INT4 n - 8), the
block sums of v q are exact integers (vpmaddubsw on the unsigned v + K, int16 sums of at most 8 products a lane,
the correction -K sum(q)), and each block adds float(sum) x fl(weight scale x value factor x d) by one fused
multiply-add, in block order. So: with every scale a power of two and few enough bits the result is the integer
restatement exactly; otherwise within n roundings (n = blocks + 1) of its float64 evaluation; a token's result does
not depend on the other tokens of the call, its place among them or the thread count; NaN or inf in a token's row
makes that token's results NaN, an E8M0 0xFF scale its row's.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from deltafin.kernels import cpu, native
from deltafin.quant import mxfp4

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 builds are x86's")
U = 2.0**-24
U8 = ("-DGW_U8=1",)  # the opt-in build
KINDS = {"mxfp4": 0, "int4_bf16": 1, "int4_f32": 2}
_V = {0: torch.from_numpy((2 * mxfp4.E2M1_VALUES).astype(np.int64)), 1: torch.arange(16) - 8, 2: torch.arange(16) - 8}


def _u8_libs():
    """The builds here whose GEMM takes 8-bit activations (AVX2 without VNNI, and this CPU's own where it is one)."""
    out = []
    for isa in ("native", "avx2-novnni"):
        lib = native.library(native.ISA_FLAGS[isa] + U8)
        if lib is not None and lib.df_gw_u8():
            out.append(lib)
    return out


@pytest.fixture(params=["native", "avx2-novnni"])
def lib(request):
    lib = native.library(native.ISA_FLAGS[request.param] + U8)
    if lib is None or not lib.df_gw_u8():
        pytest.skip(f"the {request.param} build here has no 8-bit-activation GEMM")
    return lib


def _gemm(lib, kind: int, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, nt: int = 2) -> torch.Tensor:
    return cpu._q4_quantized(lib.df_q4gw_mm, kind, x.float().contiguous(), packed, scales, nt, "GEMM buffers")


def _weights(kind: int, R: int, C: int, g: torch.Generator, spread: int = 8):
    """Random packed nibbles [R, C/2] and scales of kind (powers of two, exponents within spread of each other per
    row), their integers v [R, C] and scale x value factor [R, C/32] (float32)."""
    nb = C // 32
    packed = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
    e = torch.randint(110, 130, (R, 1), generator=g) + torch.randint(0, spread, (R, nb), generator=g)
    nib = torch.stack([packed & 15, packed >> 4], -1).view(R, C).long()
    v = _V[kind][nib]
    if kind == 0:
        scales = e.to(torch.uint8)
        ws = torch.exp2(e.double() - 128).float()  # 2^(e - 127) x 1/2
    else:
        ws = torch.exp2(e.double() - 127).float()
        scales = ws.to(torch.bfloat16) if kind == 1 else ws
    return packed, scales.contiguous(), v, ws


def _restate(x: torch.Tensor, v: torch.Tensor, ws: torch.Tensor):
    """The kernel's quantities in plain torch: the exact integer block sums s [T, R, nb] (int64) and the float32
    scale products fl(ws x d) [T, R, nb]."""
    T, C = x.shape
    R, nb = v.shape[0], C // 32
    xb = x.float().view(T, nb, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).long()
    assert q.abs().max() <= 127
    s = torch.einsum("tbk,rbk->trb", q, v.view(R, nb, 32))
    return s, ws[None] * d[:, None, :]


@pytest.mark.parametrize("kind", sorted(KINDS.values()))
def test_exact_where_every_step_is(lib, kind):
    """Scales that are powers of two (weights' exponents within 4, each block's max |x| 127 x 2^k, k within 2) and
    sums under 2^24 units: nothing rounds, the result is the integer restatement bit for bit. Includes the int16
    sums' extremes: all weights at +-12 (MXFP4) with every activation at its block's max, of either sign."""
    g = torch.Generator().manual_seed(kind)
    for R, C, T in ((37, 640, 45), (16, 32, 13), (9, 96, 24)):
        packed, scales, v, ws = _weights(kind, R, C, g, spread=4)
        nb = C // 32
        k = torch.randint(-3, -1, (T, nb, 1), generator=g).double()
        xb = torch.randint(-127, 128, (T, nb, 32), generator=g).double() + torch.rand(T, nb, 32, generator=g) - 0.5
        xb = xb.clamp(-127, 127)
        xb[:, :, 5] = 127 * torch.where(torch.rand(T, nb, generator=g) < 0.5, 1.0, -1.0)  # the block's max
        x = (xb * torch.exp2(k)).float().view(T, C)
        s, sc = _restate(x, v, ws)
        want = (s.double() * sc.double()).sum(-1)
        y = _gemm(lib, kind, x, packed, scales)
        assert torch.equal(y.double(), want), f"{(y.double() - want).abs().max():.3g}"
    if kind == 0:  # the extremes: nibble 7 is +6.0 (v = 12, u = 24), 15 is -6.0 (u = 0); q = +-127 everywhere
        R, C = 24, 256
        packed = torch.full((R, C // 2), 0x77, dtype=torch.uint8)
        packed[1::2] = 0xFF
        scales = torch.full((R, C // 32), 127, dtype=torch.uint8)
        x = torch.ones(20, C)
        x[1::2] = -1
        y = _gemm(lib, 0, x, packed, scales)
        sign = x[:, :1] * torch.where(torch.arange(R) % 2 == 0, 1.0, -1.0)
        # d = fl(1/127): each block adds +-12 x 127 x 32 x fl(1/2 x fl(1/127)) by one fused multiply-add, a chain
        # float64 evaluates exactly (41-bit products of one scale), rounded to float32 once a step
        f = torch.zeros(20, R, dtype=torch.float32)
        step = (torch.tensor(0.5) * (torch.tensor(1.0) / 127)).double()
        for _ in range(C // 32):
            f = (sign.double() * (12 * 127 * 32) * step + f.double()).float()
        assert torch.equal(y, f)


@pytest.mark.parametrize("kind", sorted(KINDS.values()))
@pytest.mark.parametrize("R,C", [(1, 32), (7, 96), (17, 512), (100, 640), (33, 1056)])  # partial vectors, chunks
def test_within_the_float_steps_of_the_restatement(lib, kind, R, C):
    """Any activations and scales: within n = blocks + 1 float32 roundings of sum_b s_b fl(ws_b d_b), the bound
    tight enough that one activation off by one step of q lands outside it."""
    g = torch.Generator().manual_seed(R + C)
    packed, scales, v, ws = _weights(kind, R, C, g)
    nb = C // 32
    for T in (11, 12, 13, 40, 85):  # token groups of 6: whole, partial, uneven
        x = torch.randn(T, C, generator=g) * torch.rand(T, 1, generator=g) * 10
        s, sc = _restate(x, v, ws)
        terms = s.double() * sc.double()
        n = nb + 1
        bound = n * U / (1 - n * U) * terms.abs().sum(-1)
        y = _gemm(lib, kind, x, packed, scales)
        err = (y.double() - terms.sum(-1)).abs()
        assert torch.all(err <= bound), f"{(err / bound).max():.3g} of the bound"
        # a real constraint: one of token 0's activations one step of q off (in a row's block of the largest
        # scale, at its largest |v|) moves the row by |v| fl(ws d), past the bound
        step = (v.view(R, nb, 32).abs().amax(-1).double() * sc[0].double()).amax(-1)
        assert torch.all(step > bound[0])


def test_one_token_q8_loop_and_gemm_agree(lib):
    """The GEMM and the one-token Q8 loop evaluate the same integer block sums: a token's results differ only by
    their float summation orders (the Q8 loop's lanes and reduction: blocks + 8 roundings)."""
    g = torch.Generator().manual_seed(3)
    R, C = 70, 640
    packed, scales, v, ws = _weights(0, R, C, g)
    x = torch.randn(30, C, generator=g)
    y = _gemm(lib, 0, x, packed, scales)
    s, sc = _restate(x, v, ws)
    mag = (s.double() * sc.double()).abs().sum(-1)
    n = C // 32 + 8
    for t in range(0, 30, 7):
        y1 = cpu._q4_quantized(lib.df_q4q8_mm, 0, x[t : t + 1].contiguous(), packed, scales, 1, "Q8 buffers")[0]
        assert torch.all((y1.double() - y[t].double()).abs() <= 2 * n * U / (1 - n * U) * mag[t])


def test_a_tokens_result_does_not_depend_on_the_call():
    """Bit for bit whatever T, the token's place in the call, the token groups and the thread count; the gated
    expert's rows (its tokens read where they lie) too."""
    libs = _u8_libs()
    if not libs:
        pytest.skip("no 8-bit-activation GEMM build here")
    g = torch.Generator().manual_seed(5)
    R, C = 256, 512  # R C T past SERIAL_ELEMENTS: the threads share the panels
    packed, scales, _, _ = _weights(0, R, C, g)
    x = torch.randn(61, C, generator=g)
    threads = torch.get_num_threads()
    for lib in libs:
        full = _gemm(lib, 0, x, packed, scales)
        for a, b in ((0, 11), (3, 17), (20, 61), (5, 6), (40, 47)):
            for nt in (1, 2):
                assert torch.equal(_gemm(lib, 0, x[a:b], packed, scales, nt), full[a:b])
        perm = torch.randperm(61, generator=g)
        assert torch.equal(_gemm(lib, 0, x[perm], packed, scales), full[perm])
    # the gated expert (df_q4gw_glu) through the 8-bit build, whole and by rows
    for lib in libs[:1]:
        from deltafin.quant.record import QTensor

        D, I = 512, 256  # noqa: E741
        recs = []
        for r, c in ((I, D), (I, D), (D, I)):
            p, s, _, _ = _weights(0, r, c, g)
            recs.append(QTensor("mxfp4", (r, c), p, s))
        try:
            torch.set_num_threads(2)
            whole = cpu.glu_expert(x, *recs, lib=lib)
            rows = torch.tensor([60, 3, 17, 17, 40, 8, 9, 10, 11, 12, 13, 30])
            assert torch.equal(cpu.glu_expert(x, *recs, lib=lib, rows=rows), whole[rows])
            torch.set_num_threads(1)
            assert torch.equal(cpu.glu_expert(x[20:45], *recs, lib=lib), whole[20:45])
        finally:
            torch.set_num_threads(threads)


def test_nan_and_inf(lib):
    """NaN or inf in a token's row: all its results NaN (not inf, not finite), the other tokens untouched; an E8M0
    0xFF scale makes its row NaN; E8M0 0 is 2^-127."""
    g = torch.Generator().manual_seed(8)
    R, C = 20, 96
    packed, scales, v, ws = _weights(0, R, C, g)
    x = torch.randn(14, C, generator=g)
    clean = _gemm(lib, 0, x, packed, scales)
    x[2, 40] = float("nan")
    x[5, 3] = float("inf")
    x[9, 95] = -float("inf")
    y = _gemm(lib, 0, x, packed, scales)
    bad = [2, 5, 9]
    assert torch.isnan(y[bad]).all()
    ok = [t for t in range(14) if t not in bad]
    assert torch.equal(y[ok], clean[ok])
    sc = scales.clone()
    sc[4, 1] = 255
    y = _gemm(lib, 0, x[ok], packed, sc)
    assert torch.isnan(y[:, 4]).all() and not torch.isnan(y[:, [r for r in range(R) if r != 4]]).any()
    zero = torch.zeros_like(scales)  # 2^-127 a block: tiny, not 0
    xb = torch.full((12, C), 127 * 2.0**93)  # d = 2^93
    y = _gemm(lib, 0, xb, packed, zero)
    s, scz = _restate(xb, v, torch.full_like(ws, 2.0**-128))
    assert torch.equal(y.double(), (s.double() * scz.double()).sum(-1))  # powers of two, few bits: exact


def test_int16_gemm_by_default_and_for_int8_rows():
    """The default build keeps the int16 GEMM on AVX2 without VNNI (int16 activations, 2^-16 of the block's max), and
    int8 rows take the int16 GEMM in either build."""
    libs = _u8_libs()
    if not libs:
        pytest.skip("no 8-bit-activation GEMM build here")
    off = native.library(native.ISA_FLAGS["avx2-novnni"])  # the default build: the int16 GEMM
    assert off is not None and off.df_gw_u8() == 0 and off.df_q4gw_vnni() == 1
    g = torch.Generator().manual_seed(9)
    R, C = 40, 256
    packed, scales, v, ws = _weights(0, R, C, g)
    x = torch.randn(30, C, generator=g)
    w = (v.double() * ws.repeat_interleave(32, 1).double())
    ref = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    e16 = ((_gemm(off, 0, x, packed, scales).double() - ref).abs() / mag).max()
    e8 = ((_gemm(libs[0], 0, x, packed, scales).double() - ref).abs() / mag).max()
    assert e16 < 1e-4 < e8 < 1e-2
    q = torch.randint(-127, 128, (R, C), dtype=torch.int8, generator=g)
    s = torch.rand(R, generator=g) + 0.5
    for lib in (libs[0], off):
        out = torch.empty(30, R)
        assert lib.df_i8gw_mm(q.data_ptr(), s.data_ptr(), x.data_ptr(), out.data_ptr(), R, C, 30, 1) == 0
        ref8 = x.double() @ (q.double() * s.double()[:, None]).T
        assert ((out.double() - ref8).abs() / (x.double().abs() @ (q.double().abs() * s.double()[:, None]).T)).max() < 1e-4
