"""MiniMax-M2 (``minimax_m2``) against transformers: QK-norm over all heads at once, partial RoPE, the sigmoid
router with its correction bias and no groups, Mixtral-style expert names."""

from __future__ import annotations

import pytest
import torch

from tests import tiny_families as tf

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2")
    tf.build("minimax_m2", root / "src")
    return tf.pack_to(root, tf.DEFAULT)


@pytest.mark.parametrize("overrides", [pytest.param({}, id="m2"), pytest.param({"rotary_dim": 16}, id="full-rope")])
def test_matches_hugging_face(tmp_path, overrides):
    hf = tf.build("minimax_m2", tmp_path / "src", **overrides)
    tf.check_matches_hf(hf, tf.pack_to(tmp_path))


def test_prompt_cache_batching_chunked_prefill(packed):
    tf.check_prompt_cache_and_batch(packed)


def test_fast_path_agrees_with_exact(packed):
    assert tf.fast_path_agreement(packed) >= 0.99


def test_fp8_release_format_matches_hugging_face(tmp_path):
    """As released: attention projections and experts FP8 in 128 x 128 blocks, dequantized on import."""
    import transformers

    tf.build("minimax_m2", tmp_path / "float")
    tf.fp8_blocks(tmp_path, r"(self_attn\.[qkvo]_proj|experts\.\d+\.w[123])\.weight$")
    from deltafin.store.checkpoint import Checkpoint
    from deltafin.store.plan import build_plan

    plan = build_plan(Checkpoint(str(tmp_path / "src")))
    assert {r.src for rs in plan.roles.values() for r in rs} == {"fp8"}
    assert {t.dtype for t in plan.trunk if ".self_attn." in t.name and "norm" not in t.name} == {"F8_E4M3"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "float"), dtype=torch.float32).eval()
    tf.check_matches_hf(hf, tf.pack_to(tmp_path))
