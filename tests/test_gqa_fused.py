"""The CPU fast path's one-token GQA attention block in one compiled call (``df_gqa1`` through ``kernels.gqa_one``):
its logits are those of the separate calls it replaces, bit for bit, in every family that takes it, with q/k norms
or none, biases, a partial rotation, a sliding window, the KV cache grown past its first buffer, and at 1 and 2
threads; where it does not apply (a bf16 trunk, the exact path) the separate calls run."""

from __future__ import annotations

import pytest
import torch

from deltafin.kernels import cpu, native
from deltafin.models import common
from deltafin.runtime.engine import Engine, EngineOptions
from tests.tiny_families import DEFAULT, LOSSLESS, build, pack_to, prompt

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"CPU kernels unavailable: {native.why()}")

# (family, overrides): no q/k norm; per-head q/k norms; GLM's partial rotation with biases and norms, and without
CASES = {
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}),
    "glm4_bias_norms": ("glm4_moe", {"attention_bias": True, "use_qk_norm": True}),
    "glm4_plain": ("glm4_moe", {}),
}
STEPS = 56  # with the 12-token prompt, past the cache's first 64 rows


def _decode(model: str, fused: bool, monkeypatch, threads: int = 2, exact: bool = False) -> tuple[torch.Tensor, int]:
    """(every decode step's logits, the fused calls that ran) for greedy steps after a prompt."""
    ran = []
    real = cpu.gqa_one

    def spy(*a, **kw):
        y = real(*a, **kw)
        ran.append(y is not None)
        return y

    with monkeypatch.context() as m:
        m.setattr(cpu, "gqa_one", spy)
        if not fused:
            m.setattr(common.GQADecoder, "_attn_one", lambda *a: None)
        n = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            eng = Engine(model, EngineOptions(exact=exact, max_len=128, threads=threads))
            eng.threads = None  # the thread count as set here
            st, out = eng.new_state(), []
            tok = int(eng.forward(prompt(12), st).argmax())
            for _ in range(STEPS):
                lg = eng.forward([tok], st)
                out.append(lg.clone())
                tok = int(lg.argmax())
            eng.close()
        finally:
            torch.set_num_threads(n)
    return torch.stack(out), sum(ran)


@pytest.fixture(scope="module", params=sorted(CASES))
def packed(request, tmp_path_factory) -> tuple[str, int]:
    family, over = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = build(family, root / "src", **over)
    return pack_to(root, DEFAULT), hf.config.num_hidden_layers


def test_fused_attention_block_gives_the_separate_calls_logits_bit_for_bit(packed, monkeypatch):
    model, layers = packed
    fused, ran = _decode(model, True, monkeypatch)
    plain, ran_plain = _decode(model, False, monkeypatch)
    assert ran == STEPS * layers and ran_plain == 0  # every layer of every step took it, and none in the other run
    assert torch.equal(fused, plain)
    one, _ = _decode(model, True, monkeypatch, threads=1)
    assert torch.equal(one, fused)


def test_fused_attention_block_stays_off_where_it_does_not_apply(tmp_path, monkeypatch):
    build("qwen3_moe", tmp_path / "src")
    model = pack_to(tmp_path, LOSSLESS)  # a bf16 trunk: no int8 rows to fuse
    fast, ran = _decode(model, True, monkeypatch)
    plain, _ = _decode(model, False, monkeypatch)
    assert ran == 0 and torch.equal(fast, plain)
    exact, ran_exact = _decode(model, True, monkeypatch, exact=True)  # the exact path never asks
    assert ran_exact == 0 and exact.shape == fast.shape


def test_gqa_table_refuses_records_it_does_not_cover():
    from deltafin.quant.record import QTensor

    D, H, Hkv, d = 64, 4, 2, 16

    def int8(o, i):
        return QTensor("int8", (o, i), torch.zeros(o, i, dtype=torch.int8), torch.ones(o))

    ln = torch.ones(D)
    q, k, v, o = int8(H * d, D), int8(Hkv * d, D), int8(Hkv * d, D), int8(D, H * d)
    assert cpu.gqa_table(D, H, Hkv, d, d, ln, q, k, v, o) is not None
    assert cpu.gqa_table(D, H, Hkv, d, d, ln, q, k, v, torch.zeros(D, H * d)) is None  # a plain tensor
    assert cpu.gqa_table(D, H, Hkv, d, d, ln, q, int8(Hkv * d, D + 32), v, o) is None  # another input width
    assert cpu.gqa_table(D, H, Hkv, d, d + 2, ln, q, k, v, o) is None  # a rotation wider than the head
