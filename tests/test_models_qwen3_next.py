"""Qwen3-Next (``qwen3_next``) and Qwen3.5-MoE (``qwen3_5_moe``) against transformers: Gated DeltaNet layers on
Kimi K3's delta-rule code (recurrent decode, chunked prefill, the recurrent state in the prompt cache), gated full
attention with partial RoPE, (1 + w) norms, the sigmoid-gated shared expert, Qwen3.5's language_model. prefix."""

from __future__ import annotations

import pytest

from deltafin.store.model_dir import PackedModel
from tests import tiny_families as tf

pytest.importorskip("transformers")
FAMILIES = ["qwen3_next", "qwen3_5_moe"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_matches_hugging_face(tmp_path, model_type):
    hf = tf.build(model_type, tmp_path / "src")
    tf.check_matches_hf(hf, tf.pack_to(tmp_path), tf.prompt(70))  # past one 64-token chunk of the prefill


def test_qwen3_next_dense_layers_and_no_renormalisation(tmp_path):
    hf = tf.build("qwen3_next", tmp_path / "src", mlp_only_layers=[1], norm_topk_prob=False)
    tf.check_matches_hf(hf, tf.pack_to(tmp_path))


@pytest.fixture(scope="module", params=FAMILIES)
def packed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    tf.build(request.param, root / "src")
    return tf.pack_to(root, tf.DEFAULT)


def test_vision_tower_skipped_and_names_normalised(packed):
    pm = PackedModel.open(packed)
    names = set(pm.trunk_records())
    assert "model.layers.0.linear_attn.A_log" in names and "model.layers.1.self_attn.q_norm.weight" in names
    assert not any("visual" in n or "language_model" in n for n in names)


def test_prompt_cache_batching_chunked_prefill(packed):
    tf.check_prompt_cache_and_batch(packed)


def test_fast_path_agrees_with_exact(packed):
    assert tf.fast_path_agreement(packed) >= 0.99
