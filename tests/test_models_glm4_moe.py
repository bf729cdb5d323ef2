"""GLM-4.5 / 4.6 / 4.7 / 4.5-Air (``glm4_moe``) against transformers: partial RoPE, optional QK-norm and q/k/v
biases, the grouped sigmoid router with its correction bias, the shared expert and the dense first layer."""

from __future__ import annotations

import pytest

from tests import tiny_families as tf

pytest.importorskip("transformers")
CASES = [
    pytest.param({}, id="glm4.5"),
    pytest.param({"use_qk_norm": True, "attention_bias": True, "norm_topk_prob": False}, id="qknorm-bias"),
]


@pytest.mark.parametrize("overrides", CASES)
def test_matches_hugging_face(tmp_path, overrides):
    hf = tf.build("glm4_moe", tmp_path / "src", **overrides)
    tf.check_matches_hf(hf, tf.pack_to(tmp_path))


def test_mtp_layer_is_skipped(tmp_path):
    """The checkpoint's layer past num_hidden_layers (multi-token prediction) is not packed."""
    import json

    from deltafin.store.checkpoint import Checkpoint
    from deltafin.store.plan import build_plan

    tf.build("glm4_moe", tmp_path / "src", num_hidden_layers=4)
    cfg_path = tmp_path / "src" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    cfg_path.write_text(json.dumps(cfg))
    plan = build_plan(Checkpoint(str(tmp_path / "src")))
    assert plan.moe_layers == [1, 2] and not plan.unused
    assert all(".layers.3." in n for n, why in plan.skipped) and plan.skipped


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4")
    tf.build("glm4_moe", root / "src", use_qk_norm=True, attention_bias=True)
    return tf.pack_to(root, tf.DEFAULT)


def test_prompt_cache_batching_chunked_prefill(packed):
    tf.check_prompt_cache_and_batch(packed)


def test_fast_path_agrees_with_exact(packed):
    assert tf.fast_path_agreement(packed) >= 0.99
