"""The `deltafin` command: lazy imports, exit codes, errors without tracebacks, verify and inspect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltafin import cli
from deltafin.store import expert_file as ef
from deltafin.store.model_dir import PackedModel
from deltafin.tiny import build_tiny

HEAVY = ("torch", "numpy", "transformers", "safetensors", "triton")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_parser_does_not_import_torch():
    code = ("import sys, deltafin.cli; deltafin.cli.build_parser(); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_help_exits_0_without_torch():
    code = ("import sys, runpy; sys.argv = ['deltafin', '--help']\n"
            "try:\n    runpy.run_module('deltafin.cli', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('EXIT', e.code, 'torch' in sys.modules)")
    r = _run("-c", code)
    assert "usage: deltafin" in r.stdout and "pack" in r.stdout and "verify" in r.stdout
    assert r.stdout.strip().endswith("EXIT 0 False"), r.stdout + r.stderr
    r = _run("-m", "deltafin.cli", "--help")
    assert r.returncode == 0 and "inspect" in r.stdout


def _expect_error(capsys, argv: list[str], *needles: str) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


def test_unknown_model_type_exits_2(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.embed_tokens.weight": torch.ones(4, 4)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    _expect_error(capsys, ["pack", str(src), str(tmp_path / "out"), "--drive", f"{tmp_path / 'd'}=1", "--create"],
                  "UnsupportedArchitectureError", "model_type 'mamba2' is not supported", "qwen3_moe", "kimi_k3")
    _expect_error(capsys, ["pack", "--plan", str(src)], "model_type 'mamba2' is not supported")


def test_missing_out_exits_2(tmp_path, capsys):
    _expect_error(capsys, ["pack", str(tmp_path)], "OUT (the model folder to write) is missing", "--plan")


def test_other_usage_errors_exit_2(tmp_path, capsys):
    _expect_error(capsys, ["pack", str(tmp_path / "nope"), str(tmp_path / "out")], "checkpoint directory not found")
    _expect_error(capsys, ["pack", str(tmp_path), str(tmp_path / "o"), "--drive", f"{tmp_path}=fast"],
                  "is not a number of GB/s")
    _expect_error(capsys, ["verify", str(tmp_path)], "no deltafin.json; not a packed Deltafin model")
    _expect_error(capsys, ["inspect", str(tmp_path), "--drive-map", "nolabel"], "expected LABEL=PATH")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    build_tiny("olmoe", root / "src", seed=4)
    rc = cli.main(["pack", str(root / "src"), str(root / "model"), "--drive", f"a:{root / 'da'}=2",
                   "--drive", f"b:{root / 'db'}=1", "--create", "--no-progress", "--json", str(root / "pack.json")])
    assert rc == 0
    return root


def test_placement_needing_a_trace_is_a_usage_error(packed, tmp_path, capsys):
    _expect_error(capsys, ["pack", str(packed / "src"), str(tmp_path / "m"), "--drive", f"{tmp_path / 'd'}=1",
                           "--create", "--placement", "coactivation"], "--placement 'coactivation'", "bandwidth")
    _expect_error(capsys, ["pack", "--plan", str(packed / "src"), "--placement", "replicas"], "--placement 'replicas'")


def test_pack_summary_json(packed):
    s = json.loads((packed / "pack.json").read_text())
    assert s["expert_files"] == s["written"] == 3 * 8
    assert set(s["per_drive"]) == {"a", "b"} and s["peak_rss_bytes"] > 0


def test_inspect_json(packed, tmp_path, capsys):
    out = tmp_path / "inspect.json"
    assert cli.main(["inspect", str(packed / "model"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "olmoe" in text and "24 files" in text
    s = json.loads(out.read_text())
    assert s["family"] == "olmoe" and s["moe_layers"] == 3 and s["experts_per_layer"] == 8
    assert s["expert_files"] == 24 and s["experts_per_token"] == 2
    assert s["expert_formats"] == ["mxfp4"] and s["trunk_formats"]["int8"] > 0
    assert sum(d["files"] for d in s["per_drive"].values()) == 24
    assert sum(d["bytes"] for d in s["per_drive"].values()) == s["expert_bytes"] == 24 * s["expert_file_bytes"]
    assert s["per_drive"]["a"]["files"] > s["per_drive"]["b"]["files"] > 0
    assert s["streamed_bytes_per_token"] == 2 * 3 * s["expert_file_bytes"]


def test_verify_exit_codes(packed, tmp_path, capsys):
    assert cli.main(["verify", str(packed / "model")]) == 0
    assert "all good" in capsys.readouterr().out
    model = PackedModel.open(str(packed / "model"))
    bad = Path(model.expert_path(2, 3))
    original = bad.read_bytes()
    try:
        raw = bytearray(original)
        raw[-1] ^= 0xFF  # the last byte of the zero padding: covered by the checksum too
        bad.write_bytes(raw)
        out = tmp_path / "verify.json"
        assert cli.main(["verify", str(packed / "model"), "--json", str(out)]) == 1
        cap = capsys.readouterr()
        assert "1 bad" in cap.out
        assert f"BAD {bad}: checksum mismatch" in cap.err
        assert f"deltafin pack {packed / 'src'} {packed / 'model'} --repair" in cap.err
        doc = json.loads(out.read_text())
        assert [b["path"] for b in doc["bad"]] == [str(bad)] and doc["files"] == 24
        assert ef.checksum(raw) != model.checksum(2, 3)
    finally:
        bad.write_bytes(original)
    assert cli.main(["verify", str(packed / "model")]) == 0
