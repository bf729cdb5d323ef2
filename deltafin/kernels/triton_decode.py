"""One-token decode kernels for the steps around the big GEMVs: MLA's absorbed projections and attention,
and the router.

On an H200 a K3 decode step spent ~80 us per MLA layer turning kv_b_proj (int8 [H*(dn+dv), R], 12.6 MB) into a
bf16 copy before two small batched matmuls, ~20 us on the scores of every cached row, and ~25 us per MoE layer
on the router (its bf16 weight widened to float32 every step, a GEMV, then eight small launches). Here:

- ``mla_absorb_q(q_nope, q, s, dn, dv)``: q_lat[h] = q_nope[h] @ W_uk[h] straight from the int8 rows (or bf16
  ones), exact products (q * x * s in float32), float32 sums; ``mla_absorb_out(o, q, s, dn, dv)``: out[h] =
  W_uv[h] @ o[h]. Each reads its half of kv_b once;
- ``mla_attend(q_lat, q_rot, rows, pos, scale)``: the absorbed attention of one token over the latent cache in
  splits of the rows (flash-decoding: scores and an online softmax in float32 on the tensor cores, the splits
  merged by a second launch);
- ``router_topk(x, w, bias, k, renorm, scaling, eps)``: float32 logits of bf16 router rows (exact products,
  float32 sums), and the last program to finish (a counter) takes the sigmoid, adds the selection bias,
  picks the k best (ties to the lower index) and writes the ids and the renormalised, scaled weights: one
  launch.

The torch forms (``mla.attend_absorbed``, ``common.sigmoid_topk``) are the reference and the fallback; the
results agree within float32 rounding, or bf16 where the torch form rounds (kv_b, the scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafin.kernels.triton_tiles import INTERPRET

MAX_EXPERTS = 4096  # widest router one program ranks in registers


@triton.jit
def _absorb_q_kernel(x_ptr, q_ptr, s_ptr, y_ptr, R, DN: tl.constexpr, DV: tl.constexpr, BR: tl.constexpr,
                     SCALED: tl.constexpr):
    """y[h, r] = sum_d x[h, d] * s[h*(DN+DV) + d] * q[h*(DN+DV) + d, r] for one head and BR columns (s = 1 for
    bf16 or float32 rows)."""
    h, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_d = tl.arange(0, DN)
    offs_r = pid * BR + tl.arange(0, BR)
    rm = offs_r < R
    rows = h * (DN + DV) + offs_d
    w = tl.load(q_ptr + rows[:, None] * R + offs_r[None, :], mask=rm[None, :], other=0).to(tl.float32)
    xs = tl.load(x_ptr + h * DN + offs_d).to(tl.float32)
    if SCALED:
        xs = xs * tl.load(s_ptr + rows)
    tl.store(y_ptr + h * R + offs_r, tl.sum(w * xs[:, None], axis=0).to(y_ptr.dtype.element_ty), mask=rm)


@triton.jit
def _absorb_out_kernel(o_ptr, q_ptr, s_ptr, y_ptr, R, DN: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                       BR: tl.constexpr, SCALED: tl.constexpr):
    """y[h*DV + v] = s[row] * sum_r q[row, r] * o[h, r], row = h*(DN+DV) + DN + v, for one head and BV rows."""
    h, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_v = pid * BV + tl.arange(0, BV)
    vm = offs_v < DV
    rows = h * (DN + DV) + DN + offs_v
    acc = tl.zeros((BV, BR), dtype=tl.float32)
    for r0 in range(0, R, BR):
        offs_r = r0 + tl.arange(0, BR)
        rm = offs_r < R
        w = tl.load(q_ptr + rows[:, None] * R + offs_r[None, :], mask=vm[:, None] & rm[None, :], other=0)
        o = tl.load(o_ptr + h * R + offs_r, mask=rm, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * o[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:
        y = y * tl.load(s_ptr + rows, mask=vm, other=0.0)
    tl.store(y_ptr + h * DV + offs_v, y.to(y_ptr.dtype.element_ty), mask=vm)


def absorb_fits(dn: int, dv: int, R: int) -> bool:
    """Whether the absorbed kernels take these widths (power-of-two head widths, a latent of at most 4096)."""
    return dn == triton.next_power_of_2(dn) and dv == triton.next_power_of_2(dv) and 16 <= dn <= 256 and \
        16 <= dv <= 256 and R <= 4096


def mla_absorb_q(q_nope: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, dn: int, dv: int) -> torch.Tensor:
    """q_nope [1, H, dn] -> q_lat [1, H, R] in q_nope's dtype, for kv_b_proj = q [H*(dn+dv), R] (int8 times the
    row scales s, or bf16 / float32 rows with s None)."""
    _, H, _ = q_nope.shape
    R = q.shape[1]
    x = q_nope.reshape(H, dn).contiguous()
    y = torch.empty(1, H, R, device=q_nope.device, dtype=q_nope.dtype)
    br = min(128, triton.next_power_of_2(R))
    _absorb_q_kernel[(H, triton.cdiv(R, br))](x, q, q if s is None else s, y, R, DN=dn, DV=dv, BR=br,
                                              SCALED=s is not None, num_warps=4)
    return y


def mla_absorb_out(o: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, dn: int, dv: int) -> torch.Tensor:
    """o [1, H, R] (attention over the latent rows) -> [1, H*dv] in o's dtype: each head's W_uv @ o[h]."""
    _, H, R = o.shape
    x = o.reshape(H, R).contiguous()
    y = torch.empty(1, H * dv, device=o.device, dtype=o.dtype)
    bv, br = 16, min(512, triton.next_power_of_2(R))
    _absorb_out_kernel[(H, triton.cdiv(dv, bv))](x, q, q if s is None else s, y, R, DN=dn, DV=dv, BV=bv, BR=br,
                                                 SCALED=s is not None, num_warps=4)
    return y


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, logit_ptr, cnt_ptr, ids_ptr, wts_ptr, E, D, scaling, eps,
                   HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, TOPK: tl.constexpr, BE: tl.constexpr,
                   BD: tl.constexpr, EP: tl.constexpr):
    """Logits of BE router rows for one token; the token's last program to finish ranks all E of them."""
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_e = pid * BE + tl.arange(0, BE)
    em = offs_e < E
    acc = tl.zeros((BE, BD), dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        dm = offs_d < D
        w = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * D + offs_d[None, :], mask=em[:, None] & dm[None, :],
                    other=0.0)
        x = tl.load(x_ptr + t * D + offs_d, mask=dm, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(logit_ptr + t * E + offs_e, tl.sum(acc, axis=1), mask=em)
    # release our logits, acquire the others' (gpu scope): the last arrival sees every row of the token
    done = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        offs = tl.arange(0, EP)
        m = offs < E
        z = tl.load(logit_ptr + t * E + offs, mask=m, other=0.0, cache_modifier=".cg")
        choice = 1.0 / (1.0 + tl.exp(-z))
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + offs, mask=m, other=0.0)
        choice = tl.where(m, choice, -float("inf"))
        # one key per expert, ordered as (choice, lower index first): the float's bits made monotonic as a
        # signed integer, above EP - 1 - index; each round takes the largest key out
        bits = choice.to(tl.int32, bitcast=True)
        mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        key = (mono.to(tl.int64) << 32) | (EP - 1 - offs).to(tl.int64)
        offs_k = tl.arange(0, TOPK)
        got = tl.zeros((TOPK,), dtype=tl.int64)
        for j in tl.static_range(TOPK):
            best = tl.max(key, 0)
            got = tl.where(offs_k == j, (EP - 1) - (best & 0xFFFFFFFF), got)
            key = tl.where(key == best, -0x7FFFFFFFFFFFFFFF, key)  # below every expert's key
        zk = tl.load(logit_ptr + t * E + got, cache_modifier=".cg")
        wk = 1.0 / (1.0 + tl.exp(-zk))  # the unbiased scores of the chosen
        if RENORM:
            wk = wk / (tl.sum(wk, 0) + eps)
        tl.store(ids_ptr + t * TOPK + offs_k, got)
        tl.store(wts_ptr + t * TOPK + offs_k, wk * scaling)

def router_fits(E: int, k: int) -> bool:
    return E <= MAX_EXPERTS and k == triton.next_power_of_2(k) and k <= E


def router_topk(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, k: int, renorm: bool, scaling: float,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (a few decode tokens), router rows w [E, D] (bf16 or float32), bias [E] float32 or None ->
    (ids [T, k] int64, weights [T, k] float32): ``common.sigmoid_topk``'s contract (one expert group)."""
    T, D = x.shape
    E = w.shape[0]
    x = x.contiguous()
    logits = torch.empty(T, E, device=x.device, dtype=torch.float32)
    cnt = torch.zeros(T, device=x.device, dtype=torch.int32)
    ids = torch.empty(T, k, device=x.device, dtype=torch.int64)
    wts = torch.empty(T, k, device=x.device, dtype=torch.float32)
    be, bd = 2, min(2048, triton.next_power_of_2(D))  # 448 programs of 8 KB loads for K3's 896 x 7168
    _router_kernel[(T, triton.cdiv(E, be))](
        x, w, bias if bias is not None else logits, logits, cnt, ids, wts, E, D, float(scaling), float(eps),
        HAS_BIAS=bias is not None, RENORM=renorm, TOPK=k, BE=be, BD=bd, EP=triton.next_power_of_2(E), num_warps=4)
    return ids, wts


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32 sums; IEEE: float32 operands (Triton's interpreter gets bf16 dot products wrong)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _mla_attend_kernel(q_ptr, rows_ptr, at_ptr, o_ptr, ml_ptr, n_rows, per_split, H, scale, DK: tl.constexpr,
                       R: tl.constexpr, RR: tl.constexpr, RRP: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr,
                       AT: tl.constexpr, IEEE: tl.constexpr):
    """One split of the cached rows for BH heads: the rows' scores against q (latent and rope parts, float32 on the
    tensor cores), an online softmax over the split, and the probabilities times the rows' latents; the split's
    unnormalised output, running max and sum go to o / ml for the combining launch."""
    sp, hg = tl.program_id(0), tl.program_id(1)
    if AT:  # keys 0 .. n-1 are visible
        n = tl.load(at_ptr).to(tl.int32) + 1
    else:
        n = n_rows
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, n)
    offs_h = hg * BH + tl.arange(0, BH)
    hm = offs_h < H
    offs_r, offs_rr = tl.arange(0, R), tl.arange(0, RRP)  # the rope part padded to a dot's least width
    rrm = offs_rr < RR
    ql = tl.load(q_ptr + offs_h[:, None] * DK + offs_r[None, :], mask=hm[:, None], other=0.0)
    qr = tl.load(q_ptr + offs_h[:, None] * DK + R + offs_rr[None, :], mask=hm[:, None] & rrm[None, :], other=0.0)
    m = tl.full((BH,), -float("inf"), dtype=tl.float32)
    den = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, R), dtype=tl.float32)
    for s0 in range(lo, hi, BS):
        offs_s = s0 + tl.arange(0, BS)
        sm = offs_s < hi
        kl = tl.load(rows_ptr + offs_s.to(tl.int64)[:, None] * DK + offs_r[None, :], mask=sm[:, None], other=0.0)
        kr = tl.load(rows_ptr + offs_s.to(tl.int64)[:, None] * DK + R + offs_rr[None, :],
                     mask=sm[:, None] & rrm[None, :], other=0.0)
        s = _dot(ql, tl.trans(kl), IEEE) + _dot(qr, tl.trans(kr), IEEE)  # [BH, BS] float32
        s = tl.where(sm[None, :], s * scale, -float("inf"))
        new = tl.maximum(m, tl.max(s, 1))  # finite: every block holds a visible row
        a = tl.exp(m - new)
        p = tl.exp(s - new[:, None])
        den = den * a + tl.sum(p, 1)
        acc = acc * a[:, None] + _dot(p.to(kl.dtype), kl, IEEE)  # p rounded to the rows' dtype, as torch's form
        m = new
    base = sp.to(tl.int64) * H + offs_h
    tl.store(o_ptr + base[:, None] * R + offs_r[None, :], acc, mask=hm[:, None])
    tl.store(ml_ptr + base * 2, m, mask=hm)
    tl.store(ml_ptr + base * 2 + 1, den, mask=hm)


@triton.jit
def _mla_combine_kernel(o_ptr, ml_ptr, y_ptr, splits, H, R: tl.constexpr, SP: tl.constexpr, BR: tl.constexpr):
    """BR columns of a head's output from its splits, all loaded at once: each rescaled to the largest running
    max (an empty split weighs 0), summed, divided by the summed denominators (fixed reduction trees: the same
    bits every call); stored in y's dtype."""
    h, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_s = tl.arange(0, SP)
    sm = offs_s < splits
    offs_r = pid * BR + tl.arange(0, BR)
    m = tl.load(ml_ptr + (offs_s * H + h) * 2, mask=sm, other=-float("inf"))
    f = tl.where(m == -float("inf"), 0.0, tl.exp(m - tl.max(m, 0)))
    den = tl.sum(f * tl.load(ml_ptr + (offs_s * H + h) * 2 + 1, mask=sm, other=0.0), 0)
    o = tl.load(o_ptr + (offs_s[:, None] * H + h) * R + offs_r[None, :], mask=sm[:, None], other=0.0)
    tl.store(y_ptr + h * R + offs_r, (tl.sum(o * f[:, None], 0) / den).to(y_ptr.dtype.element_ty))


ATTEND_SPLIT_ROWS = 256  # rows per split at the engine's default context: 16 splits x 3 head groups at 4K


def attend_fits(H: int, R: int, RR: int) -> bool:
    """Whether the absorbed attention kernel takes these widths (a power-of-two latent of 16-1024)."""
    return R == triton.next_power_of_2(R) and 16 <= R <= 1024 and 1 <= RR <= 256 and H >= 1


def mla_attend(q_lat: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor, pos: int | torch.Tensor,
               scale: float) -> torch.Tensor:
    """One query token's absorbed MLA attention: q_lat [1, H, R] and q_rot [1, H, r] against the cached rows
    [C, R + r] (latent, then rope key) at positions 0..pos (``pos`` an int, or a device tensor [1] with the rows
    past it masked: a CUDA graph's whole buffer); values are the rows' latents. Returns [1, H, R] in q's dtype.
    The rows are cut into at most 128 splits, their count and size set by the buffer's length (a replayed graph's
    grid stays put; the sums, hence the bits, follow the buffer's length: ``--max-len``), each split read once per
    head group, and merged by a second launch."""
    _, H, R = q_lat.shape
    RR = q_rot.shape[-1]
    C, DK = rows.shape
    assert DK == R + RR and rows.stride(-1) == 1 and rows.stride(0) == DK
    q = torch.cat((q_lat, q_rot), -1).reshape(H, DK).contiguous()
    splits = max(1, min(128, triton.cdiv(C, ATTEND_SPLIT_ROWS)))
    per = triton.cdiv(triton.cdiv(C, splits), 32) * 32
    splits = triton.cdiv(C, per)
    bh = 32 if H > 16 else 16
    o = torch.empty(splits, H, R, device=rows.device, dtype=torch.float32)
    ml = torch.empty(splits, H, 2, device=rows.device, dtype=torch.float32)
    at = isinstance(pos, torch.Tensor)
    _mla_attend_kernel[(splits, triton.cdiv(H, bh))](
        q, rows, pos if at else q, o, ml, 0 if at else int(pos) + 1, per, H, float(scale), DK=DK, R=R, RR=RR,
        RRP=max(16, triton.next_power_of_2(RR)), BH=bh, BS=32, AT=at, IEEE=INTERPRET, num_warps=8, num_stages=2)
    y = torch.empty(1, H, R, device=rows.device, dtype=q_lat.dtype)
    br = min(R, 64)
    _mla_combine_kernel[(H, R // br)](o, ml, y, splits, H, R=R, SP=triton.next_power_of_2(splits), BR=br,
                                      num_warps=4)
    return y
