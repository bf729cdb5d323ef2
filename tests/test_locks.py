"""One writer per model folder and per job output, locks a crashed process does not leave held, and readers
that see a consistent layout: `place` on a served model waits for readers of the old layout, the server
takes the new one up and its requests keep working, and /health reports files that moved or vanished."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deltafin import cli
from deltafin.store import place as place_mod
from deltafin.store.locks import model_lock, output_lock
from deltafin.store.model_dir import PackedModel
from deltafin.store.verify import verify
from tests.tiny import pack_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return Path(pack_tiny(tmp_path_factory.mktemp("locks"), "qwen3_moe", tokenizer=True))


def _one_line(capsys, argv: list[str], *needles: str) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith("[deltafin] warning")]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    for n in needles:
        assert n in err, err
    return err


def _python(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)


def test_a_second_pack_on_one_out_is_refused_while_the_first_runs(model, tmp_path, capsys):
    src = model.parent / "src"
    out = tmp_path / "model"
    with model_lock(str(out), "pack"):  # a pack in progress
        _one_line(capsys, ["pack", str(src), str(out), "--drive", f"{tmp_path}/d0=2", "--create", "--no-progress"],
                  str(out), "in use by another deltafin process")
    assert not (tmp_path / "d0" / "model").exists()  # nothing written by the refused one
    assert cli.main(["pack", str(src), str(out), "--drive", f"{tmp_path}/d0=2", "--no-progress"]) == 0


def test_rm_and_place_are_refused_while_another_writer_holds_the_model(model, tmp_path, capsys):
    work = tmp_path / "m"
    shutil.copytree(model.parent, work, symlinks=True)
    doc = json.loads((work / "model" / "deltafin.json").read_text())
    for d in doc["drives"]:
        d["path"] = str(work / Path(d["path"]).name)
    (work / "model" / "deltafin.json").write_text(json.dumps(doc))
    with model_lock(str(work / "model"), "pack"):
        _one_line(capsys, ["rm", str(work / "model"), "-y"], "in use")
        _one_line(capsys, ["place", str(work / "model"), "--policy", "roundrobin", "--no-progress"], "in use")
    assert verify(PackedModel.open(str(work / "model"))).ok


def test_a_crashed_writer_leaves_no_lock(model, tmp_path, capsys):
    out = tmp_path / "model"
    p = _python(f"""
        from deltafin.store.locks import model_lock
        lock = model_lock({str(out)!r}, "pack")
        print("locked", flush=True)
        import time; time.sleep(600)
    """)
    assert p.stdout.readline().strip() == "locked"
    _one_line(capsys, ["pack", str(model.parent / "src"), str(out), "--drive", f"{tmp_path}/d0=2", "--create",
                       "--no-progress"], "in use")
    p.kill()  # a crash: no cleanup runs
    p.wait()
    assert cli.main(["pack", str(model.parent / "src"), str(out), "--drive", f"{tmp_path}/d0=2", "--create",
                     "--no-progress"]) == 0


def test_two_batch_runs_on_one_output(model, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    argv = ["batch", str(model), str(inp), str(out), "--greedy", "-n", "2", "--no-progress", "--quiet",
            "--cache-gb", "0.05", "--max-len", "128"]
    lock = output_lock(str(out), "batch")  # another batch writing this output
    try:
        _one_line(capsys, argv, str(out), "in use by another deltafin process")
        texts = tmp_path / "texts.jsonl"
        texts.write_text(json.dumps({"id": 0, "text": "t"}) + "\n")
        _one_line(capsys, ["classify", str(model), str(texts), "--labels", "a,b", "-o", str(out), "--quiet"],
                  "in use")
    finally:
        lock.release()
    assert cli.main(argv) == 0
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == [0, 1, 2]  # each id written once


def test_place_waits_for_a_reader_of_the_old_layout(model, tmp_path, monkeypatch, capsys):
    work = tmp_path / "m"
    pack_tiny(work, "qwen3_moe")
    reader = _python(f"""
        from deltafin.store.model_dir import PackedModel
        pm = PackedModel.open({str(work / "model")!r})
        print("reading", flush=True)
        input()
    """)
    assert reader.stdout.readline().strip() == "reading"
    monkeypatch.setattr(place_mod, "READERS_WAIT_S", 1.0)
    capsys.readouterr()
    pm = PackedModel.open(str(work / "model"), reader=False)
    before = {r.path for L in pm.moe_layers for e in range(pm.num_experts) for r in pm.expert_files(L, e)}
    _one_line(capsys, ["place", str(work / "model"), "--policy", "roundrobin", "--no-progress"],
              "still reads the old one", "again later")
    assert all(os.path.exists(p) for p in before)  # the reader's files are all still there
    reader.stdin.write("\n")
    reader.stdin.close()
    reader.wait()
    assert cli.main(["place", str(work / "model"), "--policy", "roundrobin", "--no-progress"]) == 0
    assert "finished an interrupted placement change" in capsys.readouterr().out
    pm = PackedModel.open(str(work / "model"))
    assert verify(pm).ok and not [p for p in before if os.path.exists(p)
                                  and p not in {r.path for L in pm.moe_layers for e in range(pm.num_experts)
                                                for r in pm.expert_files(L, e)}]


def test_place_on_a_served_model_keeps_requests_working_and_health_reports_vanished_files(tmp_path):
    httpx = pytest.importorskip("httpx")
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.serve.app import create_app
    from deltafin.serve.worker import Worker
    from tests.test_serve import live

    path = pack_tiny(tmp_path, "qwen3_moe", tokenizer=True)
    eng = Engine(path, EngineOptions(exact=True, cache_gb=0.0, max_len=128, threads=2))
    worker = Worker(eng, max_batch=4).start()
    app = create_app(worker, "tiny")
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}
    try:
        with live(app) as url:
            first = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert first.status_code == 200, first.text
            for policy in ("roundrobin", "stripe-equal"):  # every expert moves at least once
                assert cli.main(["place", path, "--policy", policy, "--no-progress"]) == 0
                again = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert again.status_code == 200, again.text
                assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            shutil.move(str(tmp_path / "d1"), str(tmp_path / "d1-elsewhere"))
            import time

            time.sleep(2.1)  # past the health check's cache
            h = httpx.get(f"{url}/health", timeout=10)
            assert h.status_code == 503 and "d1" in json.dumps(h.json()["problems"]), h.text
    finally:
        worker.stop()
        eng.close()
