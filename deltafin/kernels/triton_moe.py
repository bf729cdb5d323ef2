"""Grouped routed experts in Triton: all of a layer's (token, expert) pairs in two launches.

The experts live in an :class:`ExpertSlab` (one tensor per role with a leading slot dimension, bytes as
stored), so a launch takes slot numbers rather than a list of tensors. The pairs are sorted by slot and cut
into blocks of BT rows of one expert (padded with -1); program (block, n-tile) of the first kernel computes
gate and up for its rows from the packed bytes and writes act(gate, up); the second multiplies by down,
scales each row by its routing weight and writes it to the pair's own row, so the sum over a token's k
experts is taken afterwards in slot order (arrival order never changes a result).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from deltafin.kernels import invariance, triton_gemv
from deltafin.kernels.triton import format_code, fp16_rows, sum_cast
from deltafin.kernels.triton_tiles import FMT_INT4G32, FMT_MXFP4, INTERPRET, e8m0_value, glu_act, mma_weight

ACT_SILU = 0  # SwiGLU: silu(g) * u
ACT_SITU = 1  # SiTU-GLU (Kimi K3): beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)


@triton.jit
def _block(rows_ptr, blk_ptr, BT: tl.constexpr):
    """Block b's slab slot and its BT pair rows: (slot, row numbers, pair index or -1, pair present)."""
    b = tl.program_id(0)
    slot = tl.load(blk_ptr + b).to(tl.int64)
    r = b * BT + tl.arange(0, BT)
    pair = tl.load(rows_ptr + r)
    return slot, r, pair, pair >= 0


@triton.jit
def _gate_up_block(rows_ptr, blk_ptr, gp, gs, upp, ups, p_slot, s_slot, TOPK: tl.constexpr, BT: tl.constexpr,
                   BN: tl.constexpr):
    """A gate/up program's rows (``_block``), their tokens, its n-tile and its slot's gate and up records."""
    slot, r, pair, valid = _block(rows_ptr, blk_ptr, BT)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    return (r, pair, valid, tl.where(valid, pair // TOPK, 0), offs_n, gp + slot * p_slot, gs + slot * s_slot,
            upp + slot * p_slot, ups + slot * s_slot)


@triton.jit
def _rows_tile(x_ptr, rows, valid, stride, k0, K, BK: tl.constexpr):
    """Columns k0..k0+BK of the rows ``rows`` of x (zero where not ``valid`` or past K)."""
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(x_ptr + rows[:, None] * stride + offs_k[None, :], mask=valid[:, None] & (offs_k < K)[None, :],
                   other=0.0)


@triton.jit
def _gate_up_kernel(x_ptr, rows_ptr, blk_ptr, gp, gs, upp, ups, h_ptr, stride_x, p_slot, s_slot,
                    TOPK: tl.constexpr, K: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                    ACT: tl.constexpr, BETA: tl.constexpr, LBETA: tl.constexpr, IEEE: tl.constexpr,
                    BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    r, pair, valid, tok, offs_n, g_p, g_s, u_p, u_s = _gate_up_block(rows_ptr, blk_ptr, gp, gs, upp, ups, p_slot,
                                                                     s_slot, TOPK, BT, BN)
    acc_g = tl.zeros((BT, BN), dtype=tl.float32)
    acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = _rows_tile(x_ptr, tok, valid, stride_x, k0, K, BK)
        acc_g = mma_weight(acc_g, x, g_p, g_s, offs_n, k0, I, K, FMT, IEEE, BN, BK)
        acc_u = mma_weight(acc_u, x, u_p, u_s, offs_n, k0, I, K, FMT, IEEE, BN, BK)
    h = glu_act(acc_g, acc_u, ACT, BETA, LBETA)
    tl.store(h_ptr + r[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n < I)[None, :])


@triton.jit
def _down_kernel(h_ptr, rows_ptr, blk_ptr, rw_ptr, dp, ds, y_ptr, p_slot, s_slot,
                 I: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, IEEE: tl.constexpr,
                 BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(1)
    slot, r, pair, valid = _block(rows_ptr, blk_ptr, BT)
    offs_n = pid_n * BN + tl.arange(0, BN)
    d_p, d_s = dp + slot * p_slot, ds + slot * s_slot
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        offs_k = k0 + tl.arange(0, BK)
        h = tl.load(h_ptr + r[:, None] * I + offs_k[None, :],
                    mask=valid[:, None] & (offs_k < I)[None, :], other=0.0)
        acc = mma_weight(acc, h, d_p, d_s, offs_n, k0, D, I, FMT, IEEE, BN, BK)
    w = tl.load(rw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
    tl.store(y_ptr + pair[:, None] * D + offs_n[None, :], acc * w[:, None],
             mask=valid[:, None] & (offs_n < D)[None, :])


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 experts in fp16 for many tokens (prefill). Four codes of a byte lane become fp16 high bytes with one
# shift-and-mask each and byte permutes pair them into fp16x2 registers (inline PTX), one packed multiply applies
# each block's scale, and the dot runs in fp16 with float32 sums: 290 instructions per k-step on sm_90 where
# Triton's scaled dot (bf16) takes 597. fp16's range is kept by powers of two: each weight row is scaled
# relative to its largest E8M0 scale (a block more than 2^24 below it rounds towards zero: under 2^-24 of the
# row's largest terms), each activation row by the power of two that puts its largest |x| in [2^13, 2^14) (bf16
# activations convert exactly); both come back in float32 in the epilogue. Every product is then the same
# exact number as on the bf16 path and the sums run in the same order: the H200 gave bit-identical outputs,
# 12% sooner (4,096 tokens x 64 K3 experts, top-16: 17.4 vs 19.8 ms, 249 vs 219 TFLOP/s). The rest of the gap
# to cuBLAS's bf16 rate is the tensor-core pipeline, not the decode.
MXFP4_F16 = True

_NIB_F16_ASM = tl.constexpr("""{
.reg .b32 a, b, e, o, z;
mov.b32 z, 0;
shl.b32 a, $4, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $4, 4; and.b32 b, b, 0x80808080; or.b32 e, a, b;
shr.u32 a, $4, 3; and.b32 a, a, 0x0E0E0E0E; and.b32 b, $4, 0x80808080; or.b32 o, a, b;
prmt.b32 $0, e, z, 0x1404; prmt.b32 $1, e, z, 0x3424;
prmt.b32 $2, o, z, 0x1404; prmt.b32 $3, o, z, 0x3424;
}""")  # 4 bytes -> the fp16 of their low nibbles ($0, $1) and high nibbles ($2, $3), each code's value * 2^-14


@triton.jit
def _row_scale_max(s_ptr, offs_n, N, KB: tl.constexpr, KBP: tl.constexpr):
    """[BN] int32: the largest E8M0 byte of each row's KB block scales (rows past N: 0)."""
    j = tl.arange(0, KBP)
    s = tl.load(s_ptr + offs_n[:, None] * KB + j[None, :], mask=(offs_n < N)[:, None] & (j < KB)[None, :], other=0)
    return tl.max(s.to(tl.int32), axis=1)


@triton.jit
def _w_f16(p_ptr, s_ptr, smax, offs_n, k0, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows offs_n, columns k0..k0+BK of an MXFP4 weight as fp16 [BN, BK]: W * 2^(127 - smax) per row."""
    offs_h = k0 // 2 + tl.arange(0, BK // 2)
    offs_b = k0 // 32 + tl.arange(0, BK // 32)
    nm = offs_n < N
    b = tl.load(p_ptr + offs_n[:, None] * (K // 2) + offs_h[None, :], mask=nm[:, None] & (offs_h < K // 2)[None, :],
                other=0)
    lo, hi = tl.inline_asm_elementwise(_NIB_F16_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16),
                                       is_pure=True, pack=4)
    w = tl.join(lo, hi).reshape(BN, BK)  # element 2j from the low nibble of byte j, 2j+1 from the high one
    s = tl.load(s_ptr + offs_n[:, None] * (K // 32) + offs_b[None, :],
                mask=nm[:, None] & (offs_b < K // 32)[None, :], other=0).to(tl.int32)
    m = (tl.maximum(s - smax[:, None] + 29, 0) << 10).to(tl.int16).to(tl.float16, bitcast=True)  # 2^(s-smax+14)
    return (w.reshape(BN, BK // 32, 32) * m[:, :, None]).reshape(BN, BK)


@triton.jit
def _gate_up_f16_kernel(x_ptr, xi_ptr, rows_ptr, blk_ptr, gp, gs, upp, ups, h_ptr, stride_x, p_slot, s_slot,
                        TOPK: tl.constexpr, K: tl.constexpr, I: tl.constexpr, ACT: tl.constexpr,
                        BETA: tl.constexpr, LBETA: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, KBP: tl.constexpr):
    """``_gate_up_kernel`` on fp16 activations x (row t scaled by 1 / xi[t]) and fp16-decoded MXFP4."""
    r, pair, valid, tok, offs_n, g_p, g_s, u_p, u_s = _gate_up_block(rows_ptr, blk_ptr, gp, gs, upp, ups, p_slot,
                                                                     s_slot, TOPK, BT, BN)
    g_max, u_max = _row_scale_max(g_s, offs_n, I, K // 32, KBP), _row_scale_max(u_s, offs_n, I, K // 32, KBP)
    acc_g = tl.zeros((BT, BN), dtype=tl.float32)
    acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = _rows_tile(x_ptr, tok, valid, stride_x, k0, K, BK)
        acc_g = tl.dot(x, tl.trans(_w_f16(g_p, g_s, g_max, offs_n, k0, I, K, BN, BK)), acc_g)
        acc_u = tl.dot(x, tl.trans(_w_f16(u_p, u_s, u_max, offs_n, k0, I, K, BN, BK)), acc_u)
    xi = tl.load(xi_ptr + tok)[:, None]
    g = acc_g * xi * e8m0_value(g_max.to(tl.uint32))[None, :]
    u = acc_u * xi * e8m0_value(u_max.to(tl.uint32))[None, :]
    h = glu_act(g, u, ACT, BETA, LBETA)
    tl.store(h_ptr + r[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n < I)[None, :])


@triton.jit
def _down_f16_kernel(h_ptr, hi_ptr, rows_ptr, blk_ptr, rw_ptr, dp, ds, y_ptr, p_slot, s_slot,
                     I: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     KBP: tl.constexpr):
    """``_down_kernel`` on fp16 h (row r scaled by 1 / hi[r]) and fp16-decoded MXFP4."""
    pid_n = tl.program_id(1)
    slot, r, pair, valid = _block(rows_ptr, blk_ptr, BT)
    offs_n = pid_n * BN + tl.arange(0, BN)
    d_p, d_s = dp + slot * p_slot, ds + slot * s_slot
    d_max = _row_scale_max(d_s, offs_n, D, I // 32, KBP)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        offs_k = k0 + tl.arange(0, BK)
        h = tl.load(h_ptr + r[:, None] * I + offs_k[None, :], mask=valid[:, None] & (offs_k < I)[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(_w_f16(d_p, d_s, d_max, offs_n, k0, D, I, BN, BK)), acc)
    hi = tl.load(hi_ptr + r, mask=valid, other=0.0)
    w = tl.load(rw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
    tl.store(y_ptr + pair[:, None] * D + offs_n[None, :], acc * (hi * w)[:, None] * e8m0_value(d_max.to(tl.uint32))[None, :],
             mask=valid[:, None] & (offs_n < D)[None, :])


class ExpertSlab:
    """Fixed-size expert slots on one device: per role (gate, up, down) a packed-data tensor and a scale
    tensor with a leading slot dimension. ``views(slot)`` gives a slot's tensors (reads land in them);
    ``slot_of(tensors)`` recognises such views, so a source that fills the slab hands the kernel slots.

    With ``layout`` (the experts' file layout, ``store.expert_file.ExpertLayout``) the slab is one byte tensor
    of whole expert files [slots, file_bytes] and each role's tensors are strided views of it: a read expert
    file goes into its slot in one host-to-device copy (``write_file``) instead of one per tensor. The kernels
    take each role's slot stride (``stride(0)``), so both forms run the same launches."""

    ROLES = ("gate", "up", "down")

    def __init__(self, slots: int, example: dict, device: torch.device | str, layout=None):
        self.format = example["gate"].format
        self.slots = slots
        self.layout = layout
        self.shapes = {r: example[r].shape for r in self.ROLES}
        if layout is None:
            self.bytes = None
            self.data = {r: torch.empty((slots, *example[r].data.shape), dtype=example[r].data.dtype,
                                        device=device) for r in self.ROLES}
            self.scale = {r: torch.empty((slots, *example[r].scale.shape), dtype=example[r].scale.dtype,
                                         device=device) for r in self.ROLES}
        else:
            self.bytes = torch.empty((slots, layout.file_bytes), dtype=torch.uint8, device=device)
            secs = {t.name: t.sections for t in layout.tensors}
            self.data = {r: self._section(secs[r][0]) for r in self.ROLES}
            self.scale = {r: self._section(secs[r][1]) for r in self.ROLES}
        gate = self.data["gate"]  # slot_of runs for every expert of every layer: its constants, once
        self._base, self._slot_bytes, self._cuda = gate.data_ptr(), gate.stride(0) * gate.element_size(), gate.is_cuda

    def _section(self, sec) -> torch.Tensor:
        from deltafin.store.expert_file import DTYPES

        raw = self.bytes[:, sec.offset : sec.offset + sec.nbytes]  # [slots, nbytes], rows file_bytes apart
        return raw.view(DTYPES[sec.dtype]).unflatten(1, sec.shape)

    def fits(self, tensors: dict) -> bool:
        return all(r in tensors and getattr(tensors[r], "format", None) == self.format
                   and tensors[r].shape == self.shapes[r] and tensors[r].data.shape == self.data[r].shape[1:]
                   and tensors[r].scale.dtype == self.scale[r].dtype for r in self.ROLES)

    def views(self, slot: int) -> dict:
        from deltafin.quant.record import QTensor

        return {r: QTensor(self.format, self.shapes[r], self.data[r][slot], self.scale[r][slot])
                for r in self.ROLES}

    def write(self, slot: int, tensors: dict) -> None:
        for r in self.ROLES:
            self.data[r][slot].copy_(tensors[r].data, non_blocking=True)
            self.scale[r][slot].copy_(tensors[r].scale, non_blocking=True)

    def write_file(self, slot: int, data: torch.Tensor) -> None:
        """A whole expert file (uint8 [file_bytes], pinned host memory for an asynchronous copy) into ``slot``
        of a slab made with its layout: one copy, ordered on the current stream after earlier reads of it."""
        assert self.bytes is not None and data.numel() == self.bytes.shape[1], "a file of the slab's layout"
        self.bytes[slot].copy_(data, non_blocking=True)

    def slot_of(self, tensors: dict) -> int | None:
        """The slot whose views ``tensors`` are, or None."""
        d = tensors["gate"].data
        # an address inside the slab's one allocation (live allocations never overlap) on its kind of device
        slot, rem = divmod(d.data_ptr() - self._base, self._slot_bytes)
        return slot if rem == 0 and 0 <= slot < self.slots and d.is_cuda == self._cuda else None

    @classmethod
    def stack(cls, experts: list[dict], device: torch.device | str) -> ExpertSlab:
        """A slab holding copies of ``experts`` in order (for sources that do not fill a slab)."""
        slab = cls(len(experts), experts[0], device)
        for i, t in enumerate(experts):
            slab.write(i, t)
        return slab


def block_layout(slots: np.ndarray, bt: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs [T, k] of slab slots -> (rows [NB*bt] pair index or -1, block slot [NB]): each block holds up
    to bt pairs of one slot, the pairs of a slot in pair order. A counting layout (a radix sort of the
    slots, a count per slot, no Python loop): about 1 ms for the 65,536 pairs of a 4,096-token prefill, time
    in which the device waits."""
    flat = slots.reshape(-1)
    if flat.size == 0:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
    small = flat.astype(np.int16) if flat.max() < 2**15 else flat  # numpy's stable sort is a radix sort for int16
    order = np.argsort(small, kind="stable").astype(np.int32)
    counts = np.bincount(flat)
    uniq = np.flatnonzero(counts)
    counts = counts[uniq]
    nblk = -(-counts // bt)
    first_row = (np.cumsum(nblk) - nblk) * bt  # where each slot's blocks begin
    first_pair = np.cumsum(counts) - counts  # where each slot's pairs begin in ``order``
    rows = np.full(int(nblk.sum()) * bt, -1, dtype=np.int32)
    rows[np.repeat(first_row - first_pair, counts) + np.arange(flat.size)] = order
    return rows, np.repeat(uniq, nblk).astype(np.int32)


_FMT = {"mxfp4": FMT_MXFP4, "int4g32": FMT_INT4G32}
MOE_FORMATS = frozenset(_FMT)


def moe_config(pairs: int, experts: int, K: int, I: int) -> dict:
    """Rows per block from the average rows per expert: 16 for decode, 64 or 128 for prefill (H200 sweep of
    ``deltafin.bench.kernels_cuda``: decode BN 64 x BK 128, 4 warps, 4 stages; prefill 128 x 128 x 64)."""
    avg = pairs / max(experts, 1)
    if invariance.ENABLED.get():  # batch invariance: one kernel and tile at every count (see triton.invariant_config)
        return {"BT": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "BN_down": 64, "BK_down": 128}
    if triton_gemv.GEMV_MOE and avg <= 1:  # every pair has its own expert (decode): the GEMV form
        return triton_gemv.moe_gemv_config()
    if avg <= 16:
        c = {"BT": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4}
    elif avg <= 256:
        c = {"BT": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4}
    else:
        c = {"BT": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3}
    return dict(c, BN_down=c["BN"], BK_down=c["BK"])


@dataclass
class MoePlan:
    """Where each (token, expert) pair goes: built once per routing decision, on the host (routing is the
    one host synchronisation per layer), then launched without further host work."""

    rows: torch.Tensor  # [NB*BT] int32 pair index (t*k + j) or -1, on the device
    blk: torch.Tensor  # [NB] int32 slab slot of each block, on the device
    tokens: int
    k: int
    cfg: dict


def plan_moe(slots: torch.Tensor | np.ndarray, device: torch.device | str, K: int, I: int,
             cfg: dict | None = None) -> MoePlan:
    """slots [T, k]: the slab slot of every routed pair."""
    s = slots.detach().cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots)
    s = s.astype(np.int64)
    T, k = s.shape
    c = cfg or moe_config(T * k, len(np.unique(s)), K, I)
    rows, blk = block_layout(s, c["BT"])
    return MoePlan(torch.from_numpy(rows).to(device), torch.from_numpy(blk).to(device), T, k, c)


def _unit_blocks(p: MoePlan) -> tuple[MoePlan, dict]:
    """A one-pair-per-block (GEMV) plan as the tensor-core kernels' layout: each pair alone in a block of 16."""
    c = {"BT": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4, "BN_down": 64, "BK_down": 128}
    rows = torch.full((p.rows.numel(), 16), -1, dtype=p.rows.dtype, device=p.rows.device)
    rows[:, 0] = p.rows
    return MoePlan(rows.reshape(-1), p.blk, p.tokens, p.k, c), c


def grouped_glu(x: torch.Tensor, slots: torch.Tensor | None, weights: torch.Tensor, slab: ExpertSlab,
                act: int = ACT_SILU, beta: float = 4.0, lbeta: float = 25.0, cfg: dict | None = None,
                plan: MoePlan | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e x_t, up_e x_t)) for e = slab slot slots[t, j].

    x [T, D] on the slab's device; slots [T, k] (host or device) or a ready ``plan``; weights [T, k].
    Returns [T, D] in x's dtype; the k terms are summed in slot order in float32."""
    T, D = x.shape
    if slab.format not in _FMT:
        raise ValueError(f"grouped experts: format {slab.format!r} has no kernel; kernels: {', '.join(_FMT)}")
    I, K = slab.shapes["gate"]
    p = plan or plan_moe(slots, x.device, K, I, cfg)
    c, k = p.cfg, p.k
    if c.get("gemv"):
        if slab.format == "mxfp4":
            return triton_gemv.grouped_glu_gemv(x, p.rows, p.blk, k, weights, slab, act, beta, lbeta, c)
        p, c = _unit_blocks(p)  # no GEMV form for this format: one pair per padded tensor-core block
    dev = x.device
    x = x.contiguous()
    if slab.format == "mxfp4" and x.dtype == torch.bfloat16 and not INTERPRET and c.get("f16", MXFP4_F16):
        return _grouped_f16(x, p, weights, slab, act, beta, lbeta)
    ieee = x.dtype == torch.float32 or INTERPRET
    fmt = format_code(slab.format, x.dtype, c.get("scaled")) if slab.format == "mxfp4" else _FMT[slab.format]
    nb = p.blk.numel()
    h = torch.empty(p.rows.numel(), I, device=dev, dtype=x.dtype)
    g, u, dn = slab.data["gate"], slab.data["up"], slab.data["down"]
    _gate_up_kernel[(nb, triton.cdiv(I, c["BN"]))](
        x, p.rows, p.blk, g, slab.scale["gate"], u, slab.scale["up"], h, x.stride(0),
        g.stride(0), slab.scale["gate"].stride(0),
        TOPK=k, K=K, I=I, FMT=fmt, ACT=act, BETA=beta, LBETA=lbeta, IEEE=ieee,
        BT=c["BT"], BN=c["BN"], BK=c["BK"], num_warps=c["num_warps"], num_stages=c["num_stages"])
    y = torch.empty(T * k, D, device=dev, dtype=torch.float32)  # every pair row is written
    rw = weights.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    _down_kernel[(nb, triton.cdiv(D, c["BN_down"]))](
        h, p.rows, p.blk, rw, dn, slab.scale["down"], y, dn.stride(0), slab.scale["down"].stride(0),
        I=I, D=D, FMT=fmt, IEEE=ieee, BT=c["BT"], BN=c["BN_down"], BK=c["BK_down"],
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    return sum_cast(y.view(T, k, D).transpose(0, 1), x.dtype)  # each token's k rows in slot order


def _grouped_f16(x: torch.Tensor, p: MoePlan, weights: torch.Tensor, slab: ExpertSlab, act: int, beta: float,
                 lbeta: float) -> torch.Tensor:
    """``grouped_glu``'s tensor-core launches in fp16 (see MXFP4_F16)."""
    T, D = x.shape
    I, K = slab.shapes["gate"]
    c, k, dev = p.cfg, p.k, x.device
    nb = p.blk.numel()
    x16, xi = fp16_rows(x)
    h = torch.empty(p.rows.numel(), I, device=dev, dtype=x.dtype)
    g, u, dn = slab.data["gate"], slab.data["up"], slab.data["down"]
    _gate_up_f16_kernel[(nb, triton.cdiv(I, c["BN"]))](
        x16, xi, p.rows, p.blk, g, slab.scale["gate"], u, slab.scale["up"], h, x16.stride(0),
        g.stride(0), slab.scale["gate"].stride(0), TOPK=k, K=K, I=I, ACT=act, BETA=beta, LBETA=lbeta,
        BT=c["BT"], BN=c["BN"], BK=c["BK"], KBP=triton.next_power_of_2(K // 32),
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    h16, hi = fp16_rows(h)
    y = torch.empty(T * k, D, device=dev, dtype=torch.float32)  # every pair row is written
    rw = weights.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    _down_f16_kernel[(nb, triton.cdiv(D, c["BN_down"]))](
        h16, hi, p.rows, p.blk, rw, dn, slab.scale["down"], y, dn.stride(0), slab.scale["down"].stride(0),
        I=I, D=D, BT=c["BT"], BN=c["BN_down"], BK=c["BK_down"], KBP=triton.next_power_of_2(I // 32),
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    return sum_cast(y.view(T, k, D).transpose(0, 1), x.dtype)
