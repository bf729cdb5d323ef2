"""Partial GPU offload on a CUDA device (python -m pytest -m gpu tests/test_gpu_offload.py): the last N layers and
the head on the GPU, the rest on the CPU. --exact greedy tokens equal transformers' and the all-CPU run's whatever
the split; the fast path's logits bit-identical run to run for a split; --gpu-memory-gb honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafin.errors import UsageError
from deltafin.k3_tiny import write_tiny_k3
from deltafin.runtime.engine import CUDA_HEADROOM, Engine, EngineOptions
from deltafin.runtime.offload import SplitExperts, SplitModel
from deltafin.runtime.offload_plan import TrunkSizes, gpu_bytes_for
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from deltafin.tiny import build_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
LOSSLESS = PackOptions(experts="bf16", trunk="bf16", progress=False)
DEFAULT = PackOptions(progress=False)  # int8 trunk, MXFP4 experts


def _pack(root: Path, build, opts: PackOptions) -> str:
    build(root / "src")
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]), opts)
    return str(root / "model")


def _layers(model_dir: str) -> int:
    return int(PackedModel.open(model_dir).text_config["num_hidden_layers"])


def _engine(model_dir: str, **kw) -> Engine:
    return Engine(model_dir, EngineOptions(**{"exact": True, "cache_gb": 0.0, "max_len": 256, "threads": 2, **kw}))


def _greedy(model_dir: str, n: int = 24, **kw) -> list[int]:
    eng = _engine(model_dir, **kw)
    try:
        return [t for t, _ in eng.generate(PROMPT, n, stop_ids=())]
    finally:
        eng.close()


def _check_split(eng: Engine, n: int, L: int) -> None:
    """The engine placed what the plan says: a split runs SplitModel/SplitExperts, 0 and L the one-device paths."""
    assert eng.offload is not None and eng.offload.gpu_layers == n
    if 0 < n < L:
        assert isinstance(eng.model, SplitModel) and isinstance(eng.source, SplitExperts)
        assert eng.model.first == L - n and eng.model.high.device.type == "cuda"
        assert eng.model.low.device.type == "cpu"
        st = eng.new_state()  # each layer's cache on its layer's device (KVCache.k, an MLA GrowingCache.buf)
        where = [getattr(s, "k", getattr(s, "buf", None)) for s in st.layers]
        if all(isinstance(t, torch.Tensor) for t in where):
            assert [t.device.type for t in where] == ["cpu"] * (L - n) + ["cuda"] * n
    else:
        assert not isinstance(eng.model, SplitModel)
        assert eng.device.type == ("cuda" if n == L else "cpu")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_exact_tokens_equal_hugging_face_and_the_cpu_at_any_split(family, tmp_path):
    hf = build_tiny(family, tmp_path / "src")
    model_dir = _pack(tmp_path, lambda p: None, LOSSLESS)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(PROMPT):]
    cpu = _greedy(model_dir, device="cpu")
    assert cpu == ref.tolist()
    L = _layers(model_dir)
    for n in sorted({0, 1, L // 2, L - 1, L}):
        eng = _engine(model_dir, device="cuda", gpu_layers=n)
        try:
            _check_split(eng, n, L)
            got = [t for t, _ in eng.generate(PROMPT, 24, stop_ids=())]
        finally:
            eng.close()
        assert got == cpu, f"--gpu-layers {n} of {L}"


def test_kimi_k3_exact_split_equals_the_cpu_and_the_gpu(tmp_path):
    """K3's AttnRes carry (the running sum and the block snapshots) crosses the boundary; KDA states and MLA
    caches live on their layers' devices."""
    model_dir = _pack(tmp_path, write_tiny_k3, LOSSLESS)
    L = _layers(model_dir)
    cpu = _greedy(model_dir, 16, device="cpu")
    assert _greedy(model_dir, 16, device="cuda", gpu_layers=L) == cpu
    for n in (1, L // 2, L - 1):
        assert _greedy(model_dir, 16, device="cuda", gpu_layers=n) == cpu, f"--gpu-layers {n} of {L}"


def _logits(model_dir: str, steps: int = 6, **kw) -> torch.Tensor:
    """Fast path: the prompt's logits (all positions) and greedy one-token steps, float32 on the host."""
    eng = _engine(model_dir, exact=False, **kw)
    try:
        st = eng.new_state()
        with torch.inference_mode():
            out = [eng.step([(torch.tensor(PROMPT, device=eng.device), st)], all_logits=True)[0].float().cpu()]
            for _ in range(steps):
                out.append(eng.forward([int(out[-1][-1].argmax())], st)[None].float().cpu())
        return torch.cat(out)
    finally:
        eng.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_fast_path_logits_bit_identical_run_to_run_for_a_split(family, tmp_path):
    build = write_tiny_k3 if family == "kimi_k3" else (lambda p: build_tiny(family, p))
    model_dir = _pack(tmp_path, build, DEFAULT)
    L = _layers(model_dir)
    for n in (1, L // 2):
        a = _logits(model_dir, device="cuda", gpu_layers=n)
        b = _logits(model_dir, device="cuda", gpu_layers=n, cache_gb=1.0)  # cold, then a cache on each side
        assert torch.isfinite(a).all()
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"--gpu-layers {n} of {L}"
    # all on the GPU: the path that ran before offload existed (no SplitModel), run to run as well
    a, b = _logits(model_dir, device="cuda", gpu_layers=L), _logits(model_dir, device="cuda")
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_gpu_memory_cap_is_honoured_and_bad_requests_are_refused(tmp_path):
    """A model whose layers are a few MB each and a cap that holds the head and two of its four layers beside
    the working memory: the engine places exactly those, the allocator never reserves past the cap, and the
    tokens are the CPU's."""
    wide = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_hidden_layers=4,
                moe_intermediate_size=256, intermediate_size=1024, vocab_size=4096)
    model_dir = _pack(tmp_path, lambda p: build_tiny("qwen3_moe", p, **wide), LOSSLESS)
    pm = PackedModel.open(model_dir)
    sizes = TrunkSizes.from_manifest(pm.doc["trunk"]["tensors"], 4)
    assert min(sizes.layers) > 4 << 20  # each layer is several MB: a cap between layer counts is clear-cut
    cap = CUDA_HEADROOM + gpu_bytes_for(sizes, 2) + sizes.layers[1] // 2
    cpu = _greedy(model_dir, 12, device="cpu")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    eng = _engine(model_dir, device="cuda", gpu_memory_gb=cap / 1e9, cache_gb=None)
    try:
        _check_split(eng, 2, 4)
        assert "GPU: layers 2-3 + head" in eng.offload.describe() and "CPU: layers 0-1 + embeddings" in \
            eng.offload.describe()
        assert eng.source.cache_bytes[1] <= (cap - eng.offload.gpu_bytes - CUDA_HEADROOM) // 2 + 1
        assert [t for t, _ in eng.generate(PROMPT, 12, stop_ids=())] == cpu
        assert torch.cuda.max_memory_reserved() - base <= cap
    finally:
        eng.close()
    for kw, msg in ((dict(gpu_memory_gb=0.5), r"--gpu-memory-gb 0.50: the head and the last layer need"),
                    (dict(gpu_layers=5), r"--gpu-layers 5: this model has 4 layers"),
                    (dict(gpu_layers=4, gpu_memory_gb=cap / 1e9), r"--gpu-layers 4: .*give --gpu-layers 2 or fewer")):
        with pytest.raises(UsageError, match=msg):
            _engine(model_dir, device="cuda", **kw)
    eng = _engine(model_dir, device="cuda")  # no cap left behind by the engines above: the whole trunk fits
    try:
        assert eng.offload.all_gpu and not isinstance(eng.model, SplitModel)
    finally:
        eng.close()
