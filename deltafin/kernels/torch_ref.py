"""The plain torch path: the exact reference every fused kernel is tested against, and the fallback.

x @ W^T computed in x's dtype: int8 as (x @ q^T) * s (per-row scales applied after the sum), every other
format dequantized first. These are the float32 numerics that stay token-identical to transformers.
"""

from __future__ import annotations

import torch

from deltafin.quant import int8
from deltafin.quant.record import QTensor, dequantize


def matmul(x: torch.Tensor, w: QTensor | torch.Tensor) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return x @ w.to(x.dtype).T
    if w.format == "int8":
        return int8.matmul(x, w.data, w.scale)
    return x @ dequantize(w, x.dtype).T
