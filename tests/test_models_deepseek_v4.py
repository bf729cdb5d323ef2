"""DeepSeek-V4 (``deepseek_v4``) against transformers on a tiny model (``tiny_families.NEW_TINY``): a sliding layer,
CSA (rate 4, the indexer's top 4) and HCA (rate 16) layers, a hash-routed first layer, 4 mHC streams. The prompt
(48 tokens) and the 16 decoded ones pass the window (8), the top k and several compressed entries of each kind."""

from __future__ import annotations

import json

import pytest
import torch

from deltafin.errors import CheckpointError
from deltafin.models import csa, deepseek_v4, layers
from deltafin.store.checkpoint import Checkpoint
from deltafin.store.plan import build_plan
from tests import tiny_families as tf

pytest.importorskip("transformers")
PROMPT, NEW = 48, 16
LONG = 72  # a teacher-forced sequence: 18 CSA entries for a top 4, 4 HCA entries


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(transformers' model, the folder holding its saved checkpoint under src/)."""
    from deltafin.tiny import save_byte_tokenizer

    root = tmp_path_factory.mktemp("v4")
    hf = tf.build("deepseek_v4", root / "src")
    save_byte_tokenizer(root / "src", 320)  # for classify
    return hf, root


@pytest.fixture(scope="module")
def exact(built):
    """(transformers' model, the lossless pack)."""
    hf, root = built
    return hf, tf.pack_to(root)


@pytest.fixture(scope="module")
def packed(built, tmp_path_factory):
    """Packed as shipped: int8 trunk, MXFP4 experts."""
    _, root = built
    out = tmp_path_factory.mktemp("v4_default")
    (out / "src").symlink_to(root / "src")
    return tf.pack_to(out, tf.DEFAULT)


def test_matches_hugging_face(exact):
    hf, model_dir = exact
    tf.check_matches_hf(hf, model_dir, tf.prompt(PROMPT), n=NEW)


def test_yarn_on_the_compressed_layers_matches(tmp_path):
    """YaRN (as V4-Flash ships it) applies to the compressed layers' rope only, with transformers' cos/sin factor 1."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
            "beta_slow": 1}
    hf = tf.build("deepseek_v4", tmp_path / "src", rope_parameters=yarn)
    tf.check_matches_hf(hf, tf.pack_to(tmp_path), tf.prompt(PROMPT), n=4)


def _prefill_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    eng = tf.engine(model_dir)
    try:
        with torch.inference_mode():
            return eng.step([(torch.tensor(ids), eng.new_state())], all_logits=True)[0].cpu()
    finally:
        eng.close()


def _no_sinks(monkeypatch):
    monkeypatch.setattr(csa, "_probs", lambda s, sinks, dtype: layers._probs(s, None, dtype))


def _no_hash(monkeypatch):
    real = deepseek_v4.Model._setup

    def setup(self):
        real(self)
        self.tid2eid = {}  # the hash layers route by their scores instead

    monkeypatch.setattr(deepseek_v4.Model, "_setup", setup)


def _one_sinkhorn_step_less(monkeypatch):
    real = deepseek_v4.sinkhorn
    monkeypatch.setattr(deepseek_v4, "sinkhorn", lambda comb, iters, eps: real(comb, iters - 1, eps))


def _no_indexer(monkeypatch):
    def every_finished(q, w, keys, pos, rate, k):
        seen = csa.finished(pos, q.shape[0], rate, q.device)[:, None]
        return torch.arange(keys.shape[0])[None] < seen

    monkeypatch.setattr(csa, "index_select", every_finished)


def _no_compression(monkeypatch):
    monkeypatch.setattr(deepseek_v4.Model, "_compressed", lambda self, *a: (None, None))


PARTS = {"sinks": _no_sinks, "hash routing": _no_hash, "a Sinkhorn step": _one_sinkhorn_step_less,
         "the indexer's choice": _no_indexer, "compression": _no_compression}


@pytest.fixture(scope="module")
def reference(exact):
    hf, _ = exact
    ids = tf.prompt(LONG, seed=5)
    with torch.no_grad():
        return ids, hf(torch.tensor([ids])).logits[0].float()


def test_long_prefill_matches(exact, reference):
    ids, ref = reference
    assert tf.rel_err(_prefill_logits(exact[1], ids), ref) < 1e-4


@pytest.mark.parametrize("part", PARTS)
def test_each_part_is_needed(exact, reference, part, monkeypatch):
    """The model code without one part no longer gives transformers' logits (so the match above checks it)."""
    ids, ref = reference
    PARTS[part](monkeypatch)
    assert tf.rel_err(_prefill_logits(exact[1], ids), ref) > 1e-3


def test_prompt_cache_batching_chunked_prefill(packed):
    tf.check_prompt_cache_and_batch(packed, 22, 8)  # 7 CSA entries for a top 4, an HCA entry


def test_classify_batched_equals_alone(packed):
    """classify's label scores (prefill, copied states, multi-token labels) for inputs past the window."""
    from deltafin.jobs.classify import Classifier

    eng = tf.engine(packed)
    try:
        clf = Classifier(eng, ["yes", "no way"])
        prompts = [clf.prompt(t) for t in ("the quick brown fox jumps over the lazy dog", "a longer review " * 3)]
        together = clf.score(prompts)
        for p, row in zip(prompts, together, strict=True):
            assert row == pytest.approx(clf.score([p])[0], rel=1e-4, abs=1e-5)
    finally:
        eng.close()


def test_fast_path_agrees_with_exact(packed):
    assert tf.fast_path_agreement(packed) >= 0.99


def test_hash_routed_experts_are_read_before_their_layer(packed, monkeypatch):
    """The hash layer's experts follow from the token ids: their reads are submitted before layer 0 computes,
    and the step's logits are those of a source that reads them when the layer asks."""
    events = []
    eng = tf.engine(packed)
    try:
        src, model = eng.source, eng.model
        real_attn, real_submit = model.attn_part, src.pool.submit
        monkeypatch.setattr(model, "attn_part", lambda i, c, st: events.append(("attn", i)) or real_attn(i, c, st))
        monkeypatch.setattr(src.pool, "submit", lambda d, path, *a: events.append(("read", path)) or
                            real_submit(d, path, *a))
        st, ref_st = eng.new_state(), eng.new_state()
        eng.forward(tf.prompt(20), st)
        events.clear()
        got = eng.forward([7], st)
        layer0 = [j for j, (kind, what) in enumerate(events) if kind == "read" and "/L000/" in what]
        assert layer0 and max(layer0) < events.index(("attn", 0)) and src.stats.prefetched > 0
        monkeypatch.setattr(src, "prefetch", None)  # no read ahead
        ahead = src.stats.prefetched
        eng.forward(tf.prompt(20), ref_st)
        assert torch.equal(got, eng.forward([7], ref_st)) and src.stats.prefetched == ahead
    finally:
        eng.close()


def test_plan_from_config_and_index_alone(tmp_path):
    """Shapes from config.json (no shards) equal the headers', the hash table an index table kept float."""
    tf.build("deepseek_v4", tmp_path / "src")
    src = tmp_path / "src"
    headers = build_plan(Checkpoint(str(src)))
    names = list(Checkpoint(str(src)).weight_map)
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    (src / "model.safetensors").unlink()
    config = build_plan(Checkpoint(str(src)))
    assert config.shapes_from == "config.json" and not config.unused
    assert [(t.name, t.shape, t.format) for t in config.trunk] == [(t.name, t.shape, t.format) for t in headers.trunk]
    assert {t.name: t.format for t in headers.trunk}["model.layers.0.mlp.gate.tid2eid"] == "f32"


def test_mtp_layer_is_skipped_and_unknown_settings_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tf.build("deepseek_v4", tmp_path / "src")
    f = tmp_path / "src" / "model.safetensors"
    sd = load_file(str(f))
    sd["mtp.0.attn.wq_a.weight"] = sd["model.layers.0.attn.wq_a.weight"].clone()
    save_file(sd, str(f), metadata={"format": "pt"})
    plan = build_plan(Checkpoint(str(tmp_path / "src")))
    assert ("mtp.0.attn.wq_a.weight" in {n for n, _ in plan.skipped}) and not plan.unused
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2}))
    with pytest.raises(CheckpointError, match="num_key_value_heads 2"):
        build_plan(Checkpoint(str(tmp_path / "src")))


def test_state_counted_by_the_memory_model(packed):
    """store/memory.py's count of V4's state (window, compressors, indexer) bounds what the model holds."""
    from deltafin.store.memory import context_bytes, state_sizes

    eng = tf.engine(packed)
    try:
        st = eng.new_state()
        eng.forward(tf.prompt(LONG), st)
        held = sum(layer.nbytes() for layer in st.layers)
        tc = eng.packed.text_config
        _, per_tok, _, _ = state_sizes(tc)
        assert per_tok * LONG * 4 <= held <= context_bytes(tc, LONG)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(folder with src/ in the release's format and float/ its dequantized twin, transformers' model on the
    twin, the release's tensors)."""
    root = tmp_path_factory.mktemp("v4_release")
    hf, shipped = tf.deepseek_v4_release(root)
    return root, hf, shipped


def test_release_fp4_experts_are_packed_as_shipped(release):
    """Released precision: each expert file's sections are the FP4 weight's and E8M0 scale's bytes, unchanged
    (no re-encoding); the FP8 linears (E8M0 block scales) are the trunk's FP8 entries."""
    from deltafin.quant import mxfp4
    from deltafin.store import expert_file as ef
    from deltafin.store.model_dir import PackedModel

    root, _, shipped = release
    plan = build_plan(Checkpoint(str(root / "src")))
    assert {(r.src, r.out) for rs in plan.roles.values() for r in rs} == {("ds_mxfp4", "mxfp4")}
    fp8 = {n for n, t in shipped.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8 and {t.source for t in plan.trunk if t.dtype == "F8_E4M3"} == fp8
    assert all(shipped[t.scale_inv].dtype == torch.float8_e8m0fnu for t in plan.trunk if t.scale_inv)
    w = "layers.1.ffn.experts.3.w1."
    again = mxfp4.quantize(mxfp4.dequantize(shipped[w + "weight"].view(torch.uint8), shipped[w + "scale"].view(
        torch.uint8)))[1]
    assert not torch.equal(again, shipped[w + "scale"].view(torch.uint8))  # re-encoding would show below
    pm = PackedModel.open(tf.pack_to(root, tf.DEFAULT))
    assert pm.moe_layers == [0, 1, 2, 3] and pm.num_experts == 8
    for L in pm.moe_layers:
        for e in range(pm.num_experts):
            raw, where = pm.read_expert_bytes(L, e)
            layout, _, _ = ef.parse_header(raw, where)
            for tl, w in zip(layout.tensors, ("w1", "w3", "w2"), strict=True):
                x = f"layers.{L}.ffn.experts.{e}.{w}."
                data, scale = tl.sections
                assert raw[data.offset : data.offset + data.nbytes] == shipped[x + "weight"].numpy().tobytes()
                assert raw[scale.offset : scale.offset + scale.nbytes] == \
                    shipped[x + "scale"].view(torch.uint8).numpy().tobytes()
            assert {r: t.format for r, t in pm.read_expert(L, e).items()} == dict.fromkeys(("gate", "up", "down"),
                                                                                         "mxfp4")


@pytest.mark.parametrize("experts", ["auto", "bf16"])
def test_release_format_matches_hugging_face(release, experts):
    """With a lossless trunk (FP8 x E8M0 is exact in bf16) the streaming engine gives the greedy tokens of
    transformers run on the dequantized weights, the experts kept as shipped or dequantized to bf16 on import."""
    from deltafin.store.pack import PackOptions

    root, hf, _ = release
    lossless = root / f"lossless_{experts}"
    lossless.mkdir()
    (lossless / "src").symlink_to(root / "src")
    opts = PackOptions(experts=experts, trunk="bf16", progress=False)
    tf.check_matches_hf(hf, tf.pack_to(lossless, opts), tf.prompt(PROMPT), n=NEW)


def test_flash_base_fp8_experts_match_hugging_face(tmp_path):
    """V4-Flash-Base's format (experts FP8 in 128 x 128 blocks, float32 scales) is dequantized on import, and a
    plan without the shards finds the same dtypes from its config."""
    hf, _ = tf.deepseek_v4_release(tmp_path, experts="fp8")
    plan = build_plan(Checkpoint(str(tmp_path / "src")))
    assert {r.src for rs in plan.roles.values() for r in rs} == {"fp8"}
    tf.check_matches_hf(hf, tf.pack_to(tmp_path), tf.prompt(PROMPT), n=4)
    names = list(Checkpoint(str(tmp_path / "src")).weight_map)
    (tmp_path / "src" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    (tmp_path / "src" / "model.safetensors").unlink()
    config = build_plan(Checkpoint(str(tmp_path / "src")))
    assert config.roles == plan.roles and config.trunk == plan.trunk


def test_release_fp4_with_another_scale_is_refused(release, tmp_path):
    """An FP4 expert whose scale is not E8M0 per 32 inputs (another microscaling format) is named, not packed."""
    import shutil

    from safetensors.torch import save_file

    root, _, shipped = release
    shutil.copytree(root / "src", tmp_path / "src")
    bad = dict(shipped)
    name = "layers.2.ffn.experts.0.w2.scale"
    bad[name] = bad[name].float()  # F32 scales: not the release's MXFP4
    save_file(bad, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.0\.w2\.weight: FP4 I8 \[64, 16\].*F32 \[64, 1\]"):
        build_plan(Checkpoint(str(tmp_path / "src")))


def test_release_plan_from_config_and_index_alone(release, tmp_path):
    """Without the shards, config.json's expert_dtype / scale_fmt give the release's dtypes: the same plan."""
    import shutil

    root, _, _ = release
    src = tmp_path / "src"
    shutil.copytree(root / "src", src)
    headers = build_plan(Checkpoint(str(src)))
    names = list(Checkpoint(str(src)).weight_map)
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    (src / "model.safetensors").unlink()
    config = build_plan(Checkpoint(str(src)))
    assert config.shapes_from == "config.json" and config.roles == headers.roles
    assert config.trunk == headers.trunk and config.expert_bytes == headers.expert_bytes


def test_long_context_figures_in_the_docs_are_the_memory_model_s():
    """docs/FAMILIES.md's V4-Flash state table is what store/memory.py counts for the release's config."""
    import re
    from pathlib import Path

    from deltafin import fmt
    from deltafin.store.memory import context_bytes, state_sizes

    doc = (Path(__file__).resolve().parents[1] / "docs" / "FAMILIES.md").read_text()
    table = doc.split("## DeepSeek-V4 state at long context", 1)[1].split("Command:", 1)[0]
    rows = {m[0]: (m[1], m[2]) for m in re.findall(r"^\| ([^|]+?) \| ([^|]+?) \| ([^|]+?) \|$", table, re.M)}
    tc = tf.v4_flash_config()
    fixed, per_tok, _, _ = state_sizes(tc)
    want = {"fixed (windows, unfinished compressor windows)": (fixed, fixed / 2),
            "per 1k tokens (CSA entries + indexer keys, HCA entries)": (per_tok * 4000, per_tok * 2000),
            "128K tokens": (context_bytes(tc, 1 << 17), context_bytes(tc, 1 << 17, 2)),
            "1M tokens": (context_bytes(tc, 1 << 20), context_bytes(tc, 1 << 20, 2))}
    assert {k: rows.get(k) for k in want} == {k: (fmt.size(a), fmt.size(b)) for k, (a, b) in want.items()}


@pytest.mark.slow
def test_plan_of_the_flash_release_from_config_and_index(release, tmp_path):
    """``pack --plan`` on V4-Flash as released (its config, an index of its names, no shards): 11,008 FP4 expert
    files kept as MXFP4, the 1,199 trunk tensors (the count native conversions of the release report) with FP8
    e4m3 linears and their E8M0 scales."""
    from deltafin import cli

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tf.v4_flash_config()))
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        n: "model-00001-of-00046.safetensors" for n in tf.v4_flash_index(release[2])}}))
    plan = build_plan(Checkpoint(str(src)))
    assert plan.expert_files == 11_008 and len(plan.trunk) == 1_199
    assert {(r.src, r.out, r.dtype) for rs in plan.roles.values() for r in rs} == {("ds_mxfp4", "mxfp4", "I8")}
    fp8 = [t for t in plan.trunk if t.dtype == "F8_E4M3"]
    assert fp8 and all(t.scale_inv for t in fp8) and not any(t.scale_inv for t in plan.trunk if t not in fp8)
    assert cli.main(["pack", str(src), "--plan", "--drive", f"d0:{tmp_path}/d0=25", "--create"]) == 0
