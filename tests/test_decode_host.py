"""The host work around a decode step's kernels: small 16-bit records widened once, the rope table kept between
layers, one token's slot buffer from a few ops. Each gives what the longer way gave, bit for bit."""

from __future__ import annotations

import torch

from deltafin.models.base import _weighted_slots
from deltafin.models.rope import Rope
from deltafin.quant.record import QTensor, dequantize
from deltafin.runtime.engine import WIDEN_ELEMENTS, widen_small


def test_small_16_bit_records_become_exact_float32():
    g = torch.Generator().manual_seed(0)
    norm = QTensor("bf16", (64,), torch.randn(64, generator=g).to(torch.bfloat16))
    router = QTensor("f16", (8, 64), torch.randn(8, 64, generator=g).half())
    big = QTensor("bf16", (WIDEN_ELEMENTS + 1,), torch.zeros(WIDEN_ELEMENTS + 1, dtype=torch.bfloat16))
    q = QTensor("int8", (4, 64), torch.randint(-127, 128, (4, 64), dtype=torch.int8, generator=g), torch.rand(4))
    out = widen_small({"n": norm, "r": router, "big": big, "q": q})
    assert out["n"].format == out["r"].format == "f32" and out["big"] is big and out["q"] is q
    for k, w in (("n", norm), ("r", router)):
        assert torch.equal(dequantize(out[k]), dequantize(w)) and out[k].shape == w.shape


def test_rope_table_kept_for_the_same_positions_only():
    rope = Rope({"rope_type": "default", "rope_theta": 10000.0}, 16, 128)
    c1, s1 = rope.cos_sin(5, 1)
    assert rope.cos_sin(5, 1)[0] is c1  # the next layer's ask
    c2, s2 = rope.cos_sin(6, 1)
    fresh = Rope({"rope_type": "default", "rope_theta": 10000.0}, 16, 128)
    assert torch.equal(c2, fresh.cos_sin(6, 1)[0]) and torch.equal(s2, fresh.cos_sin(6, 1)[1])
    assert not torch.equal(c1, c2) and torch.equal(rope.cos_sin(5, 3)[0][0], c1[0])


def test_one_token_slots_match_slot_by_slot():
    g = torch.Generator().manual_seed(1)
    ys = [torch.randn(1, 32, generator=g) for _ in range(4)]
    w = torch.rand(4, generator=g)
    x = torch.zeros(1, 32)
    ref = x.new_zeros(1, 4, 32)
    for s, y in enumerate(ys):
        ref[0, s] = y[0] * w[s]
    assert torch.equal(_weighted_slots(list(ys), w, x), ref)
    part = _weighted_slots([ys[0], None, ys[2], None], w, x)  # slots another rank computes read zero
    assert torch.equal(part[0, 1], torch.zeros(32)) and torch.equal(part[0, 2], ref[0, 2])
    assert torch.equal(part.sum(1), ref[:, [0, 2]].sum(1))
