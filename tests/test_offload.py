"""Partial GPU offload without a GPU: the placement plan over byte budgets, the option checks, and the split
machinery (two models of a family over stand-in records, the hand-over, per-layer state, the split expert source)
run with both sides on the CPU, where it must give the unsplit model's logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafin.errors import UsageError
from deltafin.models import registry
from deltafin.runtime import offload
from deltafin.runtime.batch import forward_batch
from deltafin.runtime.offload_plan import (
    OffloadPlan,
    TrunkSizes,
    check_offload_args,
    plan_offload,
    split_cache,
)
from deltafin.runtime.source import StreamingExperts
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import pack
from deltafin.tiny import TINY
from tests import tiny_families as tf

MB = 10**6
SIZES = TrunkSizes(layers=(10 * MB,) * 8, embed=30 * MB, head=20 * MB)  # 130 MB in all


# ------------------------------------------------------------------------------------------------ the plan


def test_plan_takes_the_last_layers_and_the_head_that_fit():
    p = plan_offload(SIZES, budget=75 * MB, headroom=5 * MB)  # room 70: head 20 + 5 layers of 10
    assert (p.gpu_layers, p.first_gpu, p.split) == (5, 3, True)
    assert [p.on_gpu(i) for i in range(8)] == [False] * 3 + [True] * 5
    assert (p.gpu_bytes, p.cpu_bytes) == (70 * MB, 60 * MB)
    assert p.describe().startswith("GPU: layers 3-7 + head (70.0 MB), CPU: layers 0-2 + embeddings (60.0 MB)")


def test_plan_whole_trunk_when_it_fits_and_never_all_layers_without_the_embeddings():
    assert plan_offload(SIZES, 135 * MB, 5 * MB).all_gpu
    p = plan_offload(SIZES, 134 * MB, 5 * MB)  # every layer and the head fit, the embeddings do not
    assert p.gpu_layers == 7 and "CPU: layer 0 + embeddings" in p.describe()


def test_plan_too_small_for_the_head_runs_on_the_cpu_unless_capped():
    p = plan_offload(SIZES, 20 * MB, 5 * MB)
    assert p.gpu_layers == 0 and "GPU: none" in p.describe() and "+ head" in p.describe()
    with pytest.raises(UsageError, match=r"--gpu-memory-gb 0.02: the head and the last layer need 0.04 GB.*"
                                         r"--gpu-memory-gb 0.04 or more"):
        plan_offload(SIZES, 20 * MB, 5 * MB, cap_gb=0.02)


def test_plan_given_layers():
    assert plan_offload(SIZES, 10**12, 5 * MB, gpu_layers=0).gpu_layers == 0
    assert plan_offload(SIZES, 10**12, 5 * MB, gpu_layers=8).all_gpu
    assert plan_offload(SIZES, 10**12, 5 * MB, gpu_layers=4).gpu_bytes == 60 * MB
    with pytest.raises(UsageError, match="--gpu-layers 9: this model has 8 layers; give 0 .* to 8"):
        plan_offload(SIZES, 10**12, 5 * MB, gpu_layers=9)
    with pytest.raises(UsageError, match=r"--gpu-layers 6: .* 0.08 GB .*--gpu-memory-gb \(0.07 GB\).*"
                                         r"--gpu-layers 4 or fewer or raise --gpu-memory-gb"):
        plan_offload(SIZES, 70 * MB, 5 * MB, gpu_layers=6, cap_gb=0.07)
    with pytest.raises(UsageError, match="the memory free on cuda:0"):
        plan_offload(SIZES, 70 * MB, 5 * MB, gpu_layers=6, where="cuda:0")


def test_sizes_from_a_manifest_count_records_as_loaded_and_a_tied_head_reads_the_table():
    t = {"model.embed_tokens.weight": {"format": "bf16", "shape": [100, 8]},
         "model.norm.weight": {"format": "f32", "shape": [8]},
         "model.layers.0.mlp.gate_proj.weight": {"format": "int8", "shape": [16, 8]},
         "model.layers.1.self_attn.q_proj.weight": {"format": "bf16", "shape": [8, 8]}}
    s = TrunkSizes.from_manifest(t, 2)
    assert (s.layers, s.embed, s.head) == ((16 * 8 + 16 * 4, 128), 1600, 32 + 1600)
    s = TrunkSizes.from_manifest({**t, "lm_head.weight": {"format": "int8", "shape": [100, 8]}}, 2)
    assert s.head == 32 + 800 + 400


def test_cache_shared_by_the_moe_layers_on_each_side():
    p = OffloadPlan(8, 2, 0, 0, "")
    assert split_cache(1000, range(1, 8), p) == (285, 715)  # 2 of 7 MoE layers on the GPU


def test_option_checks_name_the_option_and_the_fix():
    check_offload_args(40, 24.0, "cuda")
    check_offload_args(0, None, "cpu")
    check_offload_args(None, None, "cpu")
    with pytest.raises(UsageError, match="--gpu-layers -1: .*0 or more"):
        check_offload_args(-1, None, "cuda")
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="--gpu-memory-gb"):
            check_offload_args(None, bad, "cuda")
    with pytest.raises(UsageError, match="--gpu-layers: .*--device cpu .*use --device cuda, or drop --gpu-layers"):
        check_offload_args(40, None, "cpu")
    with pytest.raises(UsageError, match="--gpu-memory-gb: .*--device mps"):
        check_offload_args(None, 8.0, "mps")


# ------------------------------------------------------------------------------------------------ the CLI


def _run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    from deltafin import cli

    rc = cli.main(argv)
    return rc, capsys.readouterr().err


def test_cli_takes_the_llama_cpp_spellings_and_refuses_bad_values_before_loading(capsys, tmp_path):
    from deltafin import cli

    p = cli.build_parser()
    for flag in ("-ngl", "--n-gpu-layers", "--gpu-layers"):
        assert p.parse_args(["run", "m", flag, "12", "-p", "x"]).gpu_layers == 12
    assert cli.habits(["run", "m", "-ngl", "12"])[0] == ["run", "m", "-ngl", "12"]  # no rewrite to --device
    assert p.parse_args(["serve", "m", "--gpu-memory-gb", "24"]).gpu_memory_gb == 24.0
    for cmd in (["batch", "m", "in.jsonl", "out.jsonl"], ["classify", "m", "in.jsonl", "-o", "out.jsonl", "--labels", "a,b"]):
        assert p.parse_args([*cmd, "-ngl", "3"]).gpu_layers == 3
    assert p.parse_args(["bench", "decode", "--synthetic", "k3-slice", "--device", "cuda", "-ngl", "4"]).gpu_layers == 4
    missing = str(tmp_path / "no-such-model")  # the check comes first: the model is never looked up
    rc, err = _run_cli(capsys, ["run", missing, "--device", "cpu", "-ngl", "4", "-p", "x"])
    assert rc == 2 and "--gpu-layers: splits the trunk between a CUDA GPU and the CPU" in err
    rc, err = _run_cli(capsys, ["run", missing, "--device", "cuda", "--gpu-memory-gb", "-1", "-p", "x"])
    assert rc == 2 and "--gpu-memory-gb -1.0: give the GB" in err
    rc, err = _run_cli(capsys, ["bench", "decode", "--device", "cuda", "--gpu-layers", "2"])  # the streamed bench has no trunk
    assert rc == 2 and "--synthetic k3-slice" in err


# ------------------------------------------------------------------------------------------ the machinery


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            src: Path = root / "src"
            tf.build_any(family, src)
            pack(str(src), str(root / "m"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]), tf.DEFAULT)
            made[family] = str(root / "m")
        return made[family]

    return get


def _run(model, pm: PackedModel, source, prompt: list[int], steps: int = 4) -> torch.Tensor:
    """Prompt logits (all positions), then greedy one-token steps: every logit row, float32 on the host."""
    st = model.new_state(64)
    with torch.inference_mode():
        out = [forward_batch(model, [(torch.tensor(prompt), st)], source, all_logits=True)[0].float().cpu()]
        for _ in range(steps):
            tok = int(out[-1][-1].argmax())
            out.append(forward_batch(model, [(torch.tensor([tok]), st)], source)[0].float().cpu())
    return torch.cat(out)


def _source(pm: PackedModel) -> StreamingExperts:
    return StreamingExperts(pm, 0, 2, "cpu", reserve=False)


FIRST = ["qwen3_moe", "deepseek_v3", "kimi_k3", "deepseek_v4"]
OTHERS = sorted((set(TINY) | set(tf.NEW_TINY)) - set(FIRST))


@pytest.mark.parametrize("family", OTHERS)
def test_every_family_split_on_one_device_is_the_unsplit_model(packed, family):
    test_split_on_one_device_is_the_unsplit_model(packed, family, torch.float32)


@pytest.mark.parametrize("family", FIRST)
@pytest.mark.parametrize("high_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_split_on_one_device_is_the_unsplit_model(packed, family, high_dtype):
    """Both sides on the CPU: layers [first, L) in ``high_dtype``. In float32 the split must be the unsplit model
    bit for bit (each record is the same, each layer's math the same); with a bf16 upper side it must equal a run
    whose stream is rounded to bf16 at that layer, i.e. the hand-over is the only thing between the sides."""
    pm = PackedModel.open(packed(family))
    records = pm.trunk_records()
    L = int(pm.text_config["num_hidden_layers"])
    plan = OffloadPlan(L, L // 2 + (L == 3), 0, 0, "test")
    cpu = torch.device("cpu")
    whole = registry.build(pm.family, pm.text_config, records, cpu, torch.float32)
    split = offload.build_split(pm.family, pm.text_config, records, plan, cpu, torch.float32, high_dtype)
    assert split.low.w[next(n for n in records if n.startswith(f"model.layers.{L - 1}."))].data.is_meta
    assert not split.high.w[next(n for n in records if n.startswith(f"model.layers.{L - 1}."))].data.is_meta
    prompt = tf.prompt(9)
    src = offload.SplitExperts(_source(pm), _source(pm), plan.first_gpu)
    got = _run(split, pm, src, prompt)
    assert split.handovers == 5  # one per pass: the prompt and four steps
    if high_dtype == torch.float32:
        ref = _run(whole, pm, _source(pm), prompt)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    else:
        again = _run(offload.build_split(pm.family, pm.text_config, records, plan, cpu, torch.float32, high_dtype),
                     pm, offload.SplitExperts(_source(pm), _source(pm), plan.first_gpu), prompt)
        assert torch.equal(got.view(torch.int32), again.view(torch.int32))  # run to run
        assert torch.isfinite(got).all()
    st = split.new_state(16)
    assert all(type(s) is type(w) for s, w in zip(st.layers, whole.new_state(16).layers, strict=True))
    src.close()


def test_split_source_sends_each_layer_to_its_side_and_sums_the_counters(packed):
    pm = PackedModel.open(packed("qwen3_moe"))
    low, high = StreamingExperts(pm, 10**9, 2, "cpu", reserve=False), _source(pm)
    src = offload.SplitExperts(low, high, 2)
    src.record = []
    L0, L3 = pm.moe_layers[0], pm.moe_layers[-1]
    assert L0 < 2 <= L3
    for L in (L0, L3):
        assert sorted(e for e, _ in src.fetch(L, [0, 1])) == [0, 1]
    assert [e for g in src.fetch_groups(L0, [0, 1]) for e, _ in g] == [0, 1]  # cached on the low side now
    assert src.record == [(L0, [0, 1]), (L3, [0, 1]), (L0, [0, 1])]
    s = src.stats
    assert (low.stats.misses, high.stats.misses, low.stats.hits) == (2, 2, 2)
    assert (s.misses, s.hits, s.reads) == (4, 2, 4) and s.bytes_read == low.stats.bytes_read + high.stats.bytes_read
    assert sum(d["reads"] for d in src.per_drive().values()) == 4
    src.close()


def test_hand_over_moves_every_tensor_of_a_carry_and_keeps_integer_ones():
    from deltafin.models.kimi_k3 import Carry

    c = Carry(torch.randn(3, 4), (torch.randn(3, 4), torch.randn(3, 4)))
    h = offload.hand_over(c, torch.device("cpu"), torch.bfloat16)
    assert type(h) is Carry and h.p.dtype == torch.bfloat16 and all(b.dtype == torch.bfloat16 for b in h.blocks)
    assert torch.equal(h.blocks[1], c.blocks[1].bfloat16())
    ids = torch.arange(3)
    assert offload.hand_over(ids, torch.device("cpu"), torch.bfloat16).dtype == torch.long


def test_engine_refuses_a_split_off_cuda_before_the_trunk_loads(packed, monkeypatch):
    from deltafin.runtime.engine import Engine, EngineOptions

    model = packed("qwen3_moe")

    def no_load(*a, **k):
        raise AssertionError("the trunk was loaded before the options were checked")

    with monkeypatch.context() as m:
        m.setattr(PackedModel, "trunk_records", no_load)
        for kw, flag in ((dict(gpu_layers=2), "--gpu-layers"), (dict(gpu_memory_gb=8.0), "--gpu-memory-gb")):
            with pytest.raises(UsageError, match=f"{flag}: .*this run is on cpu .*use --device cuda"):
                Engine(model, EngineOptions(device="cpu", **kw))
    eng = Engine(model, EngineOptions(device="cpu", gpu_layers=0, cache_gb=0.0))  # 0: what the CPU does anyway
    try:
        assert eng.offload is None and not isinstance(eng.model, offload.SplitModel)
    finally:
        eng.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_sizes_from_the_manifest_are_the_loaded_records(packed, family):
    """The plan's byte counts (from the manifest, before any load) are the records' as loaded, layer by layer."""
    pm = PackedModel.open(packed(family))
    L = int(pm.text_config["num_hidden_layers"])
    s = TrunkSizes.from_manifest(pm.doc["trunk"]["tensors"], L)
    recs = pm.trunk_records()
    assert s.total == pm.doc["trunk"]["bytes"] == sum(r.nbytes for r in recs.values())
    for i in range(L):
        assert s.layers[i] == sum(r.nbytes for n, r in recs.items() if n.startswith(f"model.layers.{i}."))


@pytest.mark.parametrize("gpu_layers", [None, 0, 2, 4])
def test_bench_k3_slice_offload_smoke_on_the_cpu(monkeypatch, tmp_path, capsys, gpu_layers):
    """The offload bench's code at tiny widths with both sides on the CPU (speed is not the point): the split it
    reports, its projection and bound, its JSON record."""
    import argparse
    import json

    from deltafin.bench import k3_offload
    from deltafin.bench import k3_slice_gpu as ks

    monkeypatch.setattr(ks, "SLICE_TEXT", dict(ks.SLICE_TEXT))  # the smoke run narrows the widths in place
    a = argparse.Namespace(layers=5, experts=8, tokens=2, json=str(tmp_path / "r.json"), smoke=True)
    r = k3_offload.run(a, "decode", gpu_layers, None)
    n = 5 if gpu_layers is None else gpu_layers
    assert r["gpu_layers"] == n and json.loads((tmp_path / "r.json").read_text())["gpu_layers"] == n
    out = capsys.readouterr().out
    assert r["offload"] in out and "memory-read bound" in out
    if 0 < n < 4:  # a MoE layer on each side: projected
        assert r["k3_93_layers_s"] > 0 and r["handover_s"] > 0 and r["k3_gpu_layers"] == round(93 * n / 5)
    assert r["memory_read_bound_s"] > 0 and set(r["bytes_per_token"]) == {"cpu", "gpu"}
    with pytest.raises(UsageError, match="time decode steps"):
        k3_offload.run(a, "prefill", 2, None)


def _engine_split_on_cpu(monkeypatch, model_dir: str, gpu_layers: int, **kw):
    """The engine's split path (``_open_split``: loading, the two models, the two sources, their caches) with its
    GPU side on the CPU: CUDA is faked up to the plan, which then names the CPU as the device of the last layers."""
    from deltafin.runtime import engine as eng_mod
    from deltafin.runtime.engine import Engine, EngineOptions

    def place(self):
        self.gpu = torch.device("cpu")
        self.offload = eng_mod.plan_gpu(self.packed, self.device, self.opts)
        self.device = torch.device("cpu")  # what _open_split takes for the GPU

    with monkeypatch.context() as m:
        m.setattr(eng_mod, "resolve_device", lambda d: torch.device("cuda"))
        m.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
        m.setattr(Engine, "_place_layers", place)
        return Engine(model_dir, EngineOptions(device="cuda", gpu_layers=gpu_layers, max_len=128, threads=2, **kw))


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_engine_split_path_gives_the_cpu_engine_s_tokens_and_logits(packed, monkeypatch, family, capsys):
    import argparse

    from deltafin.interfaces.session import start_line
    from deltafin.runtime.engine import Engine, EngineOptions

    model = packed(family)
    prompt = tf.prompt(9)

    def run(eng):
        try:
            st = eng.new_state()
            with torch.inference_mode():
                lg = eng.step([(torch.tensor(prompt), st)], all_logits=True)[0].float()
            toks = [t for t, _ in eng.generate(prompt, 6, stop_ids=())]
            return lg, toks, eng.last_stats
        finally:
            eng.close()

    for exact in (True, False):
        ref_lg, ref_toks, _ = run(Engine(model, EngineOptions(device="cpu", exact=exact, max_len=128, threads=2,
                                                              cache_gb=0.0)))
        for cache in (0.0, 1.0):
            eng = _engine_split_on_cpu(monkeypatch, model, 1, exact=exact, cache_gb=cache)
            assert isinstance(eng.model, offload.SplitModel) and isinstance(eng.source, offload.SplitExperts)
            assert eng.offload.gpu_layers == 1 and eng.device_label == "cpu + cpu"
            assert sum(eng.source.cache_bytes) == int(cache * 1e9)
            line = start_line(eng, argparse.Namespace(device="cuda", cache_gb=cache, io_threads=2))
            assert eng.offload.describe() in line and "+ head" in line
            lg, toks, stats = run(eng)
            assert torch.equal(lg.view(torch.int32), ref_lg.view(torch.int32)), (exact, cache)
            assert toks == ref_toks and stats.bytes_read > 0 and stats.reads > 0
