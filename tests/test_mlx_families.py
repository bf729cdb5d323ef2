"""The MLX engine on tiny models of the families added beside the original six (``tests.tiny_families``), on MLX's
CPU build, checked as ``test_mlx_engine`` checks the others: lossless packs at float32 give ``--exact``'s greedy
tokens and logits within float32 rounding; default packs (int8 trunk, MXFP4 or INT4 experts) agree with the
float32 reference on >= 99% of teacher-forced positions; a chunked prefill and a batch equal one call."""

from __future__ import annotations

import pytest
import torch

from deltafin.kernels import mlx as km
from deltafin.runtime.engine import Engine, EngineOptions
from tests import tiny_families as tf

pytestmark = pytest.mark.skipif(bool(km.available()), reason=km.available() or "mlx present")
pytest.importorskip("transformers")
FAMILIES = ("kimi_k25", "glm4_moe", "minimax_m2", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe",
            "deepseek_v4")
# longer than the DSA tiny models' index_topk (4), so the indexer's choice matters; V4's (window 8, CSA every 4
# tokens with a top 4, HCA every 16) with its new tokens passes the window, the top k and several entries of each
PROMPT = [3, 17, 42, 99, 5, 200, 61, 8, 150, 33]
PROMPTS = {"deepseek_v4": tf.prompt(40)}
# the indexer's choice; the DeltaNet state; V4's window, compressors and indexer
CHUNKED = ("deepseek_v32", "glm_moe_dsa", "qwen3_next", "deepseek_v4")
# the optional parts of a family switched on, so that they are checked too
# and DSA with 8 indexer heads (with 2, many scores tie at 0 and the top k is the tie-break's: tests/tiny_families)
OVERRIDES = {"glm4_moe": dict(use_qk_norm=True, attention_bias=True), "deepseek_v32": dict(index_n_heads=8),
             "glm_moe_dsa": dict(index_n_heads=8)}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    made: dict[tuple[str, str], str] = {}
    sources: dict[str, object] = {}

    def get(family: str, codecs: str) -> str:
        if family not in sources:
            sources[family] = root = tmp_path_factory.mktemp(family)
            if family == "kimi_k25":
                tf.kimi_k25(root)
            else:
                tf.build(family, root / "src", **OVERRIDES.get(family, {}))
        if (family, codecs) not in made:
            sub = sources[family] / codecs
            sub.mkdir()
            (sub / "src").symlink_to(sources[family] / "src")
            made[family, codecs] = tf.pack_to(sub, tf.LOSSLESS if codecs == "bf16" else tf.DEFAULT)
        return made[family, codecs]

    return get


def _engine(model: str, device: str, exact: bool, dtype: str = "auto") -> Engine:
    return Engine(model, EngineOptions(device=device, exact=exact, dtype=dtype, cache_gb=0.0005))


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_pack_greedy_tokens_equal_exact(packs, family):
    model, p = packs(family, "bf16"), PROMPTS.get(family, PROMPT)
    ref = _engine(model, "cpu", True)
    want = [t for t, _ in ref.generate(p, 24)]
    ref_logits = ref.forward_batch([(p, ref.new_state())])[0]
    ref.close()
    e = _engine(model, "mlx", True)
    assert e.mlx and e.math_name.startswith("mlx (cpu), exact float32")
    got = [t for t, _ in e.generate(p, 24)]
    logits = e.forward_batch([(p, e.new_state())])[0]
    assert e.source.stats.reads > 0
    e.close()
    assert got == want
    assert torch.allclose(logits, ref_logits, rtol=0, atol=1e-4 * ref_logits.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_default_pack_teacher_forced_top1_against_float32(packs, family):
    model = packs(family, "default")
    ids = torch.randint(0, 256, (96,), generator=torch.Generator().manual_seed(1))
    outs = []
    experts = "int4" if family == "kimi_k25" else "mxfp4"  # as released, or packed
    for device, exact, dtype in (("cpu", True, "auto"), ("mlx", False, "f32")):
        km.USED.clear()
        e = _engine(model, device, exact, dtype)
        outs.append(e.step([(ids, e.new_state())], all_logits=True)[0])
        if device == "mlx":
            assert "float32 activations" in e.math_name
            assert any(k.startswith(f"mlx:{experts}") and "gather" in k for k in km.USED), km.USED
        e.close()
    agree = (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"{family}: teacher-forced top-1 {agree:.3f}"


@pytest.mark.parametrize("family", CHUNKED)
def test_decode_after_chunked_prefill_and_a_batch(packs, family):
    """A prompt prefilled in two calls gives the logits of one call over it all; two sequences in one step give
    each one's own logits; a copied state steps alike."""
    e, p = _engine(packs(family, "bf16"), "mlx", True), PROMPTS.get(family, PROMPT)
    cut = len(p) // 2 + 1  # off the compressors' windows
    one = e.forward_batch([(p, e.new_state())])[0]
    tol = 1e-4 * one.abs().max().item()
    st = e.new_state()
    e.forward_batch([(p[:cut], st)])
    two = e.forward_batch([(p[cut:], st)])[0]
    assert torch.allclose(one, two, atol=tol)
    a, b = e.forward_batch([(p, e.new_state()), (p[:3], e.new_state())])
    assert torch.allclose(a, one, atol=tol)
    assert torch.allclose(b, e.forward_batch([(p[:3], e.new_state())])[0], atol=tol)
    twin = e.copy_state(st)
    nxt = e.forward_batch([([7], st)])[0]
    assert torch.equal(e.forward_batch([([7], twin)])[0], nxt)
    e.close()
