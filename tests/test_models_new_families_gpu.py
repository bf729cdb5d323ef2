"""The new families on a CUDA device (run on a GPU machine: python -m pytest -m gpu): the streaming engine in
float32 (exact) gives transformers' greedy tokens, as on the CPU; the fast path's teacher-forced agreement on
CUDA stays >= 99%."""

from __future__ import annotations

import pytest
import torch

from tests import tiny_families as tf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers")
CASES = [("glm4_moe", {}), ("glm4_moe", {"use_qk_norm": True, "attention_bias": True}), ("minimax_m2", {}),
         ("qwen3_next", {}), ("qwen3_5_moe", {}), ("deepseek_v32", {}), ("glm_moe_dsa", {})]


def _build(root, model_type, overrides):
    return tf.kimi_k25(root) if model_type == "kimi_k25" else tf.build(model_type, root / "src", **overrides)


@pytest.mark.parametrize("model_type, overrides", [*CASES, ("kimi_k25", {})])
def test_float32_matches_hugging_face_on_cuda(tmp_path, model_type, overrides):
    from deltafin.store.pack import PackOptions

    hf = _build(tmp_path, model_type, overrides)
    opts = PackOptions(trunk="bf16", progress=False) if model_type == "kimi_k25" else tf.LOSSLESS
    ids = tf.prompt(70 if model_type.startswith("qwen3") else 12)
    tf.check_matches_hf(hf, tf.pack_to(tmp_path, opts), ids, device="cuda")


@pytest.mark.parametrize("model_type", ["kimi_k25", "glm4_moe", "minimax_m2", "qwen3_next", "qwen3_5_moe",
                                        "deepseek_v32", "glm_moe_dsa"])
def test_fast_path_agreement_on_cuda(tmp_path, model_type):
    from deltafin.runtime.engine import Engine, EngineOptions
    from tests.test_fast_path import N, _top1

    extra = {"index_topk": 32} if model_type in ("deepseek_v32", "glm_moe_dsa") else {}
    _build(tmp_path, model_type, extra)
    model_dir = tf.pack_to(tmp_path, tf.DEFAULT)
    ids = torch.randint(0, 256, (N,), generator=torch.Generator().manual_seed(0)).tolist()
    exact = _top1(Engine(model_dir, EngineOptions(cache_gb=0.05, max_len=N + 1, exact=True, device="cuda")), ids)
    fast = _top1(Engine(model_dir, EngineOptions(cache_gb=0.05, max_len=N + 1, exact=False, device="cuda")), ids)
    assert (exact.cpu() == fast.cpu()).float().mean().item() >= 0.99
