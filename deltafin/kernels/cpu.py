"""CPU backend: x [T, in] @ W^T for weights kept in their stored bytes (MXFP4, INT4 group 32, int8 rows).

Up to ``FUSED_TOKENS`` tokens the compiled kernel decodes each weight block in registers and multiplies it into
every token (never a float copy of the matrix); rows are split over ``torch.get_num_threads()`` threads. For
more tokens without the GEMM below (a build without it, int8 widths that are not whole blocks of 32) a tile of
rows is decoded once into a small float32 buffer and multiplied by torch's matmul for all tokens. Accumulation is float32 whatever x's
dtype; the result is float32 [T, out].

4-bit weights of more than ``GEMM_TOKENS`` tokens (``GEMM_TOKENS_AVX2`` on AVX2) take an int16 GEMM where the build has
AVX-512 VNNI and VBMI (or AVX2, the same GEMM on 256-bit vectors, with AVX-VNNI's dot products where present):
each token's row is quantized to int16 per block of 32 (d = max|x| / 32767, |x - d q| <= d (1/2 + 2^-7)), a panel
of 32 weight rows is decoded once per call into exact small integers (16 blocks at a time, kept in L1), and
vpdpwssd sums the blocks in int32 for up to six tokens at a time (groups of near-equal size); one float
multiply-add per block applies both scales. About 2^-16 of each block's largest
activation is lost (bf16 loses 2^-9 of each value), so it is the fast path only; ``DELTAFIN_CPU_GEMM=0`` selects
the loops below. Built with -DGW_U8=1 (off by default: below the fast path's agreement bar on two tiny families), on
AVX2 without VNNI (``df_gw_u8``) the 4-bit GEMM takes 8-bit activations instead, quantized as the Q8 path's (d = max|x| / 127 per block of 32), multiplied by vpmaddubsw with
exact int16 and int32 sums: the same integer block sums as the one-token Q8 loop, in fewer instructions than the
int16 pair products; int8 rows keep the int16 GEMM.

A whole gated 4-bit expert (``glu_expert``: SwiGLU, or Kimi K3's SiTU-GLU) runs as one compiled call: past
GEMM_TOKENS, x is quantized once, gate's and up's rows run in one parallel pass with the activation applied per
panel of 32 rows as soon as both are done (``df_glu_act``: vectorised through one expm1, within 10 u for SwiGLU
and 30 u for SiTU-GLU of the exact value, u = 2^-24), then h is quantized and down runs; each matrix's result is
that of its own GEMM call bit for bit. Up to GEMM_TOKENS the Q8 path does the same in one call.

4-bit weights up to ``FUSED_TOKENS`` tokens take the Q8 path by default: each token's row is quantized to int8
per block of 32 (one float scale d = max|x| / 127 per block) and the block sums run in int8 x int8 -> int32
(AVX-512 VNNI), several times faster than decoding to float. It rounds the activations
(|x - d q| <= d / 2 per element), so it is the fast path only; ``DELTAFIN_CPU_Q8=0`` selects the float decode
loop. On a CPU with AVX-512 but no VNNI the float loop stays the default (it is vectorized there). x86 CPUs without
AVX-512 (most laptops and desktops) run the same Q8, int16-activation and int16 GEMM paths on 256-bit AVX2 vectors,
with AVX-VNNI's dot products where the CPU has them (``deltafin bench kernels --isa avx2`` builds and measures them
on a machine that has more; figures in docs/BENCHMARKS.md).

int8 rows up to ``FUSED_TOKENS`` tokens take int16 activations on the same switch (``i16_enabled``): one
scale d = max|x| / 32767 per block of 128 columns, the weight bytes sign-extended into VNNI's int16 dot product
(a third of the float loop's vector instructions per byte, so the trunk GEMVs keep pace with memory). Its
rounding (|x - d q| <= d / 2) is 256 times finer than the 4-bit path's 8-bit activations, which changed greedy
tokens of a tiny Kimi K3 when applied to its int8 trunk. Past GEMM_TOKENS (``GEMM_TOKENS_INT8_AVX2`` on AVX2;
``int8_gemm``) int8 rows take the 4-bit GEMM's code with the rows sign-extended to int16 in its decode and the row's scale in each block's place: the
same int16 activations per block of 32, faster than the decoded tile and torch's matmul on K3's trunk shapes.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Iterator

import torch

from deltafin.kernels import invariance, native
from deltafin.quant import int4, mxfp4
from deltafin.quant.record import QTensor

# Token counts where one kernel overtakes another (timings that set them: docs/BENCHMARKS.md, "CPU kernel
# switch points"). The fused loop up to FUSED_TOKENS; a decoded tile of TILE_BYTES and torch's matmul past it.
FUSED_TOKENS = 16
GEMM_TOKENS = 3  # 4-bit and int8 matrices take the int16 GEMM from 4 tokens (AVX-512 builds)
GEMM_TOKENS_AVX2 = 10  # AVX2 builds: the 4-bit Q8 loop stays ahead longer (a Kimi K3 prompt gives ~9 tokens an expert)
GEMM_TOKENS_INT8_AVX2 = 2  # AVX2 builds: int8 rows take the GEMM from 3 tokens
TILE_BYTES = 8 << 20
# Matrices under SERIAL_ELEMENTS weights run on the calling thread: waking the others costs more than the
# split saves (timings: docs/BENCHMARKS.md, "CPU kernel switch points").
SERIAL_ELEMENTS = 1 << 22
_E2M1 = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32)
_INT4 = torch.arange(16, dtype=torch.float32) - 8  # stored as q + 8
_E8M0 = torch.exp2(torch.arange(256, dtype=torch.float64) - 127).to(torch.float32)
_E8M0[255] = float("nan")  # OCP MX: E8M0 0xFF is NaN
# Q8 tables: a nibble's stored value as an integer v, plus K so the weight side of vpdpbusd is unsigned
# (MXFP4: v = 2 x E2M1, 0..12 with sign, read back with the factor 0.5; INT4: v = n - 8, the nibble itself).
_Q8 = {0: (torch.tensor((2 * mxfp4.E2M1_VALUES + 12).astype("uint8")), 12, 0.5),
       1: (torch.arange(16, dtype=torch.uint8), 8, 1.0)}
_Q8[2] = _Q8[1]


def available() -> bool:
    return native.library() is not None


def _threads(R: int, C: int, T: int) -> int:
    return 1 if R * C * T < SERIAL_ELEMENTS else torch.get_num_threads()


USED: set[str] = set()  # kernel variants run so far ("mxfp4_q8", "int8_linear", ...), for the stats line
@dataclasses.dataclass(frozen=True, slots=True)
class _Build:
    """What a loaded library has, asked once (the matmuls consult it on every call)."""

    q8: bool  # the Q8 path vectorised (VNNI), or the portable build
    a16: bool  # int16 activations for int8 rows vectorised, or the portable build
    gemm: bool  # the int16 GEMM's vector code
    few_4bit: int  # gemm_tokens() of 4-bit weights
    few_int8: int  # and of int8 rows


# keyed by the library object, not its id: an id can come back once a library (a test's own build) is freed
_BUILDS: dict[ctypes.CDLL, _Build] = {}


def _build(lib=None) -> _Build:
    lib = lib or native.library()
    b = _BUILDS.get(lib)
    if b is None:
        plain, avx2 = lib.df_simd_width() == 1, lib.df_isa() in (2, 3)
        b = _BUILDS[lib] = _Build(bool(lib.df_q8_vnni()) or plain, bool(lib.df_a16_vnni()) or plain,
                                  bool(lib.df_q4gw_vnni()), GEMM_TOKENS_AVX2 if avx2 else GEMM_TOKENS,
                                  GEMM_TOKENS_INT8_AVX2 if avx2 else GEMM_TOKENS)
    return b


def isa(lib=None) -> str:
    """The vector code of these kernels in this process ('avx512', 'avx2+avx-vnni', 'avx2', 'plain C'; see
    ``native.ISA_FLAGS`` for building less than the CPU has), for stats lines and benchmarks."""
    lib = lib or native.library()
    return "none" if lib is None else native.ISA_NAMES.get(lib.df_isa(), str(lib.df_isa()))


def q8_enabled(lib=None) -> bool:
    """Whether 4-bit matmuls of up to FUSED_TOKENS tokens take the Q8 path (see the module docstring)."""
    if os.environ.get("DELTAFIN_CPU_Q8", "1") == "0":
        return False
    return _build(lib).q8


def i16_enabled(lib=None) -> bool:
    """Whether int8 matmuls of up to FUSED_TOKENS tokens take int16 activations (see the module docstring)."""
    return _build(lib).a16 and os.environ.get("DELTAFIN_CPU_Q8", "1") != "0"


def _x32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous()


def gemm_enabled(lib=None) -> bool:
    """Whether 4-bit matmuls of more than GEMM_TOKENS tokens take the int16 GEMM (AVX-512 VNNI + VBMI or AVX2 builds)."""
    if os.environ.get("DELTAFIN_CPU_GEMM", "1") == "0":
        return False
    return _build(lib).gemm


def _invariant() -> bool:
    return invariance.ENABLED.get()


def _chunked(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over x's rows in calls of at most FUSED_TOKENS (the batch-invariant path past the few-token kernels)."""
    return torch.cat([fn(x[i : i + FUSED_TOKENS]) for i in range(0, x.shape[0], FUSED_TOKENS)])


def gemm_tokens(lib=None, int8: bool = False) -> int:
    """The most tokens a matmul takes its few-token loop for where the build has the int16 GEMM: GEMM_TOKENS, or on an
    AVX2 build GEMM_TOKENS_AVX2 for 4-bit weights and GEMM_TOKENS_INT8_AVX2 for int8 rows. Batch-invariant: no
    limit (the GEMM quantizes activations otherwise than the few-token loops, so the switch would make a token's
    result depend on how many share the call)."""
    if _invariant():
        return 1 << 62
    b = _build(lib)
    return b.few_int8 if int8 else b.few_4bit


def _q4(kind: int, lut: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
        lib=None, fmt: str = "mxfp4") -> torch.Tensor:
    """Legend: T tokens, C inputs, R outputs; packed [R, C/2] bytes (element 2k low nibble of byte k)."""
    lib = lib or native.library()
    T, C = x.shape
    R = packed.shape[0]
    assert packed.shape[-1] * 2 == C and packed.dtype == torch.uint8 and packed.is_contiguous()
    if T > FUSED_TOKENS and _invariant():
        return _chunked(lambda xs: _q4(kind, lut, xs, packed, scales, lib, fmt), x)
    nt = _threads(R, C, T)
    x = _x32(x)
    if T > gemm_tokens(lib) and gemm_enabled(lib):
        USED.add(f"{fmt}_gemm")
        return _q4_quantized(lib.df_q4gw_mm, kind, x, packed, scales, nt,
                             f"GEMM buffers for [{T}, {C}] x [{R}, {C}]; set DELTAFIN_CPU_GEMM=0 to skip them")
    if T <= FUSED_TOKENS and q8_enabled(lib):
        USED.add(f"{fmt}_q8")
        return _q4_quantized(lib.df_q4q8_mm, kind, x, packed, scales, nt,
                             f"Q8 activation buffers for [{T}, {C}]; set DELTAFIN_CPU_Q8=0 to skip them")
    if T <= FUSED_TOKENS:
        USED.add(f"{fmt}_linear")
        xe, xo = x[:, 0::2].contiguous(), x[:, 1::2].contiguous()  # [T, C/2]: each nibble lane meets its column
        out = torch.empty(T, R, dtype=torch.float32)
        lib.df_q4_mm(kind, packed.data_ptr(), scales.data_ptr(), lut.data_ptr(), _E8M0.data_ptr(), xe.data_ptr(),
                     xo.data_ptr(), out.data_ptr(), R, C, T, nt)
        return out
    USED.add(f"{fmt}_tile")
    rows = max(16, TILE_BYTES // (4 * C))
    out = torch.empty(T, R, dtype=torch.float32)
    w = torch.empty(min(rows, R), C, dtype=torch.float32)  # one tile, reused
    for r0 in range(0, R, rows):
        n = min(rows, R - r0)
        lib.df_q4_decode(kind, packed.data_ptr(), scales.data_ptr(), lut.data_ptr(), _E8M0.data_ptr(),
                         w.data_ptr(), r0, n, C, nt)
        torch.mm(x, w[:n].T, out=out[:, r0 : r0 + n])
    return out


def _q4_quantized(fn, kind: int, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, nt: int,
                  no_memory: str) -> torch.Tensor:
    """One of the kernels that quantize the activations (``df_q4q8_mm``, ``df_q4gw_mm``: same arguments);
    ``no_memory`` says what could not be allocated and how to avoid it."""
    (T, C), R = x.shape, packed.shape[0]
    tab, k, mult = _Q8[kind]
    out = torch.empty(T, R, dtype=torch.float32)
    if fn(kind, packed.data_ptr(), scales.data_ptr(), tab.data_ptr(), k, mult, _E8M0.data_ptr(), x.data_ptr(),
          out.data_ptr(), R, C, T, nt) != 0:
        raise MemoryError(no_memory)
    return out


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lib=None) -> torch.Tensor:
    """x [T, in] @ W^T for MXFP4 W (packed uint8 [out, in/2], E8M0 scales uint8 [out, in/32]) -> float32 [T, out]."""
    return _q4(0, _E2M1, x, packed.contiguous(), scales.contiguous(), lib)


def int4g32_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lib=None) -> torch.Tensor:
    """x [T, in] @ W^T for INT4 group-32 W (packed int32 [out, in/8], element i at bits 4i as q + 8; scales
    [out, in/32]). On a little-endian machine byte k of a row holds elements 2k and 2k+1 in its low and high
    nibbles, the MXFP4 layout, so the same kernel runs with the int4 table."""
    assert int4.GROUP == mxfp4.BLOCK
    bytes_ = packed.contiguous().view(torch.uint8)  # [out, in/2]
    if scales.dtype == torch.bfloat16:
        return _q4(1, _INT4, x, bytes_, scales.contiguous(), lib, "int4g32")
    return _q4(2, _INT4, x, bytes_, scales.to(torch.float32).contiguous(), lib, "int4g32")


def _act_args(act: tuple) -> tuple[int, float, float]:
    """An activation as the models name it (``("silu",)``, ``("situ", beta, linear_beta)``) -> the C kernel's
    (kind, beta, linear_beta)."""
    if act[0] == "silu":
        return 0, 1.0, 1.0
    assert act[0] == "situ" and len(act) == 3, act
    return 1, float(act[1]), float(act[2])


def glu_act(g: torch.Tensor, u: torch.Tensor, act: tuple = ("silu",), lib=None) -> torch.Tensor:
    """The compiled gated activation alone (as the fused expert applies it; see ``df_glu_act``'s bound), float32."""
    lib = lib or native.library()
    g, u = _x32(g), _x32(u)
    assert g.shape == u.shape
    h = torch.empty_like(g)
    lib.df_glu_act(*_act_args(act), g.data_ptr(), u.data_ptr(), h.data_ptr(), g.numel())
    return h


def _f32_rows(t: torch.Tensor) -> bool:
    """float32 on the CPU with rows (the last dimension) contiguous and the rows of each head back to back."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float, window: int | None = None,
                sinks: torch.Tensor | None = None, lib=None) -> torch.Tensor | None:
    """Causal attention of T queries at positions pos.. (``df_attend_rows``, flash-style, only the keys each query
    sees): q [T, H, dk], k [Hkv, S, dk], v [Hkv, S, dv] float32 with S = pos + T, sinks [H] or None -> [T, H, dv].
    Each query row's result is the same whatever T, the other rows and the thread count. None where the layout
    does not fit (the caller's torch form runs)."""
    lib = lib or native.library()
    if q.dim() != 3 or q.dtype != torch.float32 or not (_f32_rows(k) and _f32_rows(v)):
        return None
    T, H, dk = q.shape
    Hkv, S, dv = v.shape
    if H % Hkv or k.shape[:2] != (Hkv, S) or k.shape[2] != dk or S != pos + T or T == 0:
        return None
    if sinks is not None:
        if sinks.shape != (H,):
            return None
        sinks = sinks.to(torch.float32).contiguous()
    q = q.contiguous()
    out = torch.empty(T, H, dv)
    # the queries' blocks split over the threads (a row's sums on one thread: the same at any count) once the scores
    # take some 64K products; below that the parallel region's wake-up costs more than it saves
    threads = torch.get_num_threads() if T * H * min(S, window or S) * dk >= 1 << 16 else 1
    rc = lib.df_attend_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if sinks is None else sinks.data_ptr(),
                            out.data_ptr(), H, Hkv, T, pos, dk, dv, k.stride(0), v.stride(0), window or 0, scale,
                            threads)
    if rc:
        return None
    USED.add("attend_rows")
    return out


def rms_rows(x: torch.Tensor, w: torch.Tensor, eps: float, lib=None) -> torch.Tensor | None:
    """RMSNorm of x [..., d] float32 by w [d] float32 (``df_rms_rows``), or None where they are not that."""
    lib = lib or native.library()
    if x.dtype != torch.float32 or w.dtype != torch.float32 or w.shape != x.shape[-1:]:
        return None
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty_like(x)
    lib.df_rms_rows(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def rope1(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib=None) -> torch.Tensor | None:
    """One token's heads x [1, n, d] float32 rotated in halves over the first r = 2 * cos.shape[-1] channels
    (``df_rope1``, NeoX's pairing) into a new tensor; None where the shapes do not fit."""
    lib = lib or native.library()
    if x.dim() != 3 or x.shape[0] != 1 or x.dtype != torch.float32 or cos.shape[0] != 1:
        return None
    r = 2 * cos.shape[-1]
    if r > x.shape[-1]:
        return None
    out = x.clone(memory_format=torch.contiguous_format)  # rotated in place: the caller's x is left as it was
    c, s = _x32(cos), _x32(sin)
    lib.df_rope1(out.data_ptr(), c.data_ptr(), s.data_ptr(), x.shape[1], x.shape[2], r)
    return out


def _glu_parts(gate: QTensor, up: QTensor, down: QTensor) -> tuple[int, int, list[torch.Tensor]] | None:
    """(kind, I, [gate, its scales, up, its scales, down, its scales] as the C kernels read them) for a gated expert
    of three 4-bit records in one format and scale type, gate and up [I, D], down [D, I], I and D whole blocks of 32;
    None for anything else. Plain attribute reads: this runs once per expert per token in decode."""
    fmt = getattr(gate, "format", None)
    if fmt not in ("mxfp4", "int4g32") or getattr(up, "format", None) != fmt or getattr(down, "format", None) != fmt:
        return None
    (I, D), gs, us, ds = gate.shape, gate.scale, up.scale, down.scale  # noqa: E741
    if (tuple(up.shape) != (I, D) or tuple(down.shape) != (D, I) or D % 32 or I % 32
            or not gs.dtype == us.dtype == ds.dtype):
        return None
    if fmt == "mxfp4":
        kind, gp, up_, dp = 0, gate.data, up.data, down.data
    else:  # int4g32: int32 words read as bytes (see int4g32_linear)
        kind = 1 if gs.dtype == torch.bfloat16 else 2
        gp, up_, dp = (w.data.view(torch.uint8) for w in (gate, up, down))
        if kind == 2:
            gs, us, ds = gs.float(), us.float(), ds.float()
    return kind, I, [t.contiguous() for t in (gp, gs, up_, us, dp, ds)]


def glu_expert(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, act: tuple = ("silu",),
               lib=None, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """down(act(gate x, up x)) for x [T, D] in one compiled call -> float32 [T, D]; None where the separate
    matmuls apply. act: ``("silu",)`` (SwiGLU) or ``("situ", beta, linear_beta)`` (Kimi K3's SiTU-GLU). The three
    records 4-bit in one format and scale type. Up to GEMM_TOKENS tokens (FUSED_TOKENS without the GEMM) the Q8
    path; more on the int16 GEMM, gate and up in one parallel pass with the activation applied per panel. Runs
    once per expert per token in decode, so the checks are kept to plain attribute reads.

    rows (int64 [T], optional): the expert's tokens are those rows of x [N, D] (expert-major prefill); the GEMM
    reads them where they lie (no gathered copy of x), the result is that of ``glu_expert(x[rows], ...)``."""
    if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1 or x.dim() != 2):
        raise TypeError(f"rows: int64 [T] indices into x [N, D], got {rows.dtype} {tuple(rows.shape)} for x "
                        f"{tuple(x.shape)}")
    T, D = x.shape if rows is None else (rows.shape[0], x.shape[1])
    lib = lib or native.library()
    if T > FUSED_TOKENS and _invariant():
        if not q8_enabled(lib) or _glu_parts(gate, up, down) is None:
            return None
        x = x if rows is None else x[rows]
        return _chunked(lambda xs: glu_expert(xs, gate, up, down, act, lib), x)
    gemm = T > gemm_tokens(lib) and gemm_enabled(lib)
    parts = None if not gemm and (T > FUSED_TOKENS or not q8_enabled(lib)) else _glu_parts(gate, up, down)
    if parts is None or gate.shape[1] != D:
        return None
    kind, I, (gp, gs, up_, us, dp, ds) = parts  # noqa: E741
    name, fn = ("gemm", lib.df_q4gw_glu) if gemm else ("q8", lib.df_q4q8_glu)
    USED.add(f"{gate.format}_{name}_{act[0]}")
    tab, k, mult = _Q8[kind]
    if rows is not None and (not gemm or x.dtype != torch.float32 or not x.is_contiguous()):
        x, rows = x[rows], None  # the Q8 path's few tokens, or x to convert: gathered first (same values)
    x = _x32(x)
    if rows is not None:  # checked here, not in C: an index out of range would read outside x
        rows = rows.contiguous()
        if T and not (0 <= int(rows.min()) and int(rows.max()) < x.shape[0]):
            raise IndexError(f"rows: indices {int(rows.min())}..{int(rows.max())} outside x's {x.shape[0]} rows")
    out = torch.empty(T, D, dtype=torch.float32)
    head = (*_act_args(act), kind, gp.data_ptr(), gs.data_ptr(), up_.data_ptr(), us.data_ptr(), dp.data_ptr(),
            ds.data_ptr(), tab.data_ptr(), k, mult, _E8M0.data_ptr(), x.data_ptr())
    tail = (out.data_ptr(), I, D, T, _threads(I, D, T))
    rc = fn(*head, None if rows is None else rows.data_ptr(), *tail) if gemm else fn(*head, *tail)
    if rc != 0:
        raise MemoryError(f"{name} activation buffers for an expert [{T}, {D}]; set DELTAFIN_CPU_"
                          f"{'GEMM' if gemm else 'Q8'}=0 to skip them")
    return out


def glu_many_tokens(lib=None) -> int:
    """The most tokens an expert may have to run in glu_experts' call: the Q8 path's (the GEMM takes more)."""
    return min(FUSED_TOKENS, gemm_tokens(lib)) if gemm_enabled(lib) else FUSED_TOKENS


def glu_experts(xs: list[torch.Tensor], experts: list[tuple[QTensor, QTensor, QTensor]], act: tuple = ("silu",),
                lib=None) -> list[torch.Tensor | None] | None:
    """[glu_expert(x, gate, up, down, act) for x, (gate, up, down) in zip(xs, experts)], bit for bit, in one compiled
    call (``df_q4q8_glu_many``): a decode step's routed experts of one layer, each on its own tokens x (the same token
    for all, or each sequence's in a batch), their rows shared out over the threads in one parallel region. Experts
    too small to split by rows (under SERIAL_ELEMENTS a call of their own runs on one thread, the others idle) keep
    every core busy together, and larger ones pay three barriers a layer instead of three an expert. The experts it
    does not take (past the Q8 path's tokens, another shape or format than the first one's) are None in the list,
    for the caller to run alone; None instead of a list where fewer than two remain, or no Q8 path. One thread
    takes the call too: a layer's experts quantize their shared token once and cost one call, not one each. Timings: docs/BENCHMARKS.md, "CPU kernel switch points"."""
    lib = lib or native.library()
    threads = torch.get_num_threads()
    if len(experts) < 2 or not q8_enabled(lib):
        return None
    first = _glu_parts(*experts[0])
    if first is None:
        return None
    kind, I, D, few = first[0], first[1], experts[0][0].shape[1], glu_many_tokens(lib)  # noqa: E741
    pick, parts = [], []  # the experts run here, and their records as the kernel reads them
    for i, (recs, x) in enumerate(zip(experts, xs, strict=True)):
        if not (0 < x.shape[0] <= few and tuple(x.shape[1:]) == (D,)):
            continue
        got = first if i == 0 else _glu_parts(*recs)
        if got is not None and got[:2] == (kind, I) and recs[0].shape[1] == D:  # the kind says the format
            pick.append(i)
            parts.append(got[2])
    if len(pick) < 2:
        return None
    n = len(pick)
    x32 = {}  # each distinct input once (a decode step's experts share one token)
    for i in pick:
        if id(xs[i]) not in x32:
            x32[id(xs[i])] = _x32(xs[i])
    ins = [x32[id(xs[i])] for i in pick]
    Ts = [x.shape[0] for x in ins]
    if len(set(Ts)) == 1:  # one buffer for all (a decode step's experts): one allocation, not one an expert
        outs = list(torch.empty(n, Ts[0], D, dtype=torch.float32).unbind(0))
    else:
        outs = [torch.empty(t, D, dtype=torch.float32) for t in Ts]
    USED.add(f"{experts[0][0].format}_q8_{act[0]}_many")
    _glu_many_call(lib, act, kind, I, D, [[t.data_ptr() for t in p] for p in parts], [x.data_ptr() for x in ins], Ts,
                   [o.data_ptr() for o in outs], threads)
    ys: list[torch.Tensor | None] = [None] * len(experts)
    for i, y in zip(pick, outs, strict=True):
        ys[i] = y
    return ys


def _glu_many_call(lib, act: tuple, kind: int, I: int, D: int, ptrs: list, ins: list[int], Ts: list[int],  # noqa: E741
                   outs: list[int], threads: int) -> None:
    """``df_q4q8_glu_many`` over n experts: ptrs[e] the six pointers of expert e's records (gate, its scales, up, its
    scales, down, its scales), ins / Ts / outs its input, token count and output addresses. The C call's nine arrays
    go as rows of one int64 array.array: nine ctypes arrays, or a tensor made from a list, cost more than the call
    itself for a decode step's experts."""
    n = len(ptrs)
    table = array.array("q", [p[j] for j in range(6) for p in ptrs] + ins + Ts + outs)
    base, row = table.buffer_info()[0], 8 * n
    tab, k, mult = _Q8[kind]
    if lib.df_q4q8_glu_many(n, *_act_args(act), kind, *(base + j * row for j in range(6)), tab.data_ptr(), k, mult,
                            _E8M0.data_ptr(), base + 6 * row, base + 7 * row, base + 8 * row, I, D, threads):
        raise MemoryError(f"q8 activation buffers for experts of width {D}; set DELTAFIN_CPU_Q8=0 to skip them")


def swiglu(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, lib=None) -> torch.Tensor | None:
    """down(silu(gate x) * up x): ``glu_expert`` with SwiGLU."""
    return glu_expert(x, gate, up, down, ("silu",), lib)


@contextlib.contextmanager
def denormals_flushed(lib=None) -> Iterator[None]:
    """Within this block, denormal floats flush to zero and read as zero (FTZ and DAZ) in this thread and torch's
    compute threads (one OpenMP runtime with the kernels'), then the setting before comes back. The fast path
    only: the exact path keeps IEEE arithmetic. Denormals come up in a real model's prefill (Kimi K3's decays of
    e^-100 and less, an activation's far tails) and take the multiply units' slow path (a batched matmul with
    denormal inputs run many times slower; figures in docs/BENCHMARKS.md). Nothing is done where the kernels did
    not build or off x86."""
    lib = lib or native.library()
    if lib is None or lib.df_ftz(-1, 0) != 0:  # no kernels, not x86, or already flushed by a block outside
        yield
        return
    lib.df_ftz(1, torch.get_num_threads())
    try:
        yield
    finally:
        lib.df_ftz(0, torch.get_num_threads())


def int8_gemm(T: int, C: int, lib=None) -> bool:
    """Whether int8 rows take the int16 GEMM at T tokens of width C: past gemm_tokens(int8=True), whole blocks of 32, where
    the build has it (timings: docs/BENCHMARKS.md, "CPU kernel switch points")."""
    return C % 32 == 0 and gemm_enabled(lib) and T > gemm_tokens(lib, int8=True)


def int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, lib=None) -> torch.Tensor:
    """x [T, in] @ W^T for W = q [out, in] int8 * s [out] float32 -> float32 [T, out]."""
    lib = lib or native.library()
    T, C = x.shape
    R = q.shape[0]
    if T > FUSED_TOKENS and _invariant():
        return _chunked(lambda xs: int8_linear(xs, q, s, lib), x)
    x, q, s = _x32(x), q.contiguous(), s.to(torch.float32).contiguous()
    if int8_gemm(T, C, lib):
        out = torch.empty(T, R, dtype=torch.float32)
        rc = lib.df_i8gw_mm(q.data_ptr(), s.data_ptr(), x.data_ptr(), out.data_ptr(), R, C, T, _threads(R, C, T))
        if rc == -1:
            raise MemoryError(f"int16 GEMM buffers for [{T}, {C}]; set DELTAFIN_CPU_GEMM=0 to skip them")
        if rc == 0:
            USED.add("int8_gemm")
            return out
    if T <= FUSED_TOKENS and i16_enabled(lib):
        USED.add("int8_a16")
        out = torch.empty(T, R, dtype=torch.float32)
        if lib.df_i8a16_mm(q.data_ptr(), s.data_ptr(), x.data_ptr(), out.data_ptr(), R, C, T, _threads(R, C, T)):
            raise MemoryError(f"int16 activation buffers for [{T}, {C}]; set DELTAFIN_CPU_Q8=0 to skip them")
        return out
    USED.add("int8_linear" if T <= FUSED_TOKENS else "int8_tile")
    if T <= FUSED_TOKENS:
        out = torch.empty(T, R, dtype=torch.float32)
        lib.df_i8_mm(q.data_ptr(), s.data_ptr(), x.data_ptr(), out.data_ptr(), R, C, T, _threads(R, C, T))
        return out
    rows = max(16, TILE_BYTES // (4 * C))
    out = torch.empty(T, R, dtype=torch.float32)
    for r0 in range(0, R, rows):
        w = q[r0 : r0 + rows].to(torch.float32)  # the tile, decoded once for all tokens
        torch.mm(x, w.T, out=out[:, r0 : r0 + w.shape[0]])
    return out.mul_(s)


def int8_linear_many(x: torch.Tensor, ws: list[QTensor], lib=None) -> list[torch.Tensor] | None:
    """[x @ W^T for W in ws] for int8 records [out_i, in] that share x [T, in], in one compiled call (x quantized
    once, one parallel pass over all their rows; each result as int8_linear's), or None where int8_linear
    applies one at a time (many tokens, no int16 path)."""
    T, C = x.shape
    lib = lib or native.library()
    if T > FUSED_TOKENS or not i16_enabled(lib) or int8_gemm(T, C, lib):
        return None
    qs = [w.data.contiguous() for w in ws]
    ss = [w.scale.to(torch.float32).contiguous() for w in ws]
    outs = [torch.empty(T, q.shape[0], dtype=torch.float32) for q in qs]
    n = len(ws)
    ptrs = [(ctypes.c_void_p * n)(*[t.data_ptr() for t in ts]) for ts in (qs, ss, outs)]
    rows = (ctypes.c_int64 * n)(*[q.shape[0] for q in qs])
    x = _x32(x)
    USED.add("int8_a16_many")
    if lib.df_i8a16_multi(n, *ptrs, rows, x.data_ptr(), C, T, _threads(sum(rows), C, T)):
        raise MemoryError(f"int16 activation buffers for [{T}, {C}]; set DELTAFIN_CPU_Q8=0 to skip them")
    return outs


def int8_heads(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, lib=None) -> torch.Tensor | None:
    """out[h] = (q[h] * s[h][:, None]) @ x[h] for n heads in one compiled call: x [n, C] float32, q int8 [n, R, C]
    (each head's rows contiguous; heads at any stride), s float32 [n, R] (rows contiguous) or None for unit
    scales. Each head's rows get ``int8_linear``'s int16-activation arithmetic. None where that path is off."""
    lib = lib or native.library()
    if not i16_enabled(lib):
        return None
    n, R, C = q.shape
    assert q.stride(2) == 1 and q.stride(1) == C and x.shape == (n, C)
    if s is None:
        s, ss = torch.ones(R, dtype=torch.float32), 0
    else:
        assert s.shape == (n, R) and s.stride(1) == 1 and s.dtype == torch.float32
        ss = s.stride(0)
    x = _x32(x)
    out = torch.empty(n, R, dtype=torch.float32)
    USED.add("int8_heads")
    if lib.df_i8a16_heads(n, q.data_ptr(), q.stride(0), s.data_ptr(), ss, x.data_ptr(), out.data_ptr(), R, C,
                          _threads(n * R, C, 1)):
        raise MemoryError(f"int16 activation buffers for {n} heads of {C}; set DELTAFIN_CPU_Q8=0 to skip them")
    return out


class GQATable:
    """One layer's records as ``df_gqa1`` reads them (an int64 table of pointers and sizes), with the float32 copies
    it points into kept alive beside it. Made once per layer (``gqa_table``)."""

    __slots__ = ("table", "keep", "D", "H", "Hkv", "d")

    def __init__(self, table: torch.Tensor, keep: list, D: int, H: int, Hkv: int, d: int):
        self.table, self.keep, self.D, self.H, self.Hkv, self.d = table, keep, D, H, Hkv, d


def _int8_rows(w, C: int) -> bool:
    return (isinstance(w, QTensor) and w.format == "int8" and len(w.shape) == 2 and w.shape[1] == C
            and w.scale is not None and w.data.device.type == "cpu")


def gqa_table(D: int, H: int, Hkv: int, d: int, r: int, ln1, q, k, v, o, biases=(None, None, None, None),
              norms=(None, None), lib=None) -> GQATable | None:
    """The table of one GQA layer for ``gqa_one``: q [H d, D], k and v [Hkv d, D], o [D, H d] int8 records, ln1 [D]
    and the optional biases (q, k, v, o) and per-head q/k norm weights [d] as tensors; None where they are not that
    (the caller keeps the separate calls)."""
    lib = lib or native.library()
    if lib is None or not (_int8_rows(q, D) and _int8_rows(k, D) and _int8_rows(v, D) and _int8_rows(o, H * d)):
        return None
    if (q.shape[0], k.shape[0], v.shape[0], o.shape[0]) != (H * d, Hkv * d, Hkv * d, D) or not 0 <= r <= d:
        return None
    keep: list[torch.Tensor] = []

    def f32(t, n: int) -> int:
        if t is None:
            return 0
        t = t.detach().to(torch.float32).contiguous().reshape(-1)
        assert t.numel() == n, (t.numel(), n)
        keep.append(t)
        return t.data_ptr()

    def rows(w) -> list[int]:
        data = w.data.contiguous()
        keep.append(data)
        return [data.data_ptr(), f32(w.scale, w.shape[0])]

    vals = [D, H, Hkv, d, r, f32(ln1, D), *rows(q), *rows(k), *rows(v), f32(biases[0], H * d), f32(biases[1], Hkv * d),
            f32(biases[2], Hkv * d), f32(norms[0], d), f32(norms[1], d), *rows(o), f32(biases[3], D)]
    assert len(vals) == lib.df_gqa_table_size()
    return GQATable(torch.tensor(vals, dtype=torch.int64), keep, D, H, Hkv, d)


def gqa_one(t: GQATable, x: torch.Tensor, eps: float, scale: float, pos: int, cos: torch.Tensor | None,
            sin: torch.Tensor | None, kbuf: torch.Tensor, vbuf: torch.Tensor, k0: int, lib=None) -> torch.Tensor | None:
    """x [1, D] + the layer's attention of one token (``df_gqa1``: the separate calls' result, bit for bit), its k and v
    written at ``pos`` of the head-major cache buffers kbuf / vbuf [Hkv, cap, d] (cap > pos), attending over positions
    k0 .. pos; cos / sin [1, r/2] float32 (None where r is 0). None where the fused call does not apply."""
    lib = lib or native.library()
    if (x.dtype != torch.float32 or x.shape != (1, t.D) or not i16_enabled(lib) or kbuf.dtype != torch.float32
            or vbuf.dtype != torch.float32 or not (kbuf.is_contiguous() and vbuf.is_contiguous())):
        return None
    x = x.contiguous()
    out = torch.empty(1, t.D, dtype=torch.float32)
    n = torch.get_num_threads()
    nq = t.H * t.d
    S = pos + 1 - k0
    cs = 0 if cos is None else cos.data_ptr()
    sn = 0 if sin is None else sin.data_ptr()
    if lib.df_gqa1(t.table.data_ptr(), x.data_ptr(), out.data_ptr(), eps, scale, pos, cs, sn, kbuf.data_ptr(),
                   vbuf.data_ptr(), kbuf.stride(0), vbuf.stride(0), k0, _threads(nq + 2 * t.Hkv * t.d, t.D, 1),
                   n if t.H * S * t.d >= 1 << 16 else 1, _threads(t.D, nq, 1)):
        raise MemoryError(f"work buffers of a one-token attention over {S} positions; set DELTAFIN_CPU_Q8=0 to run its "
                          f"separate calls")
    USED.add("gqa1")
    return out


def route1(x: torch.Tensor, ln: torch.Tensor, eps: float, router: torch.Tensor, k: int, renorm: bool, lib=None
           ) -> tuple[torch.Tensor, list[int], torch.Tensor] | None:
    """One token's MoE input and softmax top-k routing in one call (``df_route1``): (h = rms(x, ln) [1, D], the k
    expert ids, their weights [k] float32), ids in descending weight order; None where it does not apply (the
    caller's torch form runs). ln [D] and router [E, D] float32, contiguous (prepared once per layer)."""
    lib = lib or native.library()
    E, D = router.shape
    if x.dtype != torch.float32 or x.shape != (1, D) or not 0 < k <= E:
        return None
    x = x.contiguous()
    h, ids, w = torch.empty(1, D), torch.empty(k, dtype=torch.int64), torch.empty(k)
    threads = _threads(E, D, 1)
    if lib.df_route1(x.data_ptr(), ln.data_ptr(), eps, router.data_ptr(), E, D, k, int(renorm), h.data_ptr(),
                     ids.data_ptr(), w.data_ptr(), threads):
        return None
    USED.add("route1")
    return h, ids.tolist(), w


def _q8_expert(tensors) -> tuple | None:
    """(kind, I, D, the six pointers) of a gated 4-bit expert as ``df_q4q8_glu_many`` reads it, kept on the expert's
    record dict where it takes attributes (``store.expert_file.decode``'s): computed once per expert in memory."""
    got = getattr(tensors, "q8_parts", False)
    if got is not False:
        return got
    try:
        recs = (tensors["gate"], tensors["up"], tensors["down"])
    except KeyError:
        recs = None
    parts = None if recs is None else _glu_parts(*recs)
    got = None if parts is None else (parts[0], parts[1], recs[0].shape[1], tuple(t.data_ptr() for t in parts[2]),
                                      parts[2])
    with contextlib.suppress(AttributeError):  # a plain dict: computed again next time
        tensors.q8_parts = got
    return got


def glu_into(h: torch.Tensor, experts: list, slots: list[int], y: torch.Tensor, act: tuple = ("silu",), lib=None
             ) -> bool:
    """y[slots[i]] = glu_expert(h, experts[i]...) for one token h [1, D] and gated 4-bit experts (tensors by role), in
    one call (``df_q4q8_glu_many``, bit for bit each expert's own call); y [k, D] float32. False (nothing written)
    where any of them is not such an expert of the first one's shape, or there is no Q8 path: the caller runs them."""
    lib = lib or native.library()
    if not experts or not q8_enabled(lib) or h.shape[0] != 1 or h.dtype != torch.float32:
        return False
    parts = [_q8_expert(t) for t in experts]
    first = parts[0]
    if first is None or first[2] != h.shape[1] or any(p is None or p[:3] != first[:3] for p in parts):
        return False
    kind, I, D = first[:3]  # noqa: E741
    n, h, base = len(parts), h.contiguous(), y.data_ptr()
    USED.add(f"{experts[0]['gate'].format}_q8_{act[0]}_many")
    _glu_many_call(lib, act, kind, I, D, [p[3] for p in parts], [h.data_ptr()] * n, [1] * n,
                   [base + 4 * D * s for s in slots], torch.get_num_threads())
    return True


def moe_sum1(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, lib=None) -> torch.Tensor:
    """x + sum over slots s of w[s] * y[s] for one token x [1, D], y [k, D], w [k], all float32 (``df_moe_sum1``, slot
    order)."""
    lib = lib or native.library()
    out = torch.empty(x.shape)
    if not (x.is_contiguous() and y.is_contiguous() and w.is_contiguous() and y.dtype == w.dtype == torch.float32):
        x, y, w = x.contiguous(), y.float().contiguous(), w.float().contiguous()
    lib.df_moe_sum1(x.data_ptr(), y.data_ptr(), w.data_ptr(), y.shape[0], y.shape[1], out.data_ptr())
    return out
