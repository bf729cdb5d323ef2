"""Kimi K3 thinking end to end: --think/--no-think/--effort on run and chat, ``reasoning_effort`` and
``chat_template_kwargs`` in the API, reasoning returned as ``reasoning_content`` (whole and streamed),
markup and special tokens never shown."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from deltafin.cli import main
from deltafin.k3_tiny import TINY_SPECIALS, TINY_TOKENIZER_VOCAB, write_tiny_k3, write_tiny_k3_tokenizer
from deltafin.runtime import engine as eng_mod
from deltafin.runtime.batched import GenSpec, Seq, TokenOut
from deltafin.runtime.reasoning import XTMLChannels
from deltafin.serve.responses import Formatter

SCRIPT = ["Two", " and two", "<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", "Fo", "ur.",
          "<|close|>", "response", "<|sep|>", "<|close|>", "message", "<|sep|>"]


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("k3think")
    write_tiny_k3(root / "src", vocab_size=TINY_TOKENIZER_VOCAB, num_hidden_layers=6)
    write_tiny_k3_tokenizer(root / "src")
    assert main(["pack", str(root / "src"), str(root / "model"), "--drive", f"{root}/d0=2",
                 "--drive", f"{root}/d1=1", "--no-progress", "--create"]) == 0
    return root / "model"


@pytest.fixture
def scripted(monkeypatch):
    """Engine.generate replaced by a scripted Kimi K3 reply; records the prompts it was given."""
    prompts: list[list[int]] = []

    def generate(self, prompt, max_new, sampling=None, stop_ids=None, stop_strings=(), state=None, on_logits=None):
        prompts.append(list(prompt))
        from deltafin.runtime.stats import RunStats

        self.last_stats = RunStats(prompt_tokens=len(prompt))
        self.last_stats.tokens, self.last_stats.stop_reason = [self.codec.eos_ids[0]], "stop token"
        if state is not None:
            state.pos += len(prompt)
        answer_only = self.codec.decode(list(prompt)).endswith("<|open|>response<|sep|>")  # thinking off
        for piece in SCRIPT[SCRIPT.index("Fo") if answer_only else 0 :]:
            yield 0, piece

    monkeypatch.setattr(eng_mod.Engine, "generate", generate)
    return prompts


def test_run_prints_answer_on_stdout_and_reasoning_on_stderr(k3, scripted, capsys):
    assert main(["run", str(k3), "-p", "2+2?", "--chat-template", "--effort", "high", "--cache-gb", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "Four.\n" and "[thinking] Two and two" in err
    assert not any(s in out + err for s in TINY_SPECIALS)


def test_run_think_switch_and_effort_shape_the_prompt(k3, scripted, capsys):
    from deltafin.runtime.tokenizer import load_codec
    from deltafin.store.model_dir import PackedModel

    pm = PackedModel.open(str(k3))
    codec = load_codec(pm.path, pm.config)
    for flags in ([], ["--no-think"], ["--effort", "max"]):
        assert main(["run", str(k3), "-p", "hi", "--chat-template", "--quiet", "--cache-gb", "0", *flags]) == 0
    on, off, effort = (codec.decode(p) for p in scripted)
    assert on.endswith("<|open|>think<|sep|>") and off.endswith("<|open|>response<|sep|>")
    assert "thinking_effort=max" in effort and "thinking_effort" not in on
    assert capsys.readouterr().out.count("Four.") == 3


def test_chat_no_think_keeps_answers_only(k3, scripted, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n"))
    assert main(["chat", str(k3), "--quiet", "--no-think", "--cache-gb", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> Four.") == 2 and "Two and two" not in out


def test_effort_refused_where_the_template_has_none(tmp_path, capsys):
    from tests.tiny import pack_tiny

    model = pack_tiny(tmp_path, "qwen3_moe", tokenizer=True)
    assert main(["run", model, "-p", "hi", "--chat-template", "--effort", "low", "--cache-gb", "0"]) == 2
    assert "no effort levels" in capsys.readouterr().err


def _outs(pieces: list[str]) -> list[TokenOut]:
    seq = Seq(GenSpec((1,), 10))
    outs = [TokenOut(seq, 0, p) for p in pieces]
    outs[-1].finish_reason = "stop"
    return outs


def test_api_formatter_splits_reasoning_whole_and_streamed():
    fmt = Formatter("chat", "m", None, (), splitters=[XTMLChannels(thinking=True)])
    deltas = [c["choices"][0]["delta"] for o in _outs(SCRIPT) if (c := fmt.chunk(0, o, False)) is not None]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two"
    assert "".join(d.get("content", "") for d in deltas) == "Four."
    from deltafin.serve.responses import Choice

    ch = Choice(0, 1)
    for o in _outs(SCRIPT):
        ch.add(o, ())
    fmt = Formatter("chat", "m", None, (), splitters=[XTMLChannels(thinking=True)])
    msg = fmt.final([ch], False)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two"}


def test_api_k3_tool_calls_come_out_of_the_tools_section():
    from deltafin.serve.responses import Choice

    tools_section = ['<|open|>tools<|sep|><|open|>call tool="calc" index="1"<|sep|>',
                     '<|open|>argument key="x" type="number"<|sep|>2<|close|>argument<|sep|>',
                     "<|close|>call<|sep|><|close|>tools<|sep|>"]
    ch = Choice(0, 1)
    for o in _outs(SCRIPT[:13] + tools_section + SCRIPT[13:]):
        ch.add(o, ())
    fmt = Formatter("chat", "m", None, (), tool_format="xtml", splitters=[XTMLChannels(thinking=True)])
    choice = fmt.final([ch], False)["choices"][0]
    msg = choice["message"]
    assert (msg["content"], msg["reasoning_content"], choice["finish_reason"]) == ("Four.", "Two and two", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("calc", '{"x": 2}')]
    fmt = Formatter("chat", "m", None, (), splitters=[XTMLChannels(thinking=True)])  # no tools asked for
    assert fmt.final([ch], False)["choices"][0]["message"]["content"] == "Four."


def test_api_k3_stream_sends_reasoning_content_and_tool_calls():
    """The stream path: tool-call text held back on the raw text, the rest through the reasoning splitter."""
    import asyncio
    import json

    from deltafin.serve.app import _events
    from deltafin.serve.protocol import Parsed
    from deltafin.serve.worker import Job

    tools_section = ['<|open|>tools<|sep|><|open|>call tool="calc" index="1"<|sep|>',
                     '<|open|>argument key="x" type="number"<|sep|>2<|close|>argument<|sep|>',
                     "<|close|>call<|sep|><|close|>tools<|sep|>"]
    outs = _outs(SCRIPT[:13] + tools_section + SCRIPT[13:])
    job = Job(outs[0].seq.spec, lambda ev: None)
    parsed = Parsed("chat", [job.spec], stream=True, tool_format="xtml")
    fmt = Formatter("chat", "m", None, (), tool_format="xtml", splitters=[XTMLChannels(thinking=True)])

    async def run() -> list[dict]:
        q: asyncio.Queue = asyncio.Queue()
        for o in outs[1:]:
            q.put_nowait((0, o))
        tally = {"prompt": 1, "cached": 0, "completion": 0}
        events = [e async for e in _events(parsed, fmt, [job], q, (0, outs[0]), tally)]
        return [json.loads(e[6:]) for e in events if e.startswith("data: {")]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(run()) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two"
    assert "".join(d.get("content") or "" for d in deltas) == "Four."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("calc", '{"x": 2}')]


def test_api_thinking_fields(k3):
    openai = pytest.importorskip("openai")
    from deltafin.runtime.engine import Engine, EngineOptions
    from deltafin.serve.app import create_app
    from deltafin.serve.worker import Worker
    from tests.test_serve import T, live

    eng = Engine(str(k3), EngineOptions(exact=True, cache_gb=0.05, max_len=768, threads=2))
    worker = Worker(eng, max_batch=4).start()
    msgs = [{"role": "user", "content": "2+2?"}]
    try:
        with live(create_app(worker, "k3")) as url:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
            ask = lambda **kw: c.chat.completions.create(model="k3", messages=msgs, max_tokens=12,  # noqa: E731
                                                        temperature=0, **kw)
            r = ask()
            assert isinstance(r.choices[0].message.reasoning_content, str)
            assert not any(s in r.choices[0].message.content for s in TINY_SPECIALS)
            assert r.usage.prompt_tokens == len(eng.codec.chat(msgs))
            assert ask(reasoning_effort="none").usage.prompt_tokens == len(eng.codec.chat(msgs, thinking=False))
            off = ask(extra_body={"chat_template_kwargs": {"thinking": False}})
            assert off.usage.prompt_tokens == len(eng.codec.chat(msgs, thinking=False))
            assert ask(reasoning_effort="high").usage.prompt_tokens == len(eng.codec.chat(msgs, effort="high"))
            chunks = list(ask(stream=True))
            deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
                r.choices[0].message.reasoning_content
            assert "".join(d.content or "" for d in deltas) == r.choices[0].message.content
            with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
                ask(reasoning_effort="extreme")
            c.close()
    finally:
        worker.stop()
        eng.close()
