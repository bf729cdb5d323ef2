"""Plan a pack of the real Kimi K3 layout from its shipped config.json and tensor index, without weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deltafin import cli
from deltafin.store.checkpoint import Checkpoint
from deltafin.store.plan import build_plan

SPECS = Path(__file__).resolve().parents[2] / "shared" / "specs" / "kimi-k3"
FILES = ("config.json", "model.safetensors.index.json.gz")

pytestmark = pytest.mark.skipif(
    not all((SPECS / f).exists() for f in FILES),
    reason=f"the real Kimi K3 config and index are not at {SPECS} (a read-only copy beside the clone)",
)

# KIMI_K3.md 2.5: w1p + w1s + w2p + w2s + w3p + w3s = 3 x (5,505,024 + 344,064)
EXPERT_PAYLOAD = 3 * (5_505_024 + 344_064)
# KIMI_K3.md 2.6, per-layer byte totals in bf16: 69 KDA + 24 MLA layers, 92 MoE non-expert parts,
# the dense layer-0 MLP with its own post-attention norm and mlp_res vectors (3 x 7168 bf16), and the
# top level (embed_tokens and lm_head [163840, 7168], three [7168] vectors)
SPEC_TRUNK = (69 * 887_843_840 + 24 * 464_435_200 + 92 * 379_900_416 + 1_453_326_336 + 3 * 7168 * 2
              + 2 * 163_840 * 7168 * 2 + 3 * 7168 * 2)


@pytest.fixture(scope="module")
def k3_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("k3") / "Kimi-K3"
    src.mkdir()
    for f in FILES:
        shutil.copy(SPECS / f, src / f)
    return src


@pytest.fixture(scope="module")
def plans(k3_src):
    ckpt = Checkpoint(str(k3_src))
    return ckpt, build_plan(ckpt, "auto", "bf16"), build_plan(ckpt, "auto", "int8")


def test_spec_figures_agree():
    # "The full text stack comes to 1,559,965,606,912 bytes"; the experts are 82,432 x 17,547,264 of them
    assert SPEC_TRUNK == 1_559_965_606_912 - 82_432 * EXPERT_PAYLOAD == 113_509_540_864


def test_k3_plan_experts(plans):
    ckpt, plan, _ = plans
    assert plan.family.name == "kimi_k3" and plan.shapes_from == "config.json"
    assert not any(ckpt.has_shard(s) for s in ckpt.shards())  # no weights at all
    assert plan.moe_layers == list(range(1, 93)) and plan.num_experts == 896
    assert plan.expert_files == 82_432
    for L in plan.moe_layers:
        layout = plan.layouts[L]
        assert layout.payload_bytes == EXPERT_PAYLOAD == 17_547_264
        assert [(t.name, t.format, t.shape) for t in layout.tensors] == [
            ("gate", "mxfp4", (3072, 3584)), ("up", "mxfp4", (3072, 3584)), ("down", "mxfp4", (3584, 3072))]
        assert layout.file_bytes % 4096 == 0 and layout.file_bytes - layout.payload_bytes < 7 * 4096
    assert plan.expert_bytes == 82_432 * plan.layouts[1].file_bytes


def test_k3_plan_assigns_every_text_tensor(plans):
    ckpt, plan, _ = plans
    index = set(ckpt.weight_map)
    assert len(index) == 497_220
    skipped = {n for n, _ in plan.skipped}
    assert skipped == {n for n in index if n.startswith(("vision_tower.", "mm_projector."))}
    assert len(skipped) == 168
    trunk = {t.source for t in plan.trunk} | {t.scale_inv for t in plan.trunk if t.scale_inv}
    experts = {name for roles in plan.expert_names.values() for kinds in roles.values() for name in kinds.values()}
    assert not trunk & experts
    assert trunk | experts == index - skipped  # every text tensor lands in the trunk or an expert file
    assert len(experts) == 82_432 * 6
    assert all(t.name == t.source.removeprefix("language_model.") for t in plan.trunk)


def test_k3_trunk_bytes(plans):
    _, plan16, plan8 = plans
    assert plan16.trunk_bytes == SPEC_TRUNK == 113_509_540_864  # "about 113.5 GB in BF16"
    assert {t.format for t in plan16.trunk} == {"bf16", "f32"}
    assert plan8.trunk_bytes < 0.55 * plan16.trunk_bytes
    routers = [t for t in plan8.trunk if t.name.endswith("block_sparse_moe.gate.weight")]
    assert len(routers) == 92 and all(t.format == "bf16" for t in routers)
    print(f"\nK3 trunk: {plan16.trunk_bytes:,} B bf16, {plan8.trunk_bytes:,} B int8; "
          f"experts {plan16.expert_bytes:,} B in {plan16.expert_files:,} files")


def test_pack_plan_cli_writes_json(k3_src, plans, tmp_path, capsys, monkeypatch):
    """`deltafin pack --plan SRC --drive A=7 --drive B=6 --json out.json`: folders A and B at 7 and 6 GB/s."""
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["pack", "--plan", str(k3_src), "--drive", "A=7", "--drive", "B=6", "--create", "--json", "out.json"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "82,432 files" in text and "17,547,264 B payload" in text and "168 skipped" in text
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["expert_files"] == 82_432
    assert doc["expert_payload_bytes"] == 17_547_264
    assert doc["expert_bytes"] == 82_432 * doc["expert_file_bytes"]
    assert doc["trunk_bytes"] == plans[2].trunk_bytes < SPEC_TRUNK  # int8 trunk by default
    assert doc["skipped_tensors"] == 168
    pd = doc["per_drive"]
    assert [d["path"] for d in pd.values()] == [str(tmp_path / "A"), str(tmp_path / "B")]
    assert [d["gbps"] for d in pd.values()] == [7.0, 6.0]
    assert sum(d["files"] for d in pd.values()) == 82_432
    assert sum(d["bytes"] for d in pd.values()) == doc["expert_bytes"]
    # bandwidth placement: bytes follow the rates, so both drives finish a pass at about the same time
    a, b = pd.values()
    assert a["bytes"] / b["bytes"] == pytest.approx(7 / 6, rel=0.01)
    assert not (tmp_path / "A").exists() and not (tmp_path / "B").exists()  # a plan writes nothing to drives
