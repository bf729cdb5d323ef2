"""Kimi K2.5 / K2.6 (``kimi_k25``): the DeepSeek-V3 text model under ``language_model.``, the vision tower and
projector skipped, INT4 group-32 experts kept as released, against transformers' Kimi_K25ForConditionalGeneration."""

from __future__ import annotations

import pytest

from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions
from tests import tiny_families as tf

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    root = tmp_path_factory.mktemp("k25")
    hf = tf.kimi_k25(root)
    return root, hf, tf.pack_to(root, tf.DEFAULT)


def test_pack_keeps_int4_experts_and_skips_the_vision_tower(k25):
    root, _, model_dir = k25
    pm = PackedModel.open(model_dir)
    assert pm.family == "kimi_k25" and pm.moe_layers == [1, 2] and pm.num_experts == 8
    ex = pm.read_expert(1, 3)
    assert {r: t.format for r, t in ex.items()} == {"gate": "int4g32", "up": "int4g32", "down": "int4g32"}
    names = set(pm.trunk_records())
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert not any("vision" in n or "mm_projector" in n or "blocks" in n for n in names)


def test_matches_hugging_face(k25):
    """INT4 experts kept as released decode exactly (q x bf16 scale is exact in float32; a bf16 copy would round
    it): with a bf16 trunk the streaming engine gives transformers' greedy tokens."""
    root, hf, _ = k25
    lossless = root / "lossless"
    lossless.mkdir()
    (lossless / "src").symlink_to(root / "src")
    tf.check_matches_hf(hf, tf.pack_to(lossless, PackOptions(trunk="bf16", progress=False)))


def test_prompt_cache_batching_chunked_prefill(k25):
    tf.check_prompt_cache_and_batch(k25[2])


def test_fast_path_agrees_with_exact(k25):
    assert tf.fast_path_agreement(k25[2]) >= 0.99
