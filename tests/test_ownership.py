"""Nothing lost whatever the user does, on the store side: drives shared by several models, `rm` and `place`
that delete only their own files, `--repair` only from the checkpoint packed, repacks that leave no orphans,
and manifests or configs that would crash `run` refused at load with one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from deltafin import cli
from deltafin.store import manifest as mf
from deltafin.store.model_dir import PackedModel
from deltafin.store.verify import verify

OWNER = ".deltafin-owner.json"


@pytest.fixture(scope="module")
def srcs(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints of one architecture (other seeds), with a tokenizer."""
    from deltafin.tiny import build_tiny, save_byte_tokenizer

    root = tmp_path_factory.mktemp("own")
    for name, seed in (("A", 0), ("B", 1)):
        build_tiny("qwen3_moe", root / name, seed=seed, vocab_size=320)
        save_byte_tokenizer(root / name, 320)
    return root / "A", root / "B"


def _tree(*roots: Path) -> dict[str, bytes]:
    """Every file under ``roots`` with its bytes (markers and lock files left out)."""
    out = {}
    for r in roots:
        for p in sorted(Path(r).rglob("*")):
            if p.is_file() and not p.name.startswith(".deltafin"):
                out[str(p)] = p.read_bytes()
    return out


def _one_line(capsys, argv: list[str], *needles: str) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [x for x in err.strip().splitlines() if not x.startswith("[deltafin] warning")]
    assert "Traceback" not in err and len(lines) == 1, err
    for n in needles:
        assert n in err, err
    return err


def _pack(src: Path, out: Path, *drives: str, extra: tuple[str, ...] = ()) -> int:
    argv = ["pack", str(src), str(out), "--no-progress", "--create", *extra]
    for d in drives:
        argv += ["--drive", d]
    return cli.main(argv)


def _expert_count(*folders: Path) -> int:
    return sum(1 for f in folders for p in Path(f).rglob("*.dfx*") if p.is_file())


# ---------------------------------------------------------------- case 1: two models, one folder name, shared drives


def test_second_model_with_same_folder_name_is_refused_and_rm_leaves_the_first(srcs, tmp_path, capsys):
    A, B = srcs
    D0, D1 = tmp_path / "D0", tmp_path / "D1"
    assert _pack(A, tmp_path / "x" / "model", f"a:{D0}=2", f"b:{D1}=1") == 0
    a_files = _tree(D0, D1, tmp_path / "x")
    capsys.readouterr()
    _one_line(capsys, ["pack", str(B), str(tmp_path / "y" / "model"), "--drive", f"a:{D0}=2", "--drive",
                       f"b:{D1}=1", "--no-progress"], str(D0 / "model"), "another model", "--model-id")
    assert _tree(D0, D1, tmp_path / "x") == a_files  # nothing of A touched
    # with its own model id, B shares the drives; rm of B then leaves A whole
    assert _pack(B, tmp_path / "y" / "model", f"a:{D0}=2", f"b:{D1}=1", extra=("--model-id", "model-b")) == 0
    assert cli.main(["rm", str(tmp_path / "y" / "model"), "-y"]) == 0
    out = capsys.readouterr().out
    assert "deleted" in out and str(D0 / "model-b") in out
    assert _tree(D0, D1, tmp_path / "x") == a_files
    assert not (D0 / "model-b").exists() and not (tmp_path / "y" / "model").exists()
    assert verify(PackedModel.open(str(tmp_path / "x" / "model"))).ok


# ---------------------------------------------------------------- case 2: user files in OUT or a drive folder


def test_pack_refuses_folders_holding_user_files_and_rm_never_deletes_them(srcs, tmp_path, capsys):
    A, _ = srcs
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _one_line(capsys, ["pack", str(A), str(out), "--drive", f"{tmp_path}/D0=2", "--create", "--no-progress"],
              "notes.txt", "Deltafin did not write")
    (tmp_path / "D1" / "model").mkdir(parents=True)
    (tmp_path / "D1" / "model" / "thesis.tex").write_text("mine too")
    _one_line(capsys, ["pack", str(A), str(tmp_path / "model"), "--drive", f"{tmp_path}/D1=2", "--no-progress"],
              "thesis.tex", "--model-id")
    # a user file put beside the model after the pack survives rm, which says it kept it
    assert _pack(A, tmp_path / "m2", f"{tmp_path}/D2=2") == 0
    (tmp_path / "D2" / "m2" / "L001").mkdir(exist_ok=True)
    (tmp_path / "D2" / "m2" / "diary.txt").write_text("keep me")
    (tmp_path / "m2" / "photo.jpg").write_bytes(b"\xff\xd8")
    capsys.readouterr()
    assert cli.main(["rm", str(tmp_path / "m2"), "-y"]) == 0
    out_text = capsys.readouterr().out
    assert (tmp_path / "D2" / "m2" / "diary.txt").read_text() == "keep me"
    assert (tmp_path / "m2" / "photo.jpg").exists()
    assert "diary.txt" in out_text and "photo.jpg" in out_text
    assert _expert_count(tmp_path / "D2") == 0


def test_a_manifest_naming_any_folder_makes_rm_delete_nothing_there(srcs, tmp_path, capsys):
    A, _ = srcs
    assert _pack(A, tmp_path / "model", f"{tmp_path}/D0=2") == 0
    victim = tmp_path / "home" / "Documents"
    (victim / "L000").mkdir(parents=True)
    (victim / "L000" / "E0000.dfx").write_bytes(b"precious")
    (victim / "report.odt").write_bytes(b"precious")
    doc = json.loads((tmp_path / "model" / mf.MANIFEST).read_text())
    doc["model_id"] = "Documents"
    doc["drives"][0]["path"] = str(tmp_path / "home")
    (tmp_path / "model" / mf.MANIFEST).write_text(json.dumps(doc))
    assert cli.main(["rm", str(tmp_path / "model"), "-y"]) == 0
    assert (victim / "report.odt").read_bytes() == b"precious"
    assert (victim / "L000" / "E0000.dfx").read_bytes() == b"precious"
    assert "no marker of this model" in capsys.readouterr().out


# ---------------------------------------------------------------- case 3: two drives that are one folder


def test_drives_resolving_to_one_folder_are_refused_by_place_and_drive_map(srcs, tmp_path, capsys):
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"a:{tmp_path}/D0=2", f"b:{tmp_path}/D1=1") == 0
    before = _expert_count(tmp_path / "D0", tmp_path / "D1")
    _one_line(capsys, ["place", str(model), "--policy", "roundrobin", "--no-progress", "--drive-map",
                       f"b={tmp_path}/D0"], "same folder", "--drive-map")
    shutil.rmtree(tmp_path / "D1")
    os.symlink(tmp_path / "D0", tmp_path / "D1")  # the second drive now a link to the first
    _one_line(capsys, ["place", str(model), "--policy", "roundrobin", "--no-progress"], "same folder")
    _one_line(capsys, ["place", str(model), "--ranks", "a@1;b@1", "--no-progress"], "same folder")
    assert _expert_count(tmp_path / "D0") == sum(1 for _ in (tmp_path / "D0" / "model").rglob("*.dfx"))
    assert _expert_count(tmp_path / "D0") <= before  # nothing deleted by a placement


def test_pack_refuses_two_drives_that_are_one_folder(srcs, tmp_path, capsys):
    A, _ = srcs
    (tmp_path / "D0").mkdir()
    os.symlink(tmp_path / "D0", tmp_path / "D1")
    _one_line(capsys, ["pack", str(A), str(tmp_path / "model"), "--drive", f"{tmp_path}/D0=2", "--drive",
                       f"{tmp_path}/D1=1", "--no-progress"], "distinct")


# ---------------------------------------------------------------- case 4: --repair from another checkpoint


def test_repair_from_another_checkpoint_is_refused(srcs, tmp_path, capsys):
    A, B = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2") == 0
    victim = next((tmp_path / "D0" / "model").rglob("E0001.dfx"))
    data = bytearray(victim.read_bytes())
    data[5000] ^= 0xFF
    victim.write_bytes(bytes(data))
    doc = (model / mf.MANIFEST).read_text()
    capsys.readouterr()
    _one_line(capsys, ["pack", str(B), str(model), "--repair", "--no-progress"], str(B),
              "not the checkpoint", "original checkpoint")
    assert (model / mf.MANIFEST).read_text() == doc  # source unchanged, nothing rewritten
    assert victim.read_bytes() == bytes(data)
    assert cli.main(["pack", str(A), str(model), "--repair", "--no-progress"]) == 0
    assert verify(PackedModel.open(str(model))).ok


def test_repair_that_does_not_reproduce_the_packed_bytes_stops(srcs, tmp_path, capsys, monkeypatch):
    """Even past the identity check (a checkpoint edited in a way the sampled digest misses), the rewritten
    expert must reproduce its recorded checksum."""
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2", extra=("--experts", "bf16")) == 0
    victim = next((tmp_path / "D0" / "model").rglob("E0001.dfx"))
    victim.write_bytes(victim.read_bytes()[:4096])  # truncated: repair rewrites it
    from deltafin.store import convert

    real = convert.expert_tensors

    def other(*a, **kw):
        out = real(*a, **kw)
        for q in out.values():
            q.data.mul_(2)
        return out
    monkeypatch.setattr("deltafin.store.pack.expert_tensors", other)
    doc = (model / mf.MANIFEST).read_text()
    _one_line(capsys, ["pack", str(A), str(model), "--repair", "--no-progress", "--experts", "bf16"],
              "does not reproduce the packed bytes")
    assert (model / mf.MANIFEST).read_text() == doc


def test_repair_replaces_a_huge_sparse_link_without_reading_it(srcs, tmp_path, capsys):
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2") == 0
    victim = next((tmp_path / "D0" / "model").rglob("E0002.dfx"))
    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as f:
        f.truncate(64 << 30)  # 64 GiB, sparse
    victim.unlink()
    os.symlink(huge, victim)
    rep = verify(PackedModel.open(str(model)))
    assert [p for p, _ in rep.bad] == [str(victim)]
    assert cli.main(["pack", str(A), str(model), "--repair", "--no-progress"]) == 0
    assert not victim.is_symlink() and huge.stat().st_size == 64 << 30
    assert verify(PackedModel.open(str(model))).ok


def test_verify_names_an_expert_path_that_links_out_of_its_drive(srcs, tmp_path, capsys):
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2") == 0
    victim = next((tmp_path / "D0" / "model").rglob("E0003.dfx"))
    outside = tmp_path / "elsewhere.dfx"
    shutil.copy(victim, outside)
    victim.unlink()
    os.symlink(outside, victim)
    capsys.readouterr()
    assert cli.main(["verify", str(model)]) == 1
    err = capsys.readouterr().err
    assert "corrupt" not in err and str(victim) in err and "link" in err


# ---------------------------------------------------------------- case 6: other checkpoint into OUT, repack to new drives


def test_other_checkpoint_into_out_needs_overwrite_which_removes_the_old_files(srcs, tmp_path, capsys):
    A, B = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2", f"{tmp_path}/D1=1") == 0
    n = _expert_count(tmp_path / "D0", tmp_path / "D1")
    capsys.readouterr()
    _one_line(capsys, ["pack", str(B), str(model), "--no-progress"], "another model", "--overwrite")
    assert _pack(B, model, f"{tmp_path}/D2=2", extra=("--overwrite",)) == 0
    out = capsys.readouterr().out
    assert f"removed {n:,} expert files" in out
    assert _expert_count(tmp_path / "D0", tmp_path / "D1") == 0  # no orphans of A
    pm = PackedModel.open(str(model))
    assert verify(pm).ok and pm.doc["source"]["path"] == str(B)


def test_repack_to_new_drives_removes_the_old_layout(srcs, tmp_path, capsys):
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2", f"{tmp_path}/D1=1") == 0
    n = _expert_count(tmp_path / "D0", tmp_path / "D1")
    capsys.readouterr()
    assert _pack(A, model, f"{tmp_path}/D2=2", f"{tmp_path}/D3=1") == 0
    assert f"removed {n:,} expert files" in capsys.readouterr().out
    assert _expert_count(tmp_path / "D0", tmp_path / "D1") == 0
    assert not (tmp_path / "D0" / "model").exists()
    assert verify(PackedModel.open(str(model))).ok
    # a repack to another format on the same drives: no file of the old layout is left either
    assert _pack(A, model, f"{tmp_path}/D2=2", f"{tmp_path}/D3=1", extra=("--placement", "stripe-equal")) == 0
    pm = PackedModel.open(str(model))
    listed = {r.path for L in pm.moe_layers for e in range(pm.num_experts) for r in pm.expert_files(L, e)}
    on_disk = {str(p) for d in ("D2", "D3") for p in (tmp_path / d).rglob("*.dfx*")}
    assert on_disk == listed


# ---------------------------------------------------------------- manifests and configs `run` relies on


def _edit_manifest(model: Path, fn) -> None:
    doc = json.loads((model / mf.MANIFEST).read_text())
    fn(doc)
    (model / mf.MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["experts"]["locations"]["1"].__setitem__(0, [0, 0]), "more than once"),
    (lambda d: d["experts"].update(num_experts=d["experts"]["num_experts"] - 1) or [
        d["experts"][k].__setitem__(L, v[:-1]) for k in ("locations", "checksums") for L, v in
        list(d["experts"][k].items())], "experts per layer"),
])
def test_manifest_fields_run_relies_on_are_checked_at_load(srcs, tmp_path, capsys, edit, needle):
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2", f"{tmp_path}/D1=1") == 0
    _edit_manifest(model, edit)
    capsys.readouterr()
    _one_line(capsys, ["verify", str(model)], needle)
    _one_line(capsys, ["run", str(model), "--prompt-ids", "1,2", "-n", "1"], needle)


def test_a_changed_config_is_refused_at_load(srcs, tmp_path, capsys):
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2") == 0
    cfg = json.loads((model / "config.json").read_text())
    del cfg["norm_topk_prob"]
    (model / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    _one_line(capsys, ["verify", str(model)], "config.json", "changed since the model was packed")
    _one_line(capsys, ["run", str(model), "--prompt-ids", "1,2", "-n", "1"], "changed since the model was packed")


@pytest.mark.parametrize("edit,needle", [
    (lambda c: {k: v for k, v in c.items() if k != "num_experts_per_tok"}, "num_experts_per_tok"),
    (lambda c: c | {"num_hidden_layers": c["num_hidden_layers"] + 1}, "num_hidden_layers"),
    (lambda c: c | {"num_hidden_layers": c["num_hidden_layers"] - 1}, "num_hidden_layers"),
])
def test_config_fields_are_checked_at_pack(srcs, tmp_path, capsys, edit, needle):
    A, _ = srcs
    src = tmp_path / "src"
    shutil.copytree(A, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(edit(cfg)))
    _one_line(capsys, ["pack", str(src), str(tmp_path / "model"), "--drive", f"{tmp_path}/D0=2", "--create",
                       "--no-progress"], needle)
    assert not (tmp_path / "model" / mf.MANIFEST).exists()


@pytest.mark.parametrize("fmt", ["auto", "mxfp4"])
def test_nan_float_experts_are_refused_for_every_codec(srcs, tmp_path, capsys, fmt):
    from safetensors.torch import load_file, save_file

    A, _ = srcs
    src = tmp_path / "src"
    shutil.copytree(A, src)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    for f in src.glob("*.safetensors"):
        t = load_file(str(f))
        if name in t:
            t[name][2, 5] = float("nan")
            save_file(t, str(f), metadata={"format": "pt"})
    _one_line(capsys, ["pack", str(src), str(tmp_path / "model"), "--drive", f"{tmp_path}/D0=2", "--create",
                       "--no-progress", "--experts", fmt], name, "NaN/inf")


def test_verify_io_threads_out_of_range_is_one_line(srcs, tmp_path, capsys):
    A, _ = srcs
    assert _pack(A, tmp_path / "model", f"{tmp_path}/D0=2") == 0
    for n in ("0", "100000"):
        _one_line(capsys, ["verify", str(tmp_path / "model"), "--io-threads", n], "--io-threads", n)


def test_place_on_a_read_only_model_folder_is_one_line(srcs, tmp_path, capsys, monkeypatch):
    A, _ = srcs
    model = tmp_path / "model"
    assert _pack(A, model, f"{tmp_path}/D0=2", f"{tmp_path}/D1=1") == 0
    real_open = os.open

    def read_only(path, flags, *a, **kw):  # as a read-only mount answers (root ignores chmod)
        if str(path).startswith(str(model)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(os, "open", read_only)
    _one_line(capsys, ["place", str(model), "--policy", "roundrobin", "--no-progress"], str(model), "writable")
