"""Codecs: one explicit record per quantized tensor, a plain reference codec per format, fast torch paths.

Formats:
- ``mxfp4``   OCP MX v1.0 FP4 (E2M1) elements, one E8M0 scale per 32 along the input dim.
- ``int8``    weight-only symmetric int8, one float32 scale per output row.
- ``int4g32`` compressed-tensors ``pack-quantized`` INT4, group 32, symmetric (import only).
- ``bf16`` / ``f16`` / ``f32`` plain values (pass-through).
"""

from deltafin.quant.record import FORMATS, QTensor, dequantize, from_plain, matmul

__all__ = ["FORMATS", "QTensor", "dequantize", "from_plain", "matmul"]
