"""The packed fp16 form of the one-token MXFP4 GEMV (kernels/triton_gemv.py, decode 2): the packing kernels
against a torch statement of the layout, and the word dot product (inline PTX on the GPU) restated in torch
bit for bit against the float64 product. The PTX itself runs only on a GPU (tests/test_gpu.py and the
kernel benchmark check it there); without one the packing kernels run under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = triton.language

from deltafin.kernels import triton_gemv as G  # noqa: E402
from deltafin.quant import mxfp4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pairs_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout ``pack_pairs`` promises, in torch: per word of 8 the power of two f with the word's largest
    |x| * f in [2^13, 2^14); pair k of word 4b + j at [b, k, j] = fp16(x[8i + a] f) | fp16(x[8i + a + 2] f) << 16
    with a = 0, 4, 1, 5 for k = 0..3."""
    R, K = x.shape
    w = x.float().view(R, K // 8, 8)
    amax = w.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.full_like(amax, -127.0))
    f = torch.exp2(torch.clamp(13 - e, max=127.0))
    bits = (w * f[..., None]).half().view(torch.int16).to(torch.int32) & 0xFFFF
    a = torch.tensor(FIRST)
    pair = bits[..., a] | (bits[..., a + 2] << 16)  # [R, W, 4 (k)]
    xp = pair.view(R, K // 32, 4, 4).transpose(2, 3).contiguous()  # [R, b, k, j]
    return xp, 16384.0 / f


FIRST = (0, 4, 1, 5)  # the first element of pair k in a word (the second is 2 further)


def _word_dot(words: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
    """What ``_WORD_DOT_ASM`` computes, restated: words [N, W] int32 (8 E2M1 codes each), xp [W, 4 (k)] the
    token's pairs -> [N, W] float32, each word's 8 products in fp16 (rounded as the packed FMAs round)."""
    sign = -0x7F7F7F80  # 0x80808080 as an int32
    even = ((words << 1) & 0x0E0E0E0E) | ((words << 4) & sign)  # fp16 high bytes of elements 0, 2, 4, 6
    odd = ((words >> 3) & 0x0E0E0E0E) | (words & sign)  # of elements 1, 3, 5, 7
    acc = None
    for k, (src, byte) in enumerate(((even, 0), (even, 2), (odd, 0), (odd, 2))):
        lo, hi = (src >> (8 * byte)) & 0xFF, (src >> (8 * byte + 8)) & 0xFF  # the byte permute
        r = (lo << 8) | (hi << 24)
        halves = torch.stack((r & 0xFFFF, (r >> 16) & 0xFFFF), -1).to(torch.int16).view(torch.float16)
        xk = torch.stack((xp[:, k] & 0xFFFF, (xp[:, k] >> 16) & 0xFFFF), -1).to(torch.int16).view(torch.float16)
        prod = halves.float() * xk.float()  # exact in float32; one rounding per FMA, as the PTX
        acc = prod.half() if acc is None else (prod + acc.float()).half()
    return acc.float().sum(-1)


def _rand_mxfp4(N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (N, K // 32), dtype=torch.uint8, generator=g)
    return packed, scales


@pytest.mark.parametrize("R,K,scale", [(1, 3584, 1.0), (3, 96, 1e-3), (2, 512, 300.0)])
def test_pack_pairs_matches_the_layout(R, K, scale):
    x = (torch.randn(R, K, generator=torch.Generator().manual_seed(R)) * scale)
    x[0, :8] = 0.0  # an all-zero word
    xp, xsc = G.pack_pairs(x.to(DEV))
    rp, rsc = _pairs_reference(x)
    assert torch.equal(xp.view(R, K // 32, 4, 4).cpu(), rp)
    assert torch.equal(xsc.cpu(), rsc.float())


@triton.jit
def _store_vec_kernel(v_ptr, xp_ptr, xsc_ptr, N: tl.constexpr, W):
    pid = tl.program_id(0)
    v = tl.load(v_ptr + pid * N + tl.arange(0, N))
    G._store_pairs_vec(xp_ptr, xsc_ptr, 0, pid * (N // 8), v, N, W)


@pytest.mark.parametrize("N", [8, 16, 32])
def test_kernel_epilogue_packs_like_pack_pairs(N):
    """The gate/up kernel writes h packed from its tile of BN outputs; the same bits as packing h afterwards."""
    K = 96
    v = torch.randn(1, K, generator=torch.Generator().manual_seed(N)).to(DEV)
    xp = torch.zeros(1, K // 8, 4, dtype=torch.int32, device=DEV)
    xsc = torch.zeros(1, K // 8, dtype=torch.float32, device=DEV)
    _store_vec_kernel[(K // N,)](v, xp, xsc, N=N, W=K // 8)
    rp, rsc = G.pack_pairs(v)
    assert torch.equal(xp, rp) and torch.equal(xsc, rsc)


@pytest.mark.parametrize("scale", [1.0, 1e-4, 1e3])
def test_word_dot_restated_is_within_fp16_rounding(scale):
    """The decode-2 GEMV's arithmetic on the CPU: the packed products agree with the float64 W x within
    a few fp16 roundings of each word's partial sums (documented bound: 2^-9 of sum |w x| per block)."""
    N, K = 24, 1024
    packed, scales = _rand_mxfp4(N, K, 1)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2)) * scale
    xp, xsc = _pairs_reference(x)
    words = packed.view(torch.int32)  # [N, K/8], little-endian: elements 8i..8i+7 of word i
    xp_k = xp[0].transpose(1, 2).reshape(K // 8, 4)  # back to [word, k]
    d = _word_dot(words, xp_k) * xsc[0]  # [N, W]
    sc = torch.exp2(scales.double() - 127)  # E8M0
    got = (d.double().view(N, K // 32, 4).sum(-1) * sc).sum(-1)
    w = mxfp4.dequantize(packed, scales).double()
    ref = (w @ x[0].double())
    bound = 2.0**-9 * (w.abs() @ x[0].double().abs())
    assert torch.all((got - ref).abs() <= bound), ((got - ref).abs() / bound).max()
