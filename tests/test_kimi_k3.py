"""Kimi K3: KDA and MLA against transformers' kimi_linear, chunked prefill against token-by-token decode,
MXFP4 experts against the reference codec, and the tiny K3-shaped checkpoint packed and run end to end."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from deltafin.k3_tiny import tiny_config, tiny_tensors, write_tiny_k3
from deltafin.models import kda
from deltafin.models.base import ResidentExperts
from deltafin.models.kimi_k3 import Carry, Config, Model, attn_res_mix, situ_glu
from deltafin.quant import mxfp4
from deltafin.quant.record import QTensor
from deltafin.store.drives import parse_drives
from deltafin.store.families import FAMILIES, ExpertPart, Skip
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack

PROMPT = [5, 17, 200, 33, 9, 120, 64, 2, 250, 77, 31, 8, 190, 45]
NEW = 32
CHUNK = 8  # small KDA chunks so prompts span several, the last one partial
_FMT = {torch.bfloat16: "bf16", torch.float32: "f32"}


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- helpers


def checkpoint_records(config: dict, seed: int = 0) -> tuple[dict[str, QTensor], dict[tuple[int, int], dict]]:
    """The tiny checkpoint's tensors as records, named through the kimi_k3 family (no packing)."""
    fam, trunk, parts = FAMILIES["kimi_k3"], {}, {}
    for tensors in tiny_tensors(config, seed).values():
        for name, t in tensors.items():
            part = fam.classify(name)
            if isinstance(part, ExpertPart):
                parts.setdefault((part.layer, part.expert), {}).setdefault(part.role, {})[part.kind] = t
            elif not isinstance(part, Skip):
                trunk[part] = QTensor(_FMT[t.dtype], tuple(t.shape), t)
    experts = {
        key: {r: QTensor("mxfp4", (k["weight_packed"].shape[0], k["weight_packed"].shape[1] * 2),
                         k["weight_packed"], k["weight_scale"]) for r, k in roles.items()}
        for key, roles in parts.items()
    }
    return trunk, experts


def f32(t: torch.Tensor) -> QTensor:
    t = t.detach().float().contiguous()
    return QTensor("f32", tuple(t.shape), t)


class _DiskReversed:
    """Streams every expert from its file on each request, yielding in reverse order."""

    def __init__(self, pm: PackedModel):
        self.pm = pm

    def fetch(self, layer, ids):
        for e in reversed(list(ids)):
            yield e, self.pm.read_expert(layer, e)


def _hf():
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _hf_config(**kw):
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-5,
        linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "kda_layers": [1],
                            "full_attn_layers": [2]},
        num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128, n_group=1,
        topk_group=1, routed_scaling_factor=1.0, pad_token_id=None, bos_token_id=None, eos_token_id=None, **kw,
    )
    cfg._attn_implementation = "eager"
    return cfg


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_((torch.rand(p.shape, generator=g) * 15 + 1).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 5 - 4)
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _tiny_model(**cfg_changes) -> tuple[dict[str, QTensor], dict, Config]:
    config = tiny_config()
    trunk, experts = checkpoint_records(config)
    cfg = dataclasses.replace(Config.from_dict(config), **cfg_changes)
    return trunk, experts, cfg


def _decode_each(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[t : t + 1], t) for t in range(x.shape[0])])


# ---------------------------------------------------------------------------- (a) against transformers


def test_kda_kernels_match_transformers():
    """Our recurrence and WY chunked form vs kimi_linear's torch recurrent/chunk KDA on the same inputs."""
    hf = _hf()
    g0 = torch.Generator().manual_seed(1)
    T, H, K = 37, 2, 32
    q, k, v = (torch.randn(T, H, K, generator=g0) for _ in range(3))
    g = kda.lower_bound_gate(2 * torch.randn(T, H, K, generator=g0), (torch.rand(H, generator=g0) * 15 + 1).log(), -5.0)
    beta = torch.rand(T, H, generator=g0)
    S0 = 0.1 * torch.randn(H, K, K, generator=g0)
    qn, kn = kda.l2norm(q) * K**-0.5, kda.l2norm(k)
    o_rec, s_rec = kda.recurrent(qn, kn, v, g, beta, S0)
    o_chk, s_chk = kda.chunked(qn, kn, v, g, beta, S0, chunk=CHUNK)
    args = (q[None], k[None], v[None], g[None], beta[None])
    o_hr, s_hr = hf.recurrent_kimi_delta_attention(*args, S0[None], True, use_qk_l2norm_in_kernel=True)
    o_hc, s_hc = hf.chunk_kimi_delta_attention(*args, chunk_size=16, initial_state=S0[None], output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    for o, s in ((o_rec, s_rec), (o_chk, s_chk)):
        for o_ref, s_ref in ((o_hr[0], s_hr[0]), (o_hc[0], s_hc[0])):
            assert (o - o_ref).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5
    assert (o_rec - o_chk).abs().max() < 1e-5 and (s_rec - s_chk).abs().max() < 1e-5


def _hf_kda_with_k3_gate(hf, seed: int):
    """kimi_linear's KDA layer with its softplus forget gate swapped for K3's lower-bound form (§3.1 step 5);
    everything else (projections, conv, l2norm, chunk KDA, gated norm, o_proj) is transformers' code."""
    layer = hf.KimiLinearDeltaAttention(_hf_config(), 0)
    _randomise(layer, seed)
    fg = layer.forget_gate

    class K3Gate(torch.nn.Module):
        def forward(self, x):
            z = (fg.f_b_proj(fg.f_a_proj(x)).float() + fg.dt_bias).view(*x.shape[:2], -1, fg.head_dim)
            return -5.0 * torch.sigmoid(fg.A_log.float().exp() * z)

    layer.forget_gate = K3Gate()
    return layer, fg


def test_kda_layer_matches_transformers():
    hf = _hf()
    layer, fg = _hf_kda_with_k3_gate(hf, seed=2)
    trunk, experts, cfg = _tiny_model()
    pre = "model.layers.1.self_attn."
    a_log = torch.zeros(128)
    a_log[:2] = fg.A_log.detach().flatten()  # stored zero-padded like the checkpoint
    qc, kc, vc = layer.conv1d.weight.chunk(3, 0)
    trunk.update({
        pre + "q_proj.weight": f32(layer.q_proj.weight), pre + "k_proj.weight": f32(layer.k_proj.weight),
        pre + "v_proj.weight": f32(layer.v_proj.weight), pre + "q_conv1d.weight": f32(qc),
        pre + "k_conv1d.weight": f32(kc), pre + "v_conv1d.weight": f32(vc),
        pre + "f_a_proj.weight": f32(fg.f_a_proj.weight), pre + "f_b_proj.weight": f32(fg.f_b_proj.weight),
        pre + "A_log": f32(a_log), pre + "dt_bias": f32(fg.dt_bias), pre + "b_proj.weight": f32(layer.b_proj.weight),
        # K3's gate is full rank: the product of kimi_linear's low-rank pair
        pre + "g_proj.weight": f32(layer.g_b_proj.weight @ layer.g_a_proj.weight),
        pre + "o_norm.weight": f32(layer.o_norm.weight), pre + "o_proj.weight": f32(layer.o_proj.weight),
    })
    m = Model(cfg, trunk)
    m.kda_chunk = CHUNK
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = layer(x[None])[0]
    new = lambda: kda.KDAState.zeros(2, 32, 32, 4)  # noqa: E731
    prefill = m._kda(pre, x, new())
    st = new()
    decode = _decode_each(lambda xt, t: m._kda(pre, xt, st), x)
    scale = ref.abs().max()
    assert (prefill - ref).abs().max() / scale < 1e-5
    assert (decode - ref).abs().max() / scale < 1e-5


def test_mla_matches_transformers():
    """Gated MLA with its gate off vs kimi_linear's MLA (NoPE, shared un-rotated k_pe, q_a/kv_a norm eps 1e-6):
    our expanded prefill and absorbed token-by-token decode against transformers' full causal pass."""
    hf = _hf()
    attn = hf.KimiLinearAttention(_hf_config(), 1)
    _randomise(attn, seed=4)
    trunk, experts, cfg = _tiny_model(mla_use_output_gate=False)
    pre = "model.layers.3.self_attn."
    for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        trunk[pre + n + ".weight"] = f32(getattr(attn, n).weight)
    m = Model(cfg, trunk)
    T = 19
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(5))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = attn(x[None], mask)[0][0]
    prefill = m._mla(pre, x, m.new_state(T).layers[3], 0)
    cache = m.new_state(T).layers[3]
    decode = _decode_each(lambda xt, t: m._mla(pre, xt, cache, t), x)
    scale = ref.abs().max()  # 2e-6 also tells the eps apart: 1e-5 would put prefill ~7e-6 off
    assert (prefill - ref).abs().max() / scale < 2e-6
    assert (decode - ref).abs().max() / scale < 2e-6


def test_router_matches_transformers():
    """Sigmoid router, correction bias for selection only, renormalised top-k vs kimi_linear's router (1 group)."""
    hf = _hf()
    router = hf.KimiLinearTopkRouter(_hf_config())
    trunk, experts, cfg = _tiny_model()
    pre = "model.layers.1.block_sparse_moe.gate."
    with torch.no_grad():
        router.weight.copy_(trunk[pre + "weight"].data.float())
        router.e_score_correction_bias.copy_(trunk[pre + "e_score_correction_bias"].data)
    m = Model(cfg, trunk)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    ids, w = m._router(1, x)  # the router on its (already normed) input, as transformers' router
    _, w_ref, ids_ref = router(x)
    o, o_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(o.values, o_ref.values)
    assert (w.gather(1, o.indices) - w_ref.gather(1, o_ref.indices)).abs().max() < 1e-6
    assert m.route(0, x) is None  # layer 0 is dense


# ---------------------------------------------------------------------------- the packed tiny K3


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3")
    write_tiny_k3(root / "src")
    drives = parse_drives([f"{root}/d0=5", f"{root}/d1=3"])  # rates given: no probe
    summary = pack(str(root / "src"), str(root / "out"), drives, PackOptions(progress=False))
    return root, summary, PackedModel.open(str(root / "out"))


@pytest.fixture(scope="module")
def model(packed):
    _, _, pm = packed
    m = Model(Config.from_dict(pm.text_config), pm.trunk_records())
    m.kda_chunk = CHUNK
    experts = ResidentExperts({(L, e): pm.read_expert(L, e) for L in pm.moe_layers for e in range(pm.num_experts)})
    return m, experts


def _greedy(m: Model, experts, prefill: bool) -> tuple[list[int], torch.Tensor]:
    """Greedy NEW tokens after PROMPT: the prompt in one forward (chunked KDA) or one token at a time."""
    st = m.new_state(len(PROMPT) + NEW)
    if prefill:
        last = m.forward(torch.tensor(PROMPT), st, experts)[-1]
    else:
        for t in PROMPT:
            last = m.forward(torch.tensor([t]), st, experts)[-1]
    toks, steps = [], []
    for _ in range(NEW):
        steps.append(last)
        toks.append(int(last.argmax()))
        last = m.forward(torch.tensor(toks[-1:]), st, experts)[-1]
    return toks, torch.stack(steps)


@pytest.fixture(scope="module")
def generations(model):
    m, experts = model
    return {"prefill": _greedy(m, experts, True), "decode": _greedy(m, experts, False)}


def test_tiny_k3_packs(packed):
    """Vision skipped, 12 MoE layers x 8 experts, released MXFP4 bytes copied unchanged, int8 trunk."""
    root, summary, pm = packed
    src = tiny_tensors(tiny_config())
    flat = {k: t for shard in src.values() for k, t in shard.items()}
    assert summary.expert_files == 12 * 8 and pm.moe_layers == list(range(1, 13))
    assert pm.doc["skipped"] == 4  # 2 vision_tower + 2 mm_projector tensors
    for L, e in ((1, 0), (7, 5), (12, 7)):
        got = pm.read_expert(L, e)
        for role, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            pre = f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w}."
            assert got[role].format == "mxfp4"
            assert torch.equal(got[role].data, flat[pre + "weight_packed"])
            assert torch.equal(got[role].scale, flat[pre + "weight_scale"])
    recs = pm.trunk_records()
    assert recs["model.layers.1.self_attn.q_proj.weight"].format == "int8"
    assert recs["model.layers.1.self_attn.A_log"].shape == (128,)
    assert recs["model.layers.1.block_sparse_moe.gate.weight"].format == "bf16"  # the router stays exact
    assert not any(n.startswith(("vision_tower", "mm_projector", "language_model")) for n in recs)


def test_tiny_k3_generates_end_to_end(generations):
    toks, steps = generations["prefill"]
    assert len(toks) == NEW and all(0 <= t < 256 for t in toks)
    assert len(set(toks)) > 4  # a random model that still varies its output
    assert torch.isfinite(steps).all()


def test_prefill_equals_decode(model, generations):
    """Chunked prefill vs token-by-token decode: identical greedy tokens, logits within float32 noise; and one
    prefill over the whole generated sequence reproduces every decode step's logits."""
    m, experts = model
    toks_p, steps_p = generations["prefill"]
    toks_d, steps_d = generations["decode"]
    assert toks_p == toks_d
    scale = steps_d.abs().max()  # 13 layers of float32 rounding: measured ~5e-6 relative
    assert (steps_p - steps_d).abs().max() / scale < 3e-5
    full = m.forward(torch.tensor(PROMPT + toks_d[:-1]), m.new_state(len(PROMPT) + NEW), experts)
    assert (full[len(PROMPT) - 1 :] - steps_d).abs().max() / scale < 3e-5


def test_mxfp4_expert_matches_reference_codec(model, packed):
    """The routed expert on MXFP4 records vs a float32 numpy expert built on mxfp4.dequantize_ref."""
    m, _ = model
    _, _, pm = packed
    t = pm.read_expert(5, 3)
    z = torch.randn(6, 32, generator=torch.Generator().manual_seed(7))
    got = m._expert(z, t).numpy()
    W = {r: mxfp4.dequantize_ref(t[r].data.numpy(), t[r].scale.numpy()) for r in ("gate", "up", "down")}
    zn = z.numpy()
    g, u = zn @ W["gate"].T, zn @ W["up"].T
    sig = 1 / (1 + np.exp(-g))
    act = (4 * np.tanh(g / 4) * sig * (25 * np.tanh(u / 25))).astype(np.float32)
    ref = act @ W["down"].T
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-6


def test_streaming_order_does_not_change_logits(model, packed):
    """Experts read from their files on every request and yielded in reverse order: bit-identical logits."""
    m, resident = model
    _, _, pm = packed
    ids = torch.tensor(PROMPT[:12])
    a, b = m.new_state(16), m.new_state(16)
    assert torch.equal(m.forward(ids, a, resident), m.forward(ids, b, _DiskReversed(pm)))
    nxt = torch.tensor([42])
    assert torch.equal(m.forward(nxt, a, resident), m.forward(nxt, b, _DiskReversed(pm)))


def test_carries_concatenate_across_sequences(model):
    """Token-wise parts on the concatenation of two sequences' carries equal running them apart."""
    m, experts = model
    seqs = [torch.tensor(PROMPT[:5]), torch.tensor(PROMPT[5:12])]
    states = [m.new_state(8) for _ in seqs]
    carries = [m.embed(s) for s in seqs]
    for i in range(m.num_layers):
        carries = [m.attn_part(i, c, st) for c, st in zip(carries, states, strict=True)]
        joint = m.mlp_part(i, Carry.cat(carries), experts).split([5, 7])
        apart = [m.mlp_part(i, c, experts) for c in carries]
        for j, a in zip(joint, apart, strict=True):
            assert len(j.blocks) == len(a.blocks) == i // 4 + 1
            assert (j.p - a.p).abs().max() < 1e-5 * a.p.abs().max()
        carries = apart
    assert m.head(Carry.cat(carries)).shape == (12, 256)


# ---------------------------------------------------------------------------- AttnRes and SiTU by hand


def test_attn_res_mix_hand_computed():
    """Two snapshots plus the partial sum, two tokens, D = 2, worked out with scalar arithmetic."""
    b0 = [[3.0, 4.0], [1.0, -1.0]]
    b1 = [[0.5, 0.0], [2.0, 2.0]]
    p = [[1.0, 0.0], [-1.0, 3.0]]
    w_norm, w_proj, eps = [2.0, 1.0], [0.25, -1.0], 1e-5
    w = [a * b for a, b in zip(w_norm, w_proj, strict=True)]
    expected = []
    for t in range(2):
        entries = [b0[t], b1[t], p[t]]
        scores = []
        for v in entries:
            r = math.sqrt((v[0] ** 2 + v[1] ** 2) / 2 + eps)
            scores.append(v[0] / r * w[0] + v[1] / r * w[1])
        e = [math.exp(s) for s in scores]
        pi = [x / sum(e) for x in e]
        expected.append([sum(pi[j] * entries[j][i] for j in range(3)) for i in range(2)])
    got = attn_res_mix(torch.tensor(p), [torch.tensor(b0), torch.tensor(b1)], torch.tensor(w), eps)
    assert torch.allclose(got, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_situ_glu_hand_computed():
    g, u = 3.0, 40.0
    expected = 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)
    got = situ_glu(torch.tensor([g]), torch.tensor([u]), 4.0, 25.0)
    assert abs(got.item() - expected) < 1e-5 * abs(expected)
