"""--drive paths: they must exist (or --create), folders on one filesystem share its space and speed."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deltafin import cli
from deltafin.errors import DriveError, NotEnoughSpaceError
from deltafin.store import drives as drives_mod
from deltafin.store.drives import check_space, measured_rates, parse_drives, require_drives
from deltafin.tiny import build_tiny


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("dchk")
    build_tiny("olmoe", root / "src", seed=1)
    return root / "src"


def test_missing_drive_is_an_error_unless_create(src, tmp_path, capsys):
    missing = tmp_path / "Volumes" / "ssd1"
    rc = cli.main(["pack", str(src), str(tmp_path / "m"), "--drive", f"{missing}=1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"drive d0: {missing} does not exist; is the drive mounted?" in err and "--create" in err
    assert not missing.exists() and not (tmp_path / "m" / "deltafin.json").exists()
    rc = cli.main(["pack", "--plan", str(src), "--drive", f"{missing}=1"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert cli.main(["pack", str(src), str(tmp_path / "m"), "--drive", f"{missing}=1", "--create",
                     "--no-progress"]) == 0
    assert (missing / "m").is_dir()


def test_a_file_or_an_unwritable_folder_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DriveError, match="is a file, not a folder"):
        require_drives(parse_drives([f"{f}=1"]), create=True)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(DriveError, match="not writable"):
            require_drives(parse_drives([f"{ro}=1"]), create=False, plan=True)
    finally:
        ro.chmod(0o700)


def test_folders_on_one_filesystem_warn_and_count_once(src, tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out = tmp_path / "plan.json"
    assert cli.main(["pack", "--plan", str(src), "--drive", f"a:{tmp_path / 'a'}=2", "--drive",
                     f"b:{tmp_path / 'b'}=1", "--drive", f"c:{tmp_path / 'c'}=1", "--create",
                     "--json", str(out)]) == 0
    cap = capsys.readouterr()
    assert "warning: drives a, b, c are folders on one filesystem" in cap.err
    assert "drives a, b, c share it" in cap.out and "(to be created)" in cap.out
    assert not (tmp_path / "c").exists()  # a plan creates nothing
    doc = json.loads(out.read_text())
    (fs,) = doc["filesystems"].values()
    assert fs["drives"] == ["a", "b", "c"]
    assert fs["bytes"] == doc["expert_bytes"]
    assert fs["free_bytes"] == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)  # others write too
    assert fs["gbps"] == 2.0  # given rates of one device: its speed once (the largest), not their sum
    assert doc["seconds_one_pass"] == pytest.approx(doc["expert_bytes"] / 2e9)


def test_space_is_checked_per_filesystem(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    free = shutil.disk_usage(tmp_path).free
    check_space({"a": (str(tmp_path / "a"), int(free * 0.6))})
    with pytest.raises(NotEnoughSpaceError, match="drives a, b \\(one filesystem"):
        check_space({"a": (str(tmp_path / "a"), int(free * 0.6)), "b": (str(tmp_path / "b"), int(free * 0.6))})


def test_one_probe_per_filesystem(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(drives_mod, "probe_read_gbps", lambda path, label, **kw: calls.append(label) or 3.0)
    for n in "ab":
        (tmp_path / n).mkdir()
    rates = measured_rates(parse_drives([f"a:{tmp_path / 'a'}", f"b:{tmp_path / 'b'}"]))
    assert calls == ["a"] and rates == {"a": 1.5, "b": 1.5}


def test_repack_with_new_rates_moves_only_what_must_move(src, tmp_path, capsys):
    from deltafin.store.model_dir import PackedModel
    from deltafin.store.verify import verify

    out, a, b = tmp_path / "m", tmp_path / "a", tmp_path / "b"
    base = ["pack", str(src), str(out), "--create", "--no-progress", "--json", str(tmp_path / "s.json")]
    assert cli.main([*base, "--drive", f"a:{a}=3", "--drive", f"b:{b}=1"]) == 0
    before = PackedModel.open(str(out))
    old = {(L, e): before.locations(L, e) for L in before.moe_layers for e in range(before.num_experts)}
    capsys.readouterr()
    assert cli.main([*base, "--drive", f"a:{a}=1", "--drive", f"b:{b}=1"]) == 0
    text = capsys.readouterr().out
    s = json.loads((tmp_path / "s.json").read_text())
    after = PackedModel.open(str(out))
    changed = sum(after.locations(L, e) != loc for (L, e), loc in old.items())
    assert "moved only what the new drive rates or placement need" in text
    assert s["moved"] == [changed, changed] and 0 < changed < len(old) and s["written"] == changed
    assert [d.gbps for d in after.drives] == [1.0, 1.0]
    assert verify(after).ok
    files = {L: sum(after.locations(L, e) == [0] for e in range(after.num_experts)) for L in after.moe_layers}
    assert all(n == after.num_experts // 2 for n in files.values())  # equal rates: equal shares
    # the same command again: nothing to do
    assert cli.main([*base, "--drive", f"a:{a}=1", "--drive", f"b:{b}=1"]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["written"] == 0 and s["moved"] is None
    # a new placement is a move too (the files stay valid: verify reassembles striped experts)
    assert cli.main([*base, "--drive", f"a:{a}=1", "--drive", f"b:{b}=1", "--placement", "stripe-equal"]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["moved"] is not None and s["moved"][0] > 0
    striped = PackedModel.open(str(out))
    assert striped.stripe(striped.moe_layers[0]) is not None and verify(striped).ok
