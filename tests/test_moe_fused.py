"""The CPU fast path's one-token MoE step (``GQADecoder._moe_one``): the norm and softmax top-k routing in one compiled
call (``df_route1``), each group of experts the source hands over in one (``glu_into``), their weighted sum in slot
order in one (``df_moe_sum1``).

Its logits are not the layer-by-layer calls' bit for bit (the router's sum and the softmax's exp are the compiled
ones, not MKL's and torch's: a few ulps), so against those it is held to the same greedy tokens and logits within
1e-4 of their scale (where the build rounds the experts' activations in one int8 term, as AVX2 builds do, a
rounding 256 times coarser than two terms', the bound is 256 times wider: a few ulps in the router's input move
some activations by a whole step); against itself it is bit for bit: with no cache (every expert read and computed alone, as it
lands) and with every expert cached (one call a layer), and at 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch

from deltafin.kernels import cpu, native
from deltafin.models import common
from deltafin.models.common import softmax_topk
from deltafin.runtime.engine import Engine, EngineOptions
from tests.tiny_families import DEFAULT, LOSSLESS, build, pack_to, prompt

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"CPU kernels unavailable: {native.why()}")

FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
STEPS = 24


def _decode(model: str, monkeypatch, fused: bool = True, threads: int = 2, cache_gb: float | None = None
            ) -> tuple[torch.Tensor, list[int], int]:
    """(every decode step's logits, the greedy tokens, the fused MoE steps that ran)."""
    ran = []
    real = common.GQADecoder._moe_one

    def spy(self, *a):
        y = real(self, *a)
        ran.append(y is not None)
        return y

    with monkeypatch.context() as m:
        m.setattr(common.GQADecoder, "_moe_one", spy if fused else (lambda self, *a: None))
        n = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            eng = Engine(model, EngineOptions(exact=False, max_len=96, threads=threads, cache_gb=cache_gb))
            eng.threads = None
            st, out, toks = eng.new_state(), [], []
            tok = int(eng.forward(prompt(9), st).argmax())
            for _ in range(STEPS):
                lg = eng.forward([tok], st)
                out.append(lg.clone())
                tok = int(lg.argmax())
                toks.append(tok)
            eng.close()
        finally:
            torch.set_num_threads(n)
    return torch.stack(out), toks, sum(ran)


@pytest.fixture(scope="module", params=FAMILIES)
def packed(request, tmp_path_factory) -> tuple[str, int]:
    root = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, root / "src")
    return pack_to(root, DEFAULT), hf.config.num_hidden_layers


def test_fused_moe_step_keeps_the_layer_by_layer_tokens_and_logits(packed, monkeypatch):
    model, layers = packed
    fused, toks, ran = _decode(model, monkeypatch)
    plain, plain_toks, _ = _decode(model, monkeypatch, fused=False)
    assert ran == STEPS * layers  # every layer of every step (the prompt's tokens are not one-token steps)
    assert toks == plain_toks
    coarse = 256.0 if native.library().df_q8_terms() == 1 else 1.0
    assert (fused - plain).abs().max() <= 1e-4 * coarse * plain.abs().max()


def test_fused_moe_step_is_the_same_whatever_was_cached_and_at_any_thread_count(packed, monkeypatch):
    model, _ = packed
    cold, _, _ = _decode(model, monkeypatch, cache_gb=0.0)  # each expert read and computed alone, as it lands
    warm, _, _ = _decode(model, monkeypatch, cache_gb=1.0)  # after the first steps, a layer's experts in one group
    one, _, _ = _decode(model, monkeypatch, threads=1, cache_gb=1.0)
    assert torch.equal(cold, warm) and torch.equal(one, warm)


def test_fused_moe_step_runs_experts_it_cannot_group_one_at_a_time(tmp_path, monkeypatch):
    build("qwen3_moe", tmp_path / "src")
    model = pack_to(tmp_path, LOSSLESS)  # bf16 experts: none for glu_into (the router is float32 at load)
    grouped = []
    real = cpu.glu_into
    monkeypatch.setattr(cpu, "glu_into", lambda *a, **kw: grouped.append(real(*a, **kw)) or grouped[-1])
    fused, toks, ran = _decode(model, monkeypatch)
    plain, plain_toks, _ = _decode(model, monkeypatch, fused=False)
    assert ran == STEPS * 3 and grouped and not any(grouped)  # every step fused, its experts run one at a time
    assert toks == plain_toks and (fused - plain).abs().max() <= 1e-4 * plain.abs().max()


@pytest.mark.parametrize(("E", "D", "k", "renorm"), [(128, 2048, 8, True), (16, 64, 4, False), (8, 96, 8, True)])
def test_route1_picks_torchs_experts_with_its_weights(E, D, k, renorm):
    g = torch.Generator().manual_seed(E + k)
    x, ln, router = torch.randn(1, D, generator=g), torch.rand(D, generator=g) + 0.5, torch.randn(E, D, generator=g)
    h, ids, w = cpu.route1(x, ln, 1e-6, router, k, renorm)
    ref_h = ln * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    ref_ids, ref_w = softmax_topk(ref_h @ router.T, k, renorm)
    assert torch.allclose(h, ref_h, rtol=1e-6, atol=1e-6)
    assert ids == ref_ids[0].tolist()
    assert torch.allclose(w, ref_w[0], rtol=1e-5, atol=1e-7)
    assert cpu.route1(torch.full((1, D), float("nan")), ln, 1e-6, router, k, renorm) is None  # NaN: the torch form
    assert cpu.route1(x, ln, 1e-6, router, E + 1, renorm) is None


@pytest.mark.parametrize(("E", "D"), [(131, 2048), (514, 4096), (6, 64)])
def test_route1_logits_do_not_depend_on_the_thread_count(E, D):
    """Each router row's sum, and so the routing, is the same bits on one thread and on several (the engine picks
    its thread count by measurement), at widths that are and are not multiples of the vector."""
    g = torch.Generator().manual_seed(E)
    x, ln, router = torch.randn(1, D, generator=g), torch.rand(D, generator=g) + 0.5, torch.randn(E, D, generator=g)
    lib = native.library()
    out = []
    for nt in (1, 2, 3):
        h, ids, w = torch.empty(1, D), torch.empty(E, dtype=torch.int64), torch.empty(E)
        assert lib.df_route1(x.data_ptr(), ln.data_ptr(), 1e-6, router.data_ptr(), E, D, E, 0, h.data_ptr(),
                             ids.data_ptr(), w.data_ptr(), nt) == 0
        out.append((ids.clone(), w.clone()))  # every expert ranked: the whole softmax, in order
    for ids, w in out[1:]:
        assert torch.equal(ids, out[0][0]) and torch.equal(w, out[0][1])
    h, ids, w = cpu.route1(x, ln, 1e-6, router, min(8, E), True)
    ref_ids, _ = softmax_topk(h @ router.T, min(8, E), True)
    assert ids == ref_ids[0].tolist()


def test_moe_sum1_adds_the_weighted_slots_in_slot_order():
    g = torch.Generator().manual_seed(5)
    x, y, w = torch.randn(1, 300, generator=g), torch.randn(6, 300, generator=g), torch.rand(6, generator=g)
    ref = x.double() + (y.double() * w.double()[:, None]).sum(0, keepdim=True)
    got = cpu.moe_sum1(x, y, w)
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(cpu.moe_sum1(x, y, w), got)
