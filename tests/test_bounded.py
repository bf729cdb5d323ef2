"""Bounded everything: job inputs and outputs that are terminals, devices or links, a full disk, classify's
memory over huge inputs, chat's /load of an endless or deeply nested file, grammar and tools schemas (size,
prompt length first, compile deadline, cancellation), and echoes and log lines of hostile sizes."""

from __future__ import annotations

import errno
import json
import os
import pty
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from deltafin import cli
from tests.tiny import pack_tiny

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["--cache-gb", "0.05", "--max-len", "256", "--io-threads", "2", "--quiet"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return pack_tiny(tmp_path_factory.mktemp("bounded"), "qwen3_moe", tokenizer=True)


def _limited() -> None:  # the child may not take more than 3 GiB, whatever it reads
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _cli_child(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI in a child process under a memory cap and a deadline: an endless read fails the test, never
    the machine."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        return subprocess.run([sys.executable, "-m", "deltafin", *args], env=env, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=_limited, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deltafin {' '.join(args[:4])}: still running after {timeout} s")


def _one_line_child(args: list[str], *needles: str) -> None:
    r = _cli_child(args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def _one_line(capsys, argv: list[str], *needles: str) -> None:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def _inputs(tmp_path: Path, n: int = 3) -> Path:
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(n)))
    return p


# ---------------------------------------------------------------- inputs and outputs that are not files


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/full", "/dev/null"])
def test_batch_output_that_is_a_device_is_refused(model, tmp_path, dev):
    _one_line_child(["batch", model, str(_inputs(tmp_path)), dev, "--greedy", "-n", "2", *ENGINE],
                    dev, "not a regular file")


def test_batch_output_on_a_terminal_is_refused(model, tmp_path):
    master, slave = pty.openpty()
    try:
        _one_line_child(["batch", model, str(_inputs(tmp_path)), os.ttyname(slave), "--greedy", "-n", "2", *ENGINE],
                        "not a regular file")
    finally:
        os.close(master)
        os.close(slave)


def test_batch_input_that_is_a_device_is_refused(model, tmp_path):
    _one_line_child(["batch", model, "/dev/zero", str(tmp_path / "out.jsonl"), "--greedy", "-n", "2", *ENGINE],
                    "/dev/zero", "not a regular file")


def test_batch_output_that_links_to_the_input_is_refused(model, tmp_path, capsys):
    inp = _inputs(tmp_path)
    os.symlink(inp, tmp_path / "out.jsonl")
    before = inp.read_text()
    _one_line(capsys, ["batch", model, str(inp), str(tmp_path / "out.jsonl"), "--greedy", "-n", "2", *ENGINE],
              "the input file")
    assert inp.read_text() == before


def test_classify_output_inside_its_input_folder_is_refused(model, tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    _one_line(capsys, ["classify", model, str(folder), "--labels", "a,b", "-o", str(folder / "out.jsonl"), *ENGINE],
              "inside the input folder")
    assert not (folder / "out.jsonl").exists()


def test_full_disk_under_batch_output_is_one_line_and_resumes(model, tmp_path, capsys, monkeypatch):
    from deltafin.jobs import results

    inp, out = _inputs(tmp_path), tmp_path / "out.jsonl"
    real = os.write
    calls = []

    def full(fd, data):
        calls.append(1)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(results.os, "write", full)
    _one_line(capsys, ["batch", model, str(inp), str(out), "--greedy", "-n", "2", *ENGINE], str(out),
              "No space left", "re-run")
    monkeypatch.setattr(results.os, "write", real)
    assert cli.main(["batch", model, str(inp), str(out), "--greedy", "-n", "2", *ENGINE]) == 0
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [0, 1, 2]


# ---------------------------------------------------------------- classify's memory


def test_classify_reads_huge_inputs_in_bounded_memory(model, tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(6):  # sparse: 16 MiB each on no disk space, 96 MiB together
        with open(folder / f"big{i}.txt", "wb") as f:
            f.truncate((16 << 20) - 1)
    (folder / "small.txt").write_text("a short one")
    out = tmp_path / "out.jsonl"
    tracemalloc.start()
    try:
        assert cli.main(["classify", model, str(folder), "--labels", "a,b", "-o", str(out), "--batch-size", "2",
                         *ENGINE]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "label" in recs["small.txt"] and "context" in recs["big0.txt"]["error"]
    assert peak < 40 << 20, f"peak {peak / 2**20:.0f} MiB traced while classifying"


# ---------------------------------------------------------------- chat's /load


def test_chat_load_of_an_endless_or_deep_file(model, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = f"/load /dev/zero\n/load {deep}\n/exit\n"
    try:
        r = subprocess.run([sys.executable, "-m", "deltafin", "chat", model, "-n", "2", "--greedy", "--quiet",
                            "--cache-gb", "0"], input=script, env=env, capture_output=True, text=True, timeout=120,
                           preexec_fn=_limited)
    except subprocess.TimeoutExpired:
        pytest.fail("chat /load did not come back")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "/load: /dev/zero" in r.stdout and "not a regular file" in r.stdout
    assert "nested too deeply" in r.stdout


# ---------------------------------------------------------------- grammars and tools


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("xgrammar")
    httpx = pytest.importorskip("httpx")
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.serve.app import create_app
    from deltafin.serve.protocol import Limits
    from deltafin.serve.worker import Worker
    from tests.test_serve import live
    from tests.test_serve_openai import TOOL_TEMPLATE

    path = pack_tiny(tmp_path_factory.mktemp("served"), "qwen3_moe", tokenizer=True)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(TOOL_TEMPLATE)
    eng = Engine(path, EngineOptions(exact=True, cache_gb=0.05, max_len=256, threads=2))
    worker = Worker(eng, max_batch=4).start()
    app = create_app(worker, "tiny", limits=Limits(max_tokens=16))
    with live(app) as url:
        yield url, app.state.server, httpx
    worker.stop()
    eng.close()


def _tool(i: int, props: int = 1) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(props)}}}}


def test_too_many_tools_or_too_big_a_schema_is_refused_at_once(served):
    url, _, httpx = served
    msgs = [{"role": "user", "content": "hi"}]
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "tools": [_tool(i) for i in range(200)],
                                                       "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tools", r.text
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "description": "x" * 200}
                                            for i in range(500)}}
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": big}}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "schema_too_large", r.text
    assert time.monotonic() - t0 < 10


def test_prompt_length_is_checked_before_any_compile(served, monkeypatch):
    url, srv, httpx = served
    compiled = []
    monkeypatch.setattr(type(srv.ctx.grammars), "_run", lambda *a, **k: compiled.append(1))
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "word " * 400}], "tools": [_tool(i, 4) for i in range(20)],
        "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert not compiled


def _never_answers(conn, tokenizer_json):  # a compilation that runs forever (spawned by the test)
    conn.recv()
    time.sleep(3600)


def test_grammar_compile_has_a_deadline_and_stops_when_the_client_leaves(served, monkeypatch):
    from deltafin.serve import grammar_worker
    from deltafin.serve.grammar_worker import BoundedGrammars, Cancelled, GrammarTimeout

    _, srv, _ = served
    monkeypatch.setattr(grammar_worker, "_child", _never_answers)
    g = BoundedGrammars(srv.ctx.grammars.inner, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(GrammarTimeout, match="longer than 1 s"):
        g.json_schema({"type": "object"})
    assert time.monotonic() - t0 < 30 and g._proc is None  # the child was killed
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    g.timeout_s = 60
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        g.json_schema({"type": "object"}, cancel=cancel)
    assert time.monotonic() - t0 < 30 and g._proc is None


def test_a_real_schema_still_constrains_through_the_child(served):
    url, _, httpx = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 16, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}, timeout=120)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- echoes and log lines


def test_a_huge_model_name_is_not_echoed_and_a_huge_url_not_logged_whole(served, caplog):
    url, _, httpx = served
    name = "m" * 900_000
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "x"}]},
                   timeout=60)
    assert r.status_code == 404 and len(r.text) < 2000, len(r.text)
    caplog.set_level("INFO", logger="deltafin.serve.access")
    r = httpx.get(f"{url}/{'u' * 50_000}", timeout=60)
    assert r.status_code == 404 and len(r.text) < 2000
    time.sleep(0.2)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "deltafin.serve.access"]
    assert lines and max(map(len, lines)) < 1000
