"""The MLX backend's matmuls (deltafin/kernels/mlx.py) and expert slab (deltafin/mlx/slab.py) on MLX's CPU build,
against the float64 reference decode of the same stored bytes (random bytes, not quantized floats: every nibble
and a spread of scales), over the CPU kernels' shape classes (one block to many, odd row counts).

Bounds: MLX's summation order is unknown, so a sum of C products is allowed gamma_n sum |w x| with n = C + 8
(test_kernels._bound). INT4 in the slab runs as s (n + 1) with the scales as biases and -9 s . X_g taken off (X_g
the sum of x over group g): both sums' errors are bounded by gamma_n (|x| . (|w| + 18 |s|)), as |n + 1| <= |n - 8|
+ 9. int8 rows as affine 8-bit: w = s (q + 128) - 128 s in one multiply-add, within u (|w| + 256 |s|) a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltafin.kernels import mlx as km
from deltafin.quant import int4, int8, mxfp4
from deltafin.quant.record import QTensor

pytestmark = pytest.mark.skipif(bool(km.available()), reason=km.available() or "mlx present")
U = 2.0**-24
SHAPES = [(1, 32), (77, 96), (33, 256), (130, 512), (7, 640)]


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _random_record(fmt: str, R: int, C: int, seed: int) -> tuple[QTensor, np.ndarray, np.ndarray]:
    """(record of random stored bytes, its float64 weights, |per-element scale| for the bounds)."""
    rng = np.random.default_rng(seed)
    if fmt == "mxfp4":
        packed = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
        scales = rng.integers(118, 134, (R, C // 32), dtype=np.uint8)  # 2^-9 .. 2^6
        w = mxfp4.dequantize_ref(packed, scales).astype(np.float64)
        return QTensor(fmt, (R, C), torch.from_numpy(packed), torch.from_numpy(scales)), w, np.zeros_like(w)
    if fmt == "int4g32":
        packed = rng.integers(0, 2**32, (R, C // 8), dtype=np.uint64).astype(np.uint32).view(np.int32)
        scales = (rng.uniform(0.01, 2, (R, C // 32))).astype(np.float32)
        scales = torch.from_numpy(scales).to(torch.bfloat16).float().numpy()  # as packs store them
        w = int4.dequantize_ref(packed, scales).astype(np.float64)
        s = np.repeat(np.abs(scales), 32, axis=1).astype(np.float64)
        return QTensor(fmt, (R, C), torch.from_numpy(packed), torch.from_numpy(scales)), w, s
    q = rng.integers(-127, 128, (R, C), dtype=np.int8)
    sc = rng.uniform(0.001, 0.1, R).astype(np.float32)
    w = int8.dequantize_ref(q, sc).astype(np.float64)
    s = np.repeat(np.abs(sc)[:, None], C, axis=1).astype(np.float64)
    return QTensor("int8", (R, C), torch.from_numpy(q), torch.from_numpy(sc)), w, s


def _check(y: np.ndarray, x: np.ndarray, w: np.ndarray, extra: np.ndarray, n: int) -> None:
    ref = x.astype(np.float64) @ w.T
    bound = _gamma(n) * (np.abs(x).astype(np.float64) @ (np.abs(w) + extra).T)
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= bound), f"max error {err.max():.3g}, {(err / np.maximum(bound, 1e-300)).max():.3g} of bound"
    assert np.all(bound <= 1e-3 * (np.abs(x) @ np.abs(w).T) + 1e-30)  # a real constraint


@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int8"])
def test_trunk_matmuls_match_the_float64_reference(fmt, R, C):
    m = km.mx()
    rec, w, s = _random_record(fmt, R, C, seed=R * C)
    mw = km.prepare(rec, m.float32)
    assert mw.quantized and mw.mode == ("mxfp4" if fmt == "mxfp4" else "affine")
    for T in (1, 3, 17):
        x = np.random.default_rng(T).standard_normal((T, C)).astype(np.float32)
        y = np.array(km.linear(m.array(x), mw))
        assert y.shape == (T, R)
        _check(y, x, w, 256 * s if fmt == "int8" else s, C + 8)


def test_mxfp4_decode_is_the_reference_bit_for_bit():
    m = km.mx()
    rec, w, _ = _random_record("mxfp4", 33, 256, seed=5)
    mw = km.prepare(rec, m.float32)
    d = np.array(m.dequantize(mw.w, mw.scales, None, group_size=32, bits=4, mode="mxfp4", dtype=m.float32))
    assert np.array_equal(d, w.astype(np.float32))


def _slab_of(recs: list[dict[str, QTensor]]):
    """An expert slab with each expert's records written into its slot as an expert file lays them out."""
    from deltafin.mlx.slab import ExpertSlab
    from deltafin.store import expert_file as ef

    data = [ef.encode(t, 0, e) for e, t in enumerate(recs)]
    slab = ExpertSlab(len(recs) + 2, max(map(len, data)))
    tensors = []
    for d in data:
        buf = slab.get(len(d))
        buf[: len(d)] = d
        tensors.append(ef.decode(buf[: len(d)]))
    return slab, tensors


@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int8", "bf16"])
def test_gather_over_slab_slots_matches_the_reference(fmt):
    """Routed experts multiplied in place from the slab by slot index (gather_qmm for the 4-bit formats; int8 and
    plain experts decode the routed slots only), against each expert's float64 weights."""
    m = km.mx()
    R, C, E = 96, 128, 4
    made = [_random_record("int8" if fmt == "bf16" else fmt, R, C, seed=e) for e in range(E)]
    if fmt == "bf16":
        made = [(QTensor("bf16", (R, C), torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16)),
                 torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16).double().numpy(), np.zeros_like(w))
                for _, w, _ in made]
    slab, tensors = _slab_of([{"gate": r} for r, _, _ in made])
    views = slab.views(tensors[0])
    slots = [slab.slot_of(t["gate"].data) for t in tensors]
    x = np.random.default_rng(0).standard_normal((5, C)).astype(np.float32)
    pick = np.array([[3, 1], [0, 0], [2, 3], [1, 2], [3, 0]])
    idx = m.array(np.array(slots, dtype=np.uint32)[pick])
    y = np.array(km.gather_linear(m.array(x)[:, None, None, :], views["gate"], idx))
    assert y.shape == (5, 2, 1, R)
    for t in range(5):
        for j in range(2):
            _, w, s = made[pick[t, j]]
            _check(y[t, j, 0][None], x[t][None], w, 0 * s, C + 8)
    if fmt == "int4g32":  # bf16 activations: the bf16 scales serve as the biases (no second array per slot)
        xb = m.array(x).astype(m.bfloat16)
        yb = np.array(km.gather_linear(xb[:, None, None, :], views["gate"], idx).astype(m.float32))
        xin = np.array(xb.astype(m.float32)).astype(np.float64)
        for t in range(5):
            for j in range(2):
                _, w, s = made[pick[t, j]]
                err = np.abs(yb[t, j, 0] - w @ xin[t])
                assert np.all(err <= 2.0**-6 * ((np.abs(w) + 18 * s) @ np.abs(xin[t])))  # bf16 roundings


def test_reads_land_in_mlx_memory_used_in_place():
    """Bytes written into a slot's buffer (as a drive read does) are what the next gather reads, through views made
    before the write (the views are the slab's memory, not copies), and a gather over the slab allocates about
    its result, not a copy of the slab."""
    m = km.mx()
    a, wa, _ = _random_record("mxfp4", 256, 512, seed=1)
    b, wb, _ = _random_record("mxfp4", 256, 512, seed=2)
    slab, tensors = _slab_of([{"gate": a}] * 6)
    views = slab.views(tensors[0])
    s = slab.slot_of(tensors[3]["gate"].data)
    x = m.array(np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32))
    idx = m.array(np.array([[s]], dtype=np.uint32))
    m.reset_peak_memory()
    before = m.get_active_memory()
    ya = km.gather_linear(x[:, None, None, :], views["gate"], idx)
    m.eval(ya)
    assert m.get_peak_memory() - before < slab.allocated // 8
    from deltafin.store import expert_file as ef

    d = ef.encode({"gate": b}, 0, 9)
    slab.buffer(s)[: len(d)] = d  # a new expert lands in the slot
    yb = np.array(km.gather_linear(x[:, None, None, :], views["gate"], idx))
    xs = np.array(x, dtype=np.float64)
    _check(np.array(ya)[0, 0], np.array(x), wa, 0 * wa, 520)
    _check(yb[0, 0], np.array(x), wb, 0 * wb, 520)
    assert np.abs(yb - np.array(ya)).max() > 1e-2 * np.abs(xs @ wa.T).max()  # a different expert's answer


def test_a_slot_is_never_overwritten_while_a_pending_computation_reads_it():
    """A slot given back while a computation that reads it is still unevaluated (MLX is lazy) is not handed out
    again until that computation's fence is evaluated; then the computation holds the old expert's result."""
    m = km.mx()
    a, wa, _ = _random_record("mxfp4", 64, 128, seed=4)
    b, _, _ = _random_record("mxfp4", 64, 128, seed=5)
    slab, tensors = _slab_of([{"gate": a}])  # 3 slots: 1 used, 2 free
    views = slab.views(tensors[0])
    s = slab.slot_of(tensors[0]["gate"].data)
    x = m.array(np.random.default_rng(6).standard_normal((1, 128)).astype(np.float32))
    y = km.gather_linear(x[:, None, None, :], views["gate"], m.array(np.array([[s]], dtype=np.uint32)))
    slab.put(slab.buffer(s))  # the expert is done with as far as Python knows; y is not computed yet
    held = [slab.get(100), slab.get(100)]  # the two free slots
    assert s not in [slab.slot_of(h) for h in held]
    with pytest.raises(MemoryError, match="every slot of the expert slab"):
        slab.get(100)  # no fence yet: the slot is still this layer's
    slab.fence(y)
    waits = slab.waits
    buf = slab.get(100)  # only now: y is evaluated first
    assert slab.slot_of(buf) == s and slab.waits == waits + 1
    from deltafin.store import expert_file as ef

    d = ef.encode({"gate": b}, 0, 1)
    buf[: len(d)] = d
    _check(np.array(y)[0, 0], np.array(x), wa, 0 * wa, 136)  # the old expert's result
    with pytest.raises(MemoryError, match="does not fit"):
        slab.get(slab.slot_bytes + 1)


def test_int8_rows_with_bfloat16_activations_keep_q_exact():
    """With bfloat16 activations int8 rows are bf16 q (exact) times the float32 row scale after the product, not
    affine 8-bit (whose s (q + 128) - 128 s MLX's CPU build forms in bfloat16, half a step off)."""
    m = km.mx()
    rec, w, _ = _random_record("int8", 130, 512, seed=3)
    mw = km.prepare(rec, m.bfloat16)
    assert not mw.quantized and mw.row_scale is not None
    x = m.array(np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)).astype(m.bfloat16)
    y = np.array(km.linear(x, mw).astype(m.float32))
    xin = np.array(x.astype(m.float32)).astype(np.float64)
    err = np.abs(y - xin @ w.T)
    assert np.all(err <= 2.0**-6 * (np.abs(xin) @ np.abs(w).T))
