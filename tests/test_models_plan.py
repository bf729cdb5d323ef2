"""``pack --plan`` from config.json and the tensor index alone for the families whose trunk shapes config.json
gives: the shapes derived from the config equal the shard headers' (every tiny model), and each family's default
transformers config (its flagship's shape) plans expert files, bytes and the per-token read bound."""

from __future__ import annotations

import json
import re

import pytest

from deltafin import cli
from deltafin.store.checkpoint import Checkpoint
from deltafin.store.plan import build_plan
from tests import tiny_families as tf

transformers = pytest.importorskip("transformers")
FAMILIES = ["kimi_k25", "glm4_moe", "minimax_m2", "qwen3_next", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa",
            "deepseek_v4"]


def _index_only(src, names: list[str]) -> None:
    """Leave config.json and an index naming ``names`` (in an absent shard): a download not yet made."""
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    for f in src.glob("*.safetensors"):
        f.unlink()


@pytest.mark.parametrize("model_type", [*FAMILIES, "deepseek_v3", "glm4_moe_lite", "qwen3_moe", "mixtral", "olmoe"])
def test_config_shapes_equal_the_headers(tmp_path, model_type):
    tf.kimi_k25(tmp_path) if model_type == "kimi_k25" else tf.build(model_type, tmp_path / "src")
    src = tmp_path / "src"
    headers = build_plan(Checkpoint(str(src)))
    _index_only(src, list(Checkpoint(str(src)).weight_map))
    config = build_plan(Checkpoint(str(src)))
    assert config.shapes_from == "config.json" and headers.shapes_from == "headers"
    assert [(t.name, t.dtype, t.shape, t.format) for t in config.trunk] == \
        [(t.name, t.dtype, t.shape, t.format) for t in headers.trunk]
    assert {L: x.payload_bytes for L, x in config.layouts.items()} == \
        {L: x.payload_bytes for L, x in headers.layouts.items()}


NARROW = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              vocab_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, kv_lora_rank=32,
              q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, index_n_heads=2,
              index_head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16)


def _default_checkpoint(root, model_type: str):
    """The default config of ``model_type`` with the tensor names transformers saves for it (read off a copy of
    every layer and expert at narrow widths), and no shards."""
    cfg = transformers.AutoConfig.for_model(model_type)
    full = cfg.to_dict()
    text = full.get("text_config", full)
    narrow = {**text, **{k: v for k, v in NARROW.items() if k in text}, "rope_parameters": None}
    for k in ("partial_rotary_factor", "model_type", "transformers_version", "architectures"):
        narrow.pop(k, None)
    if model_type in ("kimi_k25", "qwen3_5_moe"):
        body = {"text_config": narrow, "vision_config": tf.NEW_TINY[model_type]["vision_config"]}
        model = tf.build(model_type, root / "narrow", **body)
    else:
        like = "deepseek_v4" if model_type == "deepseek_v4" else "deepseek_v3"
        model = tf.build(model_type, root / "narrow", like=like, **narrow)
    del model
    names = list(Checkpoint(str(root / "narrow")).weight_map)
    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(full))
    _index_only(src, names)
    return src, text


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_plan_of_the_default_config(tmp_path, model_type, capsys):
    src, text = _default_checkpoint(tmp_path, model_type)
    assert cli.main(["pack", str(src), "--plan", "--drive", f"d0:{tmp_path}/d0=25", "--create"]) == 0
    out = capsys.readouterr().out
    plan = build_plan(Checkpoint(str(src)))
    E = text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts")
    d, inter = text["hidden_size"], text.get("moe_intermediate_size") or text["intermediate_size"]
    assert plan.num_experts == E and plan.shapes_from == "config.json"
    assert plan.layouts[plan.moe_layers[0]].payload_bytes == 3 * (inter * d // 2 + inter * d // 32)  # MXFP4
    assert re.search(r"per token .* tok/s at 25 GB/s", out) and f"{plan.expert_files:,} files" in out
