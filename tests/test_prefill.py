"""Expert-major prefill: each touched expert read once per prompt, same results as token by token."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from deltafin.errors import UsageError
from deltafin.k3_tiny import write_tiny_k3
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.runtime.prefill_plan import plan_prefill
from deltafin.store.drives import parse_drives
from deltafin.store.pack import PackOptions, pack
from deltafin.tiny import build_tiny

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 1, 2, 3, 4, 200, 31], [9, 8, 7, 6, 5], [100, 101, 102, 103, 7, 7, 7]]


def _pack(root, build) -> str:
    build(root / "src")
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
         PackOptions(progress=False))
    return str(root / "model")


@pytest.fixture(scope="module", params=["kimi_k3", "deepseek_v3", "glm4_moe_lite", "qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi_k3":
        return _pack(root, write_tiny_k3)
    return _pack(root, lambda p: build_tiny(request.param, p))


class CountingReaders:
    """Wrap the engine's readers to count reads per expert file."""

    def __init__(self, eng: Engine):
        self.opened: Counter[str] = Counter()
        for r in eng.source.readers:
            orig = r.read_into

            def read_into(path, offset, buf, _orig=orig):
                self.opened[path] += 1
                return _orig(path, offset, buf)

            r.read_into = read_into


def _engine(model_dir: str, **kw) -> Engine:
    kw.setdefault("cache_gb", 0.0)
    return Engine(model_dir, EngineOptions(**{"exact": True, **kw}))


def test_cold_prefill_reads_each_touched_expert_once(model_dir):
    eng = _engine(model_dir)
    counts = CountingReaders(eng)
    try:
        (_,), rep = eng.prefill([PROMPTS[0]], [eng.new_state()])
    finally:
        eng.close()
    assert rep.chunk == len(PROMPTS[0])
    assert rep.read_amplification == 1.0
    assert rep.bytes_read == rep.unique_bytes > 0
    assert max(counts.opened.values()) == 1  # every expert file opened at most once for the prompt
    assert sum(rep.union_per_layer.values()) == len(counts.opened)


def test_prefill_equals_token_by_token(model_dir):
    eng = _engine(model_dir, cache_gb=1.0)
    try:
        (whole,), _ = eng.prefill([PROMPTS[0]], [eng.new_state()])
        st = eng.new_state()
        for t in PROMPTS[0]:
            step = eng.forward([t], st)
        gen_a = [t for t, _ in eng.generate(PROMPTS[0], 8)]
    finally:
        eng.close()
    assert torch.allclose(whole, step, rtol=0, atol=1e-4 * float(step.abs().max()))
    assert int(whole.argmax()) == int(step.argmax())
    assert len(gen_a) == 8


def test_batched_prefill_matches_alone(model_dir):
    eng = _engine(model_dir)
    try:
        alone = [eng.prefill([p], [eng.new_state()])[0][0] for p in PROMPTS]
        alone_bytes = eng.source.stats.bytes_read
        together, rep = eng.prefill(PROMPTS, [eng.new_state() for _ in PROMPTS])
    finally:
        eng.close()
    for a, b in zip(alone, together, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max()))
        assert int(a.argmax()) == int(b.argmax())
    assert rep.read_amplification == 1.0
    assert rep.bytes_read < alone_bytes  # the prompts shared their reads


def test_small_budget_chunks_and_still_matches(model_dir):
    eng = _engine(model_dir, cache_gb=0.0)
    try:
        (whole,), rep_whole = eng.prefill([PROMPTS[0]], [eng.new_state()])
        eng.prefill_bytes = _budget_for_chunk(eng, 4)
        (chunked,), rep = eng.prefill([PROMPTS[0]], [eng.new_state()])
    finally:
        eng.close()
    assert rep_whole.chunk == len(PROMPTS[0]) and 1 <= rep.chunk < len(PROMPTS[0])
    assert torch.allclose(whole, chunked, rtol=0, atol=1e-4 * float(whole.abs().max()))


def _budget_for_chunk(eng: Engine, chunk: int) -> int:
    from deltafin.runtime.prefill_plan import activation_bytes, plan_prefill

    tc = eng.packed.text_config
    state = plan_prefill(tc, len(PROMPTS[0]), 0, 1 << 40).state_bytes
    return state + activation_bytes(tc, chunk, chunk)


def test_prompt_that_cannot_fit_is_refused_before_work(model_dir):
    eng = _engine(model_dir, prefill_gb=1e-9)
    try:
        with pytest.raises(UsageError, match="GB"):
            eng.prefill([PROMPTS[0]], [eng.new_state()])
        assert eng.source.stats.reads == 0
    finally:
        eng.close()


def test_plan_rule_whole_prompt_when_it_fits():
    tc = {"hidden_size": 7168, "num_attention_heads": 96, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
          "num_hidden_layers": 93, "num_experts_per_token": 16, "routed_expert_hidden_size": 3584,
          "moe_intermediate_size": 3072, "intermediate_size": 33792,
          "linear_attn_config": {"full_attn_layers": list(range(24)), "kda_layers": list(range(69)),
                                 "num_heads": 96, "head_dim": 128}}
    p = plan_prefill(tc, 512, 0, 8 << 30)
    assert p.chunk == 512 and p.chunks == 1
    small = plan_prefill(tc, 8192, 0, 8 << 30)
    assert small.chunk < 8192 and small.state_bytes + small.activation_bytes <= 8 << 30


def test_moe_dispatch_slots_whatever_the_arrival_order_and_the_layer_before():
    """Many tokens: each expert's products land in its (token, slot) places and are summed over slots, bit for bit
    the per-slot sum, whatever order the experts arrive in; the slot buffer kept from the layer before (larger,
    other values, made in or out of inference mode) leaves nothing behind."""
    from deltafin.models.base import moe_dispatch

    class Source:
        def __init__(self, order):
            self.order = order

        def fetch(self, layer, wanted):
            assert wanted == sorted(wanted)
            yield from ((e, e) for e in (wanted if self.order == "up" else reversed(wanted)))

    def expert(x, e):
        return x * (e + 1) - e

    g = torch.Generator().manual_seed(0)
    for T, D, mode, order in ((40, 24, True, "up"), (9, 16, True, "down"), (9, 16, False, "up"), (1, 16, True, "down")):
        k, E = 4, 7
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        ref = torch.zeros(T, k, D)
        for t in range(T):
            for s in range(k):
                e = int(ids[t, s])
                ref[t, s] = expert(x[t : t + 1], e)[0] * w[t, s]
        with torch.inference_mode(mode):
            y = moe_dispatch(x, ids, w, 0, Source(order), expert)
        assert torch.equal(y, ref.sum(1)), (T, D, mode, order)
