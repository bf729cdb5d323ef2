"""The README's multi-machine commands, run as written on this machine: ``torchrun --nproc-per-node 2 -m
deltafin.cli ...`` (gloo, two ranks, each owning half of the experts) gives what one process gives, for ``run``
(its start line included: it once crashed there), ``batch``, ``classify`` and ``serve`` answering a request."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.tiny import pack_tiny

TIMEOUT_S = 300  # a hang fails the test instead of stalling the run


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return pack_tiny(tmp_path_factory.mktemp("torchrun") / "m", "qwen3_moe", tokenizer=True)


def _deltafin(args: list[str], ranks: int, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    if ranks == 1:
        cmd = [sys.executable, "-m", "deltafin.cli", *args, "-t", "1"]
    else:
        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port),
               "-m", "deltafin.cli", *args, "-t", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd, env=env)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}"
    return p


def test_run_under_torchrun_equals_one_process(model, tmp_path):
    args = ["run", model, "--prompt-ids", "5,17,99,3,42", "-n", "8", "--greedy", "--cache-gb", "0.001"]
    one = _deltafin(args, 1, tmp_path)
    two = _deltafin(args, 2, tmp_path)
    assert two.stdout == one.stdout and one.stdout.strip()  # the same text, printed once (by rank 0)
    assert "reserved" not in two.stderr and "Traceback" not in two.stderr


def test_batch_and_classify_under_torchrun_equal_one_process(model, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "Revenue for the quarter"}, {"id": "b", "prompt": "Costs were"},
        {"id": "c", "prompt": "Cash flow"}]))
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in (("x.txt", "Totals match the ledger."), ("y.txt", "Fine."), ("z.txt", "Late again.")):
        (docs / name).write_text(text)
    out = {}
    for ranks in (1, 2):
        b, c = tmp_path / f"batch{ranks}.jsonl", tmp_path / f"classify{ranks}.csv"
        _deltafin(["batch", model, str(inp), str(b), "--greedy", "-n", "6", "--batch-size", "2", "--no-progress",
                   "--cache-gb", "0.001"], ranks, tmp_path)
        _deltafin(["classify", model, str(docs), "--labels", "yes,no", "--template", "{input} ok?", "-o", str(c),
                   "--no-progress", "--batch-size", "2", "--cache-gb", "0.001"], ranks, tmp_path)
        out[ranks] = ([json.loads(line) for line in b.read_text().splitlines()], c.read_text())
    gen = {ranks: sorted((r["id"], r.get("text"), r.get("error")) for r in recs) for ranks, (recs, _) in out.items()}
    assert gen[2] == gen[1] and len(gen[1]) == 3 and all(t for _, t, _ in gen[1])
    assert out[2][1] == out[1][1] and out[1][1].count("\n") == 4  # header and three rows, the same probabilities


def _serve_once(model: str, ranks: int, cwd, body: dict) -> dict:
    """Start ``deltafin serve`` (under torchrun for ranks > 1), answer one request, stop it."""
    import signal
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["serve", model, "--port", str(port), "-t", "1", "--cache-gb", "0.001"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    if ranks == 1:
        cmd = [sys.executable, "-m", "deltafin.cli", *args]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            master = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(master), "-m", "deltafin.cli", *args]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert p.poll() is None, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout.read().decode()[-3000:]}"
            try:
                urllib.request.urlopen(url + "/models", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        req = urllib.request.Request(url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=TIMEOUT_S).read())
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)


def test_serve_under_torchrun_answers_as_one_process(model, tmp_path):
    body = {"prompt": "Revenue for the quarter", "max_tokens": 8, "temperature": 0, "logprobs": 3}
    one = _serve_once(model, 1, tmp_path, body)["choices"][0]
    two = _serve_once(model, 2, tmp_path, body)["choices"][0]
    assert one["text"] and two["text"] == one["text"]
    assert one["logprobs"] and two["logprobs"] == one["logprobs"]  # every reported log-probability, as printed: the same floats
