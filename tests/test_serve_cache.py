"""The server's prompt cache, metrics, request log and start-up, through the official ``openai`` client.

Two-turn chats on a tiny Qwen3-MoE and a tiny Kimi K3 (KDA recurrent state): the second turn prefills only
what the first did not feed, reports it as ``usage.prompt_tokens_details.cached_tokens``, and its greedy
tokens equal a server without the cache.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from deltafin.k3_tiny import TINY_TOKENIZER_VOCAB, write_tiny_k3, write_tiny_k3_tokenizer  # noqa: E402
from deltafin.runtime.engine import Engine, EngineOptions  # noqa: E402
from deltafin.runtime.prompt_cache import PromptCache  # noqa: E402
from deltafin.serve.app import create_app  # noqa: E402
from deltafin.serve.worker import Worker  # noqa: E402
from deltafin.store.drives import parse_drives  # noqa: E402
from deltafin.store.pack import PackOptions, pack  # noqa: E402
from tests.test_serve import T, live  # noqa: E402
from tests.tiny import pack_tiny  # noqa: E402

OPTS = EngineOptions(exact=True, cache_gb=0.05, max_len=512, threads=2)


def _k3(root) -> str:
    write_tiny_k3(root / "src", vocab_size=TINY_TOKENIZER_VOCAB, num_hidden_layers=6)
    write_tiny_k3_tokenizer(root / "src")
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
         PackOptions(progress=False))
    return str(root / "model")


@pytest.fixture(scope="module", params=["qwen3_moe", "kimi_k3"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"sc-{request.param}")
    return _k3(root) if request.param == "kimi_k3" else pack_tiny(root, "qwen3_moe", tokenizer=True)


def _serve(model_dir, cache: PromptCache | None):
    eng = Engine(model_dir, OPTS)
    worker = Worker(eng, max_batch=4, prompt_cache=cache).start()
    return eng, worker, create_app(worker, "m")


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _two_turns(url: str) -> tuple[list, list[str]]:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Summarise Q3 sales."}]
    usages, replies, prefilled = [], [], []
    for turn in ("And Q4?", "Thanks."):
        before = _metric(httpx.get(f"{url}/metrics", timeout=T).text, "deltafin_prompt_tokens_total")
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=6, temperature=0)
        after = _metric(httpx.get(f"{url}/metrics", timeout=T).text, "deltafin_prompt_tokens_total")
        usages.append(r.usage)
        prefilled.append(after - before)
        replies.append(r.choices[0].message.content)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": turn}]
    c.close()
    return [(u.prompt_tokens, u.prompt_tokens_details.cached_tokens, p) for u, p in zip(usages, prefilled, strict=True)], replies


def test_second_turn_prefills_only_new_tokens_and_output_is_unchanged(model_dir):
    eng, worker, app = _serve(model_dir, None)
    with live(app) as url:
        plain, plain_replies = _two_turns(url)
    worker.stop()
    eng.close()
    eng, worker, app = _serve(model_dir, PromptCache(256 << 20))
    with live(app) as url:
        cached, replies = _two_turns(url)
        text = httpx.get(f"{url}/metrics", timeout=T).text
    worker.stop()
    eng.close()
    assert replies == plain_replies  # greedy output identical with and without the cache
    assert all(c == 0 for _, c, _ in plain)
    (p1, c1, f1), (p2, c2, f2) = cached
    assert c1 == 0 and f1 == p1
    assert c2 >= p1 and f2 == p2 - c2  # at least the whole first prompt is reused; only the rest is fed
    assert _metric(text, "deltafin_prompt_cached_tokens_total") == c2
    assert _metric(text, 'deltafin_prompt_cache_lookups_total{result="hit"}') == 1


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return pack_tiny(tmp_path_factory.mktemp("sc-metrics"), "qwen3_moe", tokenizer=True)


def test_metrics_histograms_stream_usage_and_request_log(qwen, caplog):
    eng, worker, app = _serve(qwen, PromptCache(64 << 20))
    caplog.set_level(logging.INFO, logger="deltafin.serve.access")
    with live(app) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
        for _ in range(2):
            chunks = list(c.completions.create(model="m", prompt="the same prompt", max_tokens=3, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
        text = httpx.get(f"{url}/metrics", timeout=T).text
        c.close()
    worker.stop()
    eng.close()
    usage = chunks[-1].usage
    # the first reply's entry is cut back to the prompt, whose last token is fed again for its logits
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert _metric(text, 'deltafin_time_to_first_token_seconds_count{kind="completion"}') == 2
    assert _metric(text, 'deltafin_request_duration_seconds_count{path="/v1/completions"}') == 2
    for name in ("deltafin_generated_tokens_total", "deltafin_expert_bytes_read_total{drive=",
                 "deltafin_prompt_cache_bytes", 'deltafin_http_requests_total{path="/v1/completions",status="200"}'):
        assert name in text
    lines = [r.getMessage() for r in caplog.records if r.name == "deltafin.serve.access"]
    assert any(re.fullmatch(r"POST /v1/completions 200 prompt=\d+ cached=\d+ completion=3 \d+\.\d{3}s", ln)
               for ln in lines), lines


def test_serve_fails_fast_on_a_taken_port(tmp_path):
    """The port is taken before anything heavy is imported or loaded (the model path does not even exist)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    code = ("import sys; from deltafin.cli import main; "
            f"rc = main(['serve', {str(tmp_path / 'no-model')!r}, '--port', '{port}']); "
            "print(rc, 'torch' in sys.modules)")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert r.stdout.split() == ["2", "False"], r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_api_key_file(tmp_path):
    from deltafin.cli import build_parser
    from deltafin.errors import UsageError
    from deltafin.interfaces.cmd_serve import api_key

    f = tmp_path / "key"
    f.write_text("s3cret\n")
    args = build_parser().parse_args(["serve", "m", "--api-key-file", str(f)])
    assert api_key(args) == "s3cret"
    f.write_text("\n")
    with pytest.raises(UsageError, match="first line is empty"):
        api_key(args)
    args = build_parser().parse_args(["serve", "m", "--api-key-file", str(tmp_path / "nope")])
    with pytest.raises(UsageError, match="cannot read"):
        api_key(args)
