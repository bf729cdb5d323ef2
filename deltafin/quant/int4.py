"""compressed-tensors ``pack-quantized`` INT4, symmetric, group 32 (Kimi K2-Thinking experts).

``packed`` int32 [out, in/8]: element i of each group of 8 sits at bits 4i, stored as q + 8.
``scales`` [out, in/32] in the model dtype. w = q * scale per group of 32. Import only: kept as is.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32


def unpack_ref(packed: np.ndarray) -> np.ndarray:
    packed = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    *lead, n8 = packed.shape
    shifts = np.arange(8, dtype=np.int64) * 4
    nib = (packed[..., None] >> shifts) & 0xF  # [..., n/8, 8]
    return (nib - 8).astype(np.int8).reshape(*lead, n8 * 8)


def pack_ref(q: np.ndarray) -> np.ndarray:
    q = np.asarray(q, dtype=np.int64)
    *lead, n = q.shape
    nib = (q + 8).reshape(*lead, n // 8, 8) & 0xF
    word = (nib << (np.arange(8, dtype=np.int64) * 4)).sum(axis=-1)
    return word.astype(np.uint32).view(np.int32)


def quantize_ref(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-group quantizer (used to build test layouts): s = amax / 7, q in [-8, 7]."""
    w = np.asarray(w, dtype=np.float32)
    *lead, n = w.shape
    g = w.reshape(*lead, n // GROUP, GROUP)
    s = np.abs(g).max(axis=-1) / 7.0
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / s[..., None]), -8, 7).astype(np.int8).reshape(*lead, n)
    return pack_ref(q), s


def dequantize_ref(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    q = unpack_ref(packed).astype(np.float32)
    *lead, n = q.shape
    s = np.asarray(scales, dtype=np.float32)
    return (q.reshape(*lead, n // GROUP, GROUP) * s[..., None]).reshape(*lead, n)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    *lead, n8 = packed.shape
    p = packed.to(torch.int32).unsqueeze(-1)
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device) * 4
    q = ((p >> shifts) & 0xF) - 8  # arithmetic shift is fine: the mask drops sign bits
    q = q.to(torch.float32).reshape(*lead, n8 * 8 // GROUP, GROUP)
    return (q * scales.to(torch.float32).unsqueeze(-1)).reshape(*lead, n8 * 8).to(dtype)
