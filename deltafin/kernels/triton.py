"""CUDA backend: weight-only quantized linear layers in Triton, decoding the stored bytes inside the kernel.

``mxfp4_linear(x, packed, scales)``, ``int8_linear(x, q, s)`` and ``int4g32_linear(x, packed, scales)`` take
x [T, in] (bf16 or float32) and a weight [out, in] exactly as the store keeps it and return x @ W^T [T, out]
in x's dtype. One kernel serves decode (a few tokens: the token tile is padded to the tensor-core minimum
of 16 and the input dimension is split over programs so every multiprocessor streams weights) and prefill
(large token tiles: a tensor-core GEMM whose weight tile is decoded once per token tile).

Exactness: each decoded weight is exact in float32 and, for MXFP4 and int8, in bf16 too (E2M1 times a
power of two; |q| <= 127), so with bf16 x the only roundings are the products' float32 accumulation and the
final cast; int4 weights times a bf16 group scale round once to bf16. Float32 x is multiplied in full
float32 precision (no TF32). int8 weights under a bf16 prompt (more than X2_TOKENS tokens) take the int8 tensor
cores instead: each token's row as two int8 terms (within 2^-16 of its largest |x|), exact int32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafin.kernels import invariance, triton_gemv
from deltafin.kernels.triton_gemv import sum_cast  # noqa: F401  (re-exported: triton_moe, tests)
from deltafin.kernels.triton_tiles import (
    FMT_INT4G32,
    FMT_INT8,
    FMT_MXFP4,
    FMT_MXFP4_SCALED,
    INTERPRET,
    mma_weight,
)


@triton.jit
def _linear_kernel(x_ptr, p_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, T, N, K, stride_x, splits,
                   K_PER_SPLIT: tl.constexpr, FMT: tl.constexpr, ROW_SCALE: tl.constexpr, IEEE: tl.constexpr,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[t, n] = sum over k of x[t, k] * W[n, k] (float32 sums, stored in y's dtype). With several splits of k
    each program stores its float32 partial tile and the last of a tile's splits to arrive (a counter) adds
    them in split order and stores the result: one launch, and the sum never depends on arrival order."""
    pid_n, pid_t, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = pid_t * BT + tl.arange(0, BT)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for i in range(0, K_PER_SPLIT, BK):  # the last split may run past K: masked
        k0 = k_lo + i
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_t[:, None] * stride_x + offs_k[None, :],
                    mask=(offs_t < T)[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = mma_weight(acc, x, p_ptr, s_ptr, offs_n, k0, N, K, FMT, IEEE, BN, BK)
    if ROW_SCALE:
        acc = acc * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    tile = offs_t[:, None] * N + offs_n[None, :]
    mask = (offs_t < T)[:, None] & (offs_n < N)[None, :]
    if splits == 1:
        tl.store(y_ptr + tile, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * T * N + tile, acc, mask=mask)
        # release our partial, acquire the others' (gpu scope): the last arrival sees every partial
        done = tl.atomic_add(cnt_ptr + pid_t * tl.num_programs(0) + pid_n, 1, sem="acq_rel")
        if done == splits - 1:
            tot = tl.zeros((BT, BN), dtype=tl.float32)
            sp = 0
            while sp < splits:  # split order: a fixed summation order
                tot += tl.load(part_ptr + sp * T * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
                sp += 1
            tl.store(y_ptr + tile, tot.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp16_rows_kernel(x_ptr, y_ptr, inv_ptr, C, stride_x, BC: tl.constexpr):
    """Row r of x -> fp16 x * f and 1 / f (``fp16_rows``): a pass for the row's largest |x|, one to scale."""
    r = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BC,), dtype=tl.float32)
    for c0 in range(0, C, BC):
        offs = c0 + tl.arange(0, BC)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + r * stride_x + offs, mask=offs < C, other=0.0).to(tl.float32)))
    ea = (tl.max(amax, axis=0).to(tl.int32, bitcast=True) >> 23) & 255
    f = (tl.where(ea == 0, 127, tl.minimum(267 - ea, 254)) << 23).to(tl.float32, bitcast=True)
    for c0 in range(0, C, BC):
        offs = c0 + tl.arange(0, BC)
        v = tl.load(x_ptr + r * stride_x + offs, mask=offs < C, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * C + offs, (v * f).to(tl.float16), mask=offs < C)
    tl.store(inv_ptr + r, 1.0 / f)


def fp16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (fp16 x * f row by row, 1 / f as float32 [R]): f the power of two that puts the row's
    largest |x| in [2^13, 2^14) (1 for a row of zeros or float32 subnormals). Exact for bf16 x (8 significant
    bits, scaled by a power of two, fit fp16's 11); float32 x is rounded to 11 bits. One launch on a GPU
    (``_fp16_rows_kernel``), the same numbers from torch ops elsewhere."""
    R, C = x.shape
    if x.is_cuda and not INTERPRET and x.stride(-1) == 1:
        y = torch.empty(R, C, device=x.device, dtype=torch.float16)
        inv = torch.empty(R, device=x.device, dtype=torch.float32)
        _fp16_rows_kernel[(R,)](x, y, inv, C, x.stride(0), BC=min(4096, triton.next_power_of_2(C)), num_warps=8)
        return y, inv
    ea = (x.abs().amax(-1).float().view(torch.int32) >> 23) & 255
    f = (torch.where(ea == 0, 127, (267 - ea).clamp(max=254)) << 23).view(torch.float32)
    return (x.float() * f[:, None]).half(), (1.0 / f).contiguous()


# Programs wanted per launch so that every multiprocessor has a couple of weight streams in flight.
_TARGET_PROGRAMS = 264


def linear_config(fmt: str, T: int, N: int, K: int) -> dict:
    """Block sizes and split-K for one call: a 16-token tile and split-K for decode, large tiles for
    prefill. Chosen by the H200 sweep of ``deltafin.bench.kernels_cuda`` (BN 64 x BK 256, 4 warps, 3
    stages was fastest or within 3% for every decode shape, int8 and MXFP4). Prefill int8 runs at ~410
    TFLOP/s at the K3 shapes (4,096 tokens) where cuBLAS's bf16 on plain weights reaches 670-810: the
    tensor-core pipeline, not the decode (Triton already turns int8 into bf16 with byte permutes; an fp16
    route through inline PTX, with the weight as the dot's register operand or not, measured the same or
    slower)."""
    if T <= 16:
        bt, bn, bk, warps, stages = 16, 64, 256, 4, 3
    elif T <= 64:
        bt, bn, bk, warps, stages = 64, 64, 128, 4, 3
    else:
        bt, bn, bk, warps, stages = 128, 128, 64, 8, 3
    bk = min(bk, max(32, triton.next_power_of_2(K)))
    progs = triton.cdiv(N, bn) * triton.cdiv(T, bt)
    splits = max(1, min(triton.cdiv(_TARGET_PROGRAMS, progs), triton.cdiv(K, bk) // 2 or 1))
    k_per = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, k_per)
    return {"BT": bt, "BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages, "splits": splits,
            "k_per_split": k_per}


def invariant_config(K: int) -> dict:
    """Batch invariance (``kernels.batch_invariant``): one tile shape at every token count and no split-K, so each
    row's sums run in the same order whatever other rows share the call (a tensor-core tile computes its rows
    independently); the decode GEMV and the larger prefill tiles would each sum otherwise."""
    bk = min(256, max(32, triton.next_power_of_2(K)))
    return {"BT": 16, "BN": 64, "BK": bk, "num_warps": 4, "num_stages": 3, "splits": 1,
            "k_per_split": triton.cdiv(K, bk) * bk}


_FMT = {"mxfp4": FMT_MXFP4, "int8": FMT_INT8, "int4g32": FMT_INT4G32}
# MXFP4 with bf16 activations: Triton's scaled dot (hardware-friendly E2M1 upcast) instead of the integer
# decode; set from the H200 measurements (both are checked against the reference there).
MXFP4_SCALED_DOT = True  # H200: 10-25% faster at every decode and prefill shape, same error


def format_code(fmt: str, dtype: torch.dtype, scaled: bool | None = None) -> int:
    use = MXFP4_SCALED_DOT if scaled is None else scaled
    if fmt == "mxfp4" and use and dtype == torch.bfloat16 and not INTERPRET:
        return FMT_MXFP4_SCALED
    return _FMT[fmt]


def _linear(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, fmt: str, N: int, cfg: dict | None = None
            ) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T, K = x2.shape
    if cfg is None and invariance.ENABLED.get():
        cfg = invariant_config(K)
    if fmt == "int8" and (cfg.get("gemv") if cfg else triton_gemv.use_int8_gemv(T, N, K)):
        return triton_gemv.int8_gemv(x2, p, s, cfg).reshape(*lead, N)  # decode: the GEMV form
    if fmt == "int8" and cfg is None and use_int8_x2(T, K, x2.dtype):
        return int8_x2_linear(x2, p, s).reshape(*lead, N)  # prefill: int8 tensor cores, two activation terms
    c = cfg or linear_config(fmt, T, N, K)
    sp = c["splits"]
    grid = (triton.cdiv(N, c["BN"]), triton.cdiv(T, c["BT"]), sp)
    y = torch.empty(T, N, device=x.device, dtype=x.dtype)
    part = cnt = y  # one split writes the result directly; several write float32 partial sums, added in-kernel
    if sp > 1:
        part = torch.empty(sp, T, N, device=x.device, dtype=torch.float32)
        cnt = torch.zeros(grid[0] * grid[1], device=x.device, dtype=torch.int32)
    _linear_kernel[grid](x2, p, s, y, part, cnt, T, N, K, x2.stride(0), sp,
                         K_PER_SPLIT=c["k_per_split"], FMT=format_code(fmt, x.dtype, c.get("scaled")), ROW_SCALE=fmt == "int8", IEEE=x.dtype == torch.float32 or INTERPRET,
                         BT=c["BT"], BN=c["BN"], BK=c["BK"], num_warps=c["num_warps"],
                         num_stages=c["num_stages"])
    return y.reshape(*lead, N)


@triton.jit
def _x2_rows_kernel(x_ptr, h_ptr, l_ptr, s_ptr, C, stride_x, BC: tl.constexpr):
    """Row r of x -> int8 h, l and s = max|x| / 127 with x = s (h + l / 254) within s / 508 (``x2_rows``)."""
    r = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BC,), dtype=tl.float32)
    for c0 in range(0, C, BC):
        o = c0 + tl.arange(0, BC)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + r * stride_x + o, mask=o < C, other=0.0).to(tl.float32)))
    m = tl.max(amax, axis=0)
    inv = tl.where(m > 0, 127.0 / m, 0.0)
    for c0 in range(0, C, BC):
        o = c0 + tl.arange(0, BC)
        v = tl.load(x_ptr + r * stride_x + o, mask=o < C, other=0.0).to(tl.float32) * inv  # in [-127, 127]
        h = tl.floor(v + 0.5)
        lo = tl.minimum(tl.maximum(tl.floor((v - h) * 254.0 + 0.5), -127.0), 127.0)
        tl.store(h_ptr + r * C + o, h.to(tl.int8), mask=o < C)
        tl.store(l_ptr + r * C + o, lo.to(tl.int8), mask=o < C)
    tl.store(s_ptr + r, m / 127.0)


@triton.jit
def _int8_x2_kernel(h_ptr, l_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, T, N, K, BT: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP: tl.constexpr):
    """y = (h W^T + l W^T / 254) * sx[t] * sw[n]: both products in int32 on the int8 tensor cores (exact), token
    tiles grouped by GROUP so that a weight tile serves several of them from L2."""
    pid = tl.program_id(0)
    nt, nn = tl.cdiv(T, BT), tl.cdiv(N, BN)
    per = GROUP * nn
    t0 = (pid // per) * GROUP
    gs = tl.minimum(nt - t0, GROUP)
    pid_t = t0 + (pid % per) % gs
    pid_n = (pid % per) // gs
    ot = pid_t * BT + tl.arange(0, BT)
    on = pid_n * BN + tl.arange(0, BN)
    ok = tl.arange(0, BK)
    ah = tl.zeros((BT, BN), dtype=tl.int32)
    al = tl.zeros((BT, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        kk = k0 + ok
        mx = (ot < T)[:, None] & (kk < K)[None, :]
        xh = tl.load(h_ptr + ot[:, None].to(tl.int64) * K + kk[None, :], mask=mx, other=0)
        xl = tl.load(l_ptr + ot[:, None].to(tl.int64) * K + kk[None, :], mask=mx, other=0)
        w = tl.load(w_ptr + on[:, None].to(tl.int64) * K + kk[None, :], mask=(on < N)[:, None] & (kk < K)[None, :],
                    other=0)
        wt = tl.trans(w)
        ah = tl.dot(xh, wt, ah, out_dtype=tl.int32)
        al = tl.dot(xl, wt, al, out_dtype=tl.int32)
    y = ah.to(tl.float32) + al.to(tl.float32) * (1.0 / 254.0)
    y = y * tl.load(sx_ptr + ot, mask=ot < T, other=0.0)[:, None] * tl.load(sw_ptr + on, mask=on < N, other=0.0)[None, :]
    tl.store(y_ptr + ot[:, None] * N + on[None, :], y.to(y_ptr.dtype.element_ty), mask=(ot < T)[:, None] & (on < N)[None, :])


X2_TOKENS = 64  # from this many tokens a bf16 int8 linear takes the two-term int8 GEMM
X2_MAX_K = 1 << 17  # |sum h w| <= 127 * 127 * K must stay in int32
X2_MIN_K = 1024  # shorter rows stay on the bf16 route (H200, K = 512: 310 against 348 TFLOP/s)


def use_int8_x2(T: int, K: int, dtype: torch.dtype) -> bool:
    """The two-term int8 GEMM for this call: bf16 activations, a prefill's token count, not batch-invariant (that
    mode keeps one tile shape at every count)."""
    return (dtype == torch.bfloat16 and T > X2_TOKENS and X2_MIN_K <= K <= X2_MAX_K
            and not invariance.ENABLED.get())


def x2_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, C] -> (h, l int8 [R, C], s float32 [R]) with x = s (h + l / 254) within s / 508 per value, s the row's
    largest |x| / 127: about 16 bits of the row's range, finer than bf16's 8 for values above 1/256 of it."""
    R, C = x.shape
    h = torch.empty(R, C, device=x.device, dtype=torch.int8)
    lo = torch.empty_like(h)
    s = torch.empty(R, device=x.device, dtype=torch.float32)
    _x2_rows_kernel[(R,)](x, h, lo, s, C, x.stride(0), BC=min(1024, triton.next_power_of_2(C)), num_warps=4)
    return h, lo, s


def int8_x2_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [T, in] bf16 (rows contiguous) @ (q [out, in] int8 times s [out]) ^T in bf16: x as two int8 terms per
    token (``x2_rows``), both products exact int32 sums on the int8 tensor cores. A token's result depends on its
    own row only. H200, 4,096 tokens at K3's trunk shapes (K >= 1,536): 466-576 TFLOP/s of the bf16-equivalent work
    against 387-455 for the bf16 route (``_linear_kernel``), the output error the same (bf16's final rounding)."""
    T, K = x.shape
    N = q.shape[0]
    h, lo, sx = x2_rows(x)
    y = torch.empty(T, N, device=x.device, dtype=x.dtype)
    bt, bn, bk = 128, 128, 128
    grid = (triton.cdiv(T, bt) * triton.cdiv(N, bn),)
    _int8_x2_kernel[grid](h, lo, sx, q, s, y, T, N, K, BT=bt, BN=bn, BK=bk, GROUP=8, num_warps=8, num_stages=3)
    return y


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, cfg: dict | None = None
                 ) -> torch.Tensor:
    """x [.., in] @ W^T for MXFP4 W: packed uint8 [out, in/2], scales uint8 [out, in/32]."""
    return _linear(x, packed, scales, "mxfp4", packed.shape[0], cfg)


def int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x [.., in] @ W^T for W = q [out, in] int8 times s [out] float32 per row."""
    return _linear(x, q, s.to(torch.float32), "int8", q.shape[0], cfg)


def int4g32_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, cfg: dict | None = None
                   ) -> torch.Tensor:
    """x [.., in] @ W^T for INT4 group-32 W: packed int32 [out, in/8], scales [out, in/32]."""
    return _linear(x, packed, scales, "int4g32", packed.shape[0], cfg)
