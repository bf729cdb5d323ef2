"""The same exactness checks on a CUDA device (run on a GPU machine: python -m pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from deltafin.k3_tiny import write_tiny_k3
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.store.drives import parse_drives
from deltafin.store.pack import PackOptions, pack
from deltafin.tiny import build_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe_lite", "gpt_oss"]
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


def _pack(tmp_path, build, **opts) -> str:
    build(tmp_path / "src")
    out = tmp_path / "model"
    pack(str(tmp_path / "src"), str(out), parse_drives([f"{tmp_path}/d0=2", f"{tmp_path}/d1=1"]),
         PackOptions(progress=False, **opts))
    return str(out)


def _greedy(model_dir: str, device: str, cache_gb: float, n: int = 32) -> list[int]:
    eng = Engine(model_dir, EngineOptions(exact=True, device=device, cache_gb=cache_gb))
    try:
        return [t for t, _ in eng.generate(PROMPT, n, stop_ids=())]
    finally:
        eng.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_tokens_equal_hugging_face(family, tmp_path):
    hf = build_tiny(family, tmp_path / "src")
    model_dir = _pack(tmp_path, lambda p: None, experts="bf16", trunk="bf16")
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(PROMPT):]
    assert _greedy(model_dir, "cuda", 0.0) == ref.tolist()


@pytest.mark.parametrize("family", FAMILIES + ["kimi_k3"])
def test_cuda_streaming_independent_of_cache(family, tmp_path):
    build = write_tiny_k3 if family == "kimi_k3" else (lambda p: build_tiny(family, p))
    model_dir = _pack(tmp_path, build)
    cold, warm = _greedy(model_dir, "cuda", 0.0, 16), _greedy(model_dir, "cuda", 1.0, 16)
    assert cold == warm
    assert cold == _greedy(model_dir, "cpu", 0.0, 16)


def test_cuda_stats_split_on_the_gpu_clock_adds_up_to_the_wall_time(tmp_path):
    """On CUDA the stats line's split is timed with CUDA events: expert math is GPU time, waiting on I/O only the
    time the GPU sat idle for a read, and the three parts add up to the run's wall time (none is larger)."""
    model_dir = _pack(tmp_path, lambda p: build_tiny("qwen3_moe", p))
    for exact in (True, False):
        eng = Engine(model_dir, EngineOptions(exact=exact, device="cuda", cache_gb=0.0))
        try:
            list(eng.generate(PROMPT, 8, stop_ids=()))
            s = eng.last_stats
        finally:
            eng.close()
        wall = s.ttft_s + s.decode_s
        assert s.clock == "gpu" and s.expert_math_s > 0 and s.io_wait_s >= 0
        assert s.io_wait_s + s.expert_math_s <= wall * 1.02
        assert abs(s.io_wait_s + s.expert_math_s + s.trunk_math_s - wall) <= 0.02 * wall + 1e-3
        assert "GPU's clock" in s.summary()
