"""DeepSeek-V3 FP8 (e4m3) block weights: W[i, j] = float(W8[i, j]) * scale_inv[i // 128, j // 128]."""

from __future__ import annotations

import torch

from deltafin.errors import CodecError

BLOCK = 128


def dequantize(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """Dequantize to float32. ``scale_inv`` is [ceil(M/bm), ceil(N/bn)]."""
    M, N = w8.shape
    bm, bn = block
    if scale_inv.shape != ((M + bm - 1) // bm, (N + bn - 1) // bn):
        raise CodecError(
            f"fp8: scale_inv shape {tuple(scale_inv.shape)} does not match weight {M}x{N} with blocks {block}"
        )
    s = scale_inv.to(torch.float32).repeat_interleave(bm, 0)[:M].repeat_interleave(bn, 1)[:, :N]
    return w8.to(torch.float32) * s


def quantize(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantizer used to build test checkpoints in the DeepSeek layout."""
    M, N = w.shape
    bm, bn = block
    w = w.to(torch.float32)
    sm, sn = (M + bm - 1) // bm, (N + bn - 1) // bn
    pad = torch.zeros(sm * bm, sn * bn)
    pad[:M, :N] = w
    amax = pad.reshape(sm, bm, sn, bn).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    s = scale_inv.repeat_interleave(bm, 0)[:M].repeat_interleave(bn, 1)[:, :N]
    return (w / s).to(torch.float8_e4m3fn), scale_inv
