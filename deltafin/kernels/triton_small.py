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

from deltafin.kernels.triton_moe import ACT_SITU
from deltafin.kernels.triton_tiles import glu_act

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
def _situ_kernel(g_ptr, u_ptr, y_ptr, N, ACT: tl.constexpr, BETA: tl.constexpr, LBETA: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, glu_act(g, u, ACT, BETA, LBETA).to(y_ptr.dtype.element_ty), mask=m)


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
    _situ_kernel[(triton.cdiv(n, block),)](g, u, y, n, ACT=ACT_SITU, BETA=float(beta), LBETA=float(lbeta),
                                           BLOCK=block, num_warps=4)  # compiled kernels see constexpr args only
    return y


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _conv_silu(y_ptr, w_ptr, hist_ptr, ck, C, W: tl.constexpr):
    """One projection's causal conv (4 taps, the last on the current token) + SiLU on this head's channels;
    the history moves on by one token in place. A channel's value is held by several threads when the program
    has more threads than channels: the barrier keeps every thread's reads of the history before any thread's
    writes (without it a thread could read a tap another had already moved on: docs/DETERMINISM.md)."""
    x = tl.load(y_ptr + ck).to(tl.float32)
    h0 = tl.load(hist_ptr + ck)
    h1 = tl.load(hist_ptr + C + ck)
    h2 = tl.load(hist_ptr + 2 * C + ck)
    a = h0 * tl.load(w_ptr + ck * W) + h1 * tl.load(w_ptr + ck * W + 1) + h2 * tl.load(w_ptr + ck * W + 2) \
        + x * tl.load(w_ptr + ck * W + 3)
    tl.debug_barrier()
    tl.store(hist_ptr + ck, h1)
    tl.store(hist_ptr + C + ck, h2)
    tl.store(hist_ptr + 2 * C + ck, x)
    return a * _sigmoid(a)


@triton.jit
def _kda_step_kernel(yq, yk, yv, wq, wk, wv, hist_ptr, z_ptr, dtb_ptr, alog_ptr, b_ptr, gl_ptr, onw_ptr, S_ptr,
                     out_ptr, C, bound, eps, scale, l2_eps, K: tl.constexpr, W: tl.constexpr):
    """One KDA head of a one-token step: conv+SiLU of q/k/v, L2 norms, lower-bound decay, the delta-rule update
    of S [K, K] in place, the output read from the new state, its RMSNorm and sigmoid output gate."""
    h = tl.program_id(0)
    ck = h * K + tl.arange(0, K)
    hist_c = (W - 1) * C
    q = _conv_silu(yq, wq, hist_ptr, ck, C, W)
    k = _conv_silu(yk, wk, hist_ptr + hist_c, ck, C, W)
    v = _conv_silu(yv, wv, hist_ptr + 2 * hist_c, ck, C, W)
    q = q / tl.sqrt(tl.sum(q * q, 0) + l2_eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + l2_eps)
    z = tl.load(z_ptr + ck).to(tl.float32) + tl.load(dtb_ptr + ck)
    g = bound * _sigmoid(tl.exp(tl.load(alog_ptr + h)) * z)  # log-decay per key channel
    beta = _sigmoid(tl.load(b_ptr + h).to(tl.float32))
    rows = tl.arange(0, K)
    s_ptrs = S_ptr + h.to(tl.int64) * K * K + rows[:, None] * K + rows[None, :]
    S = tl.load(s_ptrs) * tl.exp(g)[:, None]  # decay the rows
    u = tl.sum(k[:, None] * S, 0)  # S^T k
    S = S + (beta * k)[:, None] * (v - u)[None, :]
    tl.store(s_ptrs, S)
    o = tl.sum(q[:, None] * S, 0)  # S^T q, from the updated state
    o = o / tl.sqrt(tl.sum(o * o, 0) / K + eps) * tl.load(onw_ptr + rows)
    o = o * _sigmoid(tl.load(gl_ptr + ck).to(tl.float32))
    tl.store(out_ptr + ck, o.to(out_ptr.dtype.element_ty))


def kda_fits(H: int, K: int, W: int) -> bool:
    return W == 4 and K == triton.next_power_of_2(K) and K <= 128


def kda_step(yq, yk, yv, wq, wk, wv, hist, z, dt_bias, A_log, b, gl, o_norm, S, bound: float, eps: float,
             scale: float, l2_eps: float) -> torch.Tensor:
    """The KDA layer of one token between its projections and o_proj (kimi_k3 ``_kda``, T = 1).

    yq/yk/yv/z/gl [1, C] projections (x's dtype), b [1, H], conv taps [C, 4] float32, hist [3, 3, C] and
    S [H, K, K] float32 (both updated in place), dt_bias [C], A_log [H], o_norm [K] float32. Returns the gated,
    normed output [1, C] in x's dtype."""
    H, K, _ = S.shape
    C = H * K
    out = torch.empty((1, C), device=yq.device, dtype=yq.dtype)
    args = [t.contiguous() for t in (yq, yk, yv, wq, wk, wv)]
    _kda_step_kernel[(H,)](*args, hist, z.contiguous(), dt_bias, A_log.contiguous(), b.contiguous(), gl.contiguous(),
                           o_norm, S, out, C, float(bound), float(eps), float(scale), float(l2_eps), K=K, W=4,
                           num_warps=16 if K * K > 8192 else 4)
    return out


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold


@triton.jit
def _gdn_step_kernel(y_ptr, w_ptr, hist_ptr, z_ptr, b_ptr, a_ptr, A_ptr, dtb_ptr, onw_ptr, S_ptr, out_ptr,
                     Hk, C, eps, scale, l2_eps, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     W: tl.constexpr):
    """One key head of a one-token Gated DeltaNet step and its R value heads: conv+SiLU of q, k and the heads'
    v, L2 norms, each value head's scalar decay and delta-rule update of S [K, V] in place, the output read
    from the new state, its RMSNorm and SiLU(z) gate. One program owns a key head's q/k channels, so their
    conv history moves on once."""
    hk = tl.program_id(0)
    ok, ov = tl.arange(0, K), tl.arange(0, V)
    q = _conv_silu(y_ptr, w_ptr, hist_ptr, hk * K + ok, C, W)
    k = _conv_silu(y_ptr, w_ptr, hist_ptr, Hk * K + hk * K + ok, C, W)
    q = q / tl.sqrt(tl.sum(q * q, 0) + l2_eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + l2_eps)
    for j in tl.static_range(R):
        hv = hk * R + j
        cv = 2 * Hk * K + hv * V + ov
        v = _conv_silu(y_ptr, w_ptr, hist_ptr, cv, C, W)
        beta = _sigmoid(tl.load(b_ptr + hv).to(tl.float32))
        g = tl.load(A_ptr + hv) * _softplus(tl.load(a_ptr + hv).to(tl.float32) + tl.load(dtb_ptr + hv))
        s_ptrs = S_ptr + hv.to(tl.int64) * K * V + ok[:, None] * V + ov[None, :]
        S = tl.load(s_ptrs) * tl.exp(g)
        u = tl.sum(k[:, None] * S, 0)  # S^T k
        S = S + (beta * k)[:, None] * (v - u)[None, :]
        tl.store(s_ptrs, S)
        o = tl.sum(q[:, None] * S, 0)
        o = o / tl.sqrt(tl.sum(o * o, 0) / V + eps) * tl.load(onw_ptr + ov)
        zz = tl.load(z_ptr + hv * V + ov).to(tl.float32)
        tl.store(out_ptr + hv * V + ov, (o * zz * _sigmoid(zz)).to(out_ptr.dtype.element_ty))


def gdn_fits(Hk: int, Hv: int, K: int, V: int, W: int) -> bool:
    pow2 = all(n == triton.next_power_of_2(n) and 16 <= n <= 128 for n in (K, V))
    return W == 4 and pow2 and Hv % Hk == 0


def gdn_step(qkv, taps, hist, z, b, a, A, dt_bias, o_norm, S, Hk: int, eps: float, scale: float, l2_eps: float
             ) -> torch.Tensor:
    """The Gated DeltaNet layer of one token between its projections and out_proj (qwen3_next ``_delta_net``,
    T = 1). qkv [1, C] (q | k | v channels), z [Hv, V], b and a [1, Hv] in x's dtype; taps [C, 4], hist [3, C]
    and S [Hv, K, V] float32 (both updated in place); A (-exp(A_log)), dt_bias [Hv] and o_norm [V] float32.
    Returns the gated, normed output [1, Hv * V] in qkv's dtype."""
    Hv, K, V = S.shape
    out = torch.empty((1, Hv * V), device=qkv.device, dtype=qkv.dtype)
    _gdn_step_kernel[(Hk,)](qkv.contiguous(), taps, hist, z.contiguous(), b.contiguous(), a.contiguous(), A, dt_bias,
                            o_norm, S, out, Hk, qkv.shape[-1], float(eps), float(scale), float(l2_eps), R=Hv // Hk,
                            K=K, V=V, W=4, num_warps=16 if K * V > 8192 else 4)
    return out
