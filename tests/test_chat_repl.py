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
    assert "is not a conversation written by /save" in out and "No such file or directory" in out
    assert out.count("assistant> ") == 1


def test_full_context_is_reported_and_clear_recovers(model, monkeypatch, capsys):
    out = _chat(monkeypatch, capsys, model, "hello there\nand again, a longer message this time\n/clear\nhi\n",
                "-c", "40", "-n", "30")
    assert "[context full" in out and "/clear" in out
    assert out.count("assistant> ") >= 2  # the turn after /clear is answered


def _session(model: str, **kw):
    from deltafin.interfaces.repl import ChatSession
    from deltafin.runtime.engine import Engine, EngineOptions

    eng = Engine(model, EngineOptions(exact=True, cache_gb=0.0, max_len=256))
    args = SimpleNamespace(**({"system": None, "greedy": True, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                               "seed": None, "stop": [], "max_tokens": 12, "min_p": 0.0, "presence_penalty": 0.0,
                               "frequency_penalty": 0.0, "repetition_penalty": 1.0} | kw))
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
        fed = list(s.fed)
        assert len(fed) == s.state.pos
        assert s.turn("more") is True
        # the state holds exactly the rendered conversation plus the reply
        rendered = eng.codec.chat(s.messages[:-1])
        assert s.state.pos == len(rendered) + len(eng.last_stats.tokens) - 1
        if rendered[: len(fed)] == fed:  # the stopped reply re-encodes to the tokens read: only the rest is fed
            assert eng.last_stats.prompt_tokens == len(rendered) - len(fed)
        else:  # otherwise the conversation is read again
            assert eng.last_stats.prompt_tokens == len(rendered)
    finally:
        eng.close()


def test_extension():
    from deltafin.interfaces.repl import extension

    assert extension([1, 2], [1, 2, 3, 4]) == [3, 4]
    assert extension([1, 2], [1, 5, 3]) is None
    assert extension([1, 2], [1, 2]) is None  # nothing new to feed: the caller re-reads
    assert extension([], [7]) == [7]


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


def _read_until(fd: int, needle: bytes, seen: bytearray, times: int = 1, timeout: float = 120) -> None:
    """Read the terminal into ``seen`` until ``needle`` has appeared ``times`` times."""
    import select

    end = time.monotonic() + timeout
    while seen.count(needle) < times:
        left = end - time.monotonic()
        assert left > 0, seen.decode(errors="replace")
        r, _, _ = select.select([fd], [], [], left)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            seen += chunk


@pytest.mark.skipif(os.name != "posix", reason="pseudo-terminals")
def test_on_a_terminal_history_is_kept(model, tmp_path):
    """On a terminal the REPL reads lines through readline and keeps them in the history file."""
    import pty

    pytest.importorskip("readline")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), DELTAFIN_HOME=str(tmp_path),
               TERM="dumb")
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "deltafin", "chat", model, "-n", "3", "--greedy", "--quiet",
                          "--cache-gb", "0"], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = bytearray()
    try:
        _read_until(master, b"you> ", seen)
        os.write(master, b"hello there\r")
        _read_until(master, b"you> ", seen, times=2)  # the reply, then the next prompt
        assert b"assistant> " in seen
        os.write(master, b"/exit\r")
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    history = (tmp_path / "chat_history").read_text()
    assert "hello there" in history and "/exit" in history
