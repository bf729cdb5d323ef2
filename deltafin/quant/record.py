"""The quantized-tensor record: packed data, scales, format, block size, logical shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltafin.errors import CodecError
from deltafin.quant import fp8 as _fp8  # noqa: F401  (re-exported for importers)
from deltafin.quant import int4, int8, mxfp4

# format -> (block size along the input dim, data dtype, scale dtype or None)
FORMATS: dict[str, tuple[int, torch.dtype, torch.dtype | None]] = {
    "mxfp4": (mxfp4.BLOCK, torch.uint8, torch.uint8),
    "int8": (0, torch.int8, torch.float32),
    "int4g32": (int4.GROUP, torch.int32, torch.bfloat16),
    "bf16": (0, torch.bfloat16, None),
    "f16": (0, torch.float16, None),
    "f32": (0, torch.float32, None),
}
PLAIN = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


@dataclass(frozen=True, slots=True)
class QTensor:
    """One stored tensor. ``shape`` is the logical (dequantized) shape."""

    format: str
    shape: tuple[int, ...]
    data: torch.Tensor
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise CodecError(f"unknown tensor format {self.format!r}; known: {', '.join(FORMATS)}")

    @property
    def block(self) -> int:
        return FORMATS[self.format][0]

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QTensor:
        scale = None if self.scale is None else self.scale.to(device, non_blocking=non_blocking)
        return QTensor(self.format, self.shape, self.data.to(device, non_blocking=non_blocking), scale)


def dequantize(t: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if t.format == "mxfp4":
        w = mxfp4.dequantize(t.data, t.scale, dtype)
    elif t.format == "int8":
        w = int8.dequantize(t.data, t.scale, dtype)
    elif t.format == "int4g32":
        w = int4.dequantize(t.data, t.scale, dtype)
    else:
        w = t.data.to(dtype)
    return w.reshape(t.shape)


def from_plain(w: torch.Tensor, fmt: str) -> QTensor:
    """Encode a float tensor into ``fmt`` (the packer's one place for re-encoding)."""
    shape = tuple(w.shape)
    if fmt == "mxfp4":
        packed, scales = mxfp4.quantize(w)
        return QTensor(fmt, shape, packed, scales)
    if fmt == "int8":
        q, s = int8.quantize(w)
        return QTensor(fmt, shape, q, s)
    if fmt in PLAIN:
        return QTensor(fmt, shape, w.detach().to(PLAIN[fmt]).contiguous())
    raise CodecError(f"cannot encode into {fmt!r}; encodable formats: mxfp4, int8, bf16, f16, f32")


def matmul(x: torch.Tensor, w: QTensor | torch.Tensor) -> torch.Tensor:
    """x @ W^T for a weight stored as [out, in] in any format, in x's dtype: the plain reference every fused
    kernel is tested against (int8 as (x @ q^T) * s, every other format dequantized first). The kernels'
    dispatch point, ``deltafin.kernels.matmul``, picks a fused kernel where one applies."""
    if isinstance(w, torch.Tensor):
        return x @ w.to(x.dtype).T
    if w.format == "int8":
        return int8.matmul(x, w.data, w.scale)
    return x @ dequantize(w, x.dtype).T
