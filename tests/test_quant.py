"""Codecs against their references: the numpy reference, transformers' gpt-oss dequantizer,
compressed-tensors' own INT4 packer and FP4 rounding, explicit loops. Random data, never zeros."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltafin.errors import CodecError
from deltafin.quant import fp8, int4, int8, mxfp4
from deltafin.quant.record import QTensor, dequantize, from_plain, matmul

RNG_SEED = 1234


def _rng(offset: int = 0) -> np.random.Generator:
    return np.random.default_rng(RNG_SEED + offset)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _gaussian(shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
    w = _rng(offset).standard_normal(shape).astype(np.float32)
    assert np.all(w != 0)
    return w


# ---------------------------------------------------------------- MXFP4


def test_mxfp4_reference_and_torch_dequantize_are_bit_identical():
    rng = _rng(1)
    packed = rng.integers(0, 256, (3, 48, 64), dtype=np.uint8)  # every nibble code occurs
    scales = rng.integers(0, 255, (3, 48, 4), dtype=np.uint8)  # the whole finite E8M0 range 2^-127..2^127
    assert len(np.unique(packed & 0xF)) == 16 and scales.min() == 0 and scales.max() == 254
    ref = mxfp4.dequantize_ref(packed, scales)
    fast = mxfp4.dequantize(torch.from_numpy(packed), torch.from_numpy(scales))
    assert fast.dtype == torch.float32 and tuple(fast.shape) == (3, 48, 128)
    assert torch.equal(_bits(fast), _bits(torch.from_numpy(ref)))  # same bits, -0.0 and inf included
    for dtype in (torch.bfloat16, torch.float16):  # narrower outputs: the reference rounded once
        got = mxfp4.dequantize(torch.from_numpy(packed), torch.from_numpy(scales), dtype)
        want = torch.from_numpy(ref).to(dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16)), dtype


def test_mxfp4_quantize_roundtrip_error_on_gaussian_weights():
    w = _gaussian((512, 1024), 2)
    packed, scales = mxfp4.quantize_ref(w)
    assert packed.shape == (512, 512) and scales.shape == (512, 32)
    back = mxfp4.dequantize_ref(packed, scales)
    rel_rms = float(np.sqrt(np.mean((w - back) ** 2) / np.mean(w**2)))
    print(f"\nMXFP4 quantize->dequantize relative RMS error on N(0,1) weights [512, 1024]: {rel_rms:.4f} "
          f"(limit 0.15; 4.25 bits/weight)")
    assert 0.05 < rel_rms < 0.15
    # the torch entry point is the same quantizer
    tp, ts = mxfp4.quantize(torch.from_numpy(w))
    assert np.array_equal(tp.numpy(), packed) and np.array_equal(ts.numpy(), scales)


def test_mxfp4_quantize_follows_the_convention():
    """Shared exponent floor(log2 amax) - 2, each element the nearest E2M1 value (brute force), saturating."""
    w = _gaussian((64, 256), 3) * np.float32(3.7)
    packed, scales = mxfp4.quantize_ref(w)
    blocks = w.reshape(64, 8, 32)
    amax = np.abs(blocks).max(-1)
    assert np.array_equal(scales.astype(np.int32) - 127, np.floor(np.log2(amax)).astype(np.int32) - 2)
    scaled = blocks / np.exp2(scales.astype(np.float64) - 127)[..., None]
    grid = mxfp4.E2M1_VALUES[:8].astype(np.float64)
    nearest = grid[np.abs(np.abs(scaled)[..., None] - grid).argmin(-1)] * np.sign(scaled)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(64, 8, 32)
    assert np.array_equal(mxfp4.E2M1_VALUES[codes], nearest.astype(np.float32))
    assert np.abs(scaled).max() > 6.0  # saturation was exercised (amax / 2^(floor-2) lies in [4, 8))


def test_mxfp4_rounding_matches_compressed_tensors_including_ties():
    ct_fp4 = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils")
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    vals = np.concatenate([ties, -ties, _gaussian((32 * 6 - 14,), 4) * np.float32(2.0)])
    vals[0:32] = np.where(np.arange(32) == 31, 6.0, vals[0:32])  # amax 6 keeps block 0 at scale 2^0
    w = vals.reshape(6, 32).astype(np.float32)
    packed, scales = mxfp4.quantize_ref(w)
    scaled = torch.from_numpy(w / np.exp2(scales.astype(np.float32) - 127))  # [6, 32] / [6, 1]
    expected = ct_fp4.cast_to_fp4(scaled.clone())
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(6, 32)
    got = torch.from_numpy(mxfp4.E2M1_VALUES[codes])
    assert scales[0] == 127
    assert torch.equal(got, expected), "E2M1 rounding differs from compressed-tensors (ties to even)"
    assert got[0, :7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_mxfp4_exact_values_requantize_to_the_same_bytes():
    rng = _rng(5)
    packed = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    packed[:, ::16] = (packed[:, ::16] & 0xF0) | 0x7  # one element of each block is +-6: the block max
    scales = rng.integers(60, 200, (16, 4), dtype=np.uint8)
    p2, s2 = mxfp4.quantize_ref(mxfp4.dequantize_ref(packed, scales))
    assert np.array_equal(s2, scales) and np.array_equal(p2, packed)


def test_mxfp4_bit_exact_against_transformers_gpt_oss_dequantizer():
    tf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    E, R, G = 3, 40, 4  # [E, rows, G, 16] blocks, [E, rows, G] scales, as in gpt-oss checkpoints
    rng = _rng(6)
    blocks = torch.from_numpy(rng.integers(0, 256, (E, R, G, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(0, 255, (E, R, G), dtype=np.uint8))
    ref = tf_mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    assert tuple(ref.shape) == (E, G * 32, R)  # transformers returns [E, in, out] (transposed)
    ours = mxfp4.dequantize(blocks.reshape(E, R, G * 16), scales)  # [E, out, in]
    assert torch.equal(_bits(ours.transpose(1, 2)), _bits(ref))
    # its default bf16 output is our float32 rounded to bf16, bit for bit
    ref16 = tf_mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone())
    assert torch.equal(ours.transpose(1, 2).to(torch.bfloat16).view(torch.int16), ref16.view(torch.int16))


def test_mxfp4_gguf_nibble_order_imports_to_the_same_values():
    rng = _rng(7)
    codes = rng.integers(0, 16, (5, 96), dtype=np.uint8)  # element codes, 3 blocks per row
    scales = rng.integers(100, 150, (5, 3), dtype=np.uint8)
    # by hand: value = E2M1[code] * 2^(scale - 127)
    expected = mxfp4.E2M1_VALUES[codes] * np.exp2(np.repeat(scales.astype(np.float32), 32, axis=1) - 127)
    standard = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # low nibble = even element
    blk = codes.reshape(5, 3, 32)
    gguf = (blk[..., :16] | (blk[..., 16:] << 4)).astype(np.uint8).reshape(5, 48)  # low j, high j + 16
    assert not np.array_equal(gguf, standard)
    assert np.array_equal(mxfp4.dequantize_ref(standard, scales), expected)
    converted = mxfp4.gguf_to_standard(gguf)
    assert np.array_equal(converted, standard)
    assert np.array_equal(mxfp4.dequantize_ref(converted, scales), expected)
    assert np.array_equal(mxfp4.standard_to_gguf(standard), gguf)


def test_mxfp4_e8m0_255_is_nan_in_both_paths():
    rng = _rng(8)
    packed = rng.integers(0, 256, (4, 32), dtype=np.uint8)
    scales = rng.integers(100, 150, (4, 2), dtype=np.uint8)
    scales[1, 0] = scales[3, 1] = 255
    nan_blocks = np.zeros((4, 64), dtype=bool)
    nan_blocks[1, :32] = nan_blocks[3, 32:] = True
    ref = mxfp4.dequantize_ref(packed, scales)
    fast = mxfp4.dequantize(torch.from_numpy(packed), torch.from_numpy(scales)).numpy()
    for out in (ref, fast):
        assert np.array_equal(np.isnan(out), nan_blocks)
    assert np.array_equal(ref[~nan_blocks], fast[~nan_blocks])


def test_mxfp4_rejects_mismatched_shapes_and_widths():
    with pytest.raises(CodecError, match="packed .* and scales .* disagree"):
        mxfp4.dequantize_ref(np.ones((4, 32), np.uint8), np.ones((4, 3), np.uint8))
    with pytest.raises(CodecError, match="not a multiple of 32"):
        mxfp4.quantize_ref(_gaussian((4, 48), 9))


def _mxfp4_both(w: np.ndarray, dtype: torch.dtype = torch.float32) -> None:
    """The torch quantizer gives the reference's bytes for ``w`` cast to ``dtype``."""
    t = torch.from_numpy(w).to(dtype)
    want_p, want_s = mxfp4.quantize_ref(t.to(torch.float32).numpy())
    got_p, got_s = mxfp4.quantize(t)
    assert got_p.dtype == torch.uint8 and got_s.dtype == torch.uint8
    assert np.array_equal(got_s.numpy(), want_s), dtype
    bad = np.argwhere(got_p.numpy() != want_p)
    assert bad.size == 0, f"{dtype}: {len(bad)} packed bytes differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_torch_quantize_gives_the_reference_bytes(dtype, monkeypatch):
    monkeypatch.setattr(mxfp4, "QUANTIZE_STEP", 3 * 256)  # several steps, the last one short
    rng = _rng(20)
    w = _gaussian((2, 37, 256), 21)  # blocks at exponents far apart: subnormal, tiny and huge values
    lo, hi = (-24, 14) if dtype == torch.float16 else (-140, 120)
    w *= np.exp2(rng.integers(lo, hi, (2, 37, 8, 1))).repeat(32, -1).reshape(2, 37, 256).astype(np.float32)
    w[0, 3] = 0.0  # zero blocks (scale 2^-127) and signed zeros
    w[1, 5, ::2] = -0.0
    _mxfp4_both(w, dtype)
    _mxfp4_both(_gaussian((48, 96), 22) * np.float32(0.02), dtype)  # a trunk-like scale


def test_mxfp4_torch_quantize_rounds_every_value_like_the_reference():
    """Blocks with amax 4 (shared exponent 0) carry every bf16 value below 8 in magnitude, the E2M1 ties and
    their float32 neighbours: each element's rounding is compared on its own."""
    bf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().numpy()
    vals = bf[np.isfinite(bf) & (np.abs(bf) < 8)]
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0], dtype=np.float32)
    near = np.concatenate([np.nextafter(ties, 0), ties, np.nextafter(ties, 8)])
    vals = np.concatenate([vals, near, -near, _rng(23).uniform(-8, 8, 4000).astype(np.float32)])
    vals = np.concatenate([vals, np.zeros(-len(vals) % 31, np.float32)]).reshape(-1, 31)
    w = np.concatenate([np.full((len(vals), 1), 4.0, np.float32), vals], axis=1)  # amax in [4, 8): exponent 0
    assert np.all(mxfp4.quantize_ref(w)[1] == 127)
    _mxfp4_both(w)


def test_mxfp4_torch_quantize_of_nan_and_inf_takes_the_reference():
    w = _gaussian((16, 128), 24)
    w[2, 7], w[9, 100], w[11, 0] = np.nan, np.inf, -np.inf
    p, s = mxfp4.quantize(torch.from_numpy(w))
    want_p, want_s = mxfp4.quantize_ref(w)
    assert np.array_equal(p.numpy(), want_p) and np.array_equal(s.numpy(), want_s)
    with pytest.raises(CodecError):
        mxfp4.quantize(torch.ones(4, 48))


# ---------------------------------------------------------------- int8


def test_int8_per_row_error_bound_and_torch_matches_reference():
    w = _gaussian((96, 160), 10) * np.exp(_rng(11).uniform(-3, 3, (96, 1))).astype(np.float32)  # rows of varied scale
    q, s = int8.quantize_ref(w)
    assert q.dtype == np.int8 and s.shape == (96,) and np.abs(q).max() == 127
    err = np.abs(int8.dequantize_ref(q, s) - w)
    assert np.all(err <= s[:, None] / 2 * (1 + 1e-4))  # float32 rounding of w / s
    tq, ts = int8.quantize(torch.from_numpy(w))
    assert np.array_equal(tq.numpy(), q) and np.array_equal(ts.numpy(), s)
    assert np.array_equal(int8.dequantize(tq, ts).numpy(), int8.dequantize_ref(q, s))


@pytest.mark.parametrize("shape", [(37, 160), (3, 5, 96), (96,)])
def test_int8_torch_quantize_in_steps_gives_the_reference_bytes(shape, monkeypatch):
    monkeypatch.setattr(int8, "QUANTIZE_STEP", 4 * 96)  # several steps of whole rows, the last one short
    w = _gaussian(shape, 12) * np.exp(_rng(13).uniform(-30, 30, shape[:-1] + (1,))).astype(np.float32)
    if len(shape) == 2:
        w[4] = 0.0  # a zero row: scale 1
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.from_numpy(w).to(dtype)
        q, s = int8.quantize_ref(t.float().numpy())
        tq, ts = int8.quantize(t)
        assert tq.dtype == torch.int8 and tuple(ts.shape) == shape[:-1]
        assert np.array_equal(tq.numpy(), q) and np.array_equal(ts.numpy(), s), dtype


def test_nonfinite_found_from_exponent_bits_as_isfinite_finds_it(monkeypatch):
    from deltafin.store import convert

    monkeypatch.setattr(convert, "FINITE_STEP", 1000)  # several steps
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        w = torch.from_numpy(_gaussian((40, 70), 14)).to(dtype)
        w[0, 0] = torch.finfo(dtype).max  # the largest finite value is finite
        w[1, 1] = -torch.finfo(dtype).max
        assert not convert.has_nonfinite(w)
        for bad in (float("nan"), float("inf"), float("-inf")):
            v = w.clone()
            v[39, 69] = bad  # in the last step
            assert convert.has_nonfinite(v) and convert.has_nonfinite(v.T), (dtype, bad)


def test_int8_matmul_equals_dequantize_then_matmul():
    w = torch.from_numpy(_gaussian((80, 128), 12))
    x = torch.from_numpy(_gaussian((7, 128), 13))
    rec = from_plain(w, "int8")
    assert rec.format == "int8" and rec.data.dtype == torch.int8 and rec.scale.dtype == torch.float32
    fused = matmul(x, rec)
    explicit = x @ dequantize(rec).T
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, x @ w.T, rtol=0.05, atol=0.05 * float(x.abs().max()))


# ---------------------------------------------------------------- INT4 (compressed-tensors pack-quantized)


def _int4_case(offset: int) -> tuple[np.ndarray, torch.Tensor]:
    rng = _rng(offset)
    q = rng.integers(-8, 8, (24, 128), dtype=np.int8)
    q[:, 0] = -8
    q[:, 1] = 7  # both ends of the range
    scales = torch.from_numpy(rng.uniform(0.01, 0.1, (24, 128 // 32)).astype(np.float32)).to(torch.bfloat16)
    return q, scales


def test_int4_matches_compressed_tensors_pack_and_unpack():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q, scales = _int4_case(20)
    ct_packed = helpers.pack_to_int32(torch.from_numpy(q), 4)
    assert ct_packed.dtype == torch.int32 and tuple(ct_packed.shape) == (24, 16)
    ours = int4.pack_ref(q)
    assert np.array_equal(ours, ct_packed.numpy())  # the same words
    ct_q = helpers.unpack_from_int32(ct_packed, 4, torch.Size((24, 128)))
    assert np.array_equal(int4.unpack_ref(ct_packed.numpy()), ct_q.numpy())
    expected = (ct_q.to(torch.float32).reshape(24, 4, 32) * scales.to(torch.float32)[..., None]).reshape(24, 128)
    got = dequantize(QTensor("int4g32", (24, 128), ct_packed, scales))
    assert torch.equal(got, expected)
    assert np.array_equal(int4.dequantize_ref(ct_packed.numpy(), scales.to(torch.float32).numpy()), expected.numpy())


def test_int4_hand_built_layout():
    """FORMATS.md: element i of each group of 8 sits at bits 4i, stored as q + 8."""
    q, scales = _int4_case(21)
    words = np.zeros((24, 16), dtype=np.uint64)
    for i in range(8):
        words |= (q[:, i::8].astype(np.int64) + 8).astype(np.uint64) << np.uint64(4 * i)
    packed = words.astype(np.uint32).view(np.int32)
    assert np.array_equal(int4.pack_ref(q), packed)
    assert np.array_equal(int4.unpack_ref(packed), q)
    got = int4.dequantize(torch.from_numpy(packed), scales)
    s = np.repeat(scales.to(torch.float32).numpy(), 32, axis=1)
    assert np.array_equal(got.numpy(), q.astype(np.float32) * s)


# ---------------------------------------------------------------- FP8 (DeepSeek block weights)


def test_fp8_block_dequantize_equals_explicit_loop_on_ragged_shape():
    M, N = 130, 200  # not multiples of 128: partial blocks on both edges
    w = torch.from_numpy(_gaussian((M, N), 30))
    w8, scale_inv = fp8.quantize(w)
    assert w8.dtype == torch.float8_e4m3fn and tuple(scale_inv.shape) == (2, 2)
    scale_inv = scale_inv * torch.tensor([[1.0, 3.0], [0.5, 7.0]])  # distinct per block
    got = fp8.dequantize(w8, scale_inv).numpy()
    wf, sf = w8.to(torch.float32).numpy(), scale_inv.numpy()
    expected = np.empty((M, N), dtype=np.float32)
    for i in range(M):
        for j in range(N):
            expected[i, j] = wf[i, j] * sf[i // 128, j // 128]
    assert np.array_equal(got, expected)


def test_fp8_quantize_roundtrip_and_shape_check():
    w = torch.from_numpy(_gaussian((130, 200), 31))
    back = fp8.dequantize(*fp8.quantize(w))
    assert float(((back - w) ** 2).mean().sqrt() / (w**2).mean().sqrt()) < 0.05  # e4m3: 3 mantissa bits
    with pytest.raises(CodecError, match=r"scale_inv shape \(1, 2\) does not match weight 130x200"):
        fp8.dequantize(fp8.quantize(w)[0], torch.ones(1, 2))


# ---------------------------------------------------------------- the record


def test_record_formats_and_errors():
    w = torch.from_numpy(_gaussian((8, 64), 40))
    rec = from_plain(w, "mxfp4")
    assert rec.nbytes == 8 * 32 + 8 * 2 and rec.block == 32
    assert torch.equal(dequantize(rec), torch.from_numpy(mxfp4.dequantize_ref(rec.data.numpy(), rec.scale.numpy())))
    assert torch.equal(dequantize(from_plain(w, "bf16")), w.to(torch.bfloat16).float())
    with pytest.raises(CodecError, match="unknown tensor format 'nf4'"):
        QTensor("nf4", (1,), torch.zeros(1))
    with pytest.raises(CodecError, match="cannot encode into 'int4g32'"):
        from_plain(w, "int4g32")


def test_compressed_tensors_mxfp4_bytes_are_kept_unchanged_by_the_record():
    """Released QAT bytes: the record wraps them without re-encoding (the packer test checks the files)."""
    rng = _rng(50)
    packed = torch.from_numpy(rng.integers(0, 256, (48, 64), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(110, 140, (48, 4), dtype=np.uint8))
    rec = QTensor("mxfp4", (48, 128), packed, scales)
    from deltafin.store import expert_file as ef

    back = ef.decode(memoryview(bytearray(ef.encode({"w": rec}, 1, 2))))["w"]
    assert torch.equal(back.data, packed) and torch.equal(back.scale, scales)
