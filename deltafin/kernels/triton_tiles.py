"""Triton tile loaders: one weight tile [BN, BK] decoded from the stored bytes into float32, in registers.

Every loader reads the packed layout exactly as the store keeps it (deltafin/quant/*.py) and never writes a
dequantized copy to memory. The decoded values are exact: an E2M1 code times a power of two, an int8 value,
or an int4 value times its bf16 group scale, each representable in float32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The three weight formats the kernels decode (constexpr switch values).
FMT_MXFP4 = 0
FMT_INT8 = 1
FMT_INT4G32 = 2
FMT_MXFP4_SCALED = 3  # MXFP4 through tl.dot_scaled (bf16 activations on the GPU; no interpreter support)


@triton.jit
def e2m1_bits(codes):
    """float32 bit pattern of E2M1 codes (uint32, 0..15): sign<<3 | exp<<1 | mantissa, bias 1.

    A magnitude code c >= 2 is 2^(c>>1 - 1) * (1 + (c&1)/2): exponent field (c>>1) + 126 and mantissa bit
    22, i.e. (c + 252) << 22. Code 1 is 0.5 (exponent field 126, no mantissa) and code 0 is 0, both
    c * (252 << 22). Built with integer ops so no float32 subnormal is ever formed (a flush to zero cannot
    change the value)."""
    mag = codes & 7
    bits = tl.where(mag > 1, (mag + 252) << 22, mag * (252 << 22))
    return bits | ((codes & 8) << 28)


@triton.jit
def e8m0_value(s):
    """2**(s - 127) for E8M0 bytes s (uint32): s << 23 as float32, with s = 0 the subnormal 2^-127 and
    s = 255 NaN (OCP MX)."""
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile(p_ptr, s_ptr, offs_n, k0, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Rows offs_n [BN], columns k0..k0+BK of an MXFP4 weight: packed uint8 [N, K/2] (even element in the
    low nibble), scales uint8 [N, K/32]. Returns float32 [BN, BK]; out-of-range entries are 0."""
    offs_h = k0 // 2 + tl.arange(0, BK // 2)
    offs_b = k0 // 32 + tl.arange(0, BK // 32)
    nm = offs_n < N
    b = tl.load(p_ptr + offs_n[:, None] * (K // 2) + offs_h[None, :],
                mask=nm[:, None] & (offs_h < K // 2)[None, :], other=0).to(tl.uint32)
    codes = tl.join(b & 15, b >> 4).reshape(BN, BK)  # element 2j from the low nibble, 2j+1 from the high
    v = e2m1_bits(codes).to(tl.float32, bitcast=True)
    s = tl.load(s_ptr + offs_n[:, None] * (K // 32) + offs_b[None, :],
                mask=nm[:, None] & (offs_b < K // 32)[None, :], other=127).to(tl.uint32)
    return (v.reshape(BN, BK // 32, 32) * e8m0_value(s)[:, :, None]).reshape(BN, BK)


@triton.jit
def int8_tile(q_ptr, offs_n, k0, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Rows offs_n, columns k0..k0+BK of int8 q [N, K] as float32 (the per-row scale is applied after the
    dot product, where it is one multiply per output)."""
    offs_k = k0 + tl.arange(0, BK)
    q = tl.load(q_ptr + offs_n[:, None] * K + offs_k[None, :],
                mask=(offs_n < N)[:, None] & (offs_k < K)[None, :], other=0)
    return q.to(tl.float32)


@triton.jit
def int4g32_tile(p_ptr, s_ptr, offs_n, k0, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """INT4 group 32 (compressed-tensors pack-quantized): packed int32 [N, K/8], element i of a word at
    bits 4i stored as q + 8; scales [N, K/32] (bf16 or float32). Returns float32 [BN, BK]."""
    offs_w = k0 // 8 + tl.arange(0, BK // 8)
    offs_g = k0 // 32 + tl.arange(0, BK // 32)
    nm = offs_n < N
    w = tl.load(p_ptr + offs_n[:, None] * (K // 8) + offs_w[None, :],
                mask=nm[:, None] & (offs_w < K // 8)[None, :], other=0).to(tl.uint32, bitcast=True)
    shifts = tl.arange(0, 8).to(tl.uint32) * 4
    nib = (w[:, :, None] >> shifts[None, None, :]) & 15
    q = (nib.to(tl.int32) - 8).to(tl.float32).reshape(BN, BK // 32, 32)
    s = tl.load(s_ptr + offs_n[:, None] * (K // 32) + offs_g[None, :],
                mask=nm[:, None] & (offs_g < K // 32)[None, :], other=0).to(tl.float32)
    return (q * s[:, :, None]).reshape(BN, BK)


@triton.jit
def weight_tile(p_ptr, s_ptr, offs_n, k0, N, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    if FMT == 0:
        return mxfp4_tile(p_ptr, s_ptr, offs_n, k0, N, K, BN, BK)
    elif FMT == 1:
        return int8_tile(p_ptr, offs_n, k0, N, K, BN, BK)
    else:
        return int4g32_tile(p_ptr, s_ptr, offs_n, k0, N, K, BN, BK)


# Triton's interpreter (CPU tests) gets bf16 dot products wrong: there both operands go in as float32.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def mma(acc, x, w, IEEE: tl.constexpr):
    """acc += x [BT, BK] @ w[BN, BK]^T with w cast to x's dtype; float32 inputs keep full precision.
    IEEE: float32 operands (float32 activations, or any under the interpreter)."""
    if IEEE:
        x = x.to(tl.float32)
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
def mma_weight(acc, x, p_ptr, s_ptr, offs_n, k0, N, K, FMT: tl.constexpr, IEEE: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """acc += x @ W[offs_n, k0:k0+BK]^T for a stored weight W [N, K]."""
    if FMT == 3:
        offs_h = k0 // 2 + tl.arange(0, BK // 2)
        offs_b = k0 // 32 + tl.arange(0, BK // 32)
        nm = offs_n < N
        b = tl.load(p_ptr + offs_n[:, None] * (K // 2) + offs_h[None, :],
                    mask=nm[:, None] & (offs_h < K // 2)[None, :], other=0)
        s = tl.load(s_ptr + offs_n[:, None] * (K // 32) + offs_b[None, :],
                    mask=nm[:, None] & (offs_b < K // 32)[None, :], other=127)
        return tl.dot_scaled(x.to(tl.bfloat16), None, "bf16", tl.trans(b), s, "e2m1", acc)
    else:
        return mma(acc, x, weight_tile(p_ptr, s_ptr, offs_n, k0, N, K, FMT, BN, BK), IEEE)


@triton.jit
def tanh_sat(z):
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)  # saturates to +-1 without NaN at large |z|


@triton.jit
def glu_act(g, u, ACT: tl.constexpr, BETA: tl.constexpr, LBETA: tl.constexpr):
    """The gated activation of the grouped expert kernels: SwiGLU silu(g) * u (ACT 0) or Kimi K3's SiTU-GLU
    beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta) (ACT 1), in float32."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    if ACT == 0:
        return g * sig * u
    else:
        return BETA * tanh_sat(g / BETA) * sig * (LBETA * tanh_sat(u / LBETA))
