"""Small fused Triton kernels for the decode step's vector work: one launch where the torch form takes many.

A decode step of Kimi K3 runs a few dozen tiny elementwise and row-reduction kernels per layer (norms, the
AttnRes mix, the SiTU-GLU activation), each a few microseconds of GPU time however small its row. These
kernels do each group in one launch, in float32, one program per row:

- ``rms_norm(x, w, eps)``: x [..., D] -> w * x / sqrt(mean(x^2) + eps), in x's dtype;
- ``mix_norm(V, w_mix, w_norm, eps_mix, eps_norm)``: the AttnRes mix of V [S, T, D] (softmax over S of the
  RMS-normalised rows . w_mix, applied to the raw rows; an online softmax, so V is read once), rounded to
  V's dtype as the stream is, then RMS-normalised with w_norm;
- ``situ_glu(g, u, beta, lbeta)``: beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta), elementwise.

The torch forms in the model modules are the reference (tests) and the fallback; the results agree within
float32 rounding before the final cast (the sums run in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafin.kernels.triton_moe import ACT_SITU, _act

MAX_ROW = 16384  # widest row one program holds in registers (Kimi K3's widest normed row is 7168)


@triton.jit
def _rms(x, D, eps):
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * (x * _rms(x, D, eps))).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _mix_norm_kernel(v_ptr, wm_ptr, wn_ptr, y_ptr, S, D, stride_s, stride_t, eps_mix, eps_norm,
                     MAX_S: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    wm = tl.load(wm_ptr + offs, mask=m, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    zero = tl.sum(acc, 0)
    top = zero - float("inf")  # running max of the logits
    den = zero  # running sum of exp(logit - top)
    for s in range(0, MAX_S):  # a constant bound (few compiled variants); sources past S are skipped
        if s < S:
            v = tl.load(v_ptr + s * stride_s + t * stride_t + offs, mask=m, other=0.0).to(tl.float32)
            logit = tl.sum(v * _rms(v, D, eps_mix) * wm, 0)
            new = tl.maximum(top, logit)
            a = tl.exp(top - new)
            b = tl.exp(logit - new)
            acc = acc * a + b * v
            den = den * a + b
            top = new
    h = (acc / den).to(y_ptr.dtype.element_ty).to(tl.float32)  # the mix in the stream's dtype, then its norm
    wn = tl.load(wn_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + t * D + offs, (wn * (h * _rms(h, D, eps_norm))).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _situ_kernel(g_ptr, u_ptr, y_ptr, N, BETA: tl.constexpr, LBETA: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _act(g, u, ACT_SITU, BETA, LBETA).to(y_ptr.dtype.element_ty), mask=m)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def fits(D: int) -> bool:
    return D <= MAX_ROW


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (rows contiguous), w [D] float32 -> [..., D] in x's dtype."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(x2.shape[0],)](x2, w, y, D, x2.stride(0), y.stride(0), float(eps), BLOCK=block,
                                      num_warps=_warps(block))
    return y.view(x.shape)


def mix_norm(V: torch.Tensor, w_mix: torch.Tensor, w_norm: torch.Tensor, eps_mix: float, eps_norm: float
             ) -> torch.Tensor:
    """V [S, T, D] (the block snapshots and the partial sum, stacked) -> the normed mix [T, D] in V's dtype."""
    S, T, D = V.shape
    V = V.contiguous()
    y = torch.empty((T, D), device=V.device, dtype=V.dtype)
    block = triton.next_power_of_2(D)
    _mix_norm_kernel[(T,)](V, w_mix, w_norm, y, S, D, V.stride(0), V.stride(1), float(eps_mix), float(eps_norm),
                           MAX_S=triton.next_power_of_2(S), BLOCK=block, num_warps=_warps(block))
    return y


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor:
    """SiTU-GLU of g and u (same shape) in g's dtype."""
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    block = 1024
    _situ_kernel[(triton.cdiv(n, block),)](g, u, y, n, BETA=float(beta), LBETA=float(lbeta), BLOCK=block,
                                           num_warps=4)
    return y
