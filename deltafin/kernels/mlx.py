"""MLX backend: weight matmuls over Deltafin's stored bytes on Apple's GPU (Linux: MLX's CPU build, for tests).

Formats as MLX takes them, unchanged where it can (checked against the float64 reference decode in
tests/test_mlx_kernels.py):

- MXFP4 (group 32): the packed bytes viewed as uint32 and the E8M0 scale bytes are MLX's ``mode="mxfp4"`` as
  stored: same nibble order, same scales (MLX decodes them bit for bit as ``mxfp4.dequantize_ref``; a scale byte
  0xFF is inf there, NaN here, and the packer refuses NaN scales).
- INT4 group 32 (stored as n = q + 8, bits 4i of each int32 word): MLX's affine 4-bit with the same words. Resident
  (trunk) records take biases -8 x scale once; in the expert slab, where a bias array per slot would be a second
  copy of the scales, the scales are passed as the biases too (w' = s (n + 1)) and -9 s . (x's sums per group) is
  taken off with the scales of the routed slots alone.
- int8 rows (one float32 scale a row): affine 8-bit (bytes XOR 0x80, so q + 128 unsigned; scale per group = the
  row's, biases -128 x scale), or bfloat16 rows (``INT8_AS``), the choice to be settled by measurement on a Mac.
- Anything else (bf16, float32, fp8...): decoded once to a float array (float32 on the exact path).

Expert slabs (``deltafin.mlx.slab``) hold whole expert files; ``slab_views`` are strided MLX views of one role of
every slot (no copy), which ``gather_qmm`` multiplies in place by slot indices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from deltafin.quant.record import QTensor

# int8 rows: affine 8-bit (1 byte a weight) or bf16 rows (2 bytes, q exact) times the row's float32 scale; auto:
# affine with float32 activations, bf16 rows with bfloat16 ones (MLX's CPU build forms s (q + 128) - 128 s in
# bfloat16 there, half a quantization step off: 6.7% of the largest output on a 512 x 2048 matrix)
INT8_AS = os.environ.get("DELTAFIN_MLX_INT8", "auto")
USED: set[str] = set()


def mx():
    import mlx.core

    return mlx.core


def available() -> str:
    """'' when MLX imports here, else what to install."""
    try:
        mx()
    except ImportError as e:
        return f"MLX is not installed ({e}); pip install -e \".[mlx]\" (mlx on a Mac, mlx[cpu] on Linux)"
    return ""


@dataclass(frozen=True, slots=True)
class MXWeight:
    """A weight [out, in] as MLX multiplies it: quantized (w, scales, biases, group, bits, mode) or dense (w)."""

    shape: tuple[int, int]
    w: object
    scales: object = None
    biases: object = None
    group: int = 0
    bits: int = 0
    mode: str = ""
    row_scale: object = None  # int8 rows kept as bf16 q: the float32 scale per output row, applied after

    @property
    def quantized(self) -> bool:
        return self.scales is not None


def _np(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.contiguous().numpy()


def dense_array(t, dtype) -> object:
    """A torch tensor (any dtype) as an MLX array of ``dtype``."""
    return mx().array(_np(t)).astype(dtype)


def prepare(rec: QTensor | object, dtype) -> MXWeight:
    """A trunk record as MLX multiplies it (see the module docstring); ``dtype`` the activations'."""
    m = mx()
    if isinstance(rec, QTensor) and len(rec.shape) == 2:
        R, C = rec.shape
        if rec.format == "mxfp4":
            return MXWeight((R, C), m.array(rec.data.contiguous().numpy().view(np.uint32)),
                            m.array(rec.scale.contiguous().numpy()), None, 32, 4, "mxfp4")
        if rec.format == "int4g32":
            s = m.array(_np(rec.scale)).astype(dtype)
            return MXWeight((R, C), m.array(rec.data.contiguous().numpy().view(np.uint32)), s, -8 * s, 32, 4,
                            "affine")
        affine = INT8_AS == "affine" or (INT8_AS == "auto" and dtype == m.float32)
        if rec.format == "int8" and C % 32 == 0 and affine:
            g = 128 if C % 128 == 0 else 64 if C % 64 == 0 else 32
            q = (rec.data.contiguous().numpy().view(np.uint8) ^ 0x80).view(np.uint32)  # q + 128, 4 a word
            s = m.broadcast_to(m.array(_np(rec.scale).reshape(R, 1)), (R, C // g)).astype(dtype)
            return MXWeight((R, C), m.array(q), s, -128 * s, g, 8, "affine")
        if rec.format == "int8":  # bf16 rows: q exact, the scale after the product
            return MXWeight((R, C), m.array(rec.data.numpy()).astype(m.bfloat16),
                            row_scale=m.array(_np(rec.scale).astype(np.float32)))
    import torch

    from deltafin.models.base import dense

    t = rec if isinstance(rec, torch.Tensor) else dense(rec, torch.float32)
    return MXWeight(tuple(t.shape), dense_array(t, dtype))


def linear(x, w: MXWeight, bias=None):
    """x [..., in] @ W^T (+ bias) in x's dtype."""
    m = mx()
    if w.quantized:
        USED.add(f"mlx:{w.mode}{w.bits}_linear")
        y = m.quantized_matmul(x, w.w, w.scales, w.biases, transpose=True, group_size=w.group, bits=w.bits,
                               mode=w.mode)
    elif w.row_scale is not None:
        USED.add("mlx:int8_bf16_linear")
        y = ((x @ w.w.T.astype(x.dtype)).astype(m.float32) * w.row_scale).astype(x.dtype)
    else:
        y = x @ w.w.T.astype(x.dtype)
    return y if bias is None else y + bias


# ------------------------------------------------------------------------------------------- expert slabs


@dataclass(frozen=True, slots=True)
class RoleView:
    """One role (gate, up, down...) of every slot of a slab: format, logical [out, in], strided MLX views."""

    format: str
    shape: tuple[int, int]
    data: object  # [S, out, in/8] uint32 (4-bit), or [S, out, in] (dense formats)
    scales: object | None  # [S, out, in/32]


_MX_DTYPES = {"uint8": "uint8", "int8": "int8", "int32": "int32", "bfloat16": "bfloat16", "float16": "float16",
              "float32": "float32"}


def _typed(u8, dtype: str, shape: tuple[int, ...], slot_bytes: int, offset: int):
    """A strided view of ``shape`` [S, ...] (row-major within a slot) of the slab's bytes as ``dtype``."""
    m = mx()
    dt = getattr(m, _MX_DTYPES[dtype])
    size = np.dtype(dtype if dtype != "bfloat16" else "uint16").itemsize
    assert slot_bytes % size == 0 and offset % size == 0, (dtype, slot_bytes, offset)
    inner = [1]
    for n in reversed(shape[2:]):
        inner.insert(0, inner[0] * n)
    return m.as_strided(u8.view(dt), shape, (slot_bytes // size, *inner), offset // size)


def gather_linear(x, role: RoleView, idx):
    """x [T, k, 1, in] (or [T, 1, 1, in] broadcast over k) @ W[idx]^T for slot indices idx [T, k] -> [T, k, 1, out]."""
    m = mx()
    if role.format == "mxfp4":
        USED.add("mlx:mxfp4_gather_qmm")
        return m.gather_qmm(x, role.data, role.scales, None, rhs_indices=idx, transpose=True, group_size=32,
                            bits=4, mode="mxfp4")
    if role.format == "int4g32":
        USED.add("mlx:int4_gather_qmm")
        s = role.scales if role.scales.dtype == x.dtype else None
        if s is None:  # bf16 scales with float32 activations: MLX wants them alike; the used slots' only
            return _gather_dense(x, role, idx)
        y = m.gather_qmm(x, role.data, s, s, rhs_indices=idx, transpose=True, group_size=32, bits=4,
                         mode="affine")  # s (n + 1): the scales serve as biases, no second array
        T, k = idx.shape
        C = role.shape[1]
        xs = x.reshape(*x.shape[:-1], C // 32, 32).sum(-1)  # [T, k|1, 1, C/32]
        used = m.take(s, idx.reshape(-1), axis=0).reshape(T, k, role.shape[0], C // 32)  # [T, k, R, G]
        corr = (used * xs.reshape(T, xs.shape[1], 1, C // 32)).sum(-1)  # [T, k, R]
        return y - 9 * corr[:, :, None, :]
    return _gather_dense(x, role, idx)


def _gather_dense(x, role: RoleView, idx):
    """The routed slots' weights decoded to x's dtype (a copy of those slots only), then a batched matmul."""
    m = mx()
    USED.add(f"mlx:{role.format}_gather_dense")
    T, k = idx.shape
    flat = idx.reshape(-1)
    if role.format in ("mxfp4", "int4g32"):
        w, s = m.take(role.data, flat, axis=0), m.take(role.scales, flat, axis=0)
        if role.format == "mxfp4":
            w = m.dequantize(w, s, None, group_size=32, bits=4, mode="mxfp4", dtype=x.dtype)
        else:
            s = s.astype(x.dtype)
            w = m.dequantize(w, s, -8 * s, group_size=32, bits=4, mode="affine")
    else:
        w = m.take(role.data, flat, axis=0).astype(x.dtype)
        if role.scales is not None:  # int8 rows: one scale a row
            w = w * m.take(role.scales, flat, axis=0).astype(x.dtype)[..., None]
    w = w.reshape(T, k, *role.shape)  # [T, k, out, in]
    return x @ m.swapaxes(w, -1, -2)


def slot_rows(roles: dict[str, RoleView], name: str, idx, like):
    """A per-expert vector role (a bias [n]) of the routed slots as [T, k, 1, n] in like's dtype (0 if absent)."""
    role = roles.get(name)
    if role is None:
        return 0
    T, k = idx.shape
    return mx().take(role.data, idx.reshape(-1), axis=0).reshape(T, k, 1, -1).astype(like.dtype)


def glu(x, roles: dict[str, RoleView], idx, act: tuple = ("silu",)):
    """The routed experts of T tokens, k slots each: down(act(gate x, up x)) -> [T, k, D]. x [T, D]."""
    m = mx()
    xe = x[:, None, None, :]  # [T, 1, 1, D]
    g, u = gather_linear(xe, roles["gate"], idx), gather_linear(xe, roles["up"], idx)  # [T, k, 1, I]
    h = activation(g, u, act)
    y = gather_linear(h, roles["down"], idx)  # [T, k, 1, D]
    return m.squeeze(y, 2)


def activation(g, u, act: tuple):
    """SwiGLU silu(g) u, or Kimi K3's SiTU-GLU beta tanh(g / beta) sigmoid(g) lbeta tanh(u / lbeta)."""
    m = mx()
    if act[0] == "silu":
        return g * m.sigmoid(g) * u
    b, lb = act[1], act[2]
    return b * m.tanh(g / b) * m.sigmoid(g) * (lb * m.tanh(u / lb))
