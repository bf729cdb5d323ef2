"""The CUDA backend's Triton kernels against dequantize-then-matmul in float64, on random data.

Without a GPU the kernels run under Triton's interpreter (small shapes, a few seconds). On a GPU machine
(``-m gpu``) the same checks run compiled at real Kimi K3 widths, then every family's tiny model is decoded
teacher-forced in bf16 through the kernels and compared with the float32 reference.

Tolerances (||out - ref|| / ||ref||): float32 activations 1e-5 (every decoded weight is exact in float32;
only the summation order differs). bf16 activations 8e-3 for one matmul: the reference is given the same
bf16-rounded x, so the error is the float32 accumulation plus one rounding of the output to bf16 (relative
2^-9 per element); 1.5e-2 for a whole expert, whose gated activations are rounded to bf16 once more between
the two kernels.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from deltafin.kernels import triton as K  # noqa: E402
from deltafin.kernels.triton_moe import ACT_SILU, ACT_SITU, ExpertSlab, block_layout, grouped_glu  # noqa: E402
from deltafin.quant import int4  # noqa: E402
from deltafin.quant.record import QTensor, dequantize, from_plain  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _record(fmt: str, out: int, inp: int, g: torch.Generator) -> QTensor:
    w = torch.randn(out, inp, generator=g) * 0.1
    if fmt == "int4g32":
        p, s = int4.quantize_ref(w.numpy())
        return QTensor(fmt, (out, inp), torch.from_numpy(p), torch.from_numpy(s).to(torch.bfloat16))
    return from_plain(w, fmt)


def _linear(fmt: str):
    return {"mxfp4": K.mxfp4_linear, "int8": K.int8_linear, "int4g32": K.int4g32_linear}[fmt]


def _check_linear(fmt: str, T: int, N: int, Kd: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = _record(fmt, N, Kd, g).to(DEV)
    x = torch.randn(T, Kd, generator=g).to(DEV, dtype)
    ref = x.double() @ dequantize(w).double().T
    y = _linear(fmt)(x, w.data, w.scale)
    assert y.dtype == dtype and y.shape == (T, N)
    assert _rel(y, ref) < (1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("fmt", ["mxfp4", "int8", "int4g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_reference(fmt, dtype):
    # one token (decode, split over the input dim), odd row counts, a token count past one tile
    for i, (T, N, Kd) in enumerate(((1, 40, 96), (3, 17, 160), (20, 33, 64))):
        _check_linear(fmt, T, N, Kd, dtype, seed=i)


def test_a_bf16_prompt_takes_int8_weights_on_the_int8_tensor_cores_each_token_on_its_own():
    """Past X2_TOKENS tokens a bf16 int8 linear runs as two int8 terms per token (x = s (h + l / 254) within s / 508)
    with exact int32 sums: within the bf16 bound of the float64 product, and a token's row the same bits whatever
    other tokens share the call."""
    g = torch.Generator().manual_seed(21)
    C = K.X2_MIN_K + 32  # rows of 8 whole k-steps of 128 and a part
    w = _record("int8", 33, C, g).to(DEV)
    x = (torch.randn(K.X2_TOKENS + 6, C, generator=g) * torch.rand(K.X2_TOKENS + 6, 1, generator=g) * 5).to(
        DEV, torch.bfloat16)
    assert K.use_int8_x2(x.shape[0], C, torch.bfloat16) and not K.use_int8_x2(K.X2_TOKENS, C, torch.bfloat16)
    assert not K.use_int8_x2(x.shape[0], K.X2_MIN_K - 1, torch.bfloat16)
    h, lo, sx = K.x2_rows(x)
    back = sx.double()[:, None] * (h.double() + lo.double() / 254)
    # s / 508 at a tie of the second rounding, plus float32's rounding of x / s (~127 ulps of 1, well under 5%)
    assert ((back - x.double()).abs() <= sx.double()[:, None] / 508 * 1.05).all()
    y = K.int8_linear(x, w.data, w.scale)
    assert y.dtype == torch.bfloat16 and _rel(y, x.double() @ dequantize(w).double().T) < 8e-3
    fewer = K.int8_linear(x[3:], w.data, w.scale)  # other tokens beside each row: the same bits for it
    assert torch.equal(fewer, y[3:])


@pytest.mark.parametrize("fmt", ["mxfp4", "int8"])
def test_linear_split_k_adds_its_partials_in_the_kernel(fmt):
    """Three splits of k in one launch: the last split of a tile to land adds the float32 partials in split
    order, the same bits every call, within bf16 rounding of each split run alone and the three summed."""
    g = torch.Generator().manual_seed(5)
    w = _record(fmt, 40, 160, g).to(DEV)
    x = torch.randn(2, 160, generator=g).to(DEV, torch.bfloat16)
    cfg = {"BT": 16, "BN": 16, "BK": 32, "num_warps": 4, "num_stages": 1, "splits": 3, "k_per_split": 64}
    y = _linear(fmt)(x, w.data, w.scale, cfg)
    assert y.dtype == torch.bfloat16 and torch.equal(y, _linear(fmt)(x, w.data, w.scale, cfg))
    parts = []
    for k0 in (0, 64, 128):  # each split alone: the same tiles over its k, in float32
        xs = torch.zeros(2, 160, device=DEV)
        xs[:, k0:k0 + 64] = x[:, k0:k0 + 64].float()
        parts.append(_linear(fmt)(xs, w.data, w.scale, dict(cfg, splits=1, k_per_split=160)))
    want = (parts[0] + parts[1] + parts[2]).to(torch.bfloat16)
    assert _rel(y, want) < 8e-3 and _rel(y, x.double() @ dequantize(w).double().T) < 8e-3


def _experts(fmt: str, n: int, D: int, inter: int, g: torch.Generator) -> list[dict]:
    shapes = {"gate": (inter, D), "up": (inter, D), "down": (D, inter)}
    return [{r: _record(fmt, o, i, g).to(DEV) for r, (o, i) in shapes.items()} for _ in range(n)]


def _moe_ref(x, ids, wts, experts, act) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            w = {r: dequantize(q).double() for r, q in experts[int(ids[t, j])].items()}
            gt, up = x[t].double() @ w["gate"].T, x[t].double() @ w["up"].T
            a = (torch.nn.functional.silu(gt) * up if act == ACT_SILU
                 else 4 * torch.tanh(gt / 4) * torch.sigmoid(gt) * 25 * torch.tanh(up / 25))
            out[t] += wts[t, j].double() * (a @ w["down"].T)
    return out


@pytest.mark.parametrize("fmt,act", [("mxfp4", ACT_SITU), ("int4g32", ACT_SILU)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_reference(fmt, act, dtype):
    g = torch.Generator().manual_seed(7)
    E, T, k, D, inter = 5, 4, 3, 64, 96
    experts = _experts(fmt, E, D, inter, g)
    slab = ExpertSlab.stack(experts, DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    x = torch.randn(T, D, generator=g).to(DEV, dtype)
    y = grouped_glu(x, ids, wts, slab, act)
    assert y.dtype == dtype and y.shape == (T, D)
    assert _rel(y, _moe_ref(x, ids, wts, experts, act)) < (1e-5 if dtype == torch.float32 else 1.5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_matches_reference(dtype):
    """The decode GEMV form (1-4 tokens), whole-K and split-K, odd row counts and widths."""
    from deltafin.kernels.triton_gemv import int8_gemv, int8_gemv_config

    g = torch.Generator().manual_seed(11)
    for T, N, Kd, target, magic in ((1, 40, 96, 1, True), (2, 17, 160, 8, False), (4, 33, 1000, 16, True),
                                    (3, 5, 48, 64, True)):
        w = _record("int8", N, Kd, g).to(DEV)
        x = torch.randn(T, Kd, generator=g).to(DEV, dtype)
        cfg = int8_gemv_config(N, Kd, BN=16, BK=64, target=target, magic=magic)
        y = int8_gemv(x, w.data, w.scale, cfg)
        assert y.dtype == dtype and y.shape == (T, N)
        assert _rel(y, x.double() @ dequantize(w).double().T) < (1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("act,dtype", [(ACT_SITU, torch.float32), (ACT_SILU, torch.bfloat16),
                                       (ACT_SITU, torch.bfloat16)])
def test_grouped_gemv_matches_reference(act, dtype):
    """MXFP4 experts in the GEMV form: one program per (token, expert) pair, tokens sharing an expert."""
    from deltafin.kernels.triton_gemv import moe_gemv_config
    from deltafin.kernels.triton_moe import MoePlan

    g = torch.Generator().manual_seed(5)
    E, D, inter = 4, 64, 96
    experts = _experts("mxfp4", E, D, inter, g)
    slab = ExpertSlab.stack(experts, DEV)
    for T, k in ((1, 3), (3, 2)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        wts = torch.rand(T, k, generator=g)
        x = torch.randn(T, D, generator=g).to(DEV, dtype)
        ref = _moe_ref(x, ids, wts, experts, act)
        y = grouped_glu(x, ids, wts, slab, act, cfg=moe_gemv_config(BN=16, BK=64, decode=T % 2))
        assert y.dtype == dtype and y.shape == (T, D)
        assert _rel(y, ref) < (1e-5 if dtype == torch.float32 else 1.5e-2)
        # launch after launch the same numbers; the down kernel's own tile shape: the same sums up to their order
        # (on a GPU the reduction over BK runs across threads laid out by the tile's shape)
        cfg = moe_gemv_config(BN=16, BK=64, decode=T % 2)
        assert torch.equal(grouped_glu(x, ids, wts, slab, act, cfg=cfg), y)
        y8 = grouped_glu(x, ids, wts, slab, act, cfg=moe_gemv_config(BN=16, BK=64, decode=T % 2, BN_down=8))
        assert _rel(y8, y) < (1e-6 if dtype == torch.float32 else 1e-2)
    # the CUDA-graph runner's fixed layout: pair j alone at the head of padded block j, in routing order
    rows = torch.full((T * k, 16), -1, dtype=torch.int32)
    rows[:, 0] = torch.arange(T * k, dtype=torch.int32)
    # (float32 activations take a float decode: the default on a GPU, packed fp16 pairs, is bf16's form)
    plan = MoePlan(rows.reshape(-1).to(DEV), ids.reshape(-1).to(torch.int32).to(DEV), T, k,
                   moe_gemv_config(BN=16, BK=64, decode=1 if dtype == torch.float32 else None))
    assert _rel(grouped_glu(x, None, wts, slab, act, plan=plan), ref) < (1e-5 if dtype == torch.float32 else 1.5e-2)


def test_e2m1_gemv_decode_covers_every_byte():
    """Every packed byte under a spread of E8M0 scales: the down GEMV of unit vectors gives W back exactly."""
    from deltafin.kernels.triton_gemv import _gemv_down_kernel, pack_pairs
    from deltafin.quant import mxfp4

    g = torch.Generator().manual_seed(2)
    packed = torch.arange(256, dtype=torch.uint8).reshape(1, 8, 32)  # one slot: W [8, 64], every byte once
    scales = torch.randint(100, 150, (1, 8, 2), generator=g, dtype=torch.uint8)
    w = mxfp4.dequantize(packed[0], scales[0]).double()
    h = torch.eye(64, dtype=torch.float32, device=DEV)  # pair p multiplies unit vector p
    hp, hsc = pack_pairs(h)  # decode 2's input (exact for unit vectors: each nonzero word scales 1 to 2^13)
    for decode in (0, 1, 2) if DEV == "cuda" else (0, 1):  # decode 2 is inline PTX: GPU only
        y = torch.empty(64, 8, dtype=torch.float32, device=DEV)
        _gemv_down_kernel[(64, 1)](h, hp, hsc, torch.arange(64, dtype=torch.int32, device=DEV),
                                   torch.zeros(64, dtype=torch.int32, device=DEV), torch.ones(64, device=DEV),
                                   packed.to(DEV), scales.to(DEV), y, 256, 16, RS=1, I=64, D=8, BN=8, BK=64,
                                   DECODE=decode)
        assert torch.equal(y.double().cpu(), w.T)


def test_gemv_flags_route_decode_calls(monkeypatch):
    """With the flags on, int8 linears of <= 4 tokens and decode MoE plans take the GEMV kernels (the same
    numbers as calling them directly); more tokens keep the tensor-core kernels."""
    from deltafin.kernels import triton_gemv as G
    from deltafin.kernels.triton_moe import moe_config, plan_moe

    monkeypatch.setattr(G, "GEMV_INT8", True)
    monkeypatch.setattr(G, "GEMV_MOE", True)
    g = torch.Generator().manual_seed(3)
    w = _record("int8", 24, 64, g).to(DEV)
    x = torch.randn(2, 64, generator=g).to(DEV)
    assert torch.equal(K.int8_linear(x, w.data, w.scale), G.int8_gemv(x, w.data, w.scale))
    assert G.use_int8_gemv(4, 24, 64) and not G.use_int8_gemv(5, 24, 64)
    assert not G.use_int8_gemv(1, 12288, 7168)  # the largest trunk weights stay on the tensor-core kernel
    assert plan_moe(torch.tensor([[0, 3], [2, 1]]), DEV, 64, 32).cfg["gemv"]  # every pair its own expert
    assert "gemv" not in plan_moe(torch.tensor([[0, 3], [3, 1]]), DEV, 64, 32).cfg  # a shared expert
    assert moe_config(16, 16, 64, 32)["gemv"] and "gemv" not in moe_config(64, 16, 64, 32)
    experts = _experts("int4g32", 3, 64, 32, g)  # no GEMV form: the plan is laid out for the tensor-core kernel
    slab = ExpertSlab.stack(experts, DEV)
    ids, wts = torch.tensor([[0, 2]]), torch.rand(1, 2, generator=g)
    y = grouped_glu(x[:1], ids, wts, slab, ACT_SILU)
    assert _rel(y, _moe_ref(x[:1], ids, wts, experts, ACT_SILU)) < 1e-5


def test_slab_recognises_its_own_views():
    g = torch.Generator().manual_seed(1)
    experts = _experts("mxfp4", 3, 64, 32, g)
    slab = ExpertSlab.stack(experts, DEV)
    assert [slab.slot_of(slab.views(i)) for i in range(3)] == [0, 1, 2]
    assert slab.slot_of(experts[0]) is None  # the originals are not in the slab
    assert slab.fits(experts[1])


def test_block_layout_covers_every_pair_once():
    import numpy as np

    slots = np.array([[3, 1], [1, 0], [3, 1], [2, 1]])
    rows, blk = block_layout(slots, 2)
    assert sorted(rows[rows >= 0].tolist()) == list(range(8))
    for b, s in enumerate(blk.tolist()):  # each block holds pairs of its own slot only
        pairs = rows[b * 2:(b + 1) * 2]
        assert all(slots.reshape(-1)[p] == s for p in pairs if p >= 0)
    assert blk.tolist() == [0, 1, 1, 2, 3]  # slot 1 has 4 pairs: two blocks


@pytest.mark.parametrize("slots_max,T,k,bt", [(64, 300, 16, 16), (64, 300, 16, 128), (70000, 50, 8, 4), (5, 1, 3, 16)])
def test_block_layout_matches_a_loop_statement(slots_max, T, k, bt):
    import numpy as np

    rng = np.random.default_rng(slots_max + T)
    slots = np.stack([rng.choice(slots_max, k, replace=False) for _ in range(T)])
    rows, blk = block_layout(slots, bt)
    want_rows, want_blk = [], []
    flat = slots.reshape(-1).tolist()
    for s in sorted(set(flat)):  # each slot's pairs in pair order, cut into blocks of bt padded with -1
        pairs = [p for p, v in enumerate(flat) if v == s]
        for b0 in range(0, len(pairs), bt):
            chunk = pairs[b0:b0 + bt]
            want_rows += chunk + [-1] * (bt - len(chunk))
            want_blk.append(s)
    assert rows.tolist() == want_rows and blk.tolist() == want_blk
    assert rows.dtype == np.int32 and blk.dtype == np.int32


def test_unique_ids_and_host_ids_on_the_cpu():
    from deltafin.models.base import ids_to_host_during, unique_ids

    ids = torch.tensor([[5, 2, 9], [2, 0, 5]])
    assert unique_ids(ids) == [0, 2, 5, 9] and unique_ids(ids[:0]) == []
    host, side = ids_to_host_during(ids, lambda: "side")
    assert host is ids and side == "side"  # already on the host: nothing to copy, the side work still runs


# ---------------------------------------------------------------- on the GPU, compiled, real widths


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "int8", "int4g32"])
def test_linear_k3_widths_on_gpu(fmt):
    for i, (T, N, Kd) in enumerate(((1, 3072, 3584), (1, 1536, 7168), (64, 3584, 3072), (300, 576, 7168))):
        for dtype in (torch.float32, torch.bfloat16):
            _check_linear(fmt, T, N, Kd, dtype, seed=i)


@pytest.mark.gpu
@gpu
def test_gemv_k3_widths_on_gpu():
    """The GEMV kernels compiled at Kimi K3 widths: int8 trunk shapes at 1-4 tokens, MXFP4 experts (both
    decodes) at 1 and 4 tokens."""
    from deltafin.kernels.triton_gemv import int8_gemv, moe_gemv_config

    g = torch.Generator().manual_seed(9)
    for T, N, Kd in ((1, 12288, 7168), (4, 1536, 7168), (3, 7168, 1536), (1, 576, 7168)):
        w = _record("int8", N, Kd, g).to(DEV)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(T, Kd, generator=g).to(DEV, dtype)
            y = int8_gemv(x, w.data, w.scale)
            assert _rel(y, x.double() @ dequantize(w).double().T) < (1e-5 if dtype == torch.float32 else 8e-3)
    experts = _experts("mxfp4", 6, 3584, 3072, g)
    slab = ExpertSlab.stack(experts, DEV)
    for T in (1, 4):
        ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(T)])
        wts = torch.rand(T, 4, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(T, 3584, generator=g) * 0.5).to(DEV, dtype)
            y = grouped_glu(x, ids, wts, slab, ACT_SITU, cfg=moe_gemv_config(decode=T % 2))
            ref = _moe_ref(x, ids.to(DEV), wts.to(DEV), experts, ACT_SITU)
            assert _rel(y, ref) < (1e-5 if dtype == torch.float32 else 1.5e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe_lite", "gpt_oss",
                                    "kimi_k3"])
def test_bf16_kernels_agree_with_float32_reference(family, tmp_path, monkeypatch):
    """Teacher-forced decode of 256 tokens in float32 (the reference), in bf16 on the plain torch path and in
    bf16 through the kernels. On random tiny models many positions are near-ties that bf16 itself flips (the
    torch bf16 path too), so the kernels must (1) agree with float32 at least as often as the torch bf16 path,
    less 2 points, and (2) agree at >= 99% of the positions whose float32 top-1 margin exceeds twice the
    torch bf16 path's largest logit deviation there (where bf16 rounding cannot decide the token)."""
    from deltafin.kernels import cuda as kc
    from deltafin.models import registry
    from deltafin.models.base import ResidentExperts
    from deltafin.store.model_dir import PackedModel
    from tests.test_gpu import _pack

    if family == "kimi_k3":
        from deltafin.k3_tiny import write_tiny_k3 as build
    else:
        from deltafin.tiny import build_tiny

        def build(p):
            return build_tiny(family, p)

    pm = PackedModel.open(_pack(tmp_path, build))
    weights = {k: v.to("cuda") for k, v in pm.trunk_records().items()}
    experts = ResidentExperts({(L, e): pm.read_expert(L, e) for L in pm.moe_layers
                               for e in range(pm.num_experts)}, "cuda")
    models = {dt: registry.build(pm.family, pm.text_config, weights, "cuda", dt)
              for dt in (torch.float32, torch.bfloat16)}
    stack = getattr(models[torch.bfloat16], "stack_decode_projections", None)
    if stack is not None:  # as the engine runs bf16 on CUDA
        stack()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, models[torch.float32].vocab_size, (256,), generator=g).cuda()
    logits = {}
    for name, dt, mode in (("f32", torch.float32, "triton"), ("torch", torch.bfloat16, "torch"),
                           ("kernels", torch.bfloat16, "triton")):
        monkeypatch.setenv("DELTAFIN_KERNELS", mode)
        kc.USED.clear()
        m, st = models[dt], models[dt].new_state(300)
        logits[name] = torch.cat([m.forward(tokens[i:i + 1], st, experts).float() for i in range(256)])
    assert any(u.startswith("triton:") for u in kc.USED)
    ref = logits["f32"]
    top = ref.argmax(-1)
    agree_k = (logits["kernels"].argmax(-1) == top).float()
    agree_t = (logits["torch"].argmax(-1) == top).float()
    top2 = ref.topk(2, -1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * (logits["torch"] - ref).abs().amax(-1)
    print(f"{family}: top-1 agreement with float32: kernels {agree_k.mean():.3f}, torch bf16 {agree_t.mean():.3f}; "
          f"on {int(decided.sum())} decided positions: kernels {agree_k[decided].mean():.3f}")
    assert agree_k.mean() >= agree_t.mean() - 0.02
    if decided.any():
        assert agree_k[decided].mean() >= 0.99


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this compiled")
def test_model_wiring_through_interpreter(tmp_path, monkeypatch):
    """A tiny Kimi K3 in bf16 takes the kernel path (int8 trunk linears, grouped MXFP4 experts) and gives
    the plain bf16 torch path's logits within bf16 rounding."""
    from deltafin import k3_tiny
    from deltafin.kernels import cuda as kc
    from deltafin.models import registry
    from deltafin.models.base import ResidentExperts
    from deltafin.store.drives import parse_drives
    from deltafin.store.model_dir import PackedModel
    from deltafin.store.pack import PackOptions, pack

    k3_tiny.write_tiny_k3(tmp_path / "src", num_hidden_layers=2, mla_every=2)
    pack(str(tmp_path / "src"), str(tmp_path / "m"), parse_drives([f"{tmp_path}/d0"]), PackOptions(progress=False))
    pm = PackedModel.open(str(tmp_path / "m"))
    model = registry.build(pm.family, pm.text_config, pm.trunk_records(), "cpu", torch.bfloat16)
    experts = ResidentExperts({(L, e): pm.read_expert(L, e) for L in pm.moe_layers for e in range(pm.num_experts)})
    ids = torch.tensor([5, 17, 99])
    logits = {}
    for mode in ("torch", "interpret"):
        monkeypatch.setenv("DELTAFIN_KERNELS", mode)
        kc.USED.clear()
        logits[mode] = model.forward(ids, model.new_state(8), experts)
    assert {"triton:int8_linear", "triton:grouped_mxfp4", "triton:kda_products"} <= kc.USED
    assert _rel(logits["interpret"], logits["torch"]) < 3e-2


def test_streaming_slab_slots_never_reused_within_a_layer():
    """The streaming source's slab: cached experts take cache slots (evicting the least recent one not in
    use by the current layer), the rest scratch slots; no slot is handed out twice before the layer's
    launch, and an evicted expert's slot is reused."""
    from deltafin.runtime.cache import ExpertCache
    from deltafin.runtime.source import StreamingExperts
    from deltafin.store import expert_file as ef

    g = torch.Generator().manual_seed(3)
    ex = _experts("mxfp4", 1, 64, 32, g)[0]
    data = memoryview(bytearray(ef.encode(ex, 0, 0)))  # the expert as its file: the slab holds whole files
    layout, _, _ = ef.parse_header(data)
    nbytes = layout.file_bytes
    ex = ef.decode(data, layout)
    src = StreamingExperts.__new__(StreamingExperts)  # the slot logic alone, without drives
    src.device, src.cache, src.slab, src.SCRATCH_SLOTS = torch.device(DEV), ExpertCache(2 * nbytes), None, 2
    src._slab_cache_slots, src._free, src._slot_of, src._busy, src._scratch_next = 0, [], {}, set(), 0
    src._in_slab, src._resident, src._holds_all = {}, {}, False
    src.model = SimpleNamespace(moe_layers=[1], num_experts=1)  # a model of one expert: one cache slot
    assert src._slab_ready(ex, nbytes, layout) and src.slab.slots == 3
    src.slab, src.model = None, SimpleNamespace(moe_layers=[1, 2], num_experts=8)  # the budget decides
    assert src._slab_ready(ex, nbytes, layout) and src.slab.slots == 4
    layer0 = [src.slab.slot_of(src._to_slot(0, e, ex, nbytes, data)) for e in range(4)]
    assert sorted(layer0) == [0, 1, 2, 3]  # two cached, two scratch, all distinct
    assert len(src.cache._entries) == 2
    assert src._take_slot() == (None, False)  # everything is in use by this layer
    src._busy = set()  # the next layer: layer 0's launch is queued before any new copy
    s, cached = src._take_slot()
    assert cached and s in layer0[:2] and len(src.cache._entries) == 1  # the least recent expert made room
    for r in ("gate", "up", "down"):  # the one copy of the file put every tensor where its view reads it
        torch.testing.assert_close(src.slab.views(layer0[3])[r].data.cpu(), ex[r].data)
        torch.testing.assert_close(src.slab.views(layer0[3])[r].scale.cpu(), ex[r].scale)


def test_streaming_slab_offers_a_layer_resident_only_when_nothing_can_evict_it():
    """``resident_slots``: a layer's slot table once all its experts are cached in the slab and the slab's cache
    slots hold every expert of the model; never while some expert could be evicted, and not after one was."""
    from collections import deque

    from deltafin.runtime.cache import ExpertCache
    from deltafin.runtime.source import SourceStats, StreamingExperts
    from deltafin.store import expert_file as ef

    g = torch.Generator().manual_seed(4)
    ex = _experts("mxfp4", 1, 64, 32, g)[0]
    data = memoryview(bytearray(ef.encode(ex, 0, 0)))
    layout, _, _ = ef.parse_header(data)
    nbytes = layout.file_bytes
    ex = ef.decode(data, layout)

    def source(budget_experts: int, num_experts: int):
        src = StreamingExperts.__new__(StreamingExperts)
        src.device, src.cache, src.slab, src.SCRATCH_SLOTS = torch.device(DEV), ExpertCache(budget_experts * nbytes), \
            None, 2
        src._slab_cache_slots, src._free, src._slot_of, src._busy, src._scratch_next = 0, [], {}, set(), 0
        src._in_slab, src._resident, src.record, src.routes, src._holds_all = {}, {}, None, None, False
        src.stats, src._miss_log, src._recent_misses = SourceStats(), deque(maxlen=4), 0
        src.model = SimpleNamespace(moe_layers=[1, 2], num_experts=num_experts)
        assert src._slab_ready(ex, nbytes, layout)
        return src

    src = source(4, 2)  # room for all four experts of the model
    src._to_slot(1, 0, ex, nbytes, data)
    assert src.resident_slots(1) is None  # expert 1 of layer 1 not in yet
    src._to_slot(1, 1, ex, nbytes, data)
    table = src.resident_slots(1)
    assert table is not None and table.tolist() == [src._slot_of[(1, 0)], src._slot_of[(1, 1)]]
    assert src.resident_slots(2) is None
    src.served_resident(1, 2)
    assert src.stats.hits == 2 and src.cache.hits == 2
    src.routes = []  # the routing-trace recorder on: the host must see the ids, even of a layer made resident
    assert src.resident_slots(1) is None
    src.routes = None
    assert src.resident_slots(1) is table
    src.cache.evict((1, 0))  # (a failed check's eviction): the table goes with it
    assert src.resident_slots(1) is None
    src.record = []  # fetches logged: the host must see every layer's ids
    src._to_slot(1, 0, ex, nbytes, data)
    assert src.resident_slots(1) is None
    src.record = None
    assert src.resident_slots(1) is not None

    src = source(3, 2)  # one expert short of the model: any layer could lose one
    src._to_slot(1, 0, ex, nbytes, data)
    src._to_slot(1, 1, ex, nbytes, data)
    assert src.resident_slots(1) is None


@pytest.mark.parametrize("fmt", ["mxfp4", "int4g32"])
def test_file_slab_runs_the_grouped_kernels_as_the_tensor_slab(fmt):
    """A slab of whole expert files (strided role views, one copy an expert) gives the grouped kernels' result
    bit for bit as the per-tensor slab."""
    from deltafin.store import expert_file as ef

    g = torch.Generator().manual_seed(5)
    exs = [{r: t.to("cpu") for r, t in ex.items()} for ex in _experts(fmt, 3, 64, 64, g)]
    files = [memoryview(bytearray(ef.encode(t, 1, e))) for e, t in enumerate(exs)]
    layout, _, _ = ef.parse_header(files[0])
    by_file = ExpertSlab(3, exs[0], DEV, layout)
    for s, f in enumerate(files):
        by_file.write_file(s, torch.frombuffer(f, dtype=torch.uint8).to(DEV))
    by_tensor = ExpertSlab.stack([{k: v.to(DEV) for k, v in t.items()} for t in exs], DEV)
    gate = by_file.data["gate"]
    assert gate.stride(0) * gate.element_size() == layout.file_bytes and by_file.slot_of(by_file.views(2)) == 2
    x = torch.randn(2, 64, generator=g).to(DEV)
    slots, w = torch.tensor([[0, 2], [1, 0]]), torch.rand(2, 2, generator=g).to(DEV)
    ys = [grouped_glu(x, slots, w, slab) for slab in (by_file, by_tensor)]
    assert torch.equal(ys[0], ys[1])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs the interpreter on the CPU")
def test_gemv_bench_smoke(tmp_path):
    """``kernels_cuda --gemv`` at tiny widths: every configuration checked against the reference and timed,
    the summary names the copy-rate limit."""
    import json

    from deltafin.bench import kernels_cuda, kernels_gemv

    out = tmp_path / "gemv.json"
    assert kernels_cuda.main(["--smoke", "--gemv", "--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for name in ("gemv_int8", "gemv_moe"):
        assert res[name] and all(r.get("ok") for r in res[name]), res[name]
        assert {r["kernel"] for r in res[name]} >= {"tensor-core", "gemv"}
    lines = kernels_gemv.summary(res, res["copy_GBps"])
    assert "copy" in lines[0] and any(line.startswith("int8 T=1 default") for line in lines)


@pytest.mark.gpu
@gpu
def test_grouped_f16_prefill_k3_widths_on_gpu():
    """The fp16 tensor-core launches (triton_moe.MXFP4_F16) at Kimi K3 widths and prefill sizes (both block
    configs), against the float64 reference and against the scaled-dot kernel they replace; weights whose
    block scales spread over 2^-20..2^4 and activations from 1e-4 to 1e3 stay within bf16's bound."""
    from deltafin.kernels import triton_moe as M

    g = torch.Generator().manual_seed(11)
    experts = _experts("mxfp4", 8, 3584, 3072, g)
    for e in experts[:3]:  # scales spread: E8M0 107..131
        for r in e.values():
            r.scale.copy_(torch.randint(107, 132, r.scale.shape, generator=g, dtype=torch.uint8))
    slab = ExpertSlab.stack(experts, DEV)
    for T in (300, 1200):
        ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(T)])
        wts = torch.rand(T, 4, generator=g)
        x = torch.randn(T, 3584, generator=g) * torch.logspace(-4, 3, T)[:, None]
        x = x.to(DEV, torch.bfloat16)
        ref = _moe_ref(x, ids.to(DEV), wts.to(DEV), experts, ACT_SITU)
        y = grouped_glu(x, ids, wts, slab, ACT_SITU, cfg=dict(M.moe_config(T * 4, 8, 3584, 3072), f16=True))
        y_old = grouped_glu(x, ids, wts, slab, ACT_SITU, cfg=dict(M.moe_config(T * 4, 8, 3584, 3072), f16=False))
        rows = [(y[t:t + 1], ref[t:t + 1], y_old[t:t + 1]) for t in (0, T // 2, T - 1)]
        assert _rel(y, ref) < 1.5e-2
        for a, b, c in rows:  # row by row: each activation scale on its own
            assert _rel(a, b) <= max(1.5e-2, 1.5 * _rel(c, b))


def test_fp16_rows_scales_by_powers_of_two():
    from deltafin.kernels.triton_moe import fp16_rows

    x = torch.tensor([[3e4, -1.0, 0.5], [0.0, 0.0, 0.0], [1e-6, -2e-6, 0.0]])
    x16, inv = fp16_rows(x)
    assert x16.dtype == torch.float16 and torch.isfinite(x16.float()).all()
    assert torch.all(torch.log2(inv) == torch.round(torch.log2(inv)))  # exact powers of two
    big = x16.float().abs().amax(-1)
    assert torch.all((big[[0, 2]] >= 2**13) & (big[[0, 2]] < 2**14)) and inv[1] == 1.0
    torch.testing.assert_close(x16.float() * inv[:, None], x, rtol=2**-11, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs the interpreter on the CPU")
def test_k3_slice_smoke_decodes_deep_in_a_context(capsys):
    """The slice benchmark's --context: a state that deep (latent caches filled), decode timed beside the default
    context's (tiny widths on the CPU: this checks the script, not speed)."""
    from deltafin.bench import k3_slice_gpu

    assert k3_slice_gpu.main(["--smoke", "--layers", "5", "--experts", "8", "--tokens", "1", "--prefill",
                              "--torch-steps", "1", "--context", "40"]) == 0
    out = capsys.readouterr().out
    assert "decode 40 tokens deep (CUDA graphs, 4096-row caches)" in out and "tok/s of math, beside" in out
