"""The arm64 NEON builds of the CPU kernels (baseline NEON, the dot-product extension's SDOT, I8MM's USDOT),
cross-compiled with gcc-aarch64-linux-gnu and run under qemu-aarch64 -cpu max through the kernel harness
(tests/kernel_harness.py), against the float64 references and bounds of the x86 builds (tests/test_kernels.py,
tests/test_cpu_glu.py). Skipped where the cross compiler or the emulator is not installed (.ci/run installs both)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltafin.kernels import cpu
from deltafin.quant import int8
from deltafin.quant.record import dequantize
from tests import kernel_harness as kh
from tests.test_cpu_glu import ACTS, _act_inputs, _check_act
from tests.test_kernels import U, _check_fmt, _records

pytestmark = pytest.mark.skipif(bool(kh.tools_missing()), reason=kh.tools_missing() or "tools present")


@pytest.fixture(scope="module", params=list(kh.ARM_BUILDS))
def arm(request, tmp_path_factory):
    flags, isa = kh.ARM_BUILDS[request.param]
    lib = kh.HarnessLib(kh.build(flags, tmp_path_factory.mktemp("arm") / f"harness-{request.param}"))
    assert lib.df_isa() == isa, f"{request.param}: df_isa {lib.df_isa()}, expected {isa}"
    return lib


def test_the_arm_builds_take_the_vector_paths_and_name_them(arm):
    """Each build reports its NEON level, takes the Q8 and int16-activation paths (vector code), has no int16 GEMM
    (the 4-bit prefill takes the decoded tile), and flushes denormals through FPCR.FZ inside the block only."""
    assert cpu.isa(arm) == {5: "neon", 6: "neon+dotprod", 7: "neon+i8mm"}[arm.df_isa()]
    assert cpu.q8_enabled(arm) and cpu.i16_enabled(arm) and not cpu.gemm_enabled(arm)
    assert arm.df_q8_terms() == 1 and arm.df_openmp() == 1
    assert arm.ftz_check() == 1


@pytest.mark.parametrize("R,C", [(77, 96), (33, 640), (8, 4096), (5, 32)])
def test_arm_matmuls_match_the_float64_reference(arm, R, C):
    """Partial groups of 4 blocks (96 and 640 columns), row counts not a multiple of the four rows a one-token call
    takes together, every format and scale type; one token (four-row loop), few (token loop), 17 (decoded tile)."""
    for fmt, rec in _records(R, C, seed=R + C).items():
        for T in (1, 3, 12, cpu.FUSED_TOKENS + 1):
            x = torch.randn(T, C, generator=torch.Generator().manual_seed(T)) * torch.rand(T, 1) * 10
            y = getattr(cpu, f"{fmt}_linear")(x, rec.data, rec.scale, lib=arm)
            assert y.shape == (T, R)
            _check_fmt(fmt, y, x, dequantize(rec), fused=T <= cpu.FUSED_TOKENS, lib=arm)
    i4 = _records(R, C, seed=1)["int4g32"]
    x = torch.randn(2, C)
    _check_fmt("int4g32", cpu.int4g32_linear(x, i4.data, i4.scale.float(), lib=arm), x, dequantize(i4), True, arm)


def test_arm_int8_widths_cut_short_and_batch_independence(arm):
    """int8 rows whose width is not a whole step of 8 columns (the tail summed apart), and a token's result the same
    alone as in its batch, bit for bit (each token's sums run in one order)."""
    for C in (83, 131, 250):
        q, sc = int8.quantize_ref(np.random.default_rng(C).standard_normal((9, C)).astype(np.float32))
        q, sc = torch.from_numpy(q), torch.from_numpy(sc)
        for T in (1, 2, 7):
            x = torch.randn(T, C)
            _check_fmt("int8", cpu.int8_linear(x, q, sc, lib=arm), x, int8.dequantize(q, sc), fused=True, lib=arm)
    for fmt, rec in _records(37, 128, seed=9).items():
        fn = getattr(cpu, f"{fmt}_linear")
        x = torch.randn(cpu.FUSED_TOKENS, 128)
        many = fn(x, rec.data, rec.scale, lib=arm)
        for t in (0, 7, cpu.FUSED_TOKENS - 1):
            assert torch.equal(fn(x[t : t + 1], rec.data, rec.scale, lib=arm)[0], many[t])


def test_arm_rows_over_threads_and_the_float_loop(arm, monkeypatch):
    """A matrix large enough to split over two OpenMP threads under the emulator gives the one-thread bits, and the
    float decode loop (DELTAFIN_CPU_Q8=0) stays within the float bound."""
    rec = _records(512, 8192, seed=4)["mxfp4"]
    x = torch.randn(1, 8192)
    two = cpu.mxfp4_linear(x, rec.data, rec.scale, lib=arm)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(cpu.mxfp4_linear(x, rec.data, rec.scale, lib=arm), two)
    _check_fmt("mxfp4", two, x, dequantize(rec), fused=True, lib=arm)
    monkeypatch.undo()
    monkeypatch.setenv("DELTAFIN_CPU_Q8", "0")
    rec = _records(33, 256, seed=5)["int4g32"]
    x = torch.randn(3, 256)
    _check_fmt("int4g32", cpu.int4g32_linear(x, rec.data, rec.scale, lib=arm), x, dequantize(rec), fused=True, lib=arm)


@pytest.mark.parametrize("name", list(ACTS))
def test_arm_gated_activation_within_its_bound(arm, name):
    act, rel = ACTS[name]
    g, u = _act_inputs(300, seed=3)
    _check_act(cpu.glu_act(g, u, act, lib=arm), g, u, act, rel)


@pytest.mark.parametrize("act", [("silu",), ("situ", 4.0, 25.0)])
def test_arm_gated_expert_in_one_call_equals_its_steps(arm, act):
    """The one-call 4-bit expert on the Q8 path: gate and up are the Q8 matmul's bits, down runs on the activation
    of them; the result equals those three steps through this build's own kernels, bit for bit."""
    I, D = 96, 64  # noqa: E741
    g, u, d = _records(I, D, seed=I)["mxfp4"], _records(I, D, seed=I + 1)["mxfp4"], _records(D, I, seed=D)["mxfp4"]
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(7))
    y = cpu.glu_expert(x, g, u, d, act, lib=arm)
    assert y is not None and y.shape == (2, D)
    h = cpu.glu_act(cpu.mxfp4_linear(x, g.data, g.scale, lib=arm), cpu.mxfp4_linear(x, u.data, u.scale, lib=arm),
                    act, lib=arm)
    assert torch.equal(y, cpu.mxfp4_linear(h, d.data, d.scale, lib=arm))
    ref = dequantize(d).double() @ (dequantize(g).double() @ x.double().T).sigmoid().mul(
        dequantize(g).double() @ x.double().T).mul(dequantize(u).double() @ x.double().T)
    if act[0] == "silu":  # and near the float64 expert: a few percent, the Q8 rounding of x and of h
        assert (y.double() - ref.T).abs().max() <= 0.05 * ref.abs().max() + 8 * U


def test_harness_reports_a_bad_request():
    """A call the harness does not know fails loudly instead of returning zeros."""
    lib = kh.HarnessLib(kh.build(kh.ARM_BUILDS["neon"][0], kh.ROOT / ".pytest-neon-unknown"))
    try:
        with pytest.raises(AssertionError, match="exit 2"):
            lib.run("df_nothing", [])
        with pytest.raises(AttributeError):
            lib.df_q4q8_glu_many  # noqa: B018 (arrays of pointers: not carried by the harness)
    finally:
        (kh.ROOT / ".pytest-neon-unknown").unlink(missing_ok=True)


def test_cpu_isa_names_the_arm_builds(monkeypatch):
    """On arm64 DELTAFIN_CPU_ISA takes the NEON levels (the flags these tests build with); on x86 they are refused
    with the names that apply."""
    import platform

    from deltafin.errors import UsageError
    from deltafin.kernels import native

    monkeypatch.setattr(native, "_ISA_SEEN", {})
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    for name, (flags, _) in kh.ARM_BUILDS.items():
        monkeypatch.setenv("DELTAFIN_CPU_ISA", name)
        assert native.isa_flags() == flags == native.ARM_ISA_FLAGS[name]
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "_ISA_SEEN", {})
    with pytest.raises(UsageError, match="neon-i8mm: an arm64 build, and this machine is x86_64; use one of native"):
        native.isa_flags()
