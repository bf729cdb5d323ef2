"""GEMV-form Triton kernels for decode (1-4 tokens): no tensor cores, no padded token tiles.

At one token a tensor-core tile pads 15 of its 16 rows, and decoding 4-bit codes into MMA operands costs more
than the bytes take to arrive. Here each program streams a [BN, BK] weight tile with wide loads, decodes it
with a few integer ops per element and multiplies it by one token row in float32 registers:

- ``grouped_glu_gemv``: a layer's routed MXFP4 experts for decode, one program per (pair, n-tile) with the
  pairs sorted by slab slot (pairs sharing an expert run side by side, so repeated reads hit L2). Gate and
  up with the GLU activation fused, then down times the routing weight. The grid depends on (T, k) only, so
  the launch can be captured in a CUDA graph.
- ``int8_gemv``: int8 per-row weights (trunk linears) in one launch, split over the input dimension into
  float32 partial sums that the last split to finish adds in split order (a result never depends on
  arrival order).

E2M1 decode: a magnitude code c = e<<1 | m placed at bits 9..11 of an fp16 (sign at bit 15) is the fp16
2^(e-15) * (1 + m/2), or m * 2^-15 as a subnormal for e = 0: exactly the E2M1 value times 2^-14 for every
code (fp16 subnormals are exact in hardware). The 2^14 goes into the E8M0 block scale, applied once per
32-element block to the block's float32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafin.kernels.triton_tiles import e2m1_bits, e8m0_value, glu_act

# Set from the H200 measurements of ``deltafin.bench.kernels_cuda --gemv`` (copy 4,250 GB/s in the run):
# - MoE: the 16-expert K3 step at one token 0.236 ms = 0.28 of copy here vs 0.269 ms = 0.25 through the
#   tensor-core kernel; but with several pairs per expert each pair re-reads it (T=8, all 16 experts shared:
#   0.04 vs 0.24), so only plans whose pairs all have distinct experts take it (``moe_config``).
# - int8 at T=1: ahead of the tensor-core kernel up to ~44M weights (latent_up 0.49 vs 0.38, shared
#   gate_up 0.55 vs 0.46, router 0.17 vs 0.14), behind on the 88M ones (kda.qkvg 0.59 vs 0.67): over the
#   K3 trunk shapes bytes-weighted 0.54 with this cut-off vs 0.51 tensor-core alone, 0.50 GEMV alone.
GEMV_INT8 = True
GEMV_MOE = True
MAX_TOKENS = 4
INT8_MAX_WEIGHTS = 50_000_000


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
def _gemv_gate_up_kernel(x_ptr, rows_ptr, blk_ptr, gp, gs, upp, ups, h_ptr, stride_x, p_slot, s_slot,
                         RS: tl.constexpr, TOPK: tl.constexpr, K: tl.constexpr, I: tl.constexpr, ACT: tl.constexpr,
                         BETA: tl.constexpr, LBETA: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         DECODE: tl.constexpr):
    """h[pair, n] = act(gate x_t, up x_t) for the pair rows[b * RS] (token t = pair // TOPK), n-tile pid_n."""
    b, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(blk_ptr + b).to(tl.int64)
    pair = tl.load(rows_ptr + b * RS)
    xp = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc_g = tl.zeros((BN, BK // 32), dtype=tl.float32)
    acc_u = tl.zeros((BN, BK // 32), dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc_g = _mx_gemv_acc(acc_g, gp + slot * p_slot, gs + slot * s_slot, xp, offs_n, k0, I, K, BN, BK // 32,
                             DECODE)
        acc_u = _mx_gemv_acc(acc_u, upp + slot * p_slot, ups + slot * s_slot, xp, offs_n, k0, I, K, BN,
                             BK // 32, DECODE)
    h = glu_act(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), ACT, BETA, LBETA)
    tl.store(h_ptr + pair.to(tl.int64) * I + offs_n, h.to(h_ptr.dtype.element_ty), mask=offs_n < I)


@triton.jit
def _gemv_down_kernel(h_ptr, rows_ptr, blk_ptr, rw_ptr, dp, ds, y_ptr, p_slot, s_slot, RS: tl.constexpr,
                      I: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      DECODE: tl.constexpr):
    """y[pair, n] = rw[pair] * (down h[pair])[n] in float32."""
    b, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(blk_ptr + b).to(tl.int64)
    pair = tl.load(rows_ptr + b * RS).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, BK // 32), dtype=tl.float32)
    for k0 in range(0, I, BK):
        acc = _mx_gemv_acc(acc, dp + slot * p_slot, ds + slot * s_slot, h_ptr + pair * I, offs_n, k0, D, I, BN,
                           BK // 32, DECODE)
    w = tl.load(rw_ptr + pair)
    tl.store(y_ptr + pair * D + offs_n, tl.sum(acc, axis=1) * w, mask=offs_n < D)


def moe_gemv_config(BN: int = 16, BK: int = 512, num_warps: int = 4, num_stages: int = 3, decode: int = 0,
                    BN_down: int | None = None, BK_down: int | None = None) -> dict:
    """A decode plan's config: one pair per block (BT 1). Defaults from the H200 sweep."""
    return {"gemv": True, "BT": 1, "BN": BN, "BK": BK, "num_warps": num_warps, "num_stages": num_stages,
            "decode": decode, "BN_down": BN_down or BN, "BK_down": BK_down or BK}


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
    h = torch.empty(T * k, I, device=dev, dtype=x.dtype)
    g, u, dn = slab.data["gate"], slab.data["up"], slab.data["down"]
    _gemv_gate_up_kernel[(T * k, triton.cdiv(I, c["BN"]))](
        x, rows, blk, g, slab.scale["gate"], u, slab.scale["up"], h, x.stride(0),
        g[0].numel(), slab.scale["gate"][0].numel(), RS=rs,
        TOPK=k, K=K, I=I, ACT=act, BETA=beta, LBETA=lbeta, BN=c["BN"], BK=bk, DECODE=c.get("decode", 0),
        num_warps=c["num_warps"], num_stages=c.get("num_stages", 3))
    y = torch.empty(T * k, D, device=dev, dtype=torch.float32)
    rw = weights.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    _gemv_down_kernel[(T * k, triton.cdiv(D, c["BN_down"]))](
        h, rows, blk, rw, dn, slab.scale["down"], y, dn[0].numel(), slab.scale["down"][0].numel(), RS=rs,
        I=I, D=D, BN=c["BN_down"], BK=bk_d, DECODE=c.get("decode", 0), num_warps=c["num_warps"],
        num_stages=c.get("num_stages", 3))
    from deltafin.kernels.triton import sum_cast  # (triton imports this module)

    return sum_cast(y.view(T, k, D).transpose(0, 1), x.dtype)  # each token's k rows in pair order, one launch


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
