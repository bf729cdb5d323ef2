"""Qwen3-MoE, Mixtral and OLMoE against the Hugging Face reference: tiny random models, packed, decoded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deltafin.errors import UnsupportedArchitectureError
from deltafin.models import layers, mixtral, olmoe, qwen3_moe
from deltafin.models.base import ResidentExperts
from deltafin.models.layers import KVCache
from deltafin.models.rope import Rope, rope_frequencies, rope_parameters
from deltafin.quant.record import dequantize
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from tests.tiny import build_tiny

MODULES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "olmoe": olmoe}
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}
# case -> (model_type, overrides for build_tiny)
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-yarn-dense": (
        "qwen3_moe",
        {"rope_parameters": YARN, "max_position_embeddings": 64, "mlp_only_layers": [1]},
    ),
    "mixtral": ("mixtral", {}),
    "mixtral-window": ("mixtral", {"sliding_window": 5}),
    "olmoe": ("olmoe", {}),
    "olmoe-clip-norm": ("olmoe", {"clip_qkv": 1.5, "norm_topk_prob": True}),
}
PROMPT_LEN, NEW_TOKENS = 7, 32
# role -> checkpoint sub-name, to write dequantized experts back under their Hugging Face names
CKPT_ROLES = {
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "olmoe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}


class _Built:
    def __init__(self, root: Path, case: str):
        self.model_type, overrides = CASES[case]
        self.root = root
        self.src = root / "src"
        self.hf = build_tiny(self.model_type, self.src, **overrides)
        self._packed: dict[str, Path] = {}

    def packed(self, codecs: str) -> Path:
        """codecs: 'bf16' (lossless for these weights) or 'default' (int8 trunk, MXFP4 experts)."""
        if codecs not in self._packed:
            opts = (
                PackOptions(experts="bf16", trunk="bf16", progress=False)
                if codecs == "bf16"
                else PackOptions(progress=False)
            )
            out = self.root / f"out-{codecs}"
            drives = parse_drives([f"{self.root / f'{codecs}-d0'}=2.0", f"{self.root / f'{codecs}-d1'}=2.0"])
            pack(str(self.src), str(out), drives, opts)  # rates given: no read probe on the test's tmp dir
            self._packed[codecs] = out
        return self._packed[codecs]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, _Built] = {}

    def get(case: str) -> _Built:
        if case not in cache:
            cache[case] = _Built(tmp_path_factory.mktemp(case), case)
        return cache[case]

    return get


def load(out: Path):
    pm = PackedModel.open(str(out))
    experts = ResidentExperts(
        {(L, e): pm.read_expert(L, e) for L in pm.moe_layers for e in range(pm.num_experts)}
    )
    mod = MODULES[pm.family]
    model = mod.Model(mod.Config.from_dict(pm.text_config), pm.trunk_records())
    return pm, model, experts


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model, experts, ids: torch.Tensor, n: int, max_len: int = 64) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens; logits of every position fed (prompt then generated): [len(ids) + n - 1, V]."""
    state = model.new_state(max_len)
    logits = [model.forward(ids, state, experts)]
    out = []
    for step in range(n):
        out.append(int(logits[-1][-1].argmax()))
        if step < n - 1:
            logits.append(model.forward(torch.tensor([out[-1]]), state, experts))
    assert state.pos == len(ids) + n - 1
    return out, torch.cat(logits)


@torch.no_grad()
def hf_greedy(hf, ids: torch.Tensor, n: int) -> list[int]:
    x = ids[None]
    gen = hf.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return gen[0, len(ids) :].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_lossless_pack(built, case):
    b = built(case)
    _, model, experts = load(b.packed("bf16"))
    ids = prompt()
    tokens, logits = greedy(model, experts, ids, NEW_TOKENS)
    assert tokens == hf_greedy(b.hf, ids, NEW_TOKENS)
    with torch.no_grad():
        ref = b.hf(torch.cat([ids, torch.tensor(tokens)])[None]).logits[0, : logits.shape[0]]
    prefill_err, decode_err = rel_err(logits[:PROMPT_LEN], ref[:PROMPT_LEN]), rel_err(logits, ref)
    print(f"{case}: prompt logits rel err {prefill_err:.2e}, with decode steps {decode_err:.2e}")
    assert prefill_err <= 1e-4
    assert decode_err <= 1e-4


def dequantized_checkpoint(pm: PackedModel, src: Path, dst: Path, model_type: str) -> None:
    """The packed model's weights, dequantized, as an HF checkpoint under the original names."""
    from safetensors.torch import save_file

    tensors = {n: dequantize(r, torch.float32) for n, r in pm.trunk_records().items()}
    block, names = CKPT_ROLES[model_type]
    for L in pm.moe_layers:
        for e in range(pm.num_experts):
            for role, rec in pm.read_expert(L, e).items():
                tensors[f"model.layers.{L}.{block}.experts.{e}.{names[role]}.weight"] = dequantize(
                    rec, torch.float32
                )
    dst.mkdir()
    save_file(
        {n: t.contiguous() for n, t in tensors.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    shutil.copyfile(src / "config.json", dst / "config.json")


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-yarn-dense", "mixtral", "olmoe"])
def test_default_codecs_match_hf_on_dequantized_weights(built, case, tmp_path):
    import transformers

    b = built(case)
    pm, model, experts = load(b.packed("default"))
    assert pm.trunk_records()["model.layers.0.self_attn.q_proj.weight"].format == "int8"
    assert pm.read_expert(pm.moe_layers[0], 0)["gate"].format == "mxfp4"
    dequantized_checkpoint(pm, b.src, tmp_path / "ref", b.model_type)
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ref"), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = prompt()
    tokens, logits = greedy(model, experts, ids, NEW_TOKENS)
    assert tokens == hf_greedy(ref.eval(), ids, NEW_TOKENS)
    with torch.no_grad():
        err = rel_err(logits[:PROMPT_LEN], ref(ids[None]).logits[0])
    print(f"{case} int8/MXFP4: prompt logits rel err {err:.2e}")
    assert err <= 1e-4


class _Reversed:
    def __init__(self, inner):
        self.inner = inner

    def fetch(self, layer, expert_ids):
        return reversed(list(self.inner.fetch(layer, expert_ids)))


@pytest.mark.parametrize("family", list(MODULES))
def test_arrival_order_does_not_change_logits(built, family):
    _, model, experts = load(built(family).packed("bf16"))
    ids = prompt(1)
    a = model.forward(ids, model.new_state(16), experts)
    b = model.forward(ids, model.new_state(16), _Reversed(experts))
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", list(MODULES))
def test_chunked_prefill_matches_one_shot(built, family):
    _, model, experts = load(built(family).packed("bf16"))
    ids = prompt(2)
    one = model.new_state(16)
    whole = model.forward(ids, one, experts)
    two = model.new_state(16)
    parts = torch.cat([model.forward(ids[:3], two, experts), model.forward(ids[3:], two, experts)])
    assert two.pos == one.pos == PROMPT_LEN
    assert rel_err(parts, whole) <= 1e-5
    nxt = torch.tensor([5])
    assert rel_err(model.forward(nxt, two, experts), model.forward(nxt, one, experts)) <= 1e-5


@pytest.mark.parametrize("family", list(MODULES))
def test_mlp_part_is_token_wise_across_sequences(built, family):
    _, model, experts = load(built(family).packed("bf16"))
    xs = []
    for seed in (3, 4):
        state = model.new_state(16)
        xs.append(model.attn_part(0, model.embed(prompt(seed)), state))
    joint = model.mlp_part(0, torch.cat(xs), experts)
    alone = torch.cat([model.mlp_part(0, x, experts) for x in xs])
    assert rel_err(joint, alone) <= 1e-6
    ids, w = model.route(0, torch.cat(xs))
    assert (
        ids.dtype == torch.long and w.dtype == torch.float32 and ids.shape == w.shape == (2 * PROMPT_LEN, 2)
    )


def test_dense_layer_has_no_route(built):
    _, model, _ = load(built("qwen3_moe-yarn-dense").packed("bf16"))
    assert model.route(1, torch.zeros(3, 64)) is None
    assert model.route(0, torch.zeros(3, 64)) is not None


def test_kv_cache_grows_past_max_len(built):
    _, model, experts = load(built("qwen3_moe").packed("bf16"))
    ids = prompt()
    small = greedy(model, experts, ids, 12, max_len=4)
    big = greedy(model, experts, ids, 12, max_len=64)
    assert small[0] == big[0]
    assert rel_err(small[1], big[1]) <= 1e-5


def test_kv_cache_capacity_is_geometric_and_bounded():
    c = KVCache(2, 8, 4, max_len=100, device="cpu", dtype=torch.float32)
    caps = []
    for pos in range(100):
        k, v = c.update(torch.randn(1, 2, 8), torch.randn(1, 2, 4), pos)
        assert k.shape == (2, pos + 1, 8) and v.shape == (2, pos + 1, 4)
        caps.append(c.k.shape[1])
    assert sorted(set(caps)) == [64, 100]
    c.update(torch.randn(3, 2, 8), torch.randn(3, 2, 4), 100)
    assert c.k.shape[1] >= 200  # past max_len: doubles
    k, _ = c.update(torch.ones(1, 2, 8), torch.ones(1, 2, 4), 50)  # rewind
    assert k.shape[1] == 51 and c.length == 51


@pytest.mark.parametrize(
    "pos,T,window", [(0, 9, None), (5, 4, None), (12, 1, None), (0, 9, 3), (10, 3, 4), (20, 1, 6)]
)
def test_grouped_attention_matches_torch_sdpa(monkeypatch, pos, T, window):
    """The CPU path (grouped matmuls, query blocks, key ranges) against torch's fused attention, which
    the CUDA path uses; a tiny score budget forces one query per block."""
    g = torch.Generator().manual_seed(pos * 100 + T)
    q, k, v = (
        torch.randn(T, 8, 16, generator=g),
        torch.randn(2, pos + T, 16, generator=g),
        torch.randn(2, pos + T, 8, generator=g),
    )
    ref = layers._attention_sdpa(q, k, v, pos, 0.25, window)
    assert rel_err(layers._attention_grouped(q, k, v, pos, 0.25, window), ref) <= 1e-6
    monkeypatch.setattr(layers, "SCORE_BUDGET", 1)
    assert rel_err(layers._attention_grouped(q, k, v, pos, 0.25, window), ref) <= 1e-6


# ------------------------------------------------------------------------------------------- configs

HF_CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "max_position_embeddings": 4096}
ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
    {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"] + ("-mscale" if "mscale" in r else ""))
def test_rope_frequencies_match_transformers(rope):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.Qwen3MoeConfig(**HF_CONFIG, rope_parameters=dict(rope))
    if rope["rope_type"] == "default":
        ref, ref_scale = (
            transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(
                hf_cfg
            )
        )
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    inv, scale = rope_frequencies(rope_parameters({**HF_CONFIG, "rope_parameters": dict(rope)}), 16, 4096)
    assert torch.equal(inv, ref.float())
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_rope_legacy_form_equals_transformers_5_form():
    legacy = {
        "max_position_embeddings": 4096,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    }
    new = {
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    }
    assert rope_parameters(legacy) == rope_parameters(new)
    assert rope_parameters({})["rope_theta"] == 10000.0
    assert mixtral.Config.from_dict({}).rope["rope_theta"] == 1e6  # Mixtral's default theta


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(UnsupportedArchitectureError, match="dynamic"):
        Rope({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, 16, 256, "cpu")


@pytest.mark.parametrize("family", list(MODULES))
def test_config_from_hf_json_ignores_unknown_keys(built, family):
    d = json.loads((built(family).src / "config.json").read_text())
    cfg = MODULES[family].Config.from_dict({**d, "some_future_key": 1, "quantization_config": {"x": 1}})
    assert cfg.num_hidden_layers == 3 and cfg.vocab_size == 256 and cfg.head_dim == 16
    assert cfg == MODULES[family].Config.from_dict(d)


def test_config_field_names_and_aliases():
    q = qwen3_moe.Config.from_dict(
        {
            "num_experts": 128,
            "sliding_window": 4096,
            "use_sliding_window": False,
            "head_dim": 128,
            "hidden_size": 2048,
            "mlp_only_layers": [0, 3],
        }
    )
    assert (
        q.num_experts == 128
        and q.sliding_window is None
        and q.head_dim == 128
        and q.mlp_only_layers == (0, 3)
    )
    assert not q.is_moe(0) and q.is_moe(1)
    assert qwen3_moe.Config.from_dict({"num_local_experts": 16}).num_experts == 16
    assert mixtral.Config.from_dict({"num_experts": 4, "head_dim": None}).num_local_experts == 4
    o = olmoe.Config.from_dict({"num_attention_heads": 8, "num_key_value_heads": None, "hidden_size": 256})
    assert o.num_key_value_heads == 8 and o.head_dim == 32
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act"):
        mixtral.Config.from_dict({"hidden_act": "gelu"})
