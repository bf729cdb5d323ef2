"""``deltafin pull`` against a local Hub on 127.0.0.1 (tests/hub_server.py, reached through HF_ENDPOINT): a tiny
sharded checkpoint downloaded in the packer's order and packed as it lands; the packed files equal a pack of
the same folder; with --delete-source the shards are removed after read-back and the disk never holds them all;
a download cut mid-shard and a damaged shard; a re-run resumes without fetching packed shards again."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from deltafin import cli
from deltafin.errors import DeltafinError
from deltafin.store.drives import parse_drives
from deltafin.store.manifest import MANIFEST
from deltafin.store.pack import PackOptions, pack
from deltafin.store.pull import PullOptions, pull
from tests.hub_server import Hub
from tests.tiny import build_tiny, save_byte_tokenizer

REPO = "org/tiny-qwen"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint in 14 shards, as save_pretrained writes a large one."""
    src = tmp_path_factory.mktemp("hub") / "repo"
    model = build_tiny("qwen3_moe", src, vocab_size=320)
    os.unlink(src / "model.safetensors")
    model.save_pretrained(str(src), max_shard_size="60KB")
    save_byte_tokenizer(src, 320)
    return src


@pytest.fixture(scope="module")
def reference(repo, tmp_path_factory):
    """The same checkpoint packed from the folder: what a pull must write."""
    root = tmp_path_factory.mktemp("ref")
    pack(str(repo), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]), PackOptions(progress=False))
    return json.loads((root / "model" / MANIFEST).read_text())


@pytest.fixture
def hub(repo, monkeypatch):
    with Hub(REPO, str(repo)) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield h


def _drives(root):
    for d in ("d0", "d1"):
        os.makedirs(root / d, exist_ok=True)
    return parse_drives([f"{root}/d0=2", f"{root}/d1=1"])


def _same_pack(out, reference) -> None:
    doc = json.loads((out / MANIFEST).read_text())
    assert doc["experts"]["checksums"] == reference["experts"]["checksums"]
    assert doc["experts"]["locations"] == reference["experts"]["locations"]
    assert doc["trunk"]["files"] == reference["trunk"]["files"]


def _shards(hub) -> list[str]:
    return [n for n in hub.files if n.endswith(".safetensors")]


def test_pull_delete_source_packs_identically_with_bounded_disk(hub, tmp_path, reference):
    s = pull(REPO, str(tmp_path / "model"), _drives(tmp_path), PackOptions(progress=False),
             PullOptions(delete_source=True, window=2, progress=False))
    _same_pack(tmp_path / "model", reference)
    assert s.shards == 14 and s.downloaded == 14 and s.removed == 14
    left = [n for n in os.listdir(tmp_path / "model" / "source") if n.endswith(".safetensors")]
    assert left == []  # every shard removed once packed and read back
    assert 0 < s.peak_source_bytes <= s.source_bytes / 2, (s.peak_source_bytes, s.source_bytes)
    # each shard fetched once, after its header; the packer's order is not the file order
    for name in _shards(hub):
        assert len(hub.gets(name)) == 3, (name, hub.gets(name))  # two header ranges + the download


def test_pull_keeps_source_without_delete(hub, tmp_path, reference):
    s = pull(REPO, str(tmp_path / "model"), _drives(tmp_path), PackOptions(progress=False),
             PullOptions(progress=False))
    _same_pack(tmp_path / "model", reference)
    assert s.removed == 0
    assert sorted(n for n in os.listdir(tmp_path / "model" / "source") if n.endswith(".safetensors")) == \
        sorted(_shards(hub))


def test_cut_mid_shard_then_rerun_resumes_without_refetching_packed_shards(hub, tmp_path, reference):
    # a shard drops the connection halfway on every try of this run (more than huggingface_hub's retries)
    victim = sorted(_shards_names(hub))[5]
    hub.cut[victim] = [hub.entry(victim)["size"] // 2, 50]
    with pytest.raises(DeltafinError) as e:
        pull(REPO, str(tmp_path / "model"), _drives(tmp_path), PackOptions(progress=False),
             PullOptions(delete_source=True, window=1, progress=False))
    assert "\n" not in str(e.value) and "re-run" in str(e.value)
    state = json.loads((tmp_path / "model" / "source" / ".deltafin-pull" / "pull-state.json").read_text())
    removed = list(state["removed"])
    assert removed, "shards packed before the cut were removed"
    before = {n: len(hub.gets(n)) for n in _shards_names(hub)}
    hub.cut.clear()
    s = pull(REPO, str(tmp_path / "model"), _drives(tmp_path), PackOptions(progress=False),
             PullOptions(delete_source=True, window=1, progress=False))
    _same_pack(tmp_path / "model", reference)
    for n in removed:  # packed and removed in the first run: never downloaded again
        assert len(hub.gets(n)) == before[n], n
    assert victim in s.downloaded_names and set(removed).isdisjoint(s.downloaded_names)


def _shards_names(hub) -> list[str]:
    return [n for n in hub.files if n.endswith(".safetensors")]


def test_damaged_shard_is_fetched_again_then_refused(hub, tmp_path, reference, caplog):
    victim = _shards_names(hub)[3]
    hub.corrupt[victim] = 1  # one damaged copy: the sha256 check catches it and the second copy is good
    pull(REPO, str(tmp_path / "a"), _drives(tmp_path / "da"), PackOptions(progress=False),
         PullOptions(progress=False))
    _same_pack(tmp_path / "a", reference)
    assert "does not match the Hub's" in caplog.text
    hub.corrupt[victim] = 5  # damaged every time: one line naming the shard and the checksum
    with pytest.raises(DeltafinError, match=rf"{victim}: downloaded twice and both copies fail their sha256"):
        pull(REPO, str(tmp_path / "b"), _drives(tmp_path / "db"), PackOptions(progress=False),
             PullOptions(progress=False))
    assert not (tmp_path / "b" / MANIFEST).exists()


def test_cli_pull_plan_run_and_serve(hub, tmp_path, capsys):
    """A newcomer's path: plan, pull, run, then serve, with the local Hub standing in for huggingface.co."""
    assert cli.main(["pull", REPO, str(tmp_path / "m"), "--plan", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "14 shards" in out and "peak disk with --delete-source" in out
    gets = sum(len(hub.gets(n)) for n in _shards_names(hub))
    assert gets == 2 * 14  # --plan fetched headers only, no shard
    d = _drives(tmp_path)
    argv = ["pull", REPO, str(tmp_path / "m"), "--drive", f"{d[0].path}=2", "--drive", f"{d[1].path}=1",
            "--delete-source", "--no-progress"]
    assert cli.main(argv) == 0
    assert "14 shards removed after read-back" in capsys.readouterr().out
    assert cli.main(["run", str(tmp_path / "m"), "-p", "hi", "-n", "4", "--greedy", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() != ""
    uvicorn = pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    import sys

    from deltafin.interfaces import cmd_serve

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = cli.build_parser().parse_args(["serve", str(tmp_path / "m"), "--port", str(port), "--quiet",
                                          "--cache-gb", "0.05", "-c", "256"])
    args.verbose, args.log_level = False, None
    th = threading.Thread(target=cmd_serve.run, args=(args,), daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    reply = None
    while time.monotonic() < deadline and reply is None:
        try:
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        except httpx.TransportError:
            time.sleep(0.2)
    assert reply is not None and reply.status_code == 200, reply
    assert reply.json()["usage"]["completion_tokens"] >= 1
    assert uvicorn and sys


def test_unknown_repo_is_one_line(hub, tmp_path, capsys):
    assert cli.main(["pull", "org/no-such-model", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "org/no-such-model" in err and ("--revision" in err or "Hub" in err)
