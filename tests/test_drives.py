"""Several drives end to end: the striped expert layout (pack, verify, engine), `deltafin place` (only what
must move, crash-safe), routing traces from --record-routes, and the simulate / bench drives commands."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

from deltafin import cli
from deltafin.errors import ManifestError, ReadError, UsageError
from deltafin.io.routes import read_routes
from deltafin.k3_tiny import write_tiny_k3
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.runtime.sampling import SamplingParams
from deltafin.store import manifest as mf
from deltafin.store import place as place_mod
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from deltafin.store.place import Layout, place_model
from deltafin.store.placement import moves
from deltafin.store.verify import verify

PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("k3src")
    write_tiny_k3(root / "src")
    return root / "src"


def _pack(src: Path, root: Path, placement: str, **kw) -> Path:
    pack(str(src), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
         PackOptions(placement=placement, progress=False, **kw))
    return root / "model"


@pytest.fixture(scope="module")
def packs(src, tmp_path_factory) -> dict[str, Path]:
    return {p: _pack(src, tmp_path_factory.mktemp(p), p) for p in ("bandwidth", "stripe-bandwidth", "stripe-equal")}


@pytest.fixture(scope="module")
def ref(packs) -> tuple[torch.Tensor, list[int]]:
    """Logits and greedy tokens of the whole-file layout: every other layout must match them bit for bit."""
    return _logits_and_tokens(packs["bandwidth"])


def _logits_and_tokens(model: Path, **kw) -> tuple[torch.Tensor, list[int]]:
    eng = Engine(str(model), EngineOptions(exact=True, cache_gb=0.0, threads=2, **kw))
    try:
        logits = eng.model.forward(torch.tensor(PROMPT), eng.new_state(), eng.source)
        toks = [t for t, _ in eng.generate(PROMPT, 3, SamplingParams())]
    finally:
        eng.close()
    return logits, toks


def _drive_files(model: Path) -> list[str]:
    pm = PackedModel.open(str(model))
    return sorted(os.path.realpath(p) for d in pm.drives for p in Path(d.path, pm.model_id).rglob("*")
                  if p.is_file() and p.name != ".deltafin-owner.json")


def _layout_files(model: Path) -> list[str]:
    pm = PackedModel.open(str(model))
    return sorted(f.path for L in pm.moe_layers for e in range(pm.num_experts) for f in pm.expert_files(L, e))


# ---------------------------------------------------------------- striped layout


def test_striped_packs_verify_and_decode_bit_identical(packs, ref):
    ref_logits, ref_toks = ref
    for name in ("stripe-bandwidth", "stripe-equal"):
        model = packs[name]
        pm = PackedModel.open(str(model))
        n = pm.file_bytes(pm.moe_layers[0])
        pieces = pm.stripe(pm.moe_layers[0])
        assert [p.drive for p in pieces] == [0, 1] and sum(p.nbytes for p in pieces) == n
        assert all(p.offset % 4096 == 0 and p.nbytes % 4096 == 0 for p in pieces)
        # by read rate 2:1 (7 blocks -> 5 + 2); equal -> 4 + 3
        assert [p.nbytes // 4096 for p in pieces] == ([5, 2] if name == "stripe-bandwidth" else [4, 3])
        assert _drive_files(model) == _layout_files(model)  # one piece per drive per expert, nothing else
        assert verify(pm).ok
        logits, toks = _logits_and_tokens(model)
        assert torch.equal(logits, ref_logits), name
        assert toks == ref_toks, name
    logits, toks = _logits_and_tokens(packs["stripe-bandwidth"], emulate_drives="d0:2GBps;d1:1GBps")
    assert torch.equal(logits, ref_logits) and toks == ref_toks


def test_inspect_names_the_layout(packs, capsys):
    assert cli.main(["inspect", str(packs["stripe-bandwidth"])]) == 0
    out = capsys.readouterr().out
    assert "12 of 12 layers striped (bandwidth)" in out and "placement stripe-bandwidth" in out
    assert cli.main(["inspect", str(packs["bandwidth"])]) == 0
    assert "placement bandwidth: one file per expert" in capsys.readouterr().out


def test_failed_piece_names_drive_and_file(src, tmp_path):
    model = _pack(src, tmp_path, "stripe-bandwidth")
    pm = PackedModel.open(str(model))
    piece = pm.expert_files(2, 3)[1]
    os.unlink(piece.path)
    eng = Engine(str(model), EngineOptions(exact=True, cache_gb=0.0, threads=2))
    try:
        with pytest.raises(ReadError, match=rf"drive d1: .*{re.escape(piece.path)}.*layer 2 expert 3, striped"):
            list(eng.source.fetch(2, [0, 3, 5]))
    finally:
        eng.close()
    eng = Engine(str(model), EngineOptions(exact=True, cache_gb=0.0, threads=2, emulate_drives="d0:2GBps,failpath=E0001;d1:1GBps"))
    try:
        with pytest.raises(ReadError, match=r"drive d0: read of .*E0001\.dfx\.p0\+20480 .*emulated I/O error"):
            list(eng.source.fetch(4, [1]))
    finally:
        eng.close()


def test_verify_and_repair_striped(src, tmp_path):
    model = _pack(src, tmp_path, "stripe-equal")
    pm = PackedModel.open(str(model))
    bad = Path(pm.expert_files(3, 1)[1].path)
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0xFF
    bad.write_bytes(raw)
    gone = Path(pm.expert_files(5, 0)[0].path)
    gone.unlink()
    rep = verify(pm)
    problems = dict(rep.bad)
    assert len(rep.bad) == 2
    assert any("checksum mismatch over the reassembled pieces" in p and str(bad) in path for path, p in rep.bad)
    assert problems[str(gone)].startswith("missing")
    s = pack(str(src), str(model), [], PackOptions(placement="stripe-equal", repair=True, progress=False))
    assert s.repaired == 2 and verify(PackedModel.open(str(model))).ok


def test_stripe_section_is_validated(src, tmp_path):
    model = _pack(src, tmp_path, "stripe-bandwidth")
    good = json.loads((model / mf.MANIFEST).read_text())

    def broken(edit, needle):
        doc = json.loads(json.dumps(good))
        edit(doc["experts"])
        (model / mf.MANIFEST).write_text(json.dumps(doc))
        with pytest.raises(ManifestError, match=needle):
            PackedModel.open(str(model))

    broken(lambda ex: ex["stripe"]["2"].update(mode="raid5"), "layer 2 stripe: needs a mode")
    broken(lambda ex: ex["stripe"]["2"]["pieces"][1].update(offset=4096), "must start at byte 20480")
    broken(lambda ex: ex["stripe"]["2"]["pieces"][1].update(drive=7), "names drive 7")
    broken(lambda ex: ex["stripe"]["2"]["pieces"].pop(), "cover 20480 bytes")
    broken(lambda ex: ex["locations"]["2"][0].reverse(), r"locations must list the pieces' drives \[0, 1\]")
    broken(lambda ex: ex["stripe"].update({"0": ex["stripe"]["2"]}), "'0' is not one of the MoE layers")
    (model / mf.MANIFEST).write_text(json.dumps(good))
    assert PackedModel.open(str(model)).stripe(2) is not None


# ---------------------------------------------------------------- deltafin place


def test_place_moves_only_what_must_move(src, tmp_path):
    model = _pack(src, tmp_path, "bandwidth")
    pm = PackedModel.open(str(model))
    old = Layout.from_doc(pm.doc["experts"])
    new = place_mod.model_layout(pm, "roundrobin")
    expected = moves(old.locations, new.locations)
    assert expected and len(expected) < pm.num_experts * len(pm.moe_layers)
    before = {p: os.stat(p).st_ino for p in _drive_files(model)}
    rep = place_model(str(model), "roundrobin")
    assert rep.files_copied == sum(len(add) for *_, add, _drop in expected)
    assert rep.files_deleted == sum(len(drop) for *_, drop in expected) and rep.experts_changed == len(expected)
    moved = {(L, e) for L, e, _a, _d in expected}
    pm = PackedModel.open(str(model))
    for L in pm.moe_layers:
        for e in range(pm.num_experts):
            if (L, e) not in moved:  # untouched: the very same file
                assert os.stat(pm.expert_path(L, e)).st_ino == before[pm.expert_path(L, e)]
    assert _drive_files(model) == _layout_files(model) and verify(pm).ok
    assert place_model(str(model), "roundrobin").experts_changed == 0


class Interrupt(Exception):
    pass


def _fail_after(monkeypatch, name: str, n: int) -> None:
    real = getattr(place_mod, name)
    calls = [0]

    def flaky(*a, **kw):
        if calls[0] >= n:
            raise Interrupt(f"{name} #{calls[0]}")
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(place_mod, name, flaky)


@pytest.mark.parametrize("start,policy,where,n", [
    ("bandwidth", "stripe-bandwidth", "_install", 17),  # mid-copy
    ("stripe-bandwidth", "roundrobin", "_install", 40),
    ("bandwidth", "stripe-equal", "_commit", 0),  # every copy done, manifest not yet rewritten
    ("stripe-equal", "bandwidth", "_remove", 25),  # committed, mid-delete
])
def test_place_interrupted_then_rerun_ends_correct(src, tmp_path, monkeypatch, start, policy, where, n):
    model = _pack(src, tmp_path, start)
    checksums = json.loads((model / mf.MANIFEST).read_text())["experts"]["checksums"]
    with monkeypatch.context() as m:
        _fail_after(m, where, n)
        with pytest.raises(Interrupt):
            place_model(str(model), policy)
    assert (model / place_mod.JOURNAL).exists()
    assert verify(PackedModel.open(str(model))).ok  # the manifest names a complete layout at every point
    rep = place_model(str(model), policy)
    assert rep.resumed and not (model / place_mod.JOURNAL).exists()
    pm = PackedModel.open(str(model))
    assert pm.doc["experts"]["placement"] == policy and pm.doc["experts"]["checksums"] == checksums
    assert _drive_files(model) == _layout_files(model)  # nothing lost, nothing duplicated, no temporary files
    assert verify(pm).ok  # every expert's reassembled bytes match the checksum it was packed with


def test_place_errors(packs, tmp_path, capsys):
    model = packs["bandwidth"]
    with pytest.raises(UsageError, match="needs a routing trace: pass --trace"):
        place_model(str(model), "coactivation")
    assert cli.main(["place", str(model), "--policy", "replicas", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read it" in capsys.readouterr().err


# ---------------------------------------------------------------- routing traces


def test_record_routes_feed_coactivation_and_replicas(src, tmp_path, capsys):
    model = _pack(src, tmp_path, "bandwidth")
    trace = tmp_path / "routes.jsonl"
    assert cli.main(["run", str(model), "--prompt-ids", "5,17,99", "-n", "9", "--greedy", "--cache-gb", "0",
                     "--record-routes", str(trace)]) == 0
    assert "routes of 8 decoded tokens" in capsys.readouterr().err
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    head, toks = lines[0], lines[1:]
    pm = PackedModel.open(str(model))
    assert head["format"] == "deltafin-routes" and head["num_experts"] == 8 and head["moe_layers"] == pm.moe_layers
    assert [t["token"] for t in toks] == list(range(8))
    for t in toks:
        assert sorted(map(int, t["routes"])) == pm.moe_layers
        assert all(len(ids) == 2 and ids == sorted(ids) and all(0 <= e < 8 for e in ids) for ids in t["routes"].values())
    got = read_routes(str(trace), 8)
    assert len(got) == 8 and got[0][pm.moe_layers[0]] == toks[0]["routes"][str(pm.moe_layers[0])]

    assert cli.main(["place", str(model), "--policy", "coactivation", "--trace", str(trace), "--no-progress"]) == 0
    assert cli.main(["place", str(model), "--policy", "replicas", "--trace", str(trace), "--spare-gb", "0.0001",
                     "--no-progress", "--json", str(tmp_path / "p.json")]) == 0
    pm = PackedModel.open(str(model))
    copies = sum(len(loc) > 1 for L in pm.moe_layers for loc in pm.doc["experts"]["locations"][str(L)])
    assert copies > 0 and verify(pm).ok and _drive_files(model) == _layout_files(model)
    # a pack can start with a traced placement too
    pack(str(src), str(tmp_path / "p2" / "model"), parse_drives([f"{tmp_path}/p2/d0=2", f"{tmp_path}/p2/d1=1"]),
         PackOptions(placement="coactivation", trace=str(trace), progress=False))
    assert verify(PackedModel.open(str(tmp_path / "p2" / "model"))).ok


def test_bad_trace_lines_are_named(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"token": 0, "routes": {"1": [0, 9]}}\n')
    with pytest.raises(UsageError, match="line 1: expert id 9 in layer 1 is out of range for 8 experts"):
        read_routes(str(p), 8)
    p.write_text('{"token": 0}\n')
    with pytest.raises(UsageError, match="line 1: expected"):
        read_routes(str(p))


# ---------------------------------------------------------------- simulate and bench drives


def test_simulate_cli_small(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = cli.main(["simulate", "--layers", "2", "--tokens", "1", "--prompt", "16", "--cache-gb", "1",
                   "--plots", str(tmp_path / "plots"), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "internal drive alone" in text and "RAID-0" in text and "40 drives" in text and "TTFT" in text
    doc = json.loads(out.read_text())
    names = {r["name"]: r for r in doc["scenarios"]}
    assert names["internal drive alone"]["tok_s"] < names["report drives, bandwidth striping"]["tok_s"]
    assert all(r["tok_s"] <= r["bytes_bound_tok_s"] * 1.0001 for r in doc["scenarios"])
    assert {"makespan_ms_p50", "makespan_ms_p99", "ttft_s"} <= set(names["report drives, RAID-0 striping"])
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib missing" in text
    else:
        assert (tmp_path / "plots" / "scaling_drives.png").stat().st_size > 0


def test_bench_drives_cli_small(tmp_path, capsys):
    out = tmp_path / "bench.json"
    cli.main(["bench", "drives", "--layers", "1", "--experts", "16", "--k", "4", "--tokens", "1", "--scale", "0.02",
              "--policies", "bandwidth,stripe-bandwidth,stripe-equal,one-drive", "--dir", str(tmp_path),
              "--json", str(out)])
    text = capsys.readouterr().out
    assert "one drive alone (internal)" in text and "RAID-0" in text and "target >= 0.90" in text
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"bandwidth", "stripe-bandwidth", "stripe-equal", "one-drive"}
    for r in doc["policies"].values():
        assert 0 < r["aggregate_fraction"] <= 1.05 and r["tok_s"] > 0
    assert doc["policies"]["one-drive"]["aggregate_fraction"] < 0.5  # one of four drives
    assert doc["scale"] == 0.02 and abs(doc["summed_GBps"] - 0.5) < 1e-6
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("deltafin-bench-drives-")]  # cleaned up


def test_engine_reads_replicas_from_the_drive_that_finishes_first(src, tmp_path):
    from deltafin.runtime.source import StreamingExperts
    from deltafin.store.place import apply_layout

    model = _pack(src, tmp_path, "bandwidth")
    pm = PackedModel.open(str(model))
    everywhere = Layout("replicas", {L: [[0, 1] for _ in range(pm.num_experts)] for L in pm.moe_layers})
    apply_layout(pm, everywhere)
    pm = PackedModel.open(str(model))
    assert verify(pm).ok and verify(pm).files == 2 * pm.num_experts * len(pm.moe_layers)
    source = StreamingExperts(pm, cache_bytes=0, threads=2)
    try:
        for L in pm.moe_layers[:3]:
            got = {e: t for e, t in source.fetch(L, list(range(pm.num_experts)))}
            assert sorted(got) == list(range(pm.num_experts))
        reads = {label: d["reads"] for label, d in source.per_drive().items()}
    finally:
        source.close()
    # 8 equal reads per layer at rates 2:1: 5 + 3 and 6 + 2 both finish the layer after 3 reads' time
    assert reads["d0"] + reads["d1"] == 3 * 8 and 3 * 5 <= reads["d0"] <= 3 * 6
