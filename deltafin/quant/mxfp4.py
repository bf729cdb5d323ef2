"""MXFP4 (OCP Microscaling v1.0): FP4 E2M1 elements with one E8M0 scale per block of 32.

Layout used everywhere in Deltafin (same as gpt-oss, transformers and compressed-tensors):
``packed`` uint8 [..., in/2] with the even element in the low nibble, ``scales`` uint8 [..., in/32].
The GGUF order (low nibble = element j, high = element j + 16 of a block) is converted on import.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from deltafin.errors import CodecError

BLOCK = 32
# OCP MX v1.0 E2M1 code -> value: sign<<3 | exp<<1 | mantissa, bias 1, subnormal at exp 0.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
_POS = E2M1_VALUES[:8]
_MIDPOINTS = (_POS[1:] + _POS[:-1]) / 2  # decision boundaries between magnitudes


def _check_shapes(packed_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> None:
    if packed_shape[:-1] != scales_shape[:-1] or packed_shape[-1] * 2 != scales_shape[-1] * BLOCK:
        raise CodecError(
            f"mxfp4: packed {tuple(packed_shape)} and scales {tuple(scales_shape)} disagree; "
            f"expected packed[..., n/2] with scales[..., n/32]"
        )


# ---------------------------------------------------------------- reference codec (numpy)


def quantize_ref(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference quantizer: shared exponent floor(log2(amax)) - 2, nearest E2M1, saturate at 6."""
    w = np.asarray(w, dtype=np.float32)
    *lead, n = w.shape
    if n % BLOCK:
        raise CodecError(f"mxfp4: input dimension {n} is not a multiple of {BLOCK}")
    blocks = w.reshape(*lead, n // BLOCK, BLOCK)
    exp = _shared_exponents(np.abs(blocks).max(axis=-1))
    scaled = blocks / np.exp2(exp.astype(np.float64))[..., None]
    mag = np.minimum(np.abs(scaled), 6.0)
    idx = np.searchsorted(_MIDPOINTS, mag, side="left")  # ties go to the lower magnitude...
    tie = np.isin(mag, _MIDPOINTS)
    # ...except where the upper neighbour has an even mantissa (round half to even).
    idx = np.where(tie & (idx % 2 == 1), idx + 1, idx)
    codes = (idx | np.where(np.signbit(scaled), 8, 0)).astype(np.uint8).reshape(*lead, n)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), (exp + 127).astype(np.uint8)


def _shared_exponents(amax: np.ndarray) -> np.ndarray:
    """Each block's shared exponent from its float32 amax: floor(log2(amax)) - 2, -127 for a zero block."""
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-45))) - 2, -127)
    return np.clip(exp, -127, 127).astype(np.int32)


def dequantize_ref(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Reference dequantizer: value[c] = E2M1[code] * 2**(scale[c // 32] - 127)."""
    packed = np.asarray(packed, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    _check_shapes(packed.shape, scales.shape)
    *lead, half = packed.shape
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*lead, half * 2)
    vals = E2M1_VALUES[codes]
    mult = np.exp2(np.minimum(scales, 254).astype(np.float64) - 127.0).astype(np.float32)
    mult = np.where(scales == 255, np.float32(np.nan), mult)  # OCP MX: E8M0 0xFF is NaN
    with np.errstate(over="ignore"):  # 6 * 2^127 is past float32's range: inf, as in the torch path
        return (vals.reshape(*lead, half * 2 // BLOCK, BLOCK) * mult[..., None]).reshape(*lead, half * 2)


def gguf_to_standard(packed: np.ndarray) -> np.ndarray:
    """GGUF MXFP4 order (per 16-byte block: low nibble j, high nibble j+16) to the standard order."""
    packed = np.asarray(packed, dtype=np.uint8)
    *lead, half = packed.shape
    blocks = packed.reshape(*lead, half // 16, 16)
    codes = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)  # element order 0..31
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).reshape(*lead, half)


def standard_to_gguf(packed: np.ndarray) -> np.ndarray:
    packed = np.asarray(packed, dtype=np.uint8)
    *lead, half = packed.shape
    blocks = packed.reshape(*lead, half // 16, 16)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*lead, half // 16, 32)
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8).reshape(*lead, half)


# ---------------------------------------------------------------- fast path (torch)

_LUT_CACHE: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _luts(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte -> its two element values [256, 2], E8M0 byte -> 2**(byte - 127) [256, 1])."""
    key = (device, dtype)
    if key not in _LUT_CACHE:
        vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        pair = torch.stack([vals[b & 0x0F], vals[b >> 4]], dim=-1)  # low nibble = even element
        scale = torch.exp2(torch.arange(256, dtype=torch.float64) - 127).to(torch.float32)
        scale[255] = float("nan")  # OCP MX: E8M0 0xFF is NaN
        _LUT_CACHE[key] = (pair.to(device, dtype), scale.unsqueeze(-1).to(device, dtype))
    return _LUT_CACHE[key]


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch dequantizer, bit-identical to :func:`dequantize_ref` (E2M1 values times powers of two are exact
    in float32). Two table lookups: one per packed byte (both elements), one per block scale."""
    _check_shapes(tuple(packed.shape), tuple(scales.shape))
    *lead, half = packed.shape
    # bf16 has float32's exponent range, so E2M1 x 2^k is exact in it; float16 would overflow or flush
    # large and small scales that the float32 result, rounded once, keeps
    work = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    pair, scale = _luts(packed.device, work)
    vals = torch.nn.functional.embedding(packed.reshape(-1, half).to(torch.int32), pair)  # [R, n/2, 2]
    s = torch.nn.functional.embedding(scales.reshape(-1, half // 16).to(torch.int32), scale)  # [R, n/32, 1]
    out = vals.reshape(-1, half // 16, BLOCK) * s
    return out.reshape(*lead, half * 2).to(dtype)


QUANTIZE_STEP = 1 << 18  # elements quantized per step: 1 MiB float32 work buffers, reused, stay in the cache
_TWO22 = 0x4A800000  # float32 bits of 2**22, whose ulp is 0.5
_scratch = threading.local()  # each thread's work buffers: no allocation (or page faults) per step


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor (any float dtype): the same bytes as :func:`quantize_ref`, in vectorised torch
    a block of rows at a time. A tensor holding NaN or inf takes the reference itself (packs refuse those
    unless told otherwise, so the fast path need not reproduce how they saturate)."""
    w = w.detach().cpu()
    *lead, n = w.shape
    if n % BLOCK:
        raise CodecError(f"mxfp4: input dimension {n} is not a multiple of {BLOCK}")
    rows = w.reshape(-1, n)
    R = rows.shape[0]
    packed = torch.empty(R, n // 2, dtype=torch.uint8)
    scales = torch.empty(R, n // BLOCK, dtype=torch.uint8)
    step = max(1, QUANTIZE_STEP // max(n, 1))
    bufs = _buffers(min(step, R) * n)
    for a in range(0, R, step):
        b = min(a + step, R)
        if not _quantize_rows(rows[a:b], packed[a:b], scales[a:b], bufs):
            p, s = quantize_ref(w.to(torch.float32).numpy())
            return torch.from_numpy(p), torch.from_numpy(s)
    return packed.reshape(*lead, n // 2), scales.reshape(*lead, n // BLOCK)


def _buffers(size: int) -> list[torch.Tensor]:
    """Four int32 work buffers of at least ``size`` elements, this thread's own."""
    have = getattr(_scratch, "bufs", None)
    if have is None or have[0].numel() < size:
        have = _scratch.bufs = [torch.empty(size, dtype=torch.int32) for _ in range(4)]
    return have


def _quantize_rows(w: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bufs: list[torch.Tensor]) -> bool:
    """Rows [r, n] into ``packed`` [r, n/2] and ``scales`` [r, n/32]; False (nothing written) if any is not
    finite. Exact: dividing by a power of two is exact wherever the result is a normal float32 (smaller results
    all round to code 0), and both roundings below are IEEE round-half-to-even, as the reference's ties."""
    r, n = w.shape
    bits, sign, code, high = (b[: r * n].view(r, n // BLOCK, BLOCK) for b in bufs)
    x = bits.view(torch.float32)
    x.copy_(w.reshape(r, n // BLOCK, BLOCK))  # [r, n/32, 32] float32
    torch.bitwise_right_shift(bits, 28, out=sign).bitwise_and_(8)  # the sign bit, as code bit 3
    amax = x.abs_().amax(dim=-1)  # [r, n/32]
    if not bool(torch.isfinite(amax).all()):
        return False
    exp = _shared_exponents(amax.numpy())
    scales.copy_(torch.from_numpy(exp + 127))
    x.div_(torch.from_numpy(np.exp2(exp.astype(np.float32))).unsqueeze(-1))  # |scaled| < 8
    # below 2 the E2M1 step is 0.5: adding 2**22 (ulp 0.5) rounds to it; the count of halves is the code
    torch.clamp(x, max=2.0, out=code.view(torch.float32)).view(torch.float32).add_(4194304.0)
    code.sub_(_TWO22)
    # from 1 up, one mantissa bit: round float32's 23 bits to 1 (half to even); exponent|bit is then the code
    torch.bitwise_right_shift(bits, 22, out=high).bitwise_and_(1).add_(bits).add_(0x1FFFFF)
    high.bitwise_right_shift_(22).sub_(252)
    torch.maximum(code, high, out=code).clamp_(max=7).bitwise_or_(sign)
    # two codes a word, the even element in the low half (little-endian)
    pairs, shifted = code.view(r, n).view(torch.int64), high.view(r, n).view(torch.int64)
    torch.bitwise_right_shift(pairs, 28, out=shifted)
    packed.copy_(pairs.bitwise_or_(shifted))  # the low byte is even | odd << 4; copy_ keeps that byte
    return True
