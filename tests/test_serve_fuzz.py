"""Hostile input to the server over loopback: malformed JSON, wrong types, huge numbers, NaN, invalid UTF-8,
bad headers, chunked abuse, slow and idle clients. Nothing may answer 5xx, nothing may hold up another
client, and the server must be healthy (and give the same greedy tokens) afterwards."""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from deltafin.errors import ExpertChecksumError  # noqa: E402
from deltafin.runtime.engine import Engine, EngineOptions  # noqa: E402
from deltafin.runtime.stops import StopMatcher  # noqa: E402
from deltafin.serve.app import create_app  # noqa: E402
from deltafin.serve.gate import uvicorn_config  # noqa: E402
from deltafin.serve.protocol import Limits  # noqa: E402
from deltafin.serve.worker import Worker  # noqa: E402
from tests.test_serve import live as serve_live  # noqa: E402
from tests.tiny import pack_tiny  # noqa: E402

MODEL = "tiny-qwen"
T = 30
BODY_TIMEOUT, HEADERS_TIMEOUT, IDLE_TIMEOUT = 1.0, 2.0, 1.0
# A probe request (a few greedy tokens of a tiny model) takes ~0.1 s; a stalled engine thread or event loop
# held it for tens of seconds. The bound is loose so a busy 2-core machine does not fail it.
PROBE_BOUND_S = 8.0


@contextmanager
def live(app):
    cfg = uvicorn_config(app, idle_timeout_s=IDLE_TIMEOUT, headers_timeout_s=HEADERS_TIMEOUT,
                         timeout_graceful_shutdown=2)
    with serve_live(app, cfg) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = pack_tiny(tmp_path_factory.mktemp("fuzz"), "qwen3_moe", tokenizer=True)
    eng = Engine(model_dir, EngineOptions(exact=True, cache_gb=0.05, max_len=256, threads=2))
    worker = Worker(eng, max_batch=8, max_queue=256).start()
    limits = Limits(max_tokens=8, max_body_bytes=1 << 20, max_stop_chars=300_000, body_timeout_s=BODY_TIMEOUT)
    app = create_app(worker, MODEL, limits=limits)
    with live(app) as port:
        yield port, worker, app.state.server
    worker.stop()
    eng.close()


# ---- raw HTTP ------------------------------------------------------------------------------------


def raw(port: int, parts: list[bytes], gap_s: float = 0.0, timeout: float = 10.0, read: bool = True) -> int | None:
    """Send ``parts`` (``gap_s`` apart) on a fresh connection; the response's status, or None if the server
    closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            for p in parts:
                s.sendall(p)
                if gap_s:
                    time.sleep(gap_s)
        except OSError:  # the server answered and closed before everything was sent
            pass
        if not read:
            return None
        data = b""
        try:
            while b"\r\n" not in data:
                got = s.recv(65536)
                if not got:
                    break
                data += got
        except ConnectionResetError:
            pass
    if not data:
        return None
    return int(data.split(b" ", 2)[1])


def post(path: str, body: bytes, headers: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers +
            b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def chunked(path: str, chunks: list[bytes], end: bool = True) -> list[bytes]:
    head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n\r\n")
    body = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]
    return [head, *body, *([b"0\r\n\r\n"] if end else [])]


HEADER_ABUSE = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\n\r\n",  # no Host
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\xff\xfe: \x80\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{}}}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n{}\r\n",
    b"GET /v1/%00%zz/../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"BREW /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /v1/models?" + b"q=" * 10_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xff\r\nConnection: close\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" * 3,  # pipelined
]


# ---- JSON bodies ---------------------------------------------------------------------------------

BAD_JSON = [b"", b"{", b"}", b"nul", b'{"model": }', b"{'a': 1}", b'{"a": 1,}', b"[1, 2", b'"just a string"',
            b"123", b"null", b"[]", b'{"prompt": "x"} trailing', b"\xff\xfe\x00{", b'{"prompt": "\xc3\x28"}',
            b'{"prompt": "\xed\xa0\x80"}', b"[" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
            b"\x00" * 64, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"]
JUNK = ["", "x", -1, 0, 1.5, 10**30, -(10**30), 2**63, 1e308, True, False, None, [], {}, [[]], [None],
        {"a": {"b": [1, {"c": None}]}}, ["x"] * 3, "NaN", "\ud800", [1, "a", None], "token_id:3"]
RAW_JUNK = ["NaN", "Infinity", "-Infinity", "1" + "0" * 5000, "1e999999", '"\\ud800"', '"\\udfff\\ud800x"',
            "-0", "1E-400"]
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "n", "logprobs", "echo", "user", "logit_bias", "presence_penalty", "frequency_penalty", "best_of",
          "suffix", "return_tokens_as_token_ids"]
CHAT_FIELDS = ["messages", "max_completion_tokens", "top_logprobs", "logprobs", "stop", "temperature"]


def json_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    cases = [("/v1/completions", b) for b in BAD_JSON] + [("/v1/chat/completions", b) for b in BAD_JSON[:8]]
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for f in FIELDS:
        for v in rng.sample(JUNK, 6):
            cases.append(("/v1/completions", json.dumps({**base, f: v}).encode("utf-8", "surrogatepass")))
        for v in rng.sample(RAW_JUNK, 2):
            text = json.dumps({**base, f: "__V__"}).replace('"__V__"', v)
            cases.append(("/v1/completions", text.encode()))
    for f in CHAT_FIELDS:
        for v in rng.sample(JUNK, 5):
            cases.append(("/v1/chat/completions", json.dumps({**chat, f: v}).encode("utf-8", "surrogatepass")))
    for m in [{"role": "user"}, {"role": "user", "content": 5}, {"role": "user", "content": [{"type": "image_url"}]},
              {"content": "x"}, "hello", None, {"role": "user", "content": "\ud800"},
              {"role": "tool", "content": "x", "tool_call_id": {"a": 1}}]:
        cases.append(("/v1/chat/completions",
                      json.dumps({**chat, "messages": [m]}).encode("utf-8", "surrogatepass")))
    cases.append(("/v1/completions", b'{"model": "tiny-qwen", "prompt": "\\ud800", "max_tokens": 2}'))
    cases.append(("/v1/completions", json.dumps({**base, "stop": "z" * 500_000}).encode()))  # over the limit
    cases.append(("/v1/completions", json.dumps({**base, "stop": ["a"] * 1000}).encode()))
    return cases


def sdk_cases(c) -> list:
    """Calls through the official client; each returns a result or raises an APIStatusError."""
    m = [{"role": "user", "content": "hi"}]
    return [
        lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=-1),
        lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=2**70),
        lambda: c.completions.create(model=MODEL, prompt="hi", temperature=-0.5),
        lambda: c.completions.create(model=MODEL, prompt="hi", top_p=1e300),
        lambda: c.completions.create(model=MODEL, prompt="hi", seed=2**70),
        lambda: c.completions.create(model=MODEL, prompt=[[]]),
        lambda: c.completions.create(model=MODEL, prompt=[-1, 2]),
        lambda: c.completions.create(model=MODEL, prompt="hi", extra_body={"logit_bias": {"1": 1e300}}),
        lambda: c.completions.create(model=MODEL, prompt="hi", stop=[""]),
        lambda: c.completions.create(model=MODEL, prompt="hi", logprobs=99),
        lambda: c.completions.create(model=MODEL, prompt="hi", extra_body={"top_k": "many"}),
        lambda: c.completions.create(model=MODEL, prompt="hi", extra_body={"nested": {"a": [1, {"b": None}]}}),
        lambda: c.completions.create(model=MODEL, prompt="hi", stream_options={"include_usage": True}),
        lambda: c.completions.create(model=MODEL, prompt="hi" * 400),
        lambda: c.chat.completions.create(model=MODEL, messages=[]),
        lambda: c.chat.completions.create(model=MODEL, messages=m, top_logprobs=3),
        lambda: c.chat.completions.create(model=MODEL, messages=m, max_tokens=2, max_completion_tokens=2),
        lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "x"}]}]),
        lambda: c.chat.completions.create(model="nope", messages=m),
        lambda: c.chat.completions.create(model=MODEL, messages=m, extra_body={"logit_bias": {"x": 1}}),
        lambda: c.chat.completions.create(model=MODEL, messages=m, max_tokens=2, stop="z" * 200_000),
        lambda: c.models.retrieve("no/such/model"),
    ]


def test_fuzz_no_5xx_no_stall_and_healthy_after(served, caplog):
    port, worker, srv = served
    url = f"http://127.0.0.1:{port}"
    caplog.set_level(logging.WARNING, logger="deltafin")
    probe = {"model": MODEL, "prompt": "The quarter closed with", "max_tokens": 6, "temperature": 0}
    before = httpx.post(f"{url}/v1/completions", json=probe, timeout=T).json()["choices"][0]["text"]

    latencies: list[float] = []
    stop = threading.Event()

    def probing() -> None:
        with httpx.Client(timeout=T) as h:
            while not stop.is_set():
                t0 = time.monotonic()
                r = h.post(f"{url}/v1/completions", json=probe)
                latencies.append(time.monotonic() - t0)
                assert r.status_code == 200, r.text
                time.sleep(0.05)

    statuses: list[tuple[str, int | None]] = []
    rng = random.Random(12)
    cases = json_cases(rng)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)

    def send_json(case) -> None:
        path, body = case
        statuses.append((f"json {body[:60]!r}", raw(port, [post(path, body)])))

    def send_sdk(call) -> None:
        try:
            call()
            statuses.append(("sdk", 200))
        except openai.APIStatusError as e:
            statuses.append((f"sdk {e.message[:80]}", e.status_code))

    def send_header(data: bytes) -> None:
        statuses.append((f"header {data[:60]!r}", raw(port, [data])))

    def slow_body() -> None:  # headers, then one byte every 0.3 s: the body deadline answers 408
        head = post("/v1/completions", b"x" * 100)[:-100]
        statuses.append(("slow body", raw(port, [head] + [b"{"] * 10, gap_s=0.3)))

    def slow_chunks() -> None:  # a chunked body that never ends
        statuses.append(("slow chunks", raw(port, chunked("/v1/completions", [b"{"] * 10, end=False), gap_s=0.3)))

    def big_chunked() -> None:  # 2 MB without Content-Length: counted against the 1 MB limit
        statuses.append(("2 MB chunked", raw(port, chunked("/v1/completions", [b" " * 65536] * 32))))

    def gone_mid_upload() -> None:  # a client that hangs up halfway through its body
        raw(port, [post("/v1/completions", b'{"prompt": "' + b"x" * 5000)[:-2000]], read=False)
        raw(port, chunked("/v1/completions", [b'{"prompt":'], end=False), read=False)

    def idle_and_slow_headers() -> None:
        for parts in ([], [b"POST /v1/compl"]):
            with socket.create_connection(("127.0.0.1", port), timeout=T) as s:
                for p in parts:
                    s.sendall(p)
                t0 = time.monotonic()
                assert s.recv(100) == b""  # closed by the server
                assert time.monotonic() - t0 < HEADERS_TIMEOUT + 5
                statuses.append(("idle closed", 408))

    prober = threading.Thread(target=probing, daemon=True)
    prober.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            jobs = [pool.submit(f) for f in (slow_body, slow_chunks, big_chunked, gone_mid_upload,
                                             idle_and_slow_headers)]
            jobs += [pool.submit(send_json, c) for c in cases]
            jobs += [pool.submit(send_sdk, c) for c in sdk_cases(client)]
            jobs += [pool.submit(send_header, h) for h in HEADER_ABUSE]
            for j in jobs:
                j.result(timeout=120)
    finally:
        stop.set()
        prober.join(T)
        client.close()

    assert len(statuses) >= 250, len(statuses)
    fivexx = [(what, s) for what, s in statuses if s is not None and s >= 500]
    assert not fivexx, fivexx
    assert ("slow body", 408) in statuses and ("slow chunks", 408) in statuses and ("2 MB chunked", 413) in statuses
    assert sum(1 for _, s in statuses if s is not None and 400 <= s < 500) >= 200
    assert not [k for k in srv.http if k[1] >= 500], srv.http  # a client that left is not a server error
    assert len(latencies) >= 3 and max(latencies) < PROBE_BOUND_S, latencies
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    # healthy afterwards: same greedy text, nothing left in flight
    assert httpx.get(f"{url}/health", timeout=T).json() == {"status": "ok", "in_flight": 0, "queued": 0}
    assert httpx.post(f"{url}/v1/completions", json=probe, timeout=T).json()["choices"][0]["text"] == before


def test_lone_surrogate_prompt_is_a_400_naming_it(served):
    port, _, _ = served
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=T,
                   content=b'{"model": "tiny-qwen", "prompt": "ab\\ud800", "max_tokens": 2}')
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_long_stop_string_costs_linear_time_and_stalls_nobody(served):
    """A 200,000-character stop string (allowed here) ends normally and a concurrent request is not held up."""
    port, _, _ = served
    url = f"http://127.0.0.1:{port}/v1/completions"
    result = {}

    def long_stop() -> None:
        result["r"] = httpx.post(url, json={"model": MODEL, "prompt": "zzz", "max_tokens": 8, "temperature": 0,
                                            "stop": ["z" * 200_000, "q" * 150_000]}, timeout=T)

    th = threading.Thread(target=long_stop)
    th.start()
    t0 = time.monotonic()
    other = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}, timeout=T)
    waited = time.monotonic() - t0
    th.join(T)
    assert other.status_code == 200 and waited < PROBE_BOUND_S
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["finish_reason"] == "length"
    too_long = httpx.post(url, json={"model": MODEL, "prompt": "x", "stop": "z" * 300_001}, timeout=T)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "stop"


def test_error_bodies_show_no_server_paths(served, monkeypatch):
    port, worker, _ = served
    bad = f"{worker.engine.packed.path}/L001/E0003.dfx"

    def prefill(prompts, states):
        raise ExpertChecksumError(f"{bad}: checksum mismatch (expected 1, got 2); re-run 'deltafin pack --repair'")

    monkeypatch.setattr(worker.engine, "prefill", prefill)
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                   timeout=T)
    msg = r.json()["error"]["message"]
    assert r.status_code == 500 and "E0003.dfx" in msg and worker.engine.packed.path not in msg and "/L001" not in msg


def test_stop_matcher_equals_naive_search():
    """Where the first stop string begins and how much tail is held back, against the plain definition."""
    rng = random.Random(3)
    for _ in range(300):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3)))
        text, m = "", StopMatcher(stops)
        for _ in range(12):
            text += "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            got = m.feed(text)
            assert got == (min(hits) if hits else None), (stops, text)
            if hits:
                break
            held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            assert m.held == held, (stops, text)
