"""DeepSeek-V3 family (deepseek_v3, glm4_moe_lite) and gpt-oss against Hugging Face on tiny random models:
greedy tokens, prompt logits, default codecs, arrival order, chunked prefill, and the latent cache."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from deltafin.models import deepseek_v3, gpt_oss, layers, mla
from deltafin.models.base import ResidentExperts
from deltafin.models.layers import GrowingCache
from deltafin.quant.record import dequantize
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from tests.tiny import build_tiny

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
LOSSLESS = PackOptions(experts="bf16", trunk="bf16", progress=False)
DEFAULT = PackOptions(progress=False)  # int8 trunk, MXFP4 experts
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)
CASES = [
    pytest.param("deepseek_v3", {}, id="deepseek_v3"),
    pytest.param(
        "deepseek_v3", {"rope_parameters": YARN, "n_group": 4, "topk_group": 2}, id="deepseek_v3-yarn-groups"
    ),
    pytest.param(
        "deepseek_v3",
        {"rope_interleave": False, "q_lora_rank": None, "norm_topk_prob": False},
        id="deepseek_v3-halves-noqlora",
    ),
    pytest.param("glm4_moe_lite", {}, id="glm4_moe_lite"),
    pytest.param("gpt_oss", {}, id="gpt_oss"),
]


def family(model_type: str):
    return gpt_oss if model_type == "gpt_oss" else deepseek_v3


def build_and_pack(tmp_path, model_type: str, opts: PackOptions = LOSSLESS, **overrides):
    src, out = tmp_path / "src", tmp_path / "packed"
    hf = build_tiny(model_type, src, **overrides)
    drives = parse_drives([f"{tmp_path / 'd0'}=3", f"{tmp_path / 'd1'}=3"])  # given rates: no read probe
    pack(str(src), str(out), drives, opts)
    return hf, PackedModel.open(str(out))


def load(pm: PackedModel):
    fam = family(pm.text_config["model_type"])
    model = fam.Model(fam.Config.from_dict(pm.text_config), pm.trunk_records())
    experts = ResidentExperts(
        {(L, e): pm.read_expert(L, e) for L in pm.moe_layers for e in range(pm.num_experts)}
    )
    return model, experts


def prompt(n: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model, experts, ids: torch.Tensor, n: int = NEW_TOKENS) -> tuple[torch.Tensor, list[int]]:
    state = model.new_state(128)
    first = model.forward(ids, state, experts)  # [T, V]
    tokens = [int(first[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(model.forward(torch.tensor([tokens[-1]]), state, experts)[-1].argmax()))
    assert state.pos == len(ids) + n - 1
    return first, tokens


@torch.no_grad()
def hf_greedy(hf, ids: torch.Tensor, n: int = NEW_TOKENS) -> tuple[torch.Tensor, list[int]]:
    logits = hf(ids[None]).logits[0].float()
    out = hf.generate(ids[None], max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return logits, out[0, len(ids) :].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("model_type, overrides", CASES)
def test_matches_hugging_face(tmp_path, model_type, overrides):
    hf, pm = build_and_pack(tmp_path, model_type, **overrides)
    model, experts = load(pm)
    ids = prompt()
    logits, tokens = greedy(model, experts, ids)
    ref_logits, ref_tokens = hf_greedy(hf, ids)
    assert rel_err(logits, ref_logits) < 1e-4
    assert tokens == ref_tokens


def _hf_state_from_pack(hf, pm: PackedModel) -> dict[str, torch.Tensor]:
    """The packed (dequantized) weights under transformers' in-memory names (experts fused per layer)."""
    sd = {n: dequantize(t) for n, t in pm.trunk_records().items()}
    oss = pm.family == "gpt_oss"
    for L in pm.moe_layers:
        ex = [{r: dequantize(t) for r, t in pm.read_expert(L, e).items()} for e in range(pm.num_experts)]
        p = f"model.layers.{L}.mlp.experts."
        if oss:  # transformers keeps gpt-oss experts as [E, in, out]
            sd[p + "gate_up_proj"] = torch.stack([x["gate_up"].T for x in ex])
            sd[p + "gate_up_proj_bias"] = torch.stack([x["gate_up_bias"] for x in ex])
            sd[p + "down_proj"] = torch.stack([x["down"].T for x in ex])
            sd[p + "down_proj_bias"] = torch.stack([x["down_bias"] for x in ex])
        else:  # DeepSeek: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]
            sd[p + "gate_up_proj"] = torch.stack([torch.cat((x["gate"], x["up"])) for x in ex])
            sd[p + "down_proj"] = torch.stack([x["down"] for x in ex])
    ref = hf.state_dict()
    assert set(sd) == set(ref), set(sd) ^ set(ref)
    assert all(sd[n].shape == ref[n].shape for n in ref)
    return sd


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite", "gpt_oss"])
def test_default_codecs_match_hugging_face_on_dequantized_weights(tmp_path, model_type):
    hf, pm = build_and_pack(tmp_path, model_type, DEFAULT)
    trunk = pm.trunk_records()
    assert trunk["model.embed_tokens.weight"].format == "int8"
    assert pm.read_expert(pm.moe_layers[0], 0)["down"].format == "mxfp4"
    hf.load_state_dict(_hf_state_from_pack(hf, pm), strict=True)
    model, experts = load(pm)
    ids = prompt()
    logits, tokens = greedy(model, experts, ids)
    ref_logits, ref_tokens = hf_greedy(hf, ids)
    assert tokens == ref_tokens
    assert rel_err(logits, ref_logits) < 1e-4


class Reversed:
    def __init__(self, inner: ResidentExperts):
        self.inner = inner

    def fetch(self, layer, expert_ids):
        return reversed(list(self.inner.fetch(layer, expert_ids)))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
def test_arrival_order_does_not_change_logits(tmp_path, model_type):
    _, pm = build_and_pack(tmp_path, model_type)
    model, experts = load(pm)
    ids = prompt(9)
    a, b = model.new_state(32), model.new_state(32)
    with torch.no_grad():
        for chunk in (ids, ids[:1], ids[1:2]):
            assert torch.equal(model.forward(chunk, a, experts), model.forward(chunk, b, Reversed(experts)))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite", "gpt_oss"])
def test_chunked_prefill_matches_one_shot(tmp_path, model_type):
    _, pm = build_and_pack(tmp_path, model_type)
    model, experts = load(pm)
    ids = prompt(12)
    one, two = model.new_state(32), model.new_state(32)
    with torch.no_grad():
        full = model.forward(ids, one, experts)
        model.forward(ids[:5], two, experts)
        tail = model.forward(ids[5:], two, experts)
        assert rel_err(tail, full[5:]) < 1e-5
        nxt = ids[-1:]
        assert rel_err(model.forward(nxt, two, experts), model.forward(nxt, one, experts)) < 1e-5


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite"])
def test_mla_cache_holds_only_latent_and_rope_key(tmp_path, model_type):
    _, pm = build_and_pack(tmp_path, model_type)
    model, experts = load(pm)
    c = model.cfg
    state = model.new_state(64)
    with torch.no_grad():
        model.forward(prompt(), state, experts)
        model.forward(prompt(1), state, experts)
    assert len(state.layers) == c.num_hidden_layers
    for cache in state.layers:
        assert isinstance(cache, GrowingCache)
        assert cache.buf.shape[1:] == (c.kv_lora_rank + c.qk_rope_head_dim,)
        assert cache.rows().shape == (8, c.kv_lora_rank + c.qk_rope_head_dim)
        tensors = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
        assert sum(t.numel() for t in tensors) == cache.capacity * (c.kv_lora_rank + c.qk_rope_head_dim)


def test_mla_absorbed_and_expanded_agree(tmp_path, monkeypatch):
    _, pm = build_and_pack(tmp_path, "deepseek_v3", rope_parameters=YARN)
    model, experts = load(pm)
    ids = prompt(40)  # long enough that "auto" expands the prefill and absorbs the decode
    out = {}
    for prefill_mode, decode_mode in (
        ("absorb", "absorb"),
        ("expand", "expand"),
        ("auto", "auto"),
        ("expand", "absorb"),
    ):
        state = model.new_state(64)
        with torch.no_grad():
            model.mla_mode = prefill_mode
            first = model.forward(ids, state, experts)
            model.mla_mode = decode_mode
            out[prefill_mode, decode_mode] = torch.cat([first, model.forward(ids[:1], state, experts)])
    assert rel_err(out["absorb", "absorb"], out["expand", "expand"]) < 1e-5
    assert torch.equal(out["auto", "auto"], out["expand", "absorb"])
    model.mla_mode = "auto"
    assert not model._absorb(40, 40) and model._absorb(1, 41)
    monkeypatch.setattr(mla, "EXPAND_BUDGET", 0)  # too long a context to expand: absorb whatever T
    assert model._absorb(40, 40)


def test_gpt_oss_sliding_window_matters(tmp_path):
    hf, pm = build_and_pack(tmp_path, "gpt_oss")
    model, experts = load(pm)
    assert model.cfg.layer_types[0] == "sliding_attention" and model.cfg.sliding_window == 4
    ids = prompt(9)
    logits, _ = greedy(model, experts, ids, 1)
    full = gpt_oss.Model(
        dataclasses.replace(model.cfg, layer_types=("full_attention",) * 2), pm.trunk_records()
    )
    no_window, _ = greedy(full, experts, ids, 1)
    assert rel_err(logits, hf_greedy(hf, ids, 1)[0]) < 1e-4
    assert rel_err(no_window[5:], logits[5:]) > 1e-3  # beyond the window the two differ
    assert rel_err(no_window[:4], logits[:4]) < 1e-6  # within it they agree


def test_growing_cache_doubles_and_keeps_rows():
    cache = GrowingCache((3,), max_len=20, device="cpu", dtype=torch.float32, initial=2)
    rows = torch.randn(20, 3)
    for t in range(0, 18, 3):
        cache.write(t, rows[t : t + 3])
    assert cache.capacity == 20 and torch.equal(cache.rows(), rows[:18])
    cache.write(4, rows[4:6])  # rewind: rows after 6 are dropped
    assert cache.length == 6
    with pytest.raises(AssertionError):
        cache.write(6, rows[:15])


KIMI_K2 = {  # the fields of moonshotai/Kimi-K2-Instruct's config.json that matter here, plus unknown ones
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 32.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "quantization_config": {"quant_method": "compressed-tensors"},
    "auto_map": {},
}


def _hf_rope(hf_config) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]](hf_config)


def test_kimi_k2_config_and_yarn_match_transformers():
    cfg = deepseek_v3.Config.from_dict(KIMI_K2)
    assert (cfg.model_type, cfg.rope.kind, cfg.rope.factor, cfg.rope.theta) == (
        "kimi_k2",
        "yarn",
        32.0,
        50000.0,
    )
    assert cfg.is_moe(1) and not cfg.is_moe(0)
    m = 0.1 * math.log(32.0) + 1.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * m * m)
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in KIMI_K2.items() if k != "model_type"})
    inv_freq, factor = _hf_rope(hf_cfg)
    assert torch.equal(cfg.rope.inv_freq(), inv_freq) and cfg.rope.cos_sin_factor == pytest.approx(factor)


def test_gpt_oss_config_and_yarn_match_transformers():
    d = {
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "experts_per_token": 4,
        "sliding_window": 128,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "swiglu_limit": 7.0,
        "max_position_embeddings": 131072,
        "unknown_key": 1,
    }
    cfg = gpt_oss.Config.from_dict(d)
    assert cfg.num_experts_per_tok == 4 and cfg.window(0) == 128 and cfg.window(1) is None
    hf_cfg = transformers.GptOssConfig(
        **{k: v for k, v in d.items() if k not in ("model_type", "unknown_key")}
    )
    inv_freq, factor = _hf_rope(hf_cfg)
    assert torch.equal(cfg.rope.inv_freq(), inv_freq) and cfg.rope.cos_sin_factor == pytest.approx(factor)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
def test_query_blocks_do_not_change_logits(tmp_path, monkeypatch, model_type):
    _, pm = build_and_pack(tmp_path, model_type)
    model, experts = load(pm)
    ids = prompt(12)
    with torch.no_grad():
        whole = model.forward(ids, model.new_state(16), experts)
        monkeypatch.setattr(layers, "SCORE_BUDGET", 1)  # one query per block
        blocked = model.forward(ids, model.new_state(16), experts)
    assert rel_err(blocked, whole) < 1e-6
