"""The CPU fast path's attention (``df_attend_rows``, one token or a prompt), RMSNorm and rotation
(``df_rms_rows``, ``df_rope1``) against their torch forms, and the places that take them.

Tolerance: each is a float32 evaluation of the same formula in another order, so results agree to a few ulps of
the magnitudes summed (checked against float64 at 2e-6 relative to sum |terms|). They are compared bit for bit
with themselves at 1 and 2 threads and in any batch: a sum's order is fixed when the library is built.
"""

from __future__ import annotations

import pytest
import torch

from deltafin import kernels
from deltafin.kernels import cpu, native
from deltafin.models import layers, rope

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"CPU kernels unavailable: {native.why()}")


def _cache(Hkv: int, S: int, d: int, cap: int, g: torch.Generator) -> torch.Tensor:
    """Keys or values as the KV cache holds them: the first S rows of a [Hkv, cap, d] buffer."""
    return torch.randn(Hkv, cap, d, generator=g)[:, :S]


def _exact_rows(q, k, v, pos, scale, window, sinks):
    """float64 causal attention of q [T, H, dk] at positions pos.. and the bound a float32 evaluation keeps to."""
    T, H, _ = q.shape
    G = H // k.shape[0]
    qd, kd, vd = q.double(), k.double().repeat_interleave(G, 0), v.double().repeat_interleave(G, 0)
    s = torch.einsum("thc,hsc->ths", qd, kd) * scale
    i, j = torch.arange(T)[:, None] + pos, torch.arange(k.shape[1])[None]
    hide = (j > i) | ((i - j >= window) if window else torch.zeros_like(j > i))
    s = s.masked_fill(hide[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double()[None, :, None].expand(T, H, 1)), -1)
    p = torch.softmax(s, -1)[..., : k.shape[1]]
    o = torch.einsum("ths,hsc->thc", p, vd)
    # a score's float32 sum errs by at most dk ulps of its sum |q k| (times the scale), and moves the output by that
    # much of |v_s - o| <= |v_s| + |o| per key
    pe = p * qd.shape[-1] * 2.0**-24 * scale * torch.einsum("thc,hsc->ths", qd.abs(), kd.abs())
    moved = torch.einsum("ths,hsc->thc", pe, vd.abs()) + pe.sum(-1, keepdim=True) * o.abs()
    return o, 2e-6 * torch.einsum("ths,hsc->thc", p, vd.abs()) + moved + 1e-7


ROWS_CASES = [  # T, pos, H, Hkv, dk, dv, window, sinks: key blocks cut short, odd head groups, windows, sinks
    (37, 0, 8, 2, 64, 64, None, False), (100, 21, 6, 3, 40, 24, None, True), (130, 0, 4, 4, 128, 128, 33, False),
    (5, 70, 16, 2, 128, 128, None, False), (200, 300, 8, 1, 96, 80, 64, True), (1, 9, 4, 2, 16, 16, None, True),
    (64, 64, 2, 2, 8, 8, 1, False), (70, 0, 3, 1, 20, 70, None, False), (1, 40, 32, 4, 128, 128, None, False),
    (1, 0, 8, 8, 64, 32, None, False), (1, 299, 6, 2, 48, 48, None, False), (1, 699, 32, 4, 128, 128, 100, False)]


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_attend_rows_matches_float64_and_gives_each_query_the_same_bits_however_the_prompt_is_cut(isa):
    """Every build against float64; then each query's row bit for bit the same whether the prompt comes in one call
    or in pieces (so in any batch and any chunking of a prompt) and at 1 or 2 threads."""
    import platform

    if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 build")
    lib = native.library(native.ISA_FLAGS[isa]) if isa != "native" else native.library()
    g = torch.Generator().manual_seed(11)
    n = torch.get_num_threads()
    for T, pos, H, Hkv, dk, dv, window, sk in ROWS_CASES:
        S = pos + T
        q = torch.randn(T, H, dk, generator=g)
        k, v = _cache(Hkv, S, dk, S + 7, g) * 2, _cache(Hkv, S, dv, S + 3, g)
        sinks = torch.randn(H, generator=g) if sk else None
        scale = dk**-0.5
        try:
            torch.set_num_threads(2)
            got = cpu.attend_rows(q, k, v, pos, scale, window, sinks, lib=lib)
            parts, t = [], 0
            for m in (3, 11, 1, 50, 1000):
                m = min(m, T - t)
                if m > 0:
                    parts.append(cpu.attend_rows(q[t : t + m], k[:, : pos + t + m], v[:, : pos + t + m], pos + t,
                                                 scale, window, sinks, lib=lib))
                t += m
            torch.set_num_threads(1)
            one = cpu.attend_rows(q, k, v, pos, scale, window, sinks, lib=lib)
        finally:
            torch.set_num_threads(n)
        exact, bound = _exact_rows(q, k, v, pos, scale, window, sinks)
        assert got.shape == (T, H, dv)
        assert ((got.double() - exact).abs() <= bound).all(), (T, pos, H, Hkv, dk, dv, window, sk)
        assert torch.equal(torch.cat(parts), got) and torch.equal(one, got)
    q, k, v = torch.randn(4, 8, 64), _cache(2, 9, 64, 16, g), _cache(2, 9, 64, 16, g)
    assert cpu.attend_rows(q.bfloat16(), k, v, 5, 0.1, lib=lib) is None  # another dtype: the torch form
    assert cpu.attend_rows(q, k, v, 4, 0.1, lib=lib) is None  # S != pos + T
    assert cpu.attend_rows(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 5, 0.1, lib=lib) is None


def test_rms_rows_and_rope1_match_their_torch_forms():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 2048, generator=g) * 3, torch.rand(2048, generator=g) + 0.5
    xd = x.double()
    exact = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(cpu.rms_rows(x, w, 1e-6).double(), exact, rtol=2e-6, atol=1e-7)
    h = torch.randn(1, 4, 128, generator=g)
    for r in (128, 64):  # whole heads, and a partial rotary width (the rest passes through)
        cos, sin = torch.rand(1, r // 2, generator=g), torch.rand(1, r // 2, generator=g)
        with kernels.fast(False):
            ref = rope.apply_rope(h, cos, sin)
        got = cpu.rope1(h, cos, sin)
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6) and torch.equal(got[..., r:], h[..., r:])
    assert not torch.equal(got, h)  # a new tensor: the input is left as it was


def test_the_model_layers_take_them_on_the_fast_path_only(monkeypatch):
    """Attention, norms and rotations dispatch to the compiled calls on the CPU's fast path (attention at one token
    and in a prompt); the exact path (the reference) keeps the torch forms."""
    from deltafin.models import base

    calls: list[str] = []
    for name in ("attend_rows", "rms_rows", "rope1"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _n=name, _f=real, **k: (calls.append(_n), _f(*a, **k))[1])
    x, w = torch.randn(1, 64), torch.rand(64)
    h, cs, sn = torch.randn(1, 8, 64), torch.rand(1, 32), torch.rand(1, 32)
    q1, kk, vv = torch.randn(1, 8, 64), torch.randn(2, 9, 64), torch.randn(2, 9, 64)
    with kernels.fast(False):
        base.rms_norm(x, w, 1e-6), rope.apply_rope(h, cs, sn), layers.attention(q1, kk, vv, 8, 0.125)
        layers.attention(torch.randn(3, 8, 64), kk, vv, 6, 0.125)
    assert calls == []  # the reference path: torch only
    with kernels.fast(True):
        base.rms_norm(x, w, 1e-6), rope.apply_rope(h, cs, sn), layers.attention(q1, kk, vv, 8, 0.125)
        layers.attention(torch.randn(3, 8, 64), kk, vv, 6, 0.125)  # a prompt of 3 tokens
    assert calls == ["rms_rows", "rope1", "attend_rows", "attend_rows"]
    monkeypatch.undo()
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 8, 64, generator=g), _cache(2, 9, 64, 16, g), _cache(2, 9, 64, 16, g)
    with kernels.fast(False):
        ref = layers.attention(q, k, v, 8, 0.125)
    with kernels.fast(True):
        fast = layers.attention(q, k, v, 8, 0.125)
        windowed = layers.attention(q, k, v, 8, 0.125, window=4)
    assert torch.equal(fast, cpu.attend_rows(q, k, v, 8, 0.125)) and torch.allclose(fast, ref, atol=1e-6)
    assert torch.equal(windowed, cpu.attend_rows(q, k, v, 8, 0.125, 4))  # keys 5..8 only
    with kernels.fast(False):
        assert torch.allclose(windowed, layers.attention(q, k, v, 8, 0.125, window=4), atol=1e-6)
