"""GEMV-form Triton kernels for decode (1-4 tokens): no tensor cores, no padded token tiles.

At one token a tensor-core tile pads 15 of its 16 rows, and decoding 4-bit codes into MMA operands costs more
than the bytes take to arrive. Here each program streams a [BN, BK] weight tile with wide loads, decodes it
with a few integer ops per element and multiplies it by one token row in registers (float32, or packed fp16
pairs for MXFP4 by default: see below):

- ``grouped_glu_gemv``: a layer's routed MXFP4 experts for decode, one program per (pair, n-tile) with the
  pairs sorted by slab slot (pairs sharing an expert run side by side, so repeated reads hit L2). Gate and
  up with the GLU activation fused, then down times the routing weight. The grid depends on (T, k) only, so
  the launch can be captured in a CUDA graph. In the packed form the K loop is unrolled by default
  (``_gemv_gate_up_rows_kernel``, ``_gemv_down_rows_kernel``: more loads in flight per thread).
- ``int8_gemv``: int8 per-row weights (trunk linears) in one launch, split over the input dimension into
  float32 partial sums that the last split to finish adds in split order (a result never depends on
  arrival order).

E2M1 decode: a magnitude code c = e<<1 | m placed at bits 9..11 of an fp16 (sign at bit 15) is the fp16
2^(e-15) * (1 + m/2), or m * 2^-15 as a subnormal for e = 0: exactly the E2M1 value times 2^-14 for every
code (fp16 subnormals are exact in hardware). The 2^14 goes into the E8M0 block scale, applied once per
32-element block to the block's float32 sum.

The packed fp16 form (decode 2, the default on a GPU): the codes stay in their 32-bit words (8 per word);
shifts and masks turn four of them at once into fp16 high bytes and byte permutes pair those into fp16x2
registers (``_WORD_DOT_ASM``), which meet the activations as fp16 pairs in packed FMAs (two products per
instruction): about 3.5 instructions per weight against 10 for decoding each code to float32, which is what
held the one-token step to 0.28 of the copy rate (now 0.50-0.51). The activations are packed
once per call (``pack_pairs``; the gate/up kernel writes h packed for down): each word of 8 scaled by a power
of two so its largest |x| lies in [2^13, 2^14) (products below 6, a word's fp16 sums below 24: no overflow),
each word's 4-product fp16 sums added in float32 and scaled back. Rounding: fp16 keeps 11 bits where the bf16
activations have 8, and each half sums 4 products, so a block's sum is within 2^-9 of its sum of |w x|
(tests/test_kernels_gemv_pairs.py restates the arithmetic in torch and checks that bound).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deltafin.kernels.triton_tiles import INTERPRET, e2m1_bits, e8m0_value, glu_act

# Set from the H200 measurements of ``deltafin.bench.kernels_cuda --gemv`` (copy 4,273 GB/s in the run):
# - MoE, 2026-12-04: the unrolled kernels (gate/up BN 8 x BK 256 in 2 warps, down BN 4 x BK 128 in 1) take the
#   16-expert K3 step at one token from 0.127 to 0.113-0.120 ms = 0.55-0.58 of copy (4,274 GB/s; timed alone,
#   gate/up 0.54 -> 0.61, down 0.47 -> 0.51); docs/BENCHMARKS.md has the sweep. Before them:
# - MoE: the 16-expert K3 step at one token 0.128-0.131 ms = 0.50-0.51 of copy (4,275 GB/s) with the packed fp16
#   form (decode 2), its launches dependent, gate/up in BN 8 x BK 256 tiles of 2 warps and down in BN 4 x BK 512
#   of 4 (timed alone, gate/up 0.54 of copy, down 0.48; the pack and sum launches ~3.5 and ~4.5 us, mostly hidden
#   behind their neighbours); one tile shape for both, BN 8 x BK 512 at 4 warps, 0.134-0.138 ms = 0.48-0.49;
#   0.234 ms = 0.28 decoding each code to float32 (decode 0), 0.157 ms = 0.42 through the tensor-core kernel;
#   but with several pairs per expert each pair re-reads it (T=8, all 16 experts shared: 0.08 vs 0.24), so
#   only plans whose pairs all have distinct experts take it (``moe_config``).
# - int8 at T=1, over the shapes the K3 decode step launches (same-input projections merged): the GEMV ahead
#   of the tensor-core kernel up to ~26M weights (latent_up 0.49 vs 0.44, kv_b 0.41 vs 0.35, router 0.19 vs
#   0.16), behind above (shared_down 44M 0.52 vs 0.58, q_b 28M 0.48 vs 0.51, the merged 100-350M ones
#   0.63-0.69 vs 0.69-0.73).
GEMV_INT8 = True
GEMV_MOE = True
# The decode step's four launches (pack x, gate/up, down, sum) as programmatic dependent launches (sm_90): each
# kernel lets the next one start as soon as its own programs have all started; the next loads its first weights
# and then waits (griddepcontrol) for the results it reads, so the weight stream goes on across the kernel
# boundaries instead of draining and refilling at each.
PDL = not INTERPRET and os.environ.get("DELTAFIN_CUDA_PDL", "1") != "0"  # 0: every launch waits for the one before
# decode 2's gate/up and down through the unrolled kernels (0: the tile kernels): see moe_gemv_config
UNROLLED = os.environ.get("DELTAFIN_GEMV_UNROLLED", "1") != "0"
# (Adding each token's k rows in the down kernel, the last of them to finish, in place of the summing launch
# measured level with it once the launches were dependent: 0.136 vs 0.134 ms. Not kept.)
MAX_TOKENS = 4
INT8_MAX_WEIGHTS = 27_000_000


def use_int8_gemv(T: int, N: int, K: int) -> bool:
    """Whether an int8 linear of T tokens with an [N, K] weight takes the GEMV kernel (see above)."""
    return GEMV_INT8 and T <= MAX_TOKENS and N * K <= INT8_MAX_WEIGHTS


@triton.jit
def _e2m1_x2p14(b):
    """fp16 values of the low and high E2M1 nibbles of bytes b (int32), each the code's value * 2^-14,
    returned as float32."""
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    lo = lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


# One word of 8 E2M1 codes (elements 0..7 of its four bytes, low nibble first) times 8 activations packed as four
# fp16x2 pairs: (x0, x2), (x4, x6), (x1, x3), (x5, x7). Shifts and masks turn the four low nibbles (elements
# 0, 2, 4, 6) and the four high ones (1, 3, 5, 7) each into four fp16 high bytes at once (sign at bit 7,
# magnitude at bits 1..3: the fp16 sign and bits 9..11, i.e. the code's value * 2^-14, exact, subnormal for
# code 1); a byte permute pairs two of them with zero low bytes into an fp16x2 register, which meets its
# activation pair in one packed FMA (two products per instruction); the two halves are summed in float32.
_WORD_DOT_ASM = tl.constexpr("""{
.reg .b32 a, b, e, o, r, acc, z;
.reg .b16 l, h;
.reg .f32 fl, fh;
mov.b32 z, 0;
shl.b32 a, $1, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $1, 4; and.b32 b, b, 0x80808080; or.b32 e, a, b;
shr.u32 a, $1, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $1, 0x80808080; or.b32 o, a, b;
prmt.b32 r, e, z, 0x1404; mul.rn.f16x2 acc, r, $2;
prmt.b32 r, e, z, 0x3424; fma.rn.f16x2 acc, r, $3, acc;
prmt.b32 r, o, z, 0x1404; fma.rn.f16x2 acc, r, $4, acc;
prmt.b32 r, o, z, 0x3424; fma.rn.f16x2 acc, r, $5, acc;
mov.b32 {l, h}, acc;
cvt.f32.f16 fl, l; cvt.f32.f16 fh, h;
add.f32 fl, fl, fh;
mov.b32 $0, fl;
}""")


@triton.jit
def _fp16_bits(v):
    """The fp16 bits of float32 values v (rounded to nearest) in the low half of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _store_pairs(xp_ptr, xsc_ptr, row, offs_w, lo, hi, W):
    """Words offs_w [n] of one row, lo / hi [n, 4] float32 the first and second elements of each word's pairs
    (elements 0, 4, 1, 5 and 2, 6, 3, 7) -> xp and xsc (the layout of ``pack_pairs``): each word scaled by the power of two f that puts its largest |x| in [2^13, 2^14) (so
    the fp16 products of ``_WORD_DOT_ASM`` stay below 6 and its sums below 24), xsc = 2^14 / f."""
    k = tl.arange(0, 4)
    wm = offs_w < W
    amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    ea = (amax.to(tl.int32, bitcast=True) >> 23) & 255  # biased exponent of the word's largest |x|
    e = tl.minimum(267 - ea, 254)  # f = 2^(e - 127) = 2^(140 - ea); all-zero words get 2^127
    f = (e << 23).to(tl.float32, bitcast=True)
    pair = _fp16_bits(lo * f[:, None]) | (_fp16_bits(hi * f[:, None]) << 16)
    # pair k of word 4b + j at [b, k, j]: a block's four words of one pair are adjacent (one vector load)
    dst = row * (4 * W) + (offs_w[:, None] // 4) * 16 + k[None, :] * 4 + offs_w[:, None] % 4
    tl.store(xp_ptr + dst, pair, mask=wm[:, None])
    tl.store(xsc_ptr + row * W + offs_w, 16384.0 / f, mask=wm)


@triton.jit
def _store_pairs_vec(xp_ptr, xsc_ptr, row, w0, v, N: tl.constexpr, W):
    """``_store_pairs`` for v [N] float32, the elements of words w0 .. w0 + N/8 of one row."""
    # element 4u + 2t + s of a word is the t-th (first, second) of pair k = 2s + u
    lo, hi = tl.split(tl.reshape(tl.permute(tl.reshape(v, (N // 8, 2, 2, 2)), (0, 3, 1, 2)), (N // 8, 4, 2)))
    _store_pairs(xp_ptr, xsc_ptr, row, w0 + tl.arange(0, N // 8), lo, hi, W)


@triton.jit
def _pack_pairs_kernel(x_ptr, xp_ptr, xsc_ptr, W, stride_x, WB: tl.constexpr, PDL: tl.constexpr = False):
    """Row r of x [R, 8W] (W a multiple of 4) -> xp [R, W/4, 4, 4] int32 (at [b, k, j] pair k of word i = 4b + j:
    fp16 of x[8i + a] * f and x[8i + a + 2] * f, a = 0, 4, 1, 5 for k = 0..3, low and high half) and xsc [R, W]
    float32 (``_store_pairs``). PDL: the next kernel may launch at once (it waits for this one's results)."""
    if PDL:
        gdc_launch_dependents()
    r, pid = tl.program_id(0), tl.program_id(1)
    offs_w = pid * WB + tl.arange(0, WB)
    wm = (offs_w < W)[:, None]
    k = tl.arange(0, 4)
    xo = x_ptr + r.to(tl.int64) * stride_x + offs_w[:, None] * 8 + ((k % 2) * 4 + k // 2)[None, :]
    lo = tl.load(xo, mask=wm, other=0.0).to(tl.float32)
    hi = tl.load(xo + 2, mask=wm, other=0.0).to(tl.float32)
    _store_pairs(xp_ptr, xsc_ptr, r.to(tl.int64), offs_w, lo, hi, W)


def pack_pairs(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 32) -> (xp [R, K/32, 4, 4] int32, xsc [R, K/8] float32), see _pack_pairs_kernel."""
    R, K = x.shape
    W = K // 8
    xp = torch.empty(R, W, 4, device=x.device, dtype=torch.int32)
    xsc = torch.empty(R, W, device=x.device, dtype=torch.float32)
    wb = min(128, triton.next_power_of_2(W))
    _pack_pairs_kernel[(R, triton.cdiv(W, wb))](x, xp, xsc, W, x.stride(0), WB=wb, PDL=pdl, num_warps=4)
    return xp, xsc


@triton.jit
def _mx_words(p_ptr, offs_n, k0, N, K: tl.constexpr, G: tl.constexpr):
    """[BN, G, 4] int32: the words of 8 codes of W[offs_n, k0:k0+32G] (zero past N or K)."""
    offs_g = k0 // 32 + tl.arange(0, G)
    offs_w = offs_g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, G, 4]: word index in the row
    m3 = (offs_n < N)[:, None, None] & (offs_g < K // 32)[None, :, None]
    return tl.load(p_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None, None] * (K // 8) + offs_w, mask=m3, other=0)


@triton.jit
def _mx_gemv_acc_pairs(acc, w, s_ptr, xp_ptr, xsc_ptr, offs_n, k0, N, K: tl.constexpr, G: tl.constexpr):
    """acc [BN, G, 4] += each word's sum of W[offs_n, k0:k0+32G] * x times its scales, w those words
    (``_mx_words``): x packed by ``pack_pairs`` (xp_ptr, xsc_ptr at the token's row), the packed fp16
    products of ``_WORD_DOT_ASM``, each word's sum scaled back by its xsc and its block's E8M0 scale (summed
    over words and blocks at the end)."""
    offs_g = k0 // 32 + tl.arange(0, G)
    gm = offs_g < K // 32
    nm = offs_n < N
    jw = tl.arange(0, 4)
    wmask = gm[None, :, None]
    xq = xp_ptr + offs_g[None, :, None] * 16 + jw[None, None, :]  # pair k of the block's words at +4k
    p0 = tl.load(xq, mask=wmask, other=0)
    p1 = tl.load(xq + 4, mask=wmask, other=0)
    p2 = tl.load(xq + 8, mask=wmask, other=0)
    p3 = tl.load(xq + 12, mask=wmask, other=0)
    xsc = tl.load(xsc_ptr + offs_g[None, :, None] * 4 + jw[None, None, :], mask=wmask, other=0.0)  # [1, G, 4]
    s = tl.load(s_ptr + offs_n[:, None] * (K // 32) + offs_g[None, :], mask=nm[:, None] & gm[None, :],
                other=127).to(tl.uint32)  # [BN, G]
    d = tl.inline_asm_elementwise(_WORD_DOT_ASM, "=r,r,r,r,r,r", [w, p0, p1, p2, p3], dtype=tl.int32,
                                  is_pure=True, pack=1).to(tl.float32, bitcast=True)
    return acc + d * (e8m0_value(s)[:, :, None] * xsc)


@triton.jit
def _mx_gemv_acc(acc, p_ptr, s_ptr, x_ptr, offs_n, k0, N, K: tl.constexpr, BN: tl.constexpr,
                 G: tl.constexpr, DECODE: tl.constexpr):
    """acc [BN, G] += (block sums of W[offs_n, k0:k0+32G] * x[k0:k0+32G]) * block scale, W MXFP4 packed
    [N, K/2] uint8 (even element in the low nibble) with E8M0 scales [N, K/32]. DECODE 0: through fp16
    (a conversion per element); 1: float32 bits from integer ops alone (``e2m1_bits``)."""
    offs_g = k0 // 32 + tl.arange(0, G)
    j = tl.arange(0, 16)
    gm = offs_g < K // 32
    nm = offs_n < N
    m3 = nm[:, None, None] & gm[None, :, None]
    b = tl.load(p_ptr + offs_n[:, None, None] * (K // 2) + offs_g[None, :, None] * 16 + j[None, None, :],
                mask=m3, other=0)  # [BN, G, 16]
    xo = offs_g[:, None] * 32 + 2 * j[None, :]
    xlo = tl.load(x_ptr + xo, mask=gm[:, None], other=0.0).to(tl.float32)  # [G, 16] even elements
    xhi = tl.load(x_ptr + xo + 1, mask=gm[:, None], other=0.0).to(tl.float32)
    if DECODE == 0:
        wlo, whi = _e2m1_x2p14(b.to(tl.int32))
        unit = 16384.0  # the 2^14 the fp16 route leaves out
    else:
        bu = b.to(tl.uint32)
        wlo = e2m1_bits(bu & 15).to(tl.float32, bitcast=True)
        whi = e2m1_bits(bu >> 4).to(tl.float32, bitcast=True)
        unit = 1.0
    part = tl.sum(wlo * xlo[None, :, :] + whi * xhi[None, :, :], axis=2)  # [BN, G]
    s = tl.load(s_ptr + offs_n[:, None] * (K // 32) + offs_g[None, :], mask=nm[:, None] & gm[None, :],
                other=127).to(tl.uint32)
    return acc + part * (e8m0_value(s) * unit)  # OCP MX: scale = 2**(e - 127)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, xp_ptr, xsc_ptr, rows_ptr, blk_ptr, gp, gs, upp, ups, h_ptr, hp_ptr, hsc_ptr,
                         stride_x, p_slot, s_slot,
                         RS: tl.constexpr, TOPK: tl.constexpr, K: tl.constexpr, I: tl.constexpr, ACT: tl.constexpr,
                         BETA: tl.constexpr, LBETA: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         DECODE: tl.constexpr, PF: tl.constexpr = 0, PDL: tl.constexpr = False):
    """h[pair, n] = act(gate x_t, up x_t) for the pair rows[b * RS] (token t = pair // TOPK), n-tile pid_n.
    PDL (decode 2): launched before the packing kernel ends; the first weights are loaded before waiting for it."""
    if PDL:
        gdc_launch_dependents()
    b, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(blk_ptr + b).to(tl.int64)
    pair = tl.load(rows_ptr + b * RS)
    xp = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    offs_n = pid_n * BN + tl.arange(0, BN)
    if DECODE == 2:  # x packed by pack_pairs; per-word partial sums until the end
        tok = (pair // TOPK).to(tl.int64)
        acc_g = tl.zeros((BN, BK // 32, 4), dtype=tl.float32)
        acc_u = tl.zeros((BN, BK // 32, 4), dtype=tl.float32)
        off = tl.multiple_of(slot * p_slot, 16)  # a slot's bytes start 16-byte aligned: 128-bit loads
        gw, uw = gp + off, upp + off
        soff = tl.multiple_of(slot * s_slot, 16)
        wg = _mx_words(gw, offs_n, 0, I, K, BK // 32)
        wu = _mx_words(uw, offs_n, 0, I, K, BK // 32)
        if PDL:
            gdc_wait()  # x packed by the kernel before
        for k0 in range(0, K, BK):
            if PF:  # the next step's words in flight while this step's are used (zero past K)
                wg_next = _mx_words(gw, offs_n, k0 + BK, I, K, BK // 32)
                wu_next = _mx_words(uw, offs_n, k0 + BK, I, K, BK // 32)
            elif k0 > 0:
                wg = _mx_words(gw, offs_n, k0, I, K, BK // 32)
                wu = _mx_words(uw, offs_n, k0, I, K, BK // 32)
            acc_g = _mx_gemv_acc_pairs(acc_g, wg, gs + soff, xp_ptr + tok * (K // 2),
                                       xsc_ptr + tok * (K // 8), offs_n, k0, I, K, BK // 32)
            acc_u = _mx_gemv_acc_pairs(acc_u, wu, ups + soff, xp_ptr + tok * (K // 2),
                                       xsc_ptr + tok * (K // 8), offs_n, k0, I, K, BK // 32)
            if PF:
                wg, wu = wg_next, wu_next
        g_sum, u_sum = tl.sum(tl.sum(acc_g, axis=2), axis=1), tl.sum(tl.sum(acc_u, axis=2), axis=1)
    else:
        acc_g = tl.zeros((BN, BK // 32), dtype=tl.float32)
        acc_u = tl.zeros((BN, BK // 32), dtype=tl.float32)
        for k0 in range(0, K, BK):
            acc_g = _mx_gemv_acc(acc_g, gp + slot * p_slot, gs + slot * s_slot, xp, offs_n, k0, I, K, BN,
                                 BK // 32, DECODE)
            acc_u = _mx_gemv_acc(acc_u, upp + slot * p_slot, ups + slot * s_slot, xp, offs_n, k0, I, K, BN,
                                 BK // 32, DECODE)
        g_sum, u_sum = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    h = glu_act(g_sum, u_sum, ACT, BETA, LBETA)
    if DECODE == 2:  # h straight into the down kernel's packed input (BN a multiple of 8)
        _store_pairs_vec(hp_ptr, hsc_ptr, pair.to(tl.int64), pid_n * (BN // 8), h, BN, I // 8)
    else:
        tl.store(h_ptr + pair.to(tl.int64) * I + offs_n, h.to(h_ptr.dtype.element_ty), mask=offs_n < I)


@triton.jit
def _gemv_down_kernel(h_ptr, hp_ptr, hsc_ptr, rows_ptr, blk_ptr, rw_ptr, dp, ds, y_ptr, p_slot, s_slot,
                      RS: tl.constexpr,
                      I: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      DECODE: tl.constexpr, PF: tl.constexpr = 0, PDL: tl.constexpr = False):
    """y[pair, n] = rw[pair] * (down h[pair])[n] in float32. PDL as in the gate/up kernel."""
    if PDL:
        gdc_launch_dependents()
    b, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(blk_ptr + b).to(tl.int64)
    pair = tl.load(rows_ptr + b * RS).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    if DECODE == 2:
        acc3 = tl.zeros((BN, BK // 32, 4), dtype=tl.float32)
        dw = dp + tl.multiple_of(slot * p_slot, 16)
        wd = _mx_words(dw, offs_n, 0, D, I, BK // 32)
        if PDL:
            gdc_wait()  # h packed by the gate/up kernel
        for k0 in range(0, I, BK):
            if PF:
                wd_next = _mx_words(dw, offs_n, k0 + BK, D, I, BK // 32)
            elif k0 > 0:
                wd = _mx_words(dw, offs_n, k0, D, I, BK // 32)
            acc3 = _mx_gemv_acc_pairs(acc3, wd, ds + tl.multiple_of(slot * s_slot, 16), hp_ptr + pair * (I // 2),
                                      hsc_ptr + pair * (I // 8), offs_n, k0, D, I, BK // 32)
            if PF:
                wd = wd_next
        acc = tl.sum(acc3, axis=2)
    else:
        acc = tl.zeros((BN, BK // 32), dtype=tl.float32)
        for k0 in range(0, I, BK):
            acc = _mx_gemv_acc(acc, dp + slot * p_slot, ds + slot * s_slot, h_ptr + pair * I, offs_n, k0, D, I,
                               BN, BK // 32, DECODE)
    w = tl.load(rw_ptr + pair)
    tl.store(y_ptr + pair * D + offs_n, tl.sum(acc, axis=1) * w, mask=offs_n < D)


@triton.jit
def _mx_scales(s_ptr, offs_n, k0, N, K: tl.constexpr, G: tl.constexpr, one):
    """[BN, G] uint32: the E8M0 scales of W[offs_n, k0:k0+32G] (127, i.e. 1.0, past N or K). one: 1, passed
    unspecialised, so that the loads are not merged into words (the words would then be split apart again
    through shared memory: each thread holds one block of each of its rows)."""
    offs_g = k0 // 32 + tl.arange(0, G)
    m = (offs_n < N)[:, None] & (offs_g < K // 32)[None, :]
    s = tl.load(s_ptr + offs_n[:, None] * (K // 32) + offs_g[None, :] * one, mask=m, other=127)
    return s.to(tl.uint32)


@triton.jit
def _x_pairs(xp_ptr, xsc_ptr, k0, K: tl.constexpr, G: tl.constexpr):
    """The token's packed activations for blocks k0/32 .. k0/32 + G: four [1, G, 4] pair words and the words'
    scales (``pack_pairs`` layout; zero past K)."""
    offs_g = k0 // 32 + tl.arange(0, G)
    jw = tl.arange(0, 4)
    m = (offs_g < K // 32)[None, :, None]
    xq = xp_ptr + offs_g[None, :, None] * 16 + jw[None, None, :]
    p0 = tl.load(xq, mask=m, other=0)
    p1 = tl.load(xq + 4, mask=m, other=0)
    p2 = tl.load(xq + 8, mask=m, other=0)
    p3 = tl.load(xq + 12, mask=m, other=0)
    xsc = tl.load(xsc_ptr + offs_g[None, :, None] * 4 + jw[None, None, :], mask=m, other=0.0)
    return p0, p1, p2, p3, xsc


@triton.jit
def _rows_dot(w, s, p0, p1, p2, p3, xsc):
    """[BN, G] block sums times their scales: words w [BN, G, 4], scales s [BN, G], one token's pairs."""
    d = tl.inline_asm_elementwise(_WORD_DOT_ASM, "=r,r,r,r,r,r", [w, p0, p1, p2, p3], dtype=tl.int32,
                                  is_pure=True, pack=1).to(tl.float32, bitcast=True)
    return tl.sum(d * xsc, axis=2) * e8m0_value(s)


@triton.jit(do_not_specialize=["one"])
def _gemv_gate_up_rows_kernel(xp_ptr, xsc_ptr, rows_ptr, blk_ptr, gp, gs, upp, ups, hp_ptr, hsc_ptr, p_slot, s_slot,
                              one,
                              RS: tl.constexpr, TOPK: tl.constexpr, K: tl.constexpr, I: tl.constexpr,
                              ACT: tl.constexpr, BETA: tl.constexpr, LBETA: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr, PF: tl.constexpr = 1, PDL: tl.constexpr = False):
    """The gate/up kernel of decode 2 with its K loop unrolled, so that the compiler keeps several chunks' loads
    in flight (the tile kernel's loop waits on each), each block's four word sums added in the thread before its
    scale (a [BN, G] accumulator, not [BN, G, 4]) and each scale loaded by the thread that uses it. PF: the next
    chunk requested before this one is used; the first is requested before waiting on PDL."""
    if PDL:
        gdc_launch_dependents()
    b, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(blk_ptr + b).to(tl.int64)
    pair = tl.load(rows_ptr + b * RS).to(tl.int64)
    tok = pair // TOPK
    G: tl.constexpr = BK // 32
    offs_n = pid_n * BN + tl.arange(0, BN)
    off = tl.multiple_of(slot * p_slot, 16)  # a slot's bytes start 16-byte aligned: 128-bit loads
    soff = tl.multiple_of(slot * s_slot, 16)
    gw, uw, gsc, usc = gp + off, upp + off, gs + soff, ups + soff
    wg, sg = _mx_words(gw, offs_n, 0, I, K, G), _mx_scales(gsc, offs_n, 0, I, K, G, one)
    wu, su = _mx_words(uw, offs_n, 0, I, K, G), _mx_scales(usc, offs_n, 0, I, K, G, one)
    if PDL:
        gdc_wait()  # x packed by the kernel before
    xq, xs = xp_ptr + tok * (K // 2), xsc_ptr + tok * (K // 8)
    acc_g = tl.zeros((BN, G), dtype=tl.float32)
    acc_u = tl.zeros((BN, G), dtype=tl.float32)
    for c in tl.static_range(0, K, BK):
        if PF:  # the next chunk in flight while this one is used (zero past K)
            wg_n = _mx_words(gw, offs_n, c + BK, I, K, G)
            sg_n = _mx_scales(gsc, offs_n, c + BK, I, K, G, one)
            wu_n = _mx_words(uw, offs_n, c + BK, I, K, G)
            su_n = _mx_scales(usc, offs_n, c + BK, I, K, G, one)
        elif c > 0:
            wg, sg = _mx_words(gw, offs_n, c, I, K, G), _mx_scales(gsc, offs_n, c, I, K, G, one)
            wu, su = _mx_words(uw, offs_n, c, I, K, G), _mx_scales(usc, offs_n, c, I, K, G, one)
        p0, p1, p2, p3, xsc = _x_pairs(xq, xs, c, K, G)
        acc_g += _rows_dot(wg, sg, p0, p1, p2, p3, xsc)
        acc_u += _rows_dot(wu, su, p0, p1, p2, p3, xsc)
        if PF:
            wg, sg, wu, su = wg_n, sg_n, wu_n, su_n
    h = glu_act(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), ACT, BETA, LBETA)
    _store_pairs_vec(hp_ptr, hsc_ptr, pair, pid_n * (BN // 8), h, BN, I // 8)


@triton.jit(do_not_specialize=["one"])
def _gemv_down_rows_kernel(hp_ptr, hsc_ptr, rows_ptr, blk_ptr, rw_ptr, dp, ds, y_ptr, p_slot, s_slot, one,
                           RS: tl.constexpr, I: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           PF: tl.constexpr = 1, PDL: tl.constexpr = False):
    """y[pair, n] = rw[pair] * (down h[pair])[n] in float32, laid out as ``_gemv_gate_up_rows_kernel``."""
    if PDL:
        gdc_launch_dependents()
    b, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(blk_ptr + b).to(tl.int64)
    pair = tl.load(rows_ptr + b * RS).to(tl.int64)
    G: tl.constexpr = BK // 32
    offs_n = pid_n * BN + tl.arange(0, BN)
    dw = dp + tl.multiple_of(slot * p_slot, 16)
    dsc = ds + tl.multiple_of(slot * s_slot, 16)
    w, s = _mx_words(dw, offs_n, 0, D, I, G), _mx_scales(dsc, offs_n, 0, D, I, G, one)
    if PDL:
        gdc_wait()  # h packed by the gate/up kernel
    xq, xs = hp_ptr + pair * (I // 2), hsc_ptr + pair * (I // 8)
    acc = tl.zeros((BN, G), dtype=tl.float32)
    for c in tl.static_range(0, I, BK):
        if PF:
            w_n = _mx_words(dw, offs_n, c + BK, D, I, G)
            s_n = _mx_scales(dsc, offs_n, c + BK, D, I, G, one)
        elif c > 0:
            w, s = _mx_words(dw, offs_n, c, D, I, G), _mx_scales(dsc, offs_n, c, D, I, G, one)
        p0, p1, p2, p3, xsc = _x_pairs(xq, xs, c, I, G)
        acc += _rows_dot(w, s, p0, p1, p2, p3, xsc)
        if PF:
            w, s = w_n, s_n
    tl.store(y_ptr + pair * D + offs_n, tl.sum(acc, axis=1) * tl.load(rw_ptr + pair), mask=offs_n < D)


def moe_gemv_config(BN: int = 8, BK: int = 256, num_warps: int = 2, num_stages: int = 3, decode: int | None = None,
                    BN_down: int | None = None, BK_down: int | None = None, prefetch: int = 0,
                    pdl: bool | None = None, num_warps_down: int | None = None, unrolled: bool | None = None,
                    unrolled_down: bool | None = None, pf_rows: int = 0, pf_rows_down: int = 1) -> dict:
    """A decode plan's config: one pair per block (BT 1). Defaults from the H200 sweep; the packed fp16 form
    (decode 2, inline PTX) on a GPU, the float32 decode under Triton's interpreter (no PTX there). unrolled /
    unrolled_down: decode 2's gate/up / down through the unrolled kernels (``_gemv_gate_up_rows_kernel``; both by
    default, ``UNROLLED``), pf_rows / pf_rows_down their next-chunk prefetch. The down tile defaults to each
    form's own: unrolled BN 4 x BK 128 in 1 warp, the tile kernel BN 4 x BK 512 in 4."""
    if decode is None:
        decode = 0 if INTERPRET else 2
    unrolled = UNROLLED if unrolled is None else unrolled
    unrolled_down = UNROLLED if unrolled_down is None else unrolled_down
    BN_down = 4 if BN_down is None else BN_down
    BK_down = (128 if unrolled_down else 512) if BK_down is None else BK_down
    num_warps_down = (1 if unrolled_down else 4) if num_warps_down is None else num_warps_down
    return {"gemv": True, "BT": 1, "BN": BN, "BK": BK, "num_warps": num_warps, "num_stages": num_stages,
            "decode": decode, "BN_down": BN_down, "BK_down": BK_down, "prefetch": prefetch,
            "pdl": PDL if pdl is None else pdl, "num_warps_down": num_warps_down, "unrolled": unrolled,
            "unrolled_down": unrolled_down, "pf_rows": pf_rows, "pf_rows_down": pf_rows_down}


def grouped_glu_gemv(x: torch.Tensor, rows: torch.Tensor, blk: torch.Tensor, k: int, weights: torch.Tensor,
                     slab, act: int, beta: float, lbeta: float, c: dict) -> torch.Tensor:
    """The decode form of ``triton_moe.grouped_glu`` for an MXFP4 slab: blk [T*k] the slab slot of each
    block, rows [T*k*RS] with block b's one pair at rows[b * RS] (``block_layout`` with one row per block,
    RS = 1, sorted by slot; or a fixed layout of one pair per padded block). Returns [T, D] in x's dtype."""
    T, D = x.shape
    I, K = slab.shapes["gate"]
    rs = rows.numel() // max(blk.numel(), 1)
    assert slab.format == "mxfp4" and blk.numel() == T * k and rows.numel() == rs * T * k
    dev = x.device
    x = x.contiguous()
    bk = min(c["BK"], max(32, triton.next_power_of_2(K)))
    bk_d = min(c["BK_down"], max(32, triton.next_power_of_2(I)))
    dec = c.get("decode", 0)
    pdl = dec == 2 and c.get("pdl", PDL)
    y = torch.empty(T * k, D, device=dev, dtype=torch.float32)
    rw = weights.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()  # before the chain of launches
    if dec == 2:  # x packed once; h written packed by the gate/up kernel
        assert K % 32 == 0 and I % 32 == 0 and c["BN"] % 8 == 0, "the packed fp16 form needs whole blocks"
        xp, xsc = pack_pairs(x, pdl)
        hp = torch.empty(T * k, I // 8, 4, device=dev, dtype=torch.int32)
        hsc = torch.empty(T * k, I // 8, device=dev, dtype=torch.float32)
        h = hsc  # unused
    else:
        xp = xsc = hp = hsc = x  # unused
        h = torch.empty(T * k, I, device=dev, dtype=x.dtype)
    g, u, dn = slab.data["gate"], slab.data["up"], slab.data["down"]
    if dec == 2 and c.get("unrolled"):
        _gemv_gate_up_rows_kernel[(T * k, triton.cdiv(I, c["BN"]))](
            xp, xsc, rows, blk, g, slab.scale["gate"], u, slab.scale["up"], hp, hsc, g.stride(0),
            slab.scale["gate"].stride(0), 1, RS=rs, TOPK=k, K=K, I=I, ACT=act, BETA=beta, LBETA=lbeta, BN=c["BN"],
            BK=bk, PF=c.get("pf_rows", 1), PDL=pdl, num_warps=c["num_warps"], num_stages=1, **pdl_launch(pdl))
    else:
        _gemv_gate_up_kernel[(T * k, triton.cdiv(I, c["BN"]))](
            x, xp, xsc, rows, blk, g, slab.scale["gate"], u, slab.scale["up"], h, hp, hsc, x.stride(0),
            g.stride(0), slab.scale["gate"].stride(0), RS=rs, TOPK=k, K=K, I=I, ACT=act, BETA=beta, LBETA=lbeta,
            BN=c["BN"], BK=bk, DECODE=dec, PF=c.get("prefetch", 0), PDL=pdl, num_warps=c["num_warps"],
            num_stages=c.get("num_stages", 3), **pdl_launch(pdl))
    if dec == 2 and c.get("unrolled_down"):
        _gemv_down_rows_kernel[(T * k, triton.cdiv(D, c["BN_down"]))](
            hp, hsc, rows, blk, rw, dn, slab.scale["down"], y, dn.stride(0), slab.scale["down"].stride(0), 1, RS=rs,
            I=I, D=D, BN=c["BN_down"], BK=bk_d, PF=c.get("pf_rows_down", 1), PDL=pdl,
            num_warps=c.get("num_warps_down", c["num_warps"]), num_stages=1, **pdl_launch(pdl))
    else:
        _gemv_down_kernel[(T * k, triton.cdiv(D, c["BN_down"]))](
            h, hp, hsc, rows, blk, rw, dn, slab.scale["down"], y, dn.stride(0), slab.scale["down"].stride(0), RS=rs,
            I=I, D=D, BN=c["BN_down"], BK=bk_d, DECODE=dec, PF=c.get("prefetch", 0), PDL=pdl,
            num_warps=c.get("num_warps_down", c["num_warps"]), num_stages=c.get("num_stages", 3), **pdl_launch(pdl))
    return sum_cast(y.view(T, k, D).transpose(0, 1), x.dtype, pdl)  # each token's k rows in pair order, one launch


def pdl_launch(on: bool) -> dict:
    """The launch option of a programmatic dependent launch (none when off)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def _int8_gemv_kernel(x_ptr, q_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, stride_x, splits,
                      K_PER_SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAGIC: tl.constexpr):
    """y[t, n] = s[n] * sum_k x[t, k] * q[n, k] in y's dtype. With several splits each program stores its
    float32 partial sum and the last of a tile's splits to arrive (a counter) adds them in split order, so
    one launch does it all and the result never depends on arrival order. Token t is the fastest program
    axis: the programs of one weight tile run together and share its reads in L2. MAGIC: int8 to float32
    by the bits of 1.5 * 2^23 + q (integer add, float subtract: full-rate ops, exact) instead of a
    conversion instruction."""
    t, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nm = offs_n < N
    rowp = q_ptr + offs_n.to(tl.int64)[:, None] * K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for i in range(0, K_PER_SPLIT, BK):
        offs_k = k_lo + i + tl.arange(0, BK)
        km = offs_k < K
        q = tl.load(rowp + offs_k[None, :], mask=nm[:, None] & km[None, :], other=0)
        xv = tl.load(x_ptr + t * stride_x + offs_k, mask=km, other=0.0).to(tl.float32)
        if MAGIC:
            w = (q.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        else:
            w = q.to(tl.float32)
        acc += w * xv[None, :]
    y = tl.sum(acc, axis=1)
    out = y_ptr + t * N + offs_n
    if splits == 1:
        tl.store(out, (y * tl.load(s_ptr + offs_n, mask=nm, other=0.0)).to(y_ptr.dtype.element_ty), mask=nm)
    else:
        tl.store(part_ptr + (pid_k * T + t) * N + offs_n, y, mask=nm)
        # release our partial, acquire the others' (gpu scope): the last arrival sees every partial
        done = tl.atomic_add(cnt_ptr + t * tl.num_programs(1) + pid_n, 1, sem="acq_rel")
        if done == splits - 1:
            tot = tl.zeros((BN,), dtype=tl.float32)
            sp = 0
            while sp < splits:  # split order: a fixed summation order
                tot += tl.load(part_ptr + (sp * T + t) * N + offs_n, mask=nm, other=0.0, cache_modifier=".cg")
                sp += 1
            tl.store(out, (tot * tl.load(s_ptr + offs_n, mask=nm, other=0.0)).to(y_ptr.dtype.element_ty),
                     mask=nm)


_TARGET_PROGRAMS = 528  # a few weight streams per multiprocessor (132 on an H200)


def int8_gemv_config(N: int, K: int, BN: int = 8, BK: int = 512, num_warps: int = 4, num_stages: int = 3,
                     target: int = _TARGET_PROGRAMS, magic: bool = True) -> dict:
    """Block sizes and split-K for one T <= 4 call. Defaults from the H200 sweep."""
    bk = min(BK, max(16, triton.next_power_of_2(K)))
    progs = triton.cdiv(N, BN)
    splits = max(1, min(triton.cdiv(target, progs), triton.cdiv(K, bk)))
    # a power-of-two count of BK steps per split: few distinct compiled variants over all the shapes
    k_per = triton.next_power_of_2(triton.cdiv(triton.cdiv(K, splits), bk)) * bk
    return {"gemv": True, "BN": BN, "BK": bk, "num_warps": num_warps, "num_stages": num_stages,
            "splits": triton.cdiv(K, k_per), "k_per_split": k_per, "magic": magic}


def int8_gemv(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x [.., in] (at most MAX_TOKENS rows) @ W^T for W = q [out, in] int8 times s [out] float32."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T, K = x2.shape
    N = q.shape[0]
    c = cfg or int8_gemv_config(N, K)
    sp, tiles = c["splits"], triton.cdiv(N, c["BN"])
    y = torch.empty(T, N, device=x.device, dtype=x.dtype)
    part, cnt = y, y  # unused with one split
    if sp > 1:
        part = torch.empty(sp, T, N, device=x.device, dtype=torch.float32)
        cnt = torch.zeros(T * tiles, device=x.device, dtype=torch.int32)
    _int8_gemv_kernel[(T, tiles, sp)](
        x2, q, s.to(torch.float32), y, part, cnt, T, N, K, x2.stride(0), sp, K_PER_SPLIT=c["k_per_split"],
        BN=c["BN"], BK=c["BK"], MAGIC=c.get("magic", True), num_warps=c["num_warps"],
        num_stages=c.get("num_stages", 3))
    return y.reshape(*lead, N)


@triton.jit
def _sum_cast_kernel(x_ptr, y_ptr, N, stride_r, stride_m, R: tl.constexpr, BN: tl.constexpr,
                     PDL: tl.constexpr = False):
    """y[m, n] = sum over r in order of x[r, m, n] (float32), stored in y's dtype. PDL: launched early
    (``triton_gemv.PDL``); waits here for the kernel before it."""
    if PDL:
        gdc_wait()
    m, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = pid_n * BN + tl.arange(0, BN)
    mask = offs < N
    acc = tl.zeros((BN,), dtype=tl.float32)
    for r in tl.static_range(R):  # unrolled: the R loads go out together (a decode step's 16 rows: one latency)
        acc += tl.load(x_ptr + r * stride_r + m * stride_m + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * N + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def sum_cast(x: torch.Tensor, dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """x [R, M, N] (rows of N contiguous) summed over R in order, in float32, cast to dtype: [M, N] in one
    launch (torch takes two: the sum, then the cast), for split-K partial sums and the grouped experts'
    k terms of a token. pdl: a programmatic dependent launch (the kernel before it must allow it)."""
    R, M, N = x.shape
    assert x.stride(-1) == 1
    y = torch.empty((M, N), device=x.device, dtype=dtype)
    bn = min(256, triton.next_power_of_2(N))  # several programs per row: a one-token sum is latency-bound
    _sum_cast_kernel[(M, triton.cdiv(N, bn))](x, y, N, x.stride(0), x.stride(1), R=R, BN=bn, PDL=pdl,
                                              num_warps=4, **pdl_launch(pdl))
    return y
