"""The plain torch path: the exact reference every fused kernel is tested against, and the fallback.

x @ W^T computed in x's dtype: int8 as (x @ q^T) * s (per-row scales applied after the sum), every other
format dequantized first. These are the float32 numerics that stay token-identical to transformers.
"""

from __future__ import annotations

from deltafin.quant.record import QTensor, dequantize, matmul  # noqa: F401  (the reference lives with the codecs)
