"""The chat REPL driven through stdin: slash commands, Ctrl-C stopping a reply, a full context."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltafin import cli
from tests.tiny import pack_tiny

SLOW = "d0:1MBps,lat=20ms;d1:1MBps,lat=20ms"  # each decode step waits on reads: a reply takes seconds


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return pack_tiny(tmp_path_factory.mktemp("repl"), "qwen3_moe", tokenizer=True)


def _chat(monkeypatch, capsys, model: str, script: str, *flags: str) -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    assert cli.main(["chat", model, "-n", "4", "--greedy", "--quiet", "--cache-gb", "0", *flags]) == 0
    return capsys.readouterr().out


def test_commands(model, tmp_path, monkeypatch, capsys):
    saved = tmp_path / "conv.json"
    out = _chat(monkeypatch, capsys, model, f"hello\n/stats\n/save {saved}\n/clear\n/stats\n/load {saved}\n"
                f"/stats\n/system be brief\n/system\n/bogus\n/help\n/exit\nnever read\n")
    assert out.count("assistant> ") == 1
    lines = out.splitlines()
    used = [ln for ln in lines if ln.startswith("context: ")]
    first = int(used[0].split()[1])
    assert first > 4 and "2 messages" in used[0]
    assert used[1] == "context: 0 of 256 tokens used; 0 messages"
    doc = json.loads(saved.read_text())
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"] and doc["messages"][0]["content"] == "hello"
    # /load reads the conversation back into the model: about as many tokens as the live session held
    assert "loaded 2 messages" in out and int(used[2].split()[1]) >= first - 2
    assert "system prompt set; the conversation starts over" in out and "system prompt: 'be brief'" in out
    assert "unknown command /bogus" in out and "/save FILE" in out


def test_load_refuses_a_bad_file(model, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": 1}]}))
    out = _chat(monkeypatch, capsys, model, f"/load {bad}\n/load {tmp_path / 'none.json'}\nhi\n")
    assert "is not a conversation written by /save" in out and "/load: [Errno 2]" in out
    assert out.count("assistant> ") == 1


def test_full_context_is_reported_and_clear_recovers(model, monkeypatch, capsys):
    out = _chat(monkeypatch, capsys, model, "hello there\nand again, a longer message this time\n/clear\nhi\n",
                "-c", "40", "-n", "30")
    assert "[context full" in out and "/clear" in out
    assert out.count("assistant> ") >= 2  # the turn after /clear is answered


def _session(model: str, **kw):
    from deltafin.interfaces.repl import ChatSession
    from deltafin.runtime.engine import Engine, EngineOptions

    eng = Engine(model, EngineOptions(cache_gb=0.0, max_len=256))
    args = SimpleNamespace(**({"system": None, "greedy": True, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                               "seed": None, "stop": [], "max_tokens": 12} | kw))
    return eng, ChatSession(eng, args, out=io.StringIO())


def test_stopped_reply_keeps_the_session_and_the_next_turn_rereads_it(model):
    eng, s = _session(model)
    try:
        class Out(io.StringIO):  # the user presses Ctrl-C as the first text arrives
            def write(self, text):
                if text and text != "assistant> ":
                    s.stop_requested = True
                return super().write(text)

        s.out = Out()
        assert s.turn("hello") is False
        assert s.stale and [m["role"] for m in s.messages] == ["user", "assistant"]
        assert "[reply stopped; the conversation is kept]" in s.out.getvalue()
        assert s.turn("more") is True
        # the state was rebuilt from the messages: it holds exactly the rendered conversation plus the reply
        rendered = eng.codec.chat(s.messages[:-1])
        assert s.state.pos == len(rendered) + len(eng.last_stats.tokens) - 1
    finally:
        eng.close()


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_ctrl_c_through_a_real_signal(model):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.Popen([sys.executable, "-m", "deltafin", "chat", model, "-n", "200", "--greedy", "--quiet",
                          "--cache-gb", "0", "--emulate-drives", SLOW], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        p.stdin.write("hello\n")
        p.stdin.flush()
        buf = ""
        while "assistant> " not in buf:
            ch = p.stdout.read(1)
            assert ch, p.stderr.read()
            buf += ch
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate("/stats\n/exit\n", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "[reply stopped; the conversation is kept]" in out
    assert "context: " in out and "2 messages" in out
