"""The compiled gated activation and the one-call gated 4-bit expert (CPU), against float64 references.

The activation (``df_glu_act``): SwiGLU silu(g) u within 10 u and Kimi K3's SiTU-GLU within 30 u relative
(u = 2^-24; the bounds are derived in cpu_kernels.c above ``GLU_SILU``) wherever the exact value is a normal
float32 and sigmoid(g) is too (g > -87); below, the error is absolute, under 2^-118 times |u| + 1 (sigmoid(g) <
2^-126 there, which the kernel returns as 0 or a denormal, times at most ~100 |u|).

The expert (``glu_expert`` past GEMM_TOKENS): gate and up are each df_q4gw_mm's result, the activation is
df_glu_act's and down is df_q4gw_mm's on it, so the result equals those three steps bit for bit (checked). Against
the float64 reference y = Wd act(Wg x, Wu x), the error is bounded by propagating the GEMM bound of each matrix
(test_kernels._gemm_bound: int16 rounding of the activations per block of 32, 8-bit on AVX2 builds without VNNI,
then the float32 block loop):
|g~ - g| <= Bg, |u~ - u| <= Bu; with L_g, L_u bounds on the activation's partial derivatives over that box,
|h~ - h| <= L_g Bg + L_u Bu + B_act |h~| =: Dh; and |y~ - y| <= |Wd| Dh + the GEMM bound of Wd on h~.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deltafin import kernels
from deltafin.kernels import cpu, native
from deltafin.quant.record import QTensor, dequantize
from tests.test_kernels import _gemm_bound, _records, gemm_u8

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"CPU kernels unavailable: {native.why()}")
U = 2.0**-24
SITU = ("situ", 4.0, 25.0)
ACTS = {"silu": (("silu",), 10 * U), "situ": (SITU, 30 * U)}


def _act64(g: torch.Tensor, u: torch.Tensor, act: tuple) -> torch.Tensor:
    g, u = g.double(), u.double()
    if act[0] == "silu":
        return g * torch.sigmoid(g) * u
    b, lb = act[1], act[2]
    return b * torch.tanh(g / b) * torch.sigmoid(g) * (lb * torch.tanh(u / lb))


def _act_inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every range the formulas treat apart: near 0 (tanh's and expm1's small arguments), |x| around the
    Cody-Waite steps, large (saturation, sigmoid's underflow below -88, expm1's overflow at 88.7), specials."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=gen) * s for s in (1e-6, 1e-2, 0.3, 3, 30, 60)]
    parts.append(torch.linspace(-100, 100, n))
    parts.append(torch.tensor([0.0, -0.0, 88.0, 88.5, 88.75, -88.5, -88.75, -90.0, 1e-30, -1e-30]))
    g = torch.cat(parts)
    u = g[torch.randperm(g.numel(), generator=gen)] * 1.7
    return g, u


def _normal(g: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Where the relative bound applies: sigmoid(g) a normal float32 (g > -87) and the result far from underflow."""
    return (g > -87) & (ref.double().abs() >= 2.0**-100)


def _check_act(h: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: tuple, rel: float) -> None:
    ref = _act64(g, u, act)
    err = (h.double() - ref).abs()
    normal = _normal(g, ref)
    assert torch.all(err[normal] <= rel * ref.abs()[normal]), f"max {(err[normal] / ref.abs()[normal]).max() / U:.2f} u"
    assert torch.all(err[~normal] <= 2.0**-118 * (u.double().abs()[~normal] + 1))


@pytest.mark.parametrize("name", sorted(ACTS))
def test_glu_act_within_its_bound_of_float64(name):
    act, rel = ACTS[name]
    g, u = _act_inputs(4001, seed=1)  # an odd count: a partial vector at the end
    _check_act(cpu.glu_act(g, u, act), g, u, act, rel)


@pytest.mark.parametrize("name", sorted(ACTS))
def test_glu_act_against_torch_float32(name):
    """torch's float32 activation (as the plain path runs it) is itself within a few u, so both agree within
    the kernel's bound plus torch's (taken as the same again)."""
    act, rel = ACTS[name]
    g, u = _act_inputs(2000, seed=2)
    if act[0] == "silu":
        ref = torch.nn.functional.silu(g) * u
    else:
        ref = act[1] * torch.tanh(g / act[1]) * torch.sigmoid(g) * (act[2] * torch.tanh(u / act[2]))
    h = cpu.glu_act(g, u, act)
    err = (h.double() - ref.double()).abs()
    normal = _normal(g, ref)
    assert torch.all(err[normal] <= 2 * rel * ref.double().abs()[normal])
    assert torch.all(err[~normal] <= 2.0**-117 * (u.double().abs()[~normal] + 1))


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_glu_act_specials(isa):
    """NaN stays NaN; infinities saturate as the formulas do (SiTU-GLU of +-inf is finite); in every build."""
    import platform

    lib = native.library(native.ISA_FLAGS[isa] if platform.machine() in ("x86_64", "AMD64") else ())
    inf, nan = float("inf"), float("nan")
    g = torch.tensor([nan, 1.0, inf, -inf, inf])
    u = torch.tensor([1.0, nan, 1.0, 1.0, inf])
    h = cpu.glu_act(g, u, SITU, lib=lib)
    assert h[:2].isnan().all() and h[2] == pytest.approx(4.0 * 25 * math.tanh(1 / 25)) and h[3] == 0
    assert h[4] == pytest.approx(100.0)
    s = cpu.glu_act(g, u, lib=lib)
    assert s[:2].isnan().all() and s[2] == inf and s[3].isnan()  # -inf * sigmoid(-inf) = -inf * 0, as torch


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_glu_act_builds_without_avx512(isa):
    """The builds without AVX-512 take libm's expm1f in the same formulas: within the same bounds."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the plain C build is the default build off x86")
    lib = native.library(native.ISA_FLAGS[isa])
    g, u = _act_inputs(500, seed=3)
    for act, rel in ACTS.values():
        _check_act(cpu.glu_act(g, u, act, lib=lib), g, u, act, rel)


def _expert(fmt: str, I: int, D: int, seed: int) -> dict[str, QTensor]:  # noqa: E741
    base = fmt.removesuffix("_f32")
    r = {"gate": _records(I, D, seed)[base], "up": _records(I, D, seed + 1)[base],
         "down": _records(D, I, seed + 2)[base]}
    if fmt.endswith("_f32"):
        r = {k: QTensor(v.format, v.shape, v.data, v.scale.float()) for k, v in r.items()}
    return r


def _lipschitz(g: torch.Tensor, u: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor, act: tuple):
    """Bounds on |dh/dg| and |dh/du| over the box g +- bg, u +- bu (float64)."""
    ga, ua = g.abs() + bg, u.abs() + bu
    if act[0] == "silu":  # d silu/dg = s (1 + g (1 - s)) <= 1.1; d/du = silu(g), |silu(g)| <= |g|
        return 1.1 * ua, ga
    b, lb = act[1], act[2]  # f = b tanh(g/b) s(g): |f'| <= sech^2 s + b tanh s (1 - s) <= 1 + b/4; |f| <= min(b, |g|)
    return (1 + b / 4) * torch.minimum(ua, torch.full_like(ua, lb)), torch.minimum(ga, torch.full_like(ga, b))


def _expert_bound(x: torch.Tensor, r: dict[str, QTensor], h: torch.Tensor, act: tuple, rel: float):
    """(the float64 reference [T, D], the error bound [T, D], the scale the bound is small against [T, D])."""
    wg, wu, wd = (dequantize(r[k]).double() for k in ("gate", "up", "down"))
    xa = x.double().abs()
    g, u = x.double() @ wg.T, x.double() @ wu.T
    bg, bu = _gemm_bound(x, wg), _gemm_bound(x, wu)
    lg, lu = _lipschitz(g, u, bg, bu, act)
    dh = lg * bg + lu * bu + rel * h.double().abs() + 2.0**-118 * (u.abs() + bu + 1)
    bound = dh @ wd.abs().T + _gemm_bound(h.float(), wd)
    # what the terms can reach: a wrong panel, column or activation lands far outside a small share of it
    scale = (lg * (xa @ wg.abs().T) + lu * (xa @ wu.abs().T) + h.double().abs()) @ wd.abs().T
    return _act64(g, u, act) @ wd.T, bound, scale


@pytest.mark.parametrize("name", sorted(ACTS))
@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int4g32_f32"])
@pytest.mark.parametrize("I,D", [(96, 224), (160, 32), (32, 416)])  # panels: whole, partial; one block; many
def test_fused_gemm_expert_matches_reference(fmt, name, I, D, gemm_build):  # noqa: E741
    act, rel = ACTS[name]
    r = _expert(fmt, I, D, seed=I + D)
    lin = getattr(cpu, f"{r['gate'].format}_linear")
    for T in (cpu.gemm_tokens() + 1, 17, 100, 257):  # just past the Q8 range; partial token groups; many
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)) * torch.rand(T, 1) * 4
        cpu.USED.discard(f"{r['gate'].format}_gemm_{name}")
        y = cpu.glu_expert(x, r["gate"], r["up"], r["down"], act)
        assert y.shape == (T, D) and f"{r['gate'].format}_gemm_{name}" in cpu.USED
        # the three steps it fuses, bit for bit
        h = cpu.glu_act(lin(x, r["gate"].data, r["gate"].scale), lin(x, r["up"].data, r["up"].scale), act)
        assert torch.equal(y, lin(h, r["down"].data, r["down"].scale))
        ref, bound, scale = _expert_bound(x, r, h, act, rel)
        err = (y.double() - ref).abs()
        assert torch.all(err <= bound), f"{(err / bound).max():.3g} of the bound"
        # about 1e-4 here (1e-2 with 8-bit activations, the Q8 path's): the bound is a real constraint
        assert torch.all(bound <= (0.05 if gemm_u8() else 1e-3) * scale)


@pytest.mark.parametrize("isa", ["native", "avx2", "avx2-novnni", "portable"])
def test_few_token_expert_is_its_three_matmuls(isa):
    """The Q8 range's one-call expert is bit for bit its three Q8 matmuls with the activation between them, in every
    build (the AVX2 builds are what x86 machines without AVX-512 run), and near the float64 expert."""
    import platform

    flags = native.ISA_FLAGS[isa] if platform.machine() in ("x86_64", "AMD64") else ()
    lib = native.library(flags)
    r = _expert("mxfp4", 96, 224, seed=11)
    g, u, d = (r[k] for k in ("gate", "up", "down"))
    for T in (1, 3):
        x = torch.randn(T, 224, generator=torch.Generator().manual_seed(T))
        y = cpu.glu_expert(x, g, u, d, SITU, lib=lib)
        lin = cpu.mxfp4_linear
        h = cpu.glu_act(lin(x, g.data, g.scale, lib=lib), lin(x, u.data, u.scale, lib=lib), SITU, lib=lib)
        assert torch.equal(y, lin(h, d.data, d.scale, lib=lib))
        ref, _, scale = _expert_bound(x, r, h, SITU, ACTS["situ"][1])
        assert torch.all((y.double() - ref).abs() <= 0.05 * scale)


def test_fused_gemm_expert_does_not_depend_on_the_batch(gemm_build):
    r = _expert("mxfp4", 96, 160, seed=4)
    x = torch.randn(61, 160, generator=torch.Generator().manual_seed(5))
    full = cpu.glu_expert(x, r["gate"], r["up"], r["down"], SITU)
    for a, b in ((0, cpu.gemm_tokens() + 1), (7, 20), (20, 61)):
        assert torch.equal(cpu.glu_expert(x[a:b], r["gate"], r["up"], r["down"], SITU), full[a:b])


def test_glu_dispatch(monkeypatch):
    """kernels.glu: only on the fast path; DELTAFIN_CPU_GEMM=0 leaves many tokens to the three matmuls (the
    tiled float path); the Q8 range takes either activation; mixed formats never fuse."""
    r = _expert("mxfp4", 32, 64, seed=9)
    many, few = torch.randn(cpu.FUSED_TOKENS + 3, 64), torch.randn(2, 64)
    assert kernels.glu(many, r["gate"], r["up"], r["down"], SITU) is None  # the exact path
    with kernels.fast():
        y = kernels.glu(many, r["gate"], r["up"], r["down"], SITU)
        assert (y is not None) == cpu.gemm_enabled()
        if cpu.q8_enabled():
            y = kernels.glu(few, r["gate"], r["up"], r["down"], SITU)
            lin = cpu.mxfp4_linear
            h = cpu.glu_act(lin(few, r["gate"].data, r["gate"].scale), lin(few, r["up"].data, r["up"].scale), SITU)
            assert y is not None and "mxfp4_q8_situ" in cpu.USED
            assert torch.allclose(y, lin(h, r["down"].data, r["down"].scale), rtol=1e-2, atol=1e-2)
        i8 = _records(64, 32, seed=3)["int8"]
        assert kernels.glu(many, r["gate"], r["up"], i8, SITU) is None
        monkeypatch.setenv("DELTAFIN_CPU_GEMM", "0")
        assert kernels.glu(many, r["gate"], r["up"], r["down"], SITU) is None


def test_k3_expert_takes_the_fused_call():
    """Kimi K3's routed expert on the fast CPU path is the fused call; off it, the three matmuls (float32)."""
    from deltafin.bench.decode import situ_glu_expert

    rng = np.random.default_rng(0)
    r = _expert("mxfp4", 64, 96, seed=int(rng.integers(1000)))
    x = torch.randn(cpu.gemm_tokens() + 4, 96, generator=torch.Generator().manual_seed(3))  # the GEMM's range
    exact = situ_glu_expert(x, r)
    with kernels.fast():
        fast = situ_glu_expert(x, r)
    if cpu.gemm_enabled():
        assert torch.equal(fast, cpu.glu_expert(x, r["gate"], r["up"], r["down"], SITU))
    assert torch.allclose(fast, exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())


@pytest.mark.parametrize("T", [3, cpu.GEMM_TOKENS + 1, 37])  # the Q8 range (gathered), the GEMM (read in place)
def test_expert_on_rows_of_the_batch_is_the_gathered_expert(T):
    """glu_expert(x, rows=idx) is glu_expert(x[idx]) bit for bit, for float32 and bf16 batches; bad rows are refused."""
    r = _expert("mxfp4", 64, 96, seed=T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(50, 96, generator=g)
    idx = torch.randperm(50, generator=g)[:T].sort().values
    for xb in (x, x.to(torch.bfloat16), x[:, :96].T.contiguous().T):  # float32; converted; not contiguous
        want = cpu.glu_expert(xb[idx], r["gate"], r["up"], r["down"], SITU)
        if want is None:  # no vector code in this build for this range
            continue
        assert torch.equal(cpu.glu_expert(xb, r["gate"], r["up"], r["down"], SITU, rows=idx), want)
    with kernels.fast():
        y = kernels.glu(x, r["gate"], r["up"], r["down"], SITU, rows=idx)
        assert y is None or torch.equal(y, kernels.glu(x[idx], r["gate"], r["up"], r["down"], SITU))
    if cpu.gemm_enabled() and T > cpu.gemm_tokens():
        with pytest.raises(IndexError, match="outside x's 50 rows"):
            cpu.glu_expert(x, r["gate"], r["up"], r["down"], SITU, rows=torch.full((T,), 50))
    with pytest.raises(TypeError, match="rows: int64"):
        cpu.glu_expert(x, r["gate"], r["up"], r["down"], SITU, rows=idx.to(torch.int32))


def test_expert_major_layer_runs_each_expert_on_its_rows():
    """The prefill benchmark's layer: every expert of the union fetched once, run on exactly its tokens' rows of x
    (the fused CPU expert reads them in place), with the result of the gathered rows."""
    from deltafin.bench.decode import situ_glu_expert
    from deltafin.bench.synthetic import expert_major_layer, expert_rows

    routes = [[0, 2], [2, 1], [0, 1], [2, 0]] * 3
    rows = expert_rows(routes)
    assert {e: v.tolist() for e, v in rows.items()} == {0: [0, 2, 3, 4, 6, 7, 8, 10, 11], 1: [1, 2, 5, 6, 9, 10],
                                                         2: [0, 1, 3, 4, 5, 7, 8, 9, 11]}
    experts = {e: _expert("mxfp4", 32, 64, seed=20 + e) for e in range(3)}

    class Source:
        fetched: list = []

        def fetch(self, layer, ids):
            self.fetched.append((layer, list(ids)))
            return ((e, experts[e]) for e in ids)

    x = torch.randn(len(routes), 64)
    seen = {}

    def fn(x_, t, r):
        seen[next(e for e, v in experts.items() if v is t)] = (r.tolist(), situ_glu_expert(x_, t, r))

    src = Source()
    with kernels.fast():
        n, math_s = expert_major_layer(src, 3, routes, x, False, fn)
        assert n == 3 and math_s > 0 and src.fetched == [(3, [0, 1, 2])]
        for e, (r, y) in seen.items():
            assert r == rows[e].tolist() and torch.equal(y, situ_glu_expert(x[rows[e]], experts[e]))
    assert expert_major_layer(src, 4, routes, x, True, fn) == (3, 0.0)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ["native", "avx2", "avx2-novnni"])
@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32", "int4g32_f32"])
def test_small_experts_in_one_call_are_each_expert_alone(isa, fmt, two_threads):
    """glu_experts (a decode step's small experts shared out whole over the threads) gives each expert's glu_expert
    result bit for bit, in every build with the Q8 path: one token shared by all, and each expert on its own 1-3
    tokens (a batch's sequences), an odd count of experts, both activations; each result is its own expert's."""
    import platform

    flags = native.ISA_FLAGS[isa] if platform.machine() in ("x86_64", "AMD64") else ()
    lib = native.library(flags)
    if not cpu.q8_enabled(lib):
        pytest.skip("no Q8 path in this build")
    experts = [_expert(fmt, 64, 96, seed=20 + 3 * e) for e in range(5)]
    recs = [(r["gate"], r["up"], r["down"]) for r in experts]
    gen = torch.Generator().manual_seed(1)
    one_token = [torch.randn(1, 96, generator=gen)] * 5
    own = [torch.randn(1 + e % 3, 96, generator=gen) for e in range(5)]
    for xs, act in ((one_token, SITU), (own, ("silu",))):
        ys = cpu.glu_experts(xs, recs, act, lib=lib)
        alone = [cpu.glu_expert(x, *r, act, lib=lib) for x, r in zip(xs, recs, strict=True)]
        assert ys is not None and len(ys) == 5 and all(torch.equal(a, b) for a, b in zip(ys, alone, strict=True))
    assert all(not torch.equal(alone[0][:1], y[:1]) for y in alone[1:])


def test_small_experts_in_one_call_only_where_it_applies(two_threads):
    """Experts the call cannot take (another shape or format than the first's, past the Q8 path's tokens) are None in
    its list; None instead of a list where fewer than two remain (one thread takes the call too); experts large enough for a call
    of their own to split them by rows give that call's result too. kernels.glu_many: only on the fast path, each
    expert on its rows of x, gathering only the experts it runs; not for other roles than gate/up/down."""
    small = [(r["gate"], r["up"], r["down"]) for r in (_expert("mxfp4", 32, 64, seed=s) for s in (1, 4))]
    x = torch.randn(1, 64)
    few = cpu.glu_many_tokens()
    assert cpu.glu_experts([x], small[:1]) is None
    odd = [tuple(_expert("int4g32", 32, 64, seed=2).values()), tuple(_expert("mxfp4", 64, 64, seed=3).values())]
    ys = cpu.glu_experts([x] * 4, small + odd)
    assert ys[2] is None and ys[3] is None and all(torch.equal(ys[i], cpu.glu_expert(x, *small[i])) for i in (0, 1))
    ys = cpu.glu_experts([x, torch.randn(few + 1, 64), x], [small[0], small[1], small[1]])
    assert ys[1] is None and torch.equal(ys[2], cpu.glu_expert(x, *small[1]))
    assert cpu.glu_experts([x, torch.randn(few + 1, 64)], small) is None
    # 4M weights a matrix: a call of its own splits the rows over the threads, and so does the group call
    big = [_expert("mxfp4", 2048, 2048, seed=s) for s in (7, 8)]
    assert cpu._threads(2048, 2048, 1) == 2
    xb = torch.randn(1, 2048)
    ys = cpu.glu_experts([xb, xb], [(b["gate"], b["up"], b["down"]) for b in big])
    assert all(torch.equal(y, cpu.glu_expert(xb, b["gate"], b["up"], b["down"])) for y, b in zip(ys, big, strict=True))
    torch.set_num_threads(1)  # one thread: still one call, each expert's own result
    ys = cpu.glu_experts([x, x], small)
    assert all(torch.equal(y, cpu.glu_expert(x, *r)) for y, r in zip(ys, small, strict=True))
    torch.set_num_threads(2)
    tensors = [dict(zip(("gate", "up", "down"), r, strict=True)) for r in small]
    rows = torch.randn(5, 64)
    toks = [torch.tensor([0, 3]), torch.tensor([4])]
    assert kernels.glu_many(rows, toks, tensors) is None  # the exact path
    with kernels.fast():
        ys = kernels.glu_many(rows, toks, tensors)
        assert ys is not None and all(torch.equal(y, cpu.glu_expert(rows[t], *r))
                                      for y, t, r in zip(ys, toks, small, strict=True))
        ys = kernels.glu_many(x, [None, None], tensors)
        assert all(torch.equal(y, cpu.glu_expert(x, *r)) for y, r in zip(ys, small, strict=True))
        assert kernels.glu_many(x, [None, None], [{"gate_up": small[0][0], "down": small[0][2]}] * 2) is None
