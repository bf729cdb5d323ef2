"""Weight-only int8, symmetric, one float32 scale per output row (the resident trunk's default)."""

from __future__ import annotations

import numpy as np
import torch


def quantize_ref(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q = round(w / s) with s = amax(row) / 127; rows of zeros get s = 1."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=-1, keepdims=True)
    s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    return q, s[..., 0]


def dequantize_ref(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    return np.asarray(q, dtype=np.float32) * np.asarray(s, dtype=np.float32)[..., None]


QUANTIZE_STEP = 1 << 16  # elements a step: float32 temporaries under pack's 1 MiB mmap threshold, kept in cache


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's bytes (rows are independent), a block of whole rows at a time."""
    w = w.detach().cpu()
    if w.dim() == 0:
        q, s = quantize(w.reshape(1))
        return q.reshape(()), s.reshape(())
    *lead, n = w.shape
    rows = w.reshape(-1, n)
    q = torch.empty(rows.shape, dtype=torch.int8)
    s = torch.empty(rows.shape[0], dtype=torch.float32)
    step = max(1, QUANTIZE_STEP // max(n, 1))
    for a in range(0, rows.shape[0], step):
        x = rows[a : a + step].to(torch.float32, copy=True)
        amax = x.abs().amax(dim=-1, keepdim=True)
        sa = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q[a : a + step] = x.div_(sa).round_().clamp_(-127, 127)
        s[a : a + step] = sa.squeeze(-1)
    return q.reshape(*lead, n), s.reshape(lead)


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * s.to(torch.float32).unsqueeze(-1)).to(dtype)


ROWS_AT_ONCE = 1 << 26  # weight elements converted per step: a 163840 x 7168 lm_head is done in pieces


def matmul(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x @ W^T with W = q * s, without materialising W: (x @ q^T) * s (exact per-row scaling). A large
    weight is converted a block of output rows at a time, so the float copy never holds all of it."""
    if q.numel() <= ROWS_AT_ONCE:
        return (x @ q.to(x.dtype).T) * s.to(x.dtype)
    step = max(1, ROWS_AT_ONCE // q.shape[1])
    return torch.cat([(x @ q[a : a + step].to(x.dtype).T) * s[a : a + step].to(x.dtype)
                      for a in range(0, q.shape[0], step)], dim=-1)
