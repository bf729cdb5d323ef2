"""The fast path (fused kernels, the CLI's default) against the float32 reference on every family's tiny model.

Each family is packed as shipped to users (int8 trunk, MXFP4 experts), then fed the same 256 random tokens
teacher-forced: the first 240 as one prefill pass (the tiled kernels), the last 16 one at a time (the fused
one-token kernels; one-token steps are what make the test slow). The greedy choice at every position must
agree with the exact path's at >= 99% of them.
"""

from __future__ import annotations

import pytest
import torch

from deltafin.runtime.batch import forward_batch
from deltafin.runtime.engine import Engine, EngineOptions
from tests.tiny import TINY, pack_tiny

N, PREFILL = 256, 240


def _top1(eng: Engine, ids: list[int]) -> torch.Tensor:
    st = eng.new_state(N + 1)
    with torch.inference_mode(), eng.math():
        lg = forward_batch(eng.model, [(torch.tensor(ids[:PREFILL]), st)], eng.source, all_logits=True)[0]
        picks = [lg.argmax(-1)]
        for t in ids[PREFILL:]:
            picks.append(forward_batch(eng.model, [(torch.tensor([t]), st)], eng.source)[0].argmax(-1))
    return torch.cat(picks)


def _agreement(model_dir: str, vocab: int) -> float:
    ids = torch.randint(0, vocab, (N,), generator=torch.Generator().manual_seed(0)).tolist()
    exact = _top1(Engine(model_dir, EngineOptions(cache_gb=0.05, max_len=N + 1, exact=True)), ids)
    fast = Engine(model_dir, EngineOptions(cache_gb=0.05, max_len=N + 1, exact=False))
    assert fast.dtype == torch.float32 and fast.math_name.startswith("fused kernels (cpu, ")
    return (exact == _top1(fast, ids)).float().mean().item()


@pytest.mark.parametrize("family", sorted(TINY))
def test_fast_path_agrees_with_exact(family, tmp_path):
    model_dir = pack_tiny(tmp_path, family)
    assert _agreement(model_dir, TINY[family]["vocab_size"]) >= 0.99


def test_fast_path_agrees_with_exact_k3(tmp_path):
    from deltafin.k3_tiny import write_tiny_k3
    from deltafin.store.drives import parse_drives
    from deltafin.store.pack import PackOptions, pack

    cfg = write_tiny_k3(tmp_path / "src")
    pack(str(tmp_path / "src"), str(tmp_path / "model"), parse_drives([f"{tmp_path}/d0=1"]), PackOptions(progress=False))
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    assert _agreement(str(tmp_path / "model"), vocab) >= 0.99


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_fast_path_agrees_with_exact_on_the_avx2_build(family, tmp_path, monkeypatch):
    """The kernels of an x86 machine without AVX-512 (``DELTAFIN_CPU_ISA=avx2``: its one-token Q8 and int16
    paths, its int16 GEMM for prefill) keep the same agreement."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the ISA choice is x86's")
    from deltafin.kernels import cpu

    monkeypatch.setenv("DELTAFIN_CPU_ISA", "avx2")
    assert cpu.isa().startswith("avx2")
    model_dir = pack_tiny(tmp_path, family)
    cpu.USED.clear()
    assert _agreement(model_dir, TINY[family]["vocab_size"]) >= 0.99
    assert any(k.endswith("_q8") or "_q8_" in k for k in cpu.USED) and "int8_a16" in cpu.USED
    assert any("_gemm" in k for k in cpu.USED)


def test_exact_engine_takes_the_torch_path(tmp_path, monkeypatch):
    """--exact never reaches a fused kernel (so it stays token-identical to transformers)."""
    from deltafin.kernels import cpu

    model_dir = pack_tiny(tmp_path, "qwen3_moe")
    calls = []
    monkeypatch.setattr(cpu, "mxfp4_linear", lambda *a, **k: calls.append(1))
    eng = Engine(model_dir, EngineOptions(cache_gb=0.05, exact=True))
    eng.forward([1, 2, 3], eng.new_state())
    assert calls == []


def test_fast_engine_flushes_denormals_the_exact_one_does_not(tmp_path):
    """The CPU fast path runs with denormals flushed to zero (kernels.cpu.denormals_flushed), only inside the
    engine's math block; the exact path keeps IEEE arithmetic, so it stays token-identical to transformers."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("FTZ/DAZ are x86 control bits")
    model_dir = pack_tiny(tmp_path, "qwen3_moe")
    tiny = torch.full((1 << 20,), 1e-39)
    for exact in (False, True):
        eng = Engine(model_dir, EngineOptions(cache_gb=0.05, exact=exact))
        with eng.math():
            assert bool(torch.all(tiny * 2 == 0)) is not exact
        assert torch.all(tiny * 2 == 2e-39)
