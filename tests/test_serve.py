"""The OpenAI-compatible server, through the official ``openai`` client against a live uvicorn on loopback."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from deltafin.runtime.engine import Engine, EngineOptions  # noqa: E402
from deltafin.runtime.sampling import SamplingParams  # noqa: E402
from deltafin.serve.app import create_app  # noqa: E402
from deltafin.serve.protocol import Limits  # noqa: E402
from deltafin.serve.worker import Job, Worker  # noqa: E402
from tests.tiny import pack_tiny  # noqa: E402

MODEL = "tiny-qwen"
OPTS = EngineOptions(exact=True, cache_gb=0.05, max_len=256, threads=2)
T = 30  # seconds: every client call is bounded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return pack_tiny(root, "qwen3_moe", tokenizer=True)


@pytest.fixture(scope="module")
def ref(model_dir):
    """An engine of its own: what generation gives with no server and no batching."""
    eng = Engine(model_dir, OPTS)
    yield eng
    eng.close()


@contextmanager
def live(app, config=None):
    """``app`` served from a thread on a free loopback port (``config``: uvicorn settings); yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config or uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + T
    while not server.started:
        assert th.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(T)
        sock.close()


@pytest.fixture(scope="module")
def served(model_dir):
    eng = Engine(model_dir, OPTS)
    worker = Worker(eng, max_batch=8).start()
    app = create_app(worker, MODEL, limits=Limits(max_tokens=200, max_body_bytes=64 * 1024))
    with live(app) as url:
        yield url, worker
    worker.stop()
    eng.close()


@pytest.fixture
def client(served):
    url, _ = served
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
    yield c
    c.close()


def ref_tokens(ref: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of engine.generate alone, and each one's log-probability."""
    lps: list[torch.Tensor] = []
    toks = [t for t, _ in ref.generate(prompt, n, SamplingParams(), on_logits=lambda lg: lps.append(lg))]
    return toks, [float(torch.log_softmax(lg.float(), -1)[t]) for lg, t in zip(lps, toks, strict=False)]


def ids_of(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def wait_idle(worker: Worker, timeout: float = T) -> None:
    deadline = time.monotonic() + timeout
    while worker.in_flight or worker.queued:
        assert time.monotonic() < deadline, f"worker still busy: {worker.in_flight} in flight, {worker.queued} queued"
        time.sleep(0.02)


def test_models_health_metrics(served, client):
    url, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(f"{url}/health", timeout=T).json()
    assert h["status"] == "ok" and h["in_flight"] == 0
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=2, temperature=0)
    text = httpx.get(f"{url}/metrics", timeout=T).text
    for name in ("deltafin_generated_tokens_per_second", "deltafin_expert_bytes_read_total{drive=",
                 "deltafin_expert_cache_hit_rate", "deltafin_queue_length", "deltafin_http_requests_total{"):
        assert name in text
    assert 'deltafin_http_requests_total{path="/v1/completions",status="200"}' in text


def test_plain_completion_equals_engine_generate(client, ref):
    prompt = "The quarter closed with"
    want, want_lp = ref_tokens(ref, ref.codec.encode(prompt), 10)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    assert ids_of(r.choices[0].logprobs.tokens) == want
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(want_lp, abs=1e-4)
    assert r.choices[0].text == ref.last_stats.text
    assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == len(ref.last_stats.tokens)
    assert r.choices[0].finish_reason == ("length" if len(ref.last_stats.tokens) == 10 else "stop")


def test_several_prompts_and_token_ids_in_one_request(client, ref):
    prompts = [[72, 105, 33], ref.codec.encode("Two")]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts, strict=True):
        assert ids_of(c.logprobs.tokens) == ref_tokens(ref, p, 5)[0]
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model=MODEL, prompt=[1, 99_999], max_tokens=1)


def test_streamed_completion_equals_plain(client):
    kw = dict(model=MODEL, prompt="Stream me", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_uses_template_and_streams(client, ref):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Summarise Q3."}]
    want, _ = ref_tokens(ref, ref.codec.chat(msgs), 8)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert ids_of([c.token for c in r.choices[0].logprobs.content]) == want
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.last_stats.text
    assert r.usage.prompt_tokens == len(ref.codec.chat(msgs))
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0)
    full = client.completions.create(max_tokens=16, **kw).choices[0].text
    pos = next(i for i in range(1, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[pos : pos + 2]
    want = full[: full.find(stop)]
    r = client.completions.create(max_tokens=16, stop=[stop, "never-seen"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(max_tokens=16, stop=stop, stream=True, **kw))
    assert streamed == want  # the stop string is never shown, not even in part


def test_logprobs(client, ref):
    prompt = "Numbers: 1 2 3"
    _, want_lp = ref_tokens(ref, ref.codec.encode(prompt), 6)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want_lp)
    assert lp.token_logprobs == pytest.approx(want_lp, abs=1e-4)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and top[tok] == max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy = top-1
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    for item in c.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_invalid_requests_get_openai_errors_and_server_goes_on(served, client):
    url, _ = served
    cases = [
        (dict(model=MODEL, prompt="x", max_tokens=100_000), 400, "max_tokens"),
        (dict(model=MODEL, prompt="x", temperature=7), 400, "temperature"),
        (dict(model=MODEL, prompt="x", bogus=1), 400, "bogus"),
        (dict(model=MODEL, prompt=""), 400, "empty"),
        (dict(model=MODEL, prompt="x" * 300), 400, "context length"),
        (dict(model="other", prompt="x"), 404, "does not exist"),
        (dict(model=MODEL, prompt="x", n=0), 400, "n: input should be greater than or equal to 1"),
    ]
    for body, status, words in cases:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=T)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny-qwen", "prompt": ', timeout=T)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=b"[" * 50_000, timeout=T)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", content=b'{"a": "' + b"x" * 70_000 + b'"}', timeout=T)
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/nothing", timeout=T)
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert "role" in e.value.body["message"]
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_generation_that_raises_is_a_500_for_that_request_only(served, client, monkeypatch):
    _, worker = served
    eng = worker.engine
    real = eng.prefill
    poison = ord("%")

    def prefill(prompts, states):
        if any(poison in p for p in prompts):
            raise RuntimeError("injected failure")
        return real(prompts, states)

    monkeypatch.setattr(eng, "prefill", prefill)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="100%", max_tokens=2)
    assert e.value.status_code == 500 and "Traceback" not in str(e.value.body)
    monkeypatch.setattr(eng, "prefill", real)
    assert client.completions.create(model=MODEL, prompt="fine", max_tokens=2).usage.completion_tokens >= 1


def _slow_steps(worker, monkeypatch) -> None:
    """Keep a generation running well past the moment its client leaves, on any machine."""
    step = worker.engine.forward_batch

    def slow_step(seqs):
        time.sleep(0.05)
        return step(seqs)

    monkeypatch.setattr(worker.engine, "forward_batch", slow_step)


def test_cancelled_stream_frees_the_slot(served, client, monkeypatch):
    url, worker = served
    wait_idle(worker)
    before = worker.counters.requests_cancelled
    _slow_steps(worker, monkeypatch)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                            max_tokens=200, temperature=0, stream=True)
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()  # the client hangs up
    wait_idle(worker)
    assert worker.counters.requests_cancelled == before + 1
    assert httpx.get(f"{url}/health", timeout=T).json()["in_flight"] == 0
    r = client.completions.create(model=MODEL, prompt="next", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_client_that_gives_up_on_a_plain_request_cancels_it(served, monkeypatch):
    url, worker = served
    wait_idle(worker)
    before = worker.counters.requests_cancelled
    _slow_steps(worker, monkeypatch)
    with pytest.raises(httpx.ReadTimeout):  # greedy: a sampled stop token could end it before the client leaves
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "long", "max_tokens": 200, "temperature": 0},
                   timeout=0.3)
    wait_idle(worker)
    assert worker.counters.requests_cancelled == before + 1


def test_two_concurrent_clients_batch_and_match_generate_alone(served, ref):
    url, worker = served
    prompts = ["Revenue rose in", "Costs fell by a"]
    want = [ref_tokens(ref, ref.codec.encode(p), 24)[0] for p in prompts]
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(2)

    def one(i: int) -> None:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
        barrier.wait(T)
        r = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0, logprobs=0,
                                 extra_body={"return_tokens_as_token_ids": True})
        results[i] = ids_of(r.choices[0].logprobs.tokens)
        c.close()

    wait_idle(worker)
    worker.counters.peak_batch = 0
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * T)
    assert results == {0: want[0], 1: want[1]}  # batching does not change the tokens
    assert worker.counters.peak_batch == 2  # they were decoded together


def test_worker_prefills_arrivals_together(served, ref, monkeypatch):
    """Requests that arrive together are prefilled in one call and decoded in one batch."""
    _, worker = served
    wait_idle(worker)
    groups: list[int] = []
    real = worker.engine.prefill
    monkeypatch.setattr(worker.engine, "prefill", lambda p, s: (groups.append(len(p)), real(p, s))[1])
    from deltafin.runtime.batched import GenSpec

    prompts = [ref.codec.encode(t) for t in ("alpha", "beta beta", "gamma gamma gamma")]
    events: dict[int, list] = {i: [] for i in range(3)}
    done = threading.Event()

    def deliver(i):
        def f(ev):
            events[i].append(ev)
            if all(e and getattr(e[-1], "finish_reason", "x") for e in events.values()):
                done.set()
        return f

    jobs = [Job(GenSpec(tuple(p), 6), deliver(i), i) for i, p in enumerate(prompts)]
    worker.submit(jobs)
    assert done.wait(T)
    assert groups == [3]
    for i, p in enumerate(prompts):
        assert [e.token for e in events[i]] == ref_tokens(ref, p, 6)[0]


def test_api_key_required(served):
    _, worker = served
    with live(create_app(worker, MODEL, api_key="sekret")) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=T)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", timeout=T, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(f"{url}/metrics", timeout=T).status_code == 401
        assert httpx.get(f"{url}/health", timeout=T).status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", timeout=T, max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
        good.close()
        bad.close()
