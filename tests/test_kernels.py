"""Fused CPU kernels against the reference dequantize-then-matmul, and the dispatch point.

Tolerance, from the summation order: the decoded weights are exact in float32 (E2M1 x 2^k; int4 x a bf16
scale needs 12 significant bits; int8 scales are applied after the sum), so the only error is float32
rounding of the sums. A sum evaluated with at most n roundings on any term's path is within
gamma_n * sum|w x|, gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1). The fused kernel accumulates 16 lanes over C/16 steps of 2 products each, then reduces
the lanes pairwise (4 levels) and applies a scale: n <= C/16 + 8. The tiled path hands the sum to a BLAS
matmul whose order is unknown: n <= C. Both are checked against a float64 reference of the same weights.

The Q8 path (4-bit weights, up to GEMM_TOKENS tokens, or FUSED_TOKENS without the GEMM; the default) also
rounds the activations: per block b of 32, d_b = max|x| / 127 and x is replaced by xq = d_b q, q = round(x / d_b), so |x - xq| <= d_b / 2 (plus 2^-10
d_b of slack for x * (127 / max) rounding in float32). The block sums of integers are exact (|sum| < 2^24) and
w x xq = the sum the kernel evaluates, so |y - w.x| <= sum_c |w_c| d_b(c) (1/2 + 2^-10) + gamma_n sum_c |w_c|
|xq_c|, with |xq_c| <= |x_c| + d_b(c) (1/2 + 2^-10) and n <= C/32 + 8 roundings (one scale product and one
fused multiply-add per block at most, a 4-level lane reduction).

The int16 GEMM (4-bit weights, more than GEMM_TOKENS tokens, where the build has it) rounds the activations the
same way to int16: d_b = max|x| / 32767, |x - xq| <= d_b (1/2 + 2^-7) (the slack covers the float32 roundings of
32767 / max, of x times it and of d_b: 3 u |x| <= 3 u 32767 d_b < 2^-7 d_b). The block sums of integers are exact
(|sum| <= 12 x 32767 x 32 < 2^24, so their float conversion is too) and the weight scales times 1/2 are exact, so
the float32 error is that of the block loop: one rounding of the scale product d_b x weight scale and one fused
multiply-add per block, n <= C/32 + 2 roundings on any term's path (no lane reduction: a lane is a row).
int8 rows take the same GEMM past GEMM_TOKENS (whole blocks of 32) with the row's scale as every block's weight
scale: their block sums are exact in int32 (|sum| <= 128 x 32767 x 32 < 2^31) but past 2^24 their float conversion
rounds, and the reference's weights q x s are rounded to float32 once: n <= C/32 + 4.
AVX2 builds without VNNI made with -DGW_U8=1 (not the default) take 8-bit activations in the 4-bit GEMM (``df_gw_u8``), quantized as the Q8
path's: d_b = max|x| / 127 per block of 32, |x - xq| <= d_b (1/2 + 2^-10); its integer block sums are exact too
(tests/test_kernels_gemm_u8.py), and its float steps are the int16 GEMM's: n <= C/32 + 2. int8 rows keep int16.
"""

from __future__ import annotations

import os
import platform

import numpy as np
import pytest
import torch

from deltafin import kernels
from deltafin.kernels import cpu, native, torch_ref
from deltafin.quant import int4, int8, mxfp4
from deltafin.quant.record import QTensor, dequantize

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"CPU kernels unavailable: {native.why()}")
U = 2.0**-24


def _bound(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    g = n * U / (1 - n * U)
    return g * (x.double().abs() @ w.double().abs().T)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, fused: bool) -> None:
    C = x.shape[1]
    ref = x.double() @ w.double().T
    n = C // 16 + 8 if fused else C
    err = (y.double() - ref).abs()
    assert torch.all(err <= _bound(x, w, n)), f"max error {err.max():.3g}"


Q8_SLACK = 0.5 + 2.0**-10
# The Q8 path's two int8 terms: x = d2 (256 q1 + q2) with d2 = max|x| / (127 x 256), within d2 / 2, or within 1.5 d2
# where the rest reaches 128 units and q2 is clamped to 127 (a tie of q1's rounding)
Q8_LEVELS, Q8_TWO_SLACK = 127 * 256, 1.5 + 2.0**-10


def _q8_bound(x: torch.Tensor, w: torch.Tensor, n: int | None = None, block: int = 32, levels: int = 127,
              slack: float = Q8_SLACK) -> torch.Tensor:
    T, C = x.shape
    nb = -(-C // block)  # int8 widths need not be whole blocks: the last block is the columns left
    xa = torch.nn.functional.pad(x.double().abs(), (0, nb * block - C))
    d = xa.view(T, nb, block).amax(-1, keepdim=True).div(levels).expand(T, nb, block).reshape(T, -1)[:, :C]
    aw = w.double().abs()
    n = C // 32 + 8 if n is None else n
    g = n * U / (1 - n * U)
    return (d * slack) @ aw.T + g * ((x.double().abs() + d * slack) @ aw.T)


def _check_q8(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, n: int | None = None, block: int = 32,
              levels: int = 127, slack: float = Q8_SLACK) -> None:
    ref = x.double() @ w.double().T
    err = (y.double() - ref).abs()
    bound = _q8_bound(x, w, n, block, levels, slack)
    assert torch.all(err <= bound), f"max error {err.max():.3g}"
    # the bound is a real constraint: a few percent of sum |w x| (a wrong block or scale lands far outside it)
    assert torch.all(bound <= 0.05 * (x.double().abs() @ w.double().abs().T) + 1e-30)


def _check_fmt(fmt: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, fused: bool, lib=None) -> None:
    if fused and fmt == "int8" and cpu.i16_enabled(lib):
        _check_q8(y, x, w, int8_a16_roundings(x.shape[1]), block=128, levels=32767)
    elif fused and cpu.q8_enabled(lib) and (lib or native.library()).df_q8_terms() == 2:
        _check_q8(y, x, w, levels=Q8_LEVELS, slack=Q8_TWO_SLACK)
    elif fused and cpu.q8_enabled(lib):
        _check_q8(y, x, w)
    else:
        _check(y, x, w, fused)


def int8_a16_roundings(C: int) -> int:
    """int8 rows x int16 activations (blocks of 128, d = max|x| / 32767, the Q8 bound's form): the int32 block
    sums are exact (|sum| <= 128 x 128 x 32767 < 2^31), then per block one fused multiply-add per lane, a 4-level
    lane reduction, the row scale, and the float32 rounding of the dequantized reference weight: C/128 + 6. The
    portable loop rounds twice per block (scale product, addition); the larger count bounds both."""
    return 2 * -(-C // 128) + 8


def _records(R: int, C: int, seed: int) -> dict[str, QTensor]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((R, C)).astype(np.float32) * rng.uniform(0.01, 3, (R, 1)).astype(np.float32)
    mp, ms = mxfp4.quantize_ref(w)
    ip, iscale = int4.quantize_ref(w)
    q, s = int8.quantize_ref(w)
    return {"mxfp4": QTensor("mxfp4", (R, C), torch.from_numpy(mp), torch.from_numpy(ms)),
            "int4g32": QTensor("int4g32", (R, C), torch.from_numpy(ip), torch.from_numpy(iscale).to(torch.bfloat16)),
            "int8": QTensor("int8", (R, C), torch.from_numpy(q), torch.from_numpy(s))}


GW_SLACK = 0.5 + 2.0**-7
GW_GROUP = 64  # the GEMM's activations: one int16 scale per two blocks of 32 (a last odd block alone)


def gemm_u8(fmt: str = "mxfp4", lib=None) -> bool:
    """Whether the GEMM of fmt takes 8-bit activations in this build (4-bit weights on AVX2 without VNNI)."""
    return fmt != "int8" and bool((lib or native.library()).df_gw_u8())


def _gemm_bound(x: torch.Tensor, w: torch.Tensor, fmt: str = "mxfp4", lib=None) -> torch.Tensor:
    """The GEMM's error bound: each activation off by at most its group's d (1/2 + 2^-7), d = max |x| / 32767 over
    its group of GW_GROUP; the float steps (a conversion and a multiply-add per scale step, at most one step per
    block) as n roundings. With 8-bit activations (gemm_u8) the Q8 path's bound with the GEMM's float steps."""
    T, C = x.shape
    if gemm_u8(fmt, lib):
        return _q8_bound(x, w, n=C // 32 + 2)
    d = torch.cat([g.abs().amax(-1, keepdim=True).div(32767).expand_as(g)
                   for g in x.double().split(GW_GROUP, dim=1)], dim=1)
    aw = w.double().abs()
    n = C // 32 + (4 if fmt == "int8" else 2)
    g = n * U / (1 - n * U)
    return (d * GW_SLACK) @ aw.T + g * ((x.double().abs() + d * GW_SLACK) @ aw.T)


def _check_gemm(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, fmt: str = "mxfp4", lib=None) -> None:
    ref = x.double() @ w.double().T
    err = (y.double() - ref).abs()
    bound = _gemm_bound(x, w, fmt, lib)
    assert torch.all(err <= bound), f"max error {err.max():.3g}, {(err / bound).max():.3g} of the bound"
    # a real constraint: about 2^-16 of sum |w x| for these inputs (a wrong block, row or scale lands far outside);
    # with 8-bit activations a few percent, as the Q8 path's
    rel = 0.05 if gemm_u8(fmt, lib) else 1e-3
    assert torch.all(bound <= rel * (x.double().abs() @ w.double().abs().T) + 1e-30)


def _kernel(fmt: str, T: int, lib=None) -> str:
    """Which CPU kernel runs fmt at T tokens (of a width of whole blocks): gemm, q8, fused (the float loop) or
    tile."""
    if T > cpu.gemm_tokens(lib, int8=fmt == "int8") and cpu.gemm_enabled(lib):
        return "gemm"
    if T > cpu.FUSED_TOKENS:
        return "tile"
    return "q8" if fmt != "int8" and cpu.q8_enabled(lib) else "fused"


SHAPES = [(1, 32), (77, 96), (33, 256), (130, 512), (7, 640)]  # odd row counts, one block to many
TOKENS = [1, 3, cpu.FUSED_TOKENS, cpu.FUSED_TOKENS + 1, 40]


@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int8"])
def test_fused_kernels_match_reference(fmt, R, C):
    rec = _records(R, C, seed=R * C)[fmt]
    w = dequantize(rec)  # float32, exact
    fn = getattr(cpu, f"{fmt}_linear")
    for T in TOKENS:
        x = torch.randn(T, C, generator=torch.Generator().manual_seed(T))
        y = fn(x, rec.data, rec.scale)
        assert y.shape == (T, R) and y.dtype == torch.float32
        if _kernel(fmt, T) == "gemm":
            _check_gemm(y, x, w, fmt)
        else:
            _check_fmt(fmt, y, x, w, fused=T <= cpu.FUSED_TOKENS)
        _check(torch_ref.matmul(x, rec), x, w, fused=False)  # the reference is within its own bound too


def test_int8_odd_width_and_float_int4_scales():
    rec = _records(45, 96, seed=3)
    q = rec["int8"].data[:, :83].contiguous()  # a width that is not a multiple of the vector length
    for T in (1, 5):  # one token takes the four-row loop, several the token loop
        x = torch.randn(T, 83)
        _check_fmt("int8", cpu.int8_linear(x, q, rec["int8"].scale), x, int8.dequantize(q, rec["int8"].scale), True)
    for T in (cpu.GEMM_TOKENS + 1, cpu.FUSED_TOKENS + 1):  # not whole blocks of 32: no GEMM, the loop or the tile
        x = torch.randn(T, 83)
        cpu.USED.clear()
        y = cpu.int8_linear(x, q, rec["int8"].scale)
        assert "int8_gemm" not in cpu.USED
        _check_fmt("int8", y, x, int8.dequantize(q, rec["int8"].scale), T <= cpu.FUSED_TOKENS)
    i4 = rec["int4g32"]
    x = torch.randn(2, 96)
    _check_fmt("int4g32", cpu.int4g32_linear(x, i4.data, i4.scale.float()), x, dequantize(i4), fused=True)


@pytest.mark.parametrize("isa", ["avx2", "avx2-novnni", "portable"])
def test_builds_without_avx512_match_reference(isa):
    """What machines without AVX-512 compile (AVX2 with and without AVX-VNNI, and the plain C loops) gives answers
    within the same bounds: partial groups of 4 blocks and runs of 8 scales (96 and 640 columns), row counts not a
    multiple of the four rows a one-token call takes together, int8 widths that are not whole steps of 16."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the plain C build is the default build off x86")
    lib = native.library(native.ISA_FLAGS[isa])
    assert lib is not None and lib.df_simd_width() == 1
    assert native.ISA_NAMES[lib.df_isa()] != "avx512"
    if isa == "portable":
        assert lib.df_isa() == 0
    for R, C in ((77, 96), (33, 640), (8, 4096)):
        for fmt, rec in _records(R, C, seed=R + C).items():
            for T in (1, 3, 12):
                x = torch.randn(T, C) * torch.rand(T, 1) * 10
                y = getattr(cpu, f"{fmt}_linear")(x, rec.data, rec.scale, lib=lib)
                _check_fmt(fmt, y, x, dequantize(rec), fused=T <= cpu.FUSED_TOKENS, lib=lib)
    for C in (83, 131, 250):  # int8 rows: a step of 16 columns cut short, alone or after whole ones
        q, sc = int8.quantize_ref(np.random.default_rng(C).standard_normal((9, C)).astype(np.float32))
        q, sc = torch.from_numpy(q), torch.from_numpy(sc)
        for T in (1, 2, 7):
            x = torch.randn(T, C)
            _check_fmt("int8", cpu.int8_linear(x, q, sc, lib=lib), x, int8.dequantize(q, sc), fused=True, lib=lib)


@pytest.mark.parametrize("isa", ["avx2", "avx2-novnni"])
def test_avx2_one_row_loops_equal_the_four_row_loops(isa):
    """The AVX2 builds' one-token loops that read one row start to end (4-bit Q8 rows, int8 rows with int16
    activations) give the four-row loop's result (the build with -DQ8_NO_ROWS1) bit for bit, the gated expert too,
    at widths where they run (whole groups of 4 blocks, whole blocks of 128) and where they do not."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 builds are x86's")
    one, four = native.library(native.ISA_FLAGS[isa]), native.library((*native.ISA_FLAGS[isa], "-DQ8_NO_ROWS1"))
    if one is None or four is None or one.df_isa() not in (2, 3):
        pytest.skip("no AVX2 build here")
    assert (one.df_one_row_loops(), four.df_one_row_loops()) == (3, 0)
    for R, C in ((77, 128), (40, 2048), (9, 640), (33, 96)):
        x = torch.randn(1, C) * 3
        for fmt, rec in _records(R, C, seed=R * C).items():
            f = cpu.int8_linear if fmt == "int8" else getattr(cpu, f"{fmt}_linear")
            a, b = f(x, rec.data, rec.scale, lib=one), f(x, rec.data, rec.scale, lib=four)
            assert torch.equal(a, b), (fmt, R, C)
    g = torch.Generator().manual_seed(5)
    recs = [QTensor("mxfp4", s, torch.randint(0, 256, (s[0], s[1] // 2), dtype=torch.uint8, generator=g),
                    torch.randint(118, 130, (s[0], s[1] // 32), dtype=torch.uint8, generator=g))
            for s in ((96, 256), (96, 256), (256, 96))]
    x = torch.randn(1, 256)
    assert torch.equal(cpu.glu_expert(x, *recs, lib=one), cpu.glu_expert(x, *recs, lib=four))


def test_avx2_builds_keep_4bit_matmuls_on_the_q8_loop_longer():
    """On an AVX2 build 4-bit matmuls take the Q8 loop up to GEMM_TOKENS_AVX2 tokens (it is faster there), int8 rows
    the GEMM past GEMM_TOKENS_INT8_AVX2 (sooner than on AVX-512); the matmuls take the kernels that say."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 builds are x86's")
    lib = native.library(native.ISA_FLAGS["avx2"])
    if lib.df_isa() not in (2, 3) or not cpu.gemm_enabled(lib):
        pytest.skip("no AVX2 on this CPU")
    assert cpu.gemm_tokens(lib) == cpu.GEMM_TOKENS_AVX2 > cpu.GEMM_TOKENS
    assert cpu.gemm_tokens(lib, int8=True) == cpu.GEMM_TOKENS_INT8_AVX2 < cpu.GEMM_TOKENS
    if native.library().df_isa() == 4:
        assert cpu.gemm_tokens() == cpu.gemm_tokens(int8=True) == cpu.GEMM_TOKENS
    recs = _records(40, 64, seed=2)
    for T, kernel in ((cpu.GEMM_TOKENS_INT8_AVX2, "int8_a16"), (cpu.GEMM_TOKENS_INT8_AVX2 + 1, "int8_gemm")):
        cpu.USED.clear()
        cpu.int8_linear(torch.randn(T, 64), recs["int8"].data, recs["int8"].scale, lib=lib)
        assert cpu.USED == {kernel}
    rec = recs["mxfp4"]
    for T, kernel in ((cpu.GEMM_TOKENS_AVX2, "mxfp4_q8"), (cpu.GEMM_TOKENS_AVX2 + 1, "mxfp4_gemm")):
        cpu.USED.clear()
        cpu.mxfp4_linear(torch.randn(T, 64), rec.data, rec.scale, lib=lib)
        assert cpu.USED == {kernel}


def test_cpu_isa_choice(monkeypatch):
    """DELTAFIN_CPU_ISA picks the build; an unknown name is refused with the names it knows, an x86 build off x86
    with the fix."""
    from deltafin.errors import UsageError

    monkeypatch.setenv("DELTAFIN_CPU_ISA", "portable")
    if platform.machine() in ("x86_64", "AMD64"):
        assert native.isa_flags() == native.ISA_FLAGS["portable"]
    monkeypatch.setattr(platform, "machine", lambda: "arm64")  # the x86 builds are refused elsewhere
    monkeypatch.setattr(native, "_ISA_SEEN", {})
    with pytest.raises(UsageError, match="DELTAFIN_CPU_ISA=portable: an x86 build, and this machine is arm64"):
        native.isa_flags()
    monkeypatch.setenv("DELTAFIN_CPU_ISA", "native")
    assert native.isa_flags() == ()
    monkeypatch.undo()
    monkeypatch.setattr(native, "_ISA_SEEN", {})
    monkeypatch.setenv("DELTAFIN_CPU_ISA", "avx9")
    with pytest.raises(UsageError, match="avx9.*native, avx2, avx2-novnni, portable"):
        native.isa_flags()
    monkeypatch.delenv("DELTAFIN_CPU_ISA")
    assert native.isa_flags() == ()


GEMM_R = [17, 33, 100, 257]  # odd row counts: a partial vector of 16 rows, a partial panel of 32


@pytest.mark.parametrize("C", [32, 96, 640])  # one block; a partial vector of 16 scales; a run and a partial one
@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int4g32_f32", "int8"])
def test_gemm_matches_reference(fmt, C, gemm_build):
    for R in GEMM_R:
        rec = _records(R, C, seed=R + C)[fmt.removesuffix("_f32")]
        scale = rec.scale.float() if fmt.endswith("_f32") else rec.scale
        w = dequantize(rec)
        fn = getattr(cpu, f"{rec.format}_linear")
        for T in (cpu.gemm_tokens(int8=fmt == "int8") + 1, 17, 33, 100, 257):  # around the token groups
            x = torch.randn(T, C, generator=torch.Generator().manual_seed(T)) * torch.rand(T, 1) * 10
            cpu.USED.discard(f"{rec.format}_gemm")
            y = fn(x, rec.data, scale)
            assert y.shape == (T, R) and f"{rec.format}_gemm" in cpu.USED
            _check_gemm(y, x, w, rec.format)


def test_gemm_off_selects_the_tiled_float_path(monkeypatch, gemm_build):
    rec = _records(37, 256, seed=6)["mxfp4"]
    x = torch.randn(40, 256)
    gemm = cpu.mxfp4_linear(x, rec.data, rec.scale)
    monkeypatch.setenv("DELTAFIN_CPU_GEMM", "0")
    assert not cpu.gemm_enabled()
    y = cpu.mxfp4_linear(x, rec.data, rec.scale)
    _check(y, x, dequantize(rec), fused=False)
    assert not torch.equal(y, gemm) and "mxfp4_tile" in cpu.USED


@pytest.mark.parametrize("C", [64, 512])
def test_gemm_nan_scale_and_smallest_scale_like_the_reference(C, gemm_build):
    """E8M0 0xFF (NaN) reaches its row only; E8M0 0 is 2^-127, not the 0 its bits would give."""
    rec = _records(4, C, seed=1)["mxfp4"]
    scales = rec.scale.clone()
    scales[2, 1] = 255
    y = cpu.mxfp4_linear(torch.randn(20, C), rec.data, scales)
    assert torch.isnan(y[:, 2]).all() and not torch.isnan(y[:, [0, 1, 3]]).any()
    scales = torch.full_like(rec.scale, 0)
    x = torch.full((20, C), 2.0**100)
    w = dequantize(QTensor("mxfp4", (4, C), rec.data, scales))
    assert torch.all(w.abs().sum(1) > 0)
    _check_gemm(cpu.mxfp4_linear(x, rec.data, scales), x, w)


def test_bench_prefill_rows_time_both_paths(monkeypatch):
    """`bench kernels` prefill rows: the fast path and the tiled float path timed in the same run (small shapes)."""
    from deltafin.bench import kernels as bk

    recs = [_records(64, 96, seed=s)["mxfp4"] for s in (1, 2)] + [_records(96, 64, seed=3)["mxfp4"]]
    monkeypatch.setattr(bk, "_cases", lambda device: [("small expert", 1, lambda: recs)])
    monkeypatch.setattr(bk, "PREFILL_TOKENS", (cpu.FUSED_TOKENS + 3,))
    monkeypatch.setattr(bk, "PREFILL_INT8", ((37, 64),))
    monkeypatch.setattr(bk, "PREFILL_INT8_TOKENS", cpu.FUSED_TOKENS + 5)
    used, env = set(cpu.USED), os.environ.get("DELTAFIN_CPU_GEMM")
    cpu.USED.clear()
    try:
        row, i8 = bk._prefill_rows("cpu", seconds=0.06, rounds=2)
        ran = set(cpu.USED)
    finally:
        cpu.USED |= used
    assert row["tokens"] == cpu.FUSED_TOKENS + 3 and row["fused_GFLOPs"] > 0 and row["tile_GFLOPs"] > 0
    assert row["fused_over_tile"] == row["fused_GFLOPs"] / row["tile_GFLOPs"]
    assert row["target_over_tile"] == bk.PREFILL_TARGET and i8["target_over_tile"] is None
    assert i8["case"] == f"int8 37x64 x{cpu.FUSED_TOKENS + 5} tok" and i8["fused_GFLOPs"] > 0 and i8["tile_GFLOPs"] > 0
    assert "mxfp4_tile" in ran and ("mxfp4_gemm" in ran) == cpu.gemm_enabled()
    assert "int8_tile" in ran and ("int8_gemm" in ran) == cpu.gemm_enabled()
    assert os.environ.get("DELTAFIN_CPU_GEMM") == env  # restored
    assert bk.int16_peak("cpu") >= 0


def test_bench_gated_expert_rows_beside_the_peak_of_as_many_threads(monkeypatch):
    """`bench kernels` gated-expert rows: the fused call and the three GEMMs on one thread and on all, each over the
    int16 peak of as many threads measured beside it; the thread count is restored; none without the GEMM."""
    from deltafin.bench import kernels as bk

    recs = [_records(64, 96, seed=s)["mxfp4"] for s in (1, 2)] + [_records(96, 64, seed=3)["mxfp4"]]
    monkeypatch.setattr(bk, "_cases", lambda device: [("small expert", 1, lambda: recs)])
    monkeypatch.setattr(bk, "GLU_TOKENS", cpu.GEMM_TOKENS + 4)
    threads = torch.get_num_threads()
    rows = bk._glu_rows("cpu", seconds=0.06, rounds=2)
    assert torch.get_num_threads() == threads
    if not cpu.gemm_enabled():
        assert rows == []
        return
    assert [r["threads"] for r in rows] == sorted({1, threads})
    for r in rows:
        assert r["tokens"] == cpu.GEMM_TOKENS + 4 and r["int16_peak_GOPs"] > 0 and r["fused_GFLOPs"] > 0
        assert r["fused_over_peak"] == r["fused_GFLOPs"] / r["int16_peak_GOPs"]
        assert r["three_gemms_over_peak"] == r["three_gemms_GFLOPs"] / r["int16_peak_GOPs"]
    bk._print({"device": "cpu", "backend": "cpu", "threads": threads, "bandwidth_GBps": 1.0, "cases": [],
               "worst_one_token_fraction": 1.0, "target": 0.5, "prefill": [], "gated_expert": rows})


def test_bench_kernels_times_the_engines_one_call_expert_beside_the_three_matmuls(monkeypatch, capsys):
    """`bench kernels` expert rows: the three matmuls (the target's figure) and, where the backend has one call for
    the whole expert (gate, up, SiTU-GLU, down: what the engine runs), that call beside them; a lone matrix has
    none."""
    import argparse

    from deltafin.bench import kernels as bk

    expert = [_records(64, 96, seed=s)["mxfp4"] for s in (1, 2)] + [_records(96, 64, seed=3)["mxfp4"]]
    lone = [_records(64, 96, seed=4)["int8"]]
    monkeypatch.setattr(bk, "_cases", lambda device: [("small expert", 1, lambda: expert), ("int8", 1, lambda: lone)])
    monkeypatch.setattr(bk, "_cache_bytes", lambda: 0)
    monkeypatch.setattr(bk, "bandwidth", lambda device: 10.0)  # no 1 GiB sum here
    for name in ("_prefill_rows", "_glu_rows"):
        monkeypatch.setattr(bk, name, lambda device, seconds: [])
    r = bk.run(argparse.Namespace(device="cpu", seconds=0.05, json=None))
    e, i8 = r["cases"]
    assert e["one_call_GBps"] > 0 and e["one_call_over_bandwidth"] == e["one_call_GBps"] / r["bandwidth_GBps"]
    assert i8["one_call_GBps"] is None and i8["one_call_over_bandwidth"] is None
    assert r["worst_one_token_fraction"] == min(e["fused_over_bandwidth"], i8["fused_over_bandwidth"])
    out = capsys.readouterr().out
    assert out.count("as one call with the activation (the engine's expert)") == 1


def test_bench_kernels_prefill_rows_over_the_higher_int16_peak(monkeypatch, capsys):
    """`bench kernels` measures the int16 peak before and after the GEMM rows and divides by the higher (a VM's vCPUs
    move between one core's hyperthreads and two whole cores during a run), as it does the memory bandwidth."""
    import argparse

    from deltafin.bench import kernels as bk

    expert = [_records(64, 96, seed=s)["mxfp4"] for s in (1, 2)] + [_records(96, 64, seed=3)["mxfp4"]]
    monkeypatch.setattr(bk, "_cases", lambda device: [("small expert", 1, lambda: expert)])
    monkeypatch.setattr(bk, "_cache_bytes", lambda: 0)
    monkeypatch.setattr(bk, "bandwidth", lambda device: 10.0)
    peaks = iter([300.0, 500.0])
    monkeypatch.setattr(bk, "int16_peak", lambda device: next(peaks))
    monkeypatch.setattr(bk, "_prefill_rows", lambda device, seconds: [
        {"case": "k3 expert mxfp4 x64 tok", "tokens": 64, "fused_GFLOPs": 400.0, "tile_GFLOPs": 100.0,
         "f32_matmul_GFLOPs": 150.0, "fused_over_tile": 4.0}])
    monkeypatch.setattr(bk, "_glu_rows", lambda device, seconds: [])
    monkeypatch.setattr(cpu, "gemm_enabled", lambda lib=None: True)
    r = bk.run(argparse.Namespace(device="cpu", seconds=0.05, json=None))
    assert r["int16_peak_GOPs_before_after"] == [300.0, 500.0] and r["int16_peak_GOPs"] == 500.0
    assert r["prefill"][0]["fused_over_peak"] == 400.0 / 500.0
    assert "int16 dot-product peak 500 GOP/s (the higher of before and after" in capsys.readouterr().out


def test_bench_kernels_on_a_build_without_avx512(monkeypatch, capsys):
    """`bench kernels --isa portable` (or avx2) measures the kernels other x86 machines build, says which, and leaves
    out the prefill rows of the int16 GEMM that such a build does not have."""
    import argparse

    from deltafin.bench import kernels as bk

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the ISA choice is x86's")
    monkeypatch.setenv("DELTAFIN_CPU_ISA", "native")  # restored after the test: run() sets it
    expert = [_records(64, 96, seed=s)["mxfp4"] for s in (1, 2)] + [_records(96, 64, seed=3)["mxfp4"]]
    monkeypatch.setattr(bk, "_cases", lambda device: [("small expert", 1, lambda: expert)])
    monkeypatch.setattr(bk, "_cache_bytes", lambda: 0)
    monkeypatch.setattr(bk, "bandwidth", lambda device: 10.0)
    r = bk.run(argparse.Namespace(device="cpu", seconds=0.05, json=None, isa="portable"))
    assert r["isa"] == "plain C" and r["prefill"] == [] and r["gated_expert"] == []
    assert r["cases"][0]["fused_GBps"] > 0
    out = capsys.readouterr().out
    assert "backend cpu (plain C)" in out and "this build has no int16 GEMM" in out


@pytest.mark.parametrize("C", [64, 512])  # a partial run of 16 block scales, and a whole one (vector decode)
def test_nan_scale_propagates_like_the_reference(C):
    rec = _records(4, C, seed=1)["mxfp4"]
    scales = rec.scale.clone()
    scales[2, 1] = 255  # OCP MX: E8M0 0xFF is NaN
    y = cpu.mxfp4_linear(torch.randn(1, C), rec.data, scales)
    assert torch.isnan(y[0, 2]) and not torch.isnan(y[0, [0, 1, 3]]).any()


def test_smallest_e8m0_scale_is_two_to_the_minus_127():
    """E8M0 0 is 2^-127 (a float32 subnormal), not the 0 its bits would give."""
    rec = _records(4, 512, seed=4)["mxfp4"]
    scales = torch.full_like(rec.scale, 0)
    x = torch.full((1, 512), 2.0**100)
    y = cpu.mxfp4_linear(x, rec.data, scales)
    w = dequantize(QTensor("mxfp4", (4, 512), rec.data, scales))
    assert torch.all(w.abs().sum(1) > 0)
    _check_fmt("mxfp4", y, x, w, fused=True)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int8"])
def test_q8_off_selects_the_float_decode_loop(fmt, monkeypatch):
    rec = _records(37, 256, seed=6)[fmt]
    x = torch.randn(3, 256)
    fn = getattr(cpu, f"{fmt}_linear")
    q8 = fn(x, rec.data, rec.scale)
    monkeypatch.setenv("DELTAFIN_CPU_Q8", "0")
    monkeypatch.setenv("DELTAFIN_CPU_GEMM", "0")  # a build that takes the int16 GEMM from few tokens (AVX2 alone)
    assert not cpu.q8_enabled()
    y = fn(x, rec.data, rec.scale)
    _check(y, x, dequantize(rec), fused=True)  # the float loop's own, tighter bound
    assert not torch.equal(y, q8)


def test_dispatch_exact_by_default_fused_inside_fast():
    rec = _records(33, 64, seed=2)["mxfp4"]
    x = torch.randn(3, 64)
    assert torch.equal(kernels.matmul(x, rec), torch_ref.matmul(x, rec))
    with kernels.fast():
        assert kernels.fast_enabled()
        y = kernels.matmul(x, rec)
        assert torch.equal(y, cpu.mxfp4_linear(x, rec.data, rec.scale))
        yb = kernels.matmul(x.to(torch.bfloat16), rec)
        assert yb.dtype == torch.bfloat16
        plain = torch.randn(5, 64)
        assert torch.equal(kernels.matmul(x, plain), x @ plain.T)  # not a fused format: the torch path
    assert not kernels.fast_enabled()
    assert kernels.backend_name("cpu") == "cpu"


@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int8"])
def test_a_tokens_result_does_not_depend_on_its_batch(fmt):
    """Within one kernel's range of token counts (one token takes a four-row path with the same arithmetic;
    the GEMM groups six tokens but sums each alone), each token's sums run in one order, so batching requests
    together cannot change a greedy choice."""
    rec = _records(37, 128, seed=9)[fmt]
    fn = getattr(cpu, f"{fmt}_linear")
    few = cpu.gemm_tokens(int8=fmt == "int8")
    small = few if _kernel(fmt, few + 1) == "gemm" else cpu.FUSED_TOKENS
    x = torch.randn(small, 128)
    many = fn(x, rec.data, rec.scale)
    for t in (0, small // 2, small - 1):
        assert torch.equal(fn(x[t : t + 1], rec.data, rec.scale)[0], many[t])
    if small == few:
        x = torch.randn(45, 128)
        many = fn(x, rec.data, rec.scale)
        for t in (0, 7, 30):
            assert torch.equal(fn(x[t : t + small + 1], rec.data, rec.scale)[0], many[t])


def test_no_compiler_falls_back_to_torch_with_the_install_hint(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why", {})
    assert native.library() is None
    assert "apt install gcc" in native.why() and "plain torch path" in caplog.text


def _build_through(script: str, tmp_path, monkeypatch):
    """The kernels built through a shell wrapper around the real compiler (``script``: its body, the real compiler
    in ``{cc}``), in a fresh cache; returns the library (asserted built)."""
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc"
    wrapper.write_text("#!/bin/sh\n" + script.replace("{cc}", cc))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DELTAFIN_CPU_ISA", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why", {})
    lib = native.library()
    assert lib is not None, native.why()
    rec = _records(40, 96, seed=3)["mxfp4"]  # and it computes what the reference does
    x = torch.randn(3, 96)
    ref = x.double() @ dequantize(rec).double().T
    y = cpu.mxfp4_linear(x, rec.data, rec.scale, lib=lib)
    assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
    return lib


def test_the_cached_build_is_of_the_source_text_its_name_hashes(tmp_path, monkeypatch):
    """The library is built from the text whose hash names it, not from the file read again at compile time: a
    source changed in between (a package upgraded under a running process) is not cached under the old name."""
    if native._compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "k.c"
    marked = native.SOURCE.read_text() + "\nint df_test_marker(void) { return MARK; }\n"
    src.write_text(marked.replace("MARK", "7"))
    real = native._compile

    def changed_meanwhile(*args):
        src.write_text(marked.replace("MARK", "8"))
        return real(*args)

    monkeypatch.setattr(native, "SOURCE", src)
    monkeypatch.setattr(native, "_compile", changed_meanwhile)
    monkeypatch.setenv("DELTAFIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why", {})
    lib = native.library(())
    assert lib is not None, native.why()
    assert lib.df_test_marker() == 7
    assert [p.suffix for p in (tmp_path / "cache" / "kernels").iterdir()] == [".so"]  # the temp source removed


@pytest.mark.parametrize("refused", [("-march=native",), ("-march=native", "-mcpu=native")])
def test_a_compiler_that_refuses_march_native_still_builds_the_kernels(refused, tmp_path, monkeypatch, caplog):
    """clang before 15 on arm64 (Apple's among them) refuses -march=native: the kernels build with -mcpu=native, or
    for the compiler's default target where it takes neither, say so in the log, and compute what the reference
    does. Here a wrapper around the real compiler refuses the flags."""
    tests = " ".join(f'[ "$a" = "{f}" ] && {{ echo "error: unsupported option \'{f}\'" >&2; exit 1; }};' for f in refused)
    lib = _build_through(f'for a in "$@"; do {tests} done\nexec {{cc}} "$@"\n', tmp_path, monkeypatch)
    used = "-mcpu=native" if len(refused) == 1 else "the compiler's default target"
    assert f"CPU kernels built with {used}" in caplog.text and "unsupported option '-march=native'" in caplog.text
    if len(refused) == 2 and platform.machine() in ("x86_64", "AMD64"):
        assert lib.df_isa() == 0  # x86-64's baseline: the plain C loops


def test_a_compiler_without_openmp_that_removes_its_failed_output_still_builds(tmp_path, monkeypatch, caplog):
    """clang without libomp fails to link -fopenmp and removes the half-written output itself; the build goes on
    without OpenMP (one thread, which the log says) instead of reporting the cache folder unwritable. Here a
    wrapper around the real compiler does that."""
    lib = _build_through('out=""; prev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
                         'for a in "$@"; do [ "$a" = "-fopenmp" ] && { rm -f "$out"; echo "ld: cannot find -lomp" >&2; '
                         'exit 1; }; done\nexec {cc} "$@"\n', tmp_path, monkeypatch)
    assert not list((tmp_path / "cache" / "kernels").glob("tmp*"))  # nothing half-written left behind
    assert lib.df_openmp() == 0 and "built without OpenMP: they run on one thread" in caplog.text


@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int4g32-f32"])
@pytest.mark.parametrize("I,D", [(96, 64), (32, 160)])
def test_fused_swiglu_matches_the_three_matmuls(fmt, I, D):
    """One call for a whole 4-bit expert against the fast path's three matmuls with torch's SiLU between.

    Gate and up are bit-identical in both (the same quantized x, the same rows); only SiLU's last bit may differ
    (expf against torch's exp, a few ulps of h). That moves each Q8 code of h by at most one step and each block
    scale by a few ulps, so |y_fused - y_three| <= sum_c |Wd_c| d(c) (1 + 2^-10) plus each side's float32 rounding,
    gamma_n sum_c |Wd_c| (|h_c| + d(c)), n <= I/32 + 8 (the Q8 bound's count)."""
    if not cpu.q8_enabled():
        pytest.skip("the fused expert is on the Q8 path only")
    base = fmt.split("-")[0]
    g, u = _records(I, D, seed=I)[base], _records(I, D, seed=I + 1)[base]
    d = _records(D, I, seed=D)[base]
    if fmt.endswith("f32"):
        g, u, d = (QTensor(r.format, r.shape, r.data, r.scale.float()) for r in (g, u, d))
    most = cpu.gemm_tokens() if cpu.gemm_enabled() else cpu.FUSED_TOKENS  # the Q8 path's token range
    if not cpu.gemm_enabled():  # past it: the GEMM's fused expert where built (test_fused_gemm_expert_...)
        assert cpu.swiglu(torch.randn(most + 1, D), g, u, d) is None
    x = torch.randn(most, D, generator=torch.Generator().manual_seed(7))
    fused = cpu.swiglu(x, g, u, d)
    assert fused is not None and fused.shape == (most, D)
    lin = getattr(cpu, f"{base}_linear")
    h = torch.nn.functional.silu(lin(x, g.data, g.scale)) * lin(x, u.data, u.scale)
    three = lin(h, d.data, d.scale)
    wd = dequantize(d).double().abs()
    T = h.shape[0]
    dh = h.double().abs().view(T, I // 32, 32).amax(-1, keepdim=True).div(127).expand(T, I // 32, 32).reshape(T, I)
    n = I // 32 + 8
    bound = (dh * (1 + 2.0**-10)) @ wd.T + 2 * (n * U / (1 - n * U)) * ((h.double().abs() + dh) @ wd.T)
    assert torch.all((fused.double() - three.double()).abs() <= bound)
    for t in (0, most - 1):  # a token's result does not depend on its batch
        assert torch.equal(cpu.swiglu(x[t : t + 1], g, u, d)[0], fused[t])


def test_fused_swiglu_dispatch():
    """kernels.swiglu runs only on the fast path, for 4-bit experts in one format; otherwise the caller's
    three matmuls run (None)."""
    from deltafin.models.common import swiglu_expert

    if not cpu.q8_enabled():
        pytest.skip("the fused expert is on the Q8 path only")
    r = {n: _records(32, 64, seed=s)["mxfp4"] for n, s in (("gate", 1), ("up", 2))}
    r["down"] = _records(64, 32, seed=3)["mxfp4"]
    x = torch.randn(2, 64)
    assert kernels.swiglu(x, r["gate"], r["up"], r["down"]) is None  # the exact path
    with kernels.fast():
        y = swiglu_expert(x, r)
        assert torch.equal(y, cpu.swiglu(x, r["gate"], r["up"], r["down"]))
        i8 = _records(64, 32, seed=3)["int8"]
        assert kernels.swiglu(x, r["gate"], r["up"], i8) is None  # mixed formats: three matmuls
        many = kernels.swiglu(torch.randn(cpu.FUSED_TOKENS + 1, 64), r["gate"], r["up"], r["down"])
        assert (many is None) != cpu.gemm_enabled()  # the GEMM's fused expert, where built


@pytest.mark.parametrize("T", [1, 3, cpu.FUSED_TOKENS])
def test_int8_many_equals_separate_calls(T):
    """q, k and v in one call: x quantized once, the rows of all three in one pass; each result bit for bit
    that of its own int8_linear call (odd row counts and a width that is not whole blocks)."""
    if not cpu.i16_enabled():
        pytest.skip("one call per matrix without the int16 path")
    ws = [_records(R, 224, seed=R)["int8"] for R in (37, 5, 130)]
    ws = [QTensor("int8", (w.shape[0], 201), w.data[:, :201].contiguous(), w.scale) for w in ws]  # not whole blocks
    x = torch.randn(T, 201, generator=torch.Generator().manual_seed(T))
    many = cpu.int8_linear_many(x, ws)
    for y, w in zip(many, ws, strict=True):
        assert torch.equal(y, cpu.int8_linear(x, w.data, w.scale))
        _check_fmt("int8", y, x, dequantize(w), fused=True)
    with kernels.fast():
        assert all(torch.equal(a, b) for a, b in zip(kernels.matmul_many(x, ws), many, strict=True))
        plain = torch.randn(7, 201)  # not all int8: one matmul each
        ys = kernels.matmul_many(x, [ws[0], plain])
        assert torch.equal(ys[0], many[0]) and torch.equal(ys[1], x @ plain.T)
    exact = kernels.matmul_many(x, ws)  # off the fast path: the torch reference, one at a time
    assert all(torch.equal(a, torch_ref.matmul(x, w)) for a, w in zip(exact, ws, strict=True))


def test_rows_split_over_threads_give_the_one_thread_results(monkeypatch):
    """Rows are independent, so splitting them over threads (any matrix when SERIAL_ELEMENTS is 0) changes no
    bit of any result; test shapes are otherwise below the threshold and run on one thread."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread here")
    recs = _records(130, 512, seed=11)
    x = torch.randn(3, 512)
    down = _records(512, 128, seed=12)["mxfp4"]
    runs = []
    for serial in (cpu.SERIAL_ELEMENTS, 0):
        monkeypatch.setattr(cpu, "SERIAL_ELEMENTS", serial)
        ys = [getattr(cpu, f"{f}_linear")(x[:t], r.data, r.scale) for f, r in recs.items() for t in (1, 3)]
        if cpu.q8_enabled():
            g = _records(128, 512, seed=13)["mxfp4"]
            ys.append(cpu.swiglu(x, g, g, down))
        if cpu.i16_enabled():
            ys += cpu.int8_linear_many(x, [recs["int8"], recs["int8"]]) or []  # None where the GEMM takes them
        runs.append(ys)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_denormals_flushed_inside_the_block_and_back_after():
    """The CPU fast path's block flushes denormals (FTZ/DAZ) in this thread and torch's compute threads, and puts
    the setting back after it; the exact path keeps IEEE arithmetic."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("FTZ/DAZ are x86 control bits")
    if cpu.available() and not native.library().df_openmp():
        pytest.skip("kernels built without OpenMP reach only the calling thread, not torch's")
    tiny = torch.full((1 << 20,), 1e-39)  # a denormal float32, in a tensor large enough to spread over threads
    assert torch.all(tiny * 2 == 2e-39)
    with cpu.denormals_flushed():
        assert torch.all(tiny * 2 == 0)  # read as zero in every thread that took a share
        with cpu.denormals_flushed():  # nested: the outer block's setting stands
            assert torch.all(tiny * 2 == 0)
        assert torch.all(tiny * 2 == 0)
    assert torch.all(tiny * 2 == 2e-39)


@pytest.mark.timing
@pytest.mark.parametrize("isa", ["native", "avx2", "avx2-novnni"])
def test_int16_peak_bounds_the_gemm(timing, isa):
    """`df_gw_peak`, the limit the GEMM's figures are divided by, is a ceiling: a 4-bit GEMM at 128 tokens on one
    thread (the same int16 pair sums, plus the weights' decode and the scale step) never runs faster than the probe
    beside it. Written from intrinsics the probe once timed its own register copies (0.55 of a core that runs two
    vpdpwssd a cycle, the GEMM reading 1.2-1.3 'of the peak'); without VNNI it timed only the adds."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the probe is x86's")
    lib = native.library(native.ISA_FLAGS[isa])
    if lib is None or not cpu.gemm_enabled(lib) or not lib.df_gw_peak(1, 1):
        pytest.skip(f"no {isa} GEMM here ({native.why(native.ISA_FLAGS[isa]) or 'this CPU lacks it'})")
    rec = _records(512, 2048, seed=7)["mxfp4"]
    x = torch.randn(128, 2048)
    ops = 2 * 512 * 2048 * 128
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        import time

        best_gemm = best_peak = 0.0
        for _ in range(5):
            best_peak = max(best_peak, lib.df_gw_peak(1, 200_000))
            t = time.perf_counter()
            for _ in range(4):
                cpu.mxfp4_linear(x, rec.data, rec.scale, lib=lib)
            best_gemm = max(best_gemm, 4 * ops / (time.perf_counter() - t) / 1e9)
    finally:
        torch.set_num_threads(threads)
    assert best_gemm <= 1.05 * best_peak, (isa, best_gemm, best_peak)
    assert best_gemm >= 0.2 * best_peak, (isa, best_gemm, best_peak)  # and the probe is not far above it either


def _mx(packed: torch.Tensor, e: torch.Tensor) -> QTensor:
    return QTensor("mxfp4", (packed.shape[0], 2 * packed.shape[1]), packed.contiguous(), e.to(torch.uint8).contiguous())


@pytest.mark.parametrize("isa", ["native", "avx2", "avx2-novnni"])
def test_gemm_one_scale_step_per_pair_of_blocks_where_exponents_allow(isa):
    """The GEMM takes one scale step per two blocks where every row's two E8M0 exponents are within 6 of each other
    (the larger block's values shifted left by the gap: exact) and int8 rows always; one per block for INT4, for a
    pair 7 apart or with exponent 0 or 255. Either way the result keeps the GEMM's bound: gaps of 0-6, a gap of 6
    at the largest values (|v| 12 x 2^6, sums near 2^31 with every activation at its group's maximum), a chunk kept
    per block by one far pair, an odd block count (the last block alone)."""
    if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 builds are x86's")
    lib = native.library(native.ISA_FLAGS[isa])
    if lib is None or not cpu.gemm_enabled(lib):
        pytest.skip(f"no {isa} GEMM here")
    g = torch.Generator().manual_seed(11)
    R, C = 70, 9 * 32
    nb = C // 32
    packed = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
    e = torch.randint(118, 124, (R, 1), generator=g) + torch.randint(0, 7, (R, nb), generator=g)

    def merge(kind: int, sc: torch.Tensor, r0: int = 0, r1: int = R) -> int:
        return lib.df_gw_merge(kind, sc.data_ptr(), r0, r1, nb, 0, nb)

    e8 = e.to(torch.uint8).contiguous()
    mb = merge(8, torch.ones(R))  # int8 rows always take the build's groups: 2, 1 on AVX2 without VNNI
    assert mb == (2 if lib.df_q8_vnni() else 1)  # AVX2 without VNNI keeps one step a block
    assert merge(0, e8) == mb
    assert merge(1, torch.ones(R, nb, dtype=torch.bfloat16)) == 1 and merge(2, torch.ones(R, nb)) == 1
    far = e.clone()
    far[3, 4], far[3, 5] = 120, 127  # blocks 4 and 5 are a pair: 7 apart in row 3
    far8 = far.to(torch.uint8).contiguous()
    assert merge(0, far8) == 1 and merge(0, far8, 4, R) == mb and merge(0, far8, 0, 3) == mb
    far[3, 5] = 126  # 6 apart: merged again
    assert merge(0, far.to(torch.uint8).contiguous()) == mb
    for bad in (0, 255):
        z = e.clone()
        z[5, 8] = bad  # the last, lone block: its own group
        assert merge(0, z.to(torch.uint8).contiguous()) == 1
    x = torch.randn(40, C, generator=g)
    for rec in (_mx(packed, e), _mx(packed, far)):
        y = cpu.mxfp4_linear(x, rec.data, rec.scale, lib=lib)
        _check_gemm(y, x, dequantize(rec), lib=lib)
    # the largest values at a gap of 6: nibble 7 is +6.0 (v = 12), 15 is -6.0; every activation its group's max
    big = torch.full((R, C // 2), 0x77, dtype=torch.uint8)
    big[1::2] = 0xFF
    eb = torch.full((R, nb), 120)
    eb[:, 1::2] = 126
    xb = torch.ones(24, C)
    xb[1::2] = -1.0
    rec = _mx(big, eb)
    assert merge(0, rec.scale) == mb
    y = cpu.mxfp4_linear(xb, rec.data, rec.scale, lib=lib)
    _check_gemm(y, xb, dequantize(rec), lib=lib)
    if not gemm_u8(lib=lib):
        assert torch.equal(y.abs(), (xb.double() @ dequantize(rec).double().T).abs().float())  # exact: powers of two
        return
    # 8-bit activations: q = +-127 with d = fl(1 / 127), no power of two, so each block's step rounds: its exact
    # sum +-12 x 127 x 32 times fl(weight scale x 1/2 x d), added in block order by one fused multiply-add (exact
    # in float64 here: 41-bit products, the terms within 2^12 of each other), rounded once to float32
    d = torch.tensor(1.0) / 127
    ws = torch.exp2(eb[0].double() - 128).float()  # weight scale x 1/2, the same in every row
    f = torch.zeros(24, R)
    sign = xb[:, :1] * torch.where(torch.arange(R) % 2 == 0, 1.0, -1.0)
    for b in range(nb):
        f = (sign.double() * (12 * 127 * 32) * (ws[b] * d).double() + f.double()).float()
    assert torch.equal(y, f)
