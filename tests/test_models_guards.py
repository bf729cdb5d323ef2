"""Guards against silent wrong output: a checkpoint whose model_type was set by hand to a near family is refused
at pack, with one line naming what its code does not implement: trunk tensors the family's model never reads
(``--allow-unused`` packs them anyway), and config settings it would otherwise read as a default."""

from __future__ import annotations

import json

import pytest

from deltafin.errors import CheckpointError
from deltafin.store.checkpoint import Checkpoint
from deltafin.store.pack import PackOptions
from deltafin.store.plan import build_plan
from tests import tiny_families as tf

pytest.importorskip("transformers")
DSA = dict(index_topk=4, index_n_heads=2, index_head_dim=16)


def _relabel(src, model_type: str, drop=(), **settings) -> None:
    p = src / "config.json"
    cfg = json.loads(p.read_text())
    cfg["model_type"] = model_type
    for k in drop:
        cfg.pop(k, None)
    cfg.update(settings)
    p.write_text(json.dumps(cfg))


def test_deepseek_v32_read_as_deepseek_v3_is_refused_for_its_indexer(tmp_path):
    tf.build("deepseek_v32", tmp_path / "src", like="deepseek_v3", **DSA)
    _relabel(tmp_path / "src", "deepseek_v3")
    with pytest.raises(CheckpointError, match=r"index_topk.*DSA lightning indexer"):
        tf.pack_to(tmp_path)
    # without the indexer settings, its weights still give it away
    _relabel(tmp_path / "src", "deepseek_v3", drop=DSA)
    with pytest.raises(CheckpointError, match=r"never reads, e\.g\. model\.layers\.\d\.self_attn\.indexer\."):
        tf.pack_to(tmp_path)
    plan = build_plan(Checkpoint(str(tmp_path / "src")))
    assert plan.unused and all(".self_attn.indexer." in n for n in plan.unused)
    tf.pack_to(tmp_path, PackOptions(experts="bf16", trunk="bf16", progress=False, allow_unused=True))


def test_deepseek_v2_read_as_deepseek_v3_is_refused_for_its_router(tmp_path):
    tf.build("deepseek_v2", tmp_path / "src", like="deepseek_v3")
    _relabel(tmp_path / "src", "deepseek_v3")
    with pytest.raises(CheckpointError, match=r"topk_method = \"greedy\""):
        tf.pack_to(tmp_path)
    _relabel(tmp_path / "src", "deepseek_v3", topk_method="noaux_tc", scoring_func="softmax")
    with pytest.raises(CheckpointError, match=r"scoring_func = \"softmax\""):
        tf.pack_to(tmp_path)


def test_minimax_m2_read_as_mixtral_is_refused(tmp_path):
    tf.build("minimax_m2", tmp_path / "src")
    _relabel(tmp_path / "src", "mixtral")
    with pytest.raises(CheckpointError, match=r"rotary_dim = 8: partial RoPE"):
        tf.pack_to(tmp_path)
    _relabel(tmp_path / "src", "mixtral", drop=("rotary_dim", "rope_parameters"))
    with pytest.raises(CheckpointError, match=r"mixtral model code never reads.*(q_norm|e_score_correction_bias)"):
        tf.pack_to(tmp_path)


def test_qwen3_next_read_as_qwen3_moe_is_refused(tmp_path):
    tf.build("qwen3_next", tmp_path / "src")
    _relabel(tmp_path / "src", "qwen3_moe")
    with pytest.raises(CheckpointError, match=r"qwen3_moe model code never reads.*linear_attn"):
        tf.pack_to(tmp_path)


@pytest.mark.parametrize("model_type, key, val", [("glm4_moe", "scoring_func", "softmax"),
                                                  ("glm4_moe", "topk_method", "greedy"),
                                                  ("minimax_m2", "use_routing_bias", False),
                                                  ("minimax_m2", "attn_type_list", [0, 1, 1]),
                                                  ("qwen3_next", "attn_output_gate", False)])
def test_settings_the_code_does_not_implement_are_refused(tmp_path, model_type, key, val):
    tf.build(model_type, tmp_path / "src")
    _relabel(tmp_path / "src", model_type, **{key: val})
    with pytest.raises(CheckpointError, match=key):
        build_plan(Checkpoint(str(tmp_path / "src")))
