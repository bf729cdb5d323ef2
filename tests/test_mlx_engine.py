"""The MLX engine (``--device mlx``, deltafin/mlx/) on tiny models of each family it runs, on MLX's CPU build:
with float32 activations on lossless (bf16) packs the greedy tokens equal ``--exact``'s and the logits stay within
float32 rounding of them; on default packs (int8 trunk, MXFP4 experts) with float32 activations the teacher-forced
top-1 agrees with the float32 reference on >= 99% of positions. Experts are streamed from the packed drives into the
MLX slab (a small cache, so slots are reused within the run)."""

from __future__ import annotations

import pytest
import torch

from deltafin.errors import UsageError
from deltafin.k3_tiny import write_tiny_k3
from deltafin.kernels import mlx as km
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.store.drives import parse_drives
from deltafin.store.pack import PackOptions, pack
from tests.tiny import pack_tiny

pytestmark = pytest.mark.skipif(bool(km.available()), reason=km.available() or "mlx present")
FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe_lite", "kimi_k3")
PROMPT = [3, 17, 42, 99, 5, 200, 61]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    made = {}

    def get(family: str, codecs: str) -> str:
        if (family, codecs) not in made:
            opts = dict(experts="bf16", trunk="bf16") if codecs == "bf16" else {}
            root = tmp_path_factory.mktemp(f"{family}-{codecs}")
            made[family, codecs] = _pack_k3(root, opts) if family == "kimi_k3" else pack_tiny(root, family, **opts)
        return made[family, codecs]

    return get


def _pack_k3(root, opts: dict) -> str:
    """deltafin.k3_tiny's Kimi K3 (transformers has no class for it), packed as ``pack_tiny`` packs the others."""
    write_tiny_k3(root / "src")
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
         PackOptions(progress=False, **opts))
    return str(root / "model")


def _engine(model: str, device: str, exact: bool, dtype: str = "auto") -> Engine:
    return Engine(model, EngineOptions(device=device, exact=exact, dtype=dtype, cache_gb=0.0005))


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_pack_greedy_tokens_equal_exact(packs, family):
    model = packs(family, "bf16")
    ref = _engine(model, "cpu", True)
    want = [t for t, _ in ref.generate(PROMPT, 32)]
    ref_logits = ref.forward_batch([(PROMPT, ref.new_state())])[0]
    ref.close()
    e = _engine(model, "mlx", True)
    assert e.mlx and e.math_name.startswith("mlx (cpu), exact float32")
    got = [t for t, _ in e.generate(PROMPT, 32)]
    logits = e.forward_batch([(PROMPT, e.new_state())])[0]
    s = e.source
    assert s.stats.reads > 0 and s.mlx_slab.waits >= 0 and any("mlx:" in k for k in km.USED)
    e.close()
    assert got == want
    assert torch.allclose(logits, ref_logits, rtol=0, atol=1e-4 * ref_logits.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_default_pack_teacher_forced_top1_against_float32(packs, family):
    model = packs(family, "default")
    ids = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(1))
    outs = []
    for device, exact, dtype in (("cpu", True, "auto"), ("mlx", False, "f32")):
        e = _engine(model, device, exact, dtype)
        outs.append(e.step([(ids, e.new_state())], all_logits=True)[0])
        if device == "mlx":
            assert "float32 activations" in e.math_name and "mlx:mxfp4_gather_qmm" in km.USED
        e.close()
    agree = (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"{family}: teacher-forced top-1 {agree:.3f}"


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])  # K3: its KDA state and AttnRes carry
def test_decode_after_chunked_prefill_and_a_batch(packs, family):
    """A prompt prefilled in two calls, then decoded, gives the logits of one call over it all; two sequences in one
    step give each one's own logits (the MoE part runs on their tokens together); a copied state steps alike."""
    e = _engine(packs(family, "bf16"), "mlx", True)
    one = e.forward_batch([(PROMPT, e.new_state())])[0]
    st = e.new_state()
    e.forward_batch([(PROMPT[:4], st)])
    two = e.forward_batch([(PROMPT[4:], st)])[0]
    assert torch.allclose(one, two, atol=1e-4 * one.abs().max().item())
    a, b = e.forward_batch([(PROMPT, e.new_state()), (PROMPT[:3], e.new_state())])
    assert torch.allclose(a, one, atol=1e-4 * one.abs().max().item())
    assert torch.allclose(b, e.forward_batch([(PROMPT[:3], e.new_state())])[0], atol=1e-4 * one.abs().max().item())
    twin = e.copy_state(st)
    nxt = e.forward_batch([([7], st)])[0]
    assert torch.equal(e.forward_batch([([7], twin)])[0], nxt)
    e.close()


def test_runs_are_bit_identical(packs):
    model = packs("mixtral", "default")
    runs = []
    for _ in range(2):
        e = _engine(model, "mlx", False, "f32")
        runs.append(e.forward_batch([(PROMPT, e.new_state())])[0])
        e.close()
    assert torch.equal(runs[0], runs[1])


def test_every_family_runs_on_mlx():
    from deltafin.mlx.engine import DECODERS
    from deltafin.mlx.model import FAMILIES as RUNS
    from deltafin.models import registry

    assert set(RUNS) == set(registry.MODULES) and set(DECODERS) <= set(RUNS)


def test_a_family_mlx_does_not_run_yet_is_refused_before_loading(tmp_path, monkeypatch):
    """Every family runs on MLX now; a family left out of ``mlx.model.FAMILIES`` (as a new one would be) is refused
    with one line naming --device cpu before the trunk loads."""
    import re

    from deltafin.mlx import model as mlx_model
    from deltafin.store.model_dir import PackedModel

    runs = tuple(f for f in mlx_model.FAMILIES if f != "mixtral")
    monkeypatch.setattr(mlx_model, "FAMILIES", runs)
    model = pack_tiny(tmp_path, "mixtral")
    monkeypatch.setattr(PackedModel, "trunk_records", lambda *a, **k: pytest.fail("the trunk loaded"))
    with pytest.raises(UsageError, match=re.escape(f"--device mlx runs {', '.join(runs)} so far, not mixtral; "
                                                   "use --device cpu")):
        _engine(model, "mlx", True)
