"""The OpenAI-compatible HTTP API over one engine worker (FastAPI).

Routes: /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions (JSON or server-sent events),
/health, /metrics.
Every error is OpenAI's JSON shape with a 4xx status (500 only when generation itself fails); nothing a
client sends can stop the server. A client that disconnects cancels its sequences.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltafin.runtime.batched import TokenOut
from deltafin.runtime.grammar import Grammars
from deltafin.serve import tools
from deltafin.serve.gate import BodyTimeout, BodyTooLarge, ClientLeft, read_body, replay
from deltafin.serve.protocol import (
    APIError,
    Context,
    Limits,
    ModelInfo,
    Parsed,
    clip,
    parse_chat,
    parse_completion,
    redact,
)
from deltafin.serve.responses import Choice, Formatter, TokenPieces, ToolStream
from deltafin.serve.thinking import ThinkingOptions, take_thinking
from deltafin.serve.worker import Failure, Job, QueueFull, Worker

log = logging.getLogger(__name__)
access = logging.getLogger("deltafin.serve.access")  # one line per request


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Gate:
    """ASGI middleware: reads a request's body whole before the route runs, under a size limit (413, counted
    as it arrives, chunked or not) and a deadline (408); a client that hangs up mid-upload ends the exchange
    quietly (counted as 499). Counts responses by path and status for /metrics, times each request and logs
    one line for it."""

    def __init__(self, app, max_bytes: int, counts: Counter, body_timeout_s: float = 30.0, metrics=None):
        self.app, self.max_bytes, self.counts, self.body_timeout_s = app, max_bytes, counts, body_timeout_s
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        scope.setdefault("state", {})["t0"] = t0  # routes time the first token from here
        try:
            await self._gated(scope, receive, send)
        finally:
            self._done(scope, t0)

    def _done(self, scope, t0: float) -> None:
        seconds = time.monotonic() - t0
        path = scope.get("path", "")
        status = scope["state"].get("status", 499)
        if self.metrics is not None:
            self.metrics.latency.labels(path if path in KNOWN_PATHS else "other").observe(seconds)
        tally = scope["state"].get("tally")
        tokens = (f" prompt={tally['prompt']} cached={tally['cached']} completion={tally['completion']}"
                  if tally else "")
        access.info("%s %s %s%s %.3fs", scope.get("method", "?"), clip(path, 200), status, tokens, seconds)

    async def _gated(self, scope, receive, send):
        path = scope.get("path", "")
        path = path if path in KNOWN_PATHS else "other"

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                scope["state"]["status"] = msg["status"]
                self.counts[(path, msg["status"])] += 1
            await send(msg)

        too_big = APIError(413, f"request body too large: the limit is {self.max_bytes} bytes "
                           f"(--max-request-bytes)", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(too_big)(scope, receive, counted_send)
        try:
            body = await read_body(receive, self.max_bytes, self.body_timeout_s)
        except BodyTooLarge:
            return await error_response(too_big)(scope, receive, counted_send)
        except BodyTimeout:
            late = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s; send it "
                            f"at once", code="request_timeout")
            return await error_response(late)(scope, receive, counted_send)
        except ClientLeft:
            self.counts[(path, 499)] += 1
            return
        await self.app(scope, replay(body, receive), counted_send)


KNOWN_PATHS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}


class CancellingStream(StreamingResponse):
    """A streamed response that runs ``on_close`` however it ends: finished, client gone, or error."""

    def __init__(self, content, on_close: Callable[[], None], **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class Server:
    """State shared by the routes: the worker, the served model's facts, limits and counters."""

    def __init__(self, worker: Worker, name: str, api_key: str | None, limits: Limits,
                 thinking: ThinkingOptions | None = None):
        eng = worker.engine
        self.worker, self.api_key, self.limits = worker, api_key, limits
        self.thinking = thinking or ThinkingOptions()
        embed = getattr(eng.model, "embed_w", None)
        vocab = int(eng.packed.text_config.get("vocab_size") or getattr(embed, "shape", (0,))[0])
        self.info = ModelInfo(name, eng.opts.max_len, vocab)
        self.ctx = Context(_grammars(eng.codec, vocab, limits.grammar_timeout_s), tools.detect(eng.codec))
        self._health: tuple[float, list[str]] = (0.0, [])
        self.pieces = TokenPieces(eng.codec, worker.codec_lock)
        self.http: Counter = Counter()
        self.started = int(time.time())
        from deltafin.serve.metrics import Metrics

        self.metrics = Metrics(worker, self.http)

    def model_problems(self, every_s: float = 2.0) -> list[str]:
        """What is wrong with the served model's files (store/health.py), re-checked at most every ``every_s``."""
        t, found = self._health
        if time.monotonic() - t >= every_s:
            packed = getattr(self.worker.engine, "packed", None)
            found = packed.health() if packed is not None and hasattr(packed, "health") else []
            self._health = (time.monotonic(), found)
        return found

    def first_token(self, request: Request, kind: str) -> None:
        t0 = getattr(request.state, "t0", None)
        if t0 is not None:
            self.metrics.ttft.labels(kind).observe(time.monotonic() - t0)

    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    # -- tokenization (thread pool: the tokenizer is shared with the engine thread, under its lock)
    def encode(self, text: str) -> list[int]:
        codec = self.worker.engine.codec
        if codec is None:
            from deltafin.errors import UsageError

            raise UsageError("this model has no tokenizer files; send the prompt as a list of token ids")
        with self.worker.codec_lock:
            return codec.encode(text)

    def chat(self, messages: list[dict], tools: list[dict] | None = None,
             opts: ThinkingOptions | None = None) -> list[int]:
        codec = self.worker.engine.codec
        if codec is None:
            from deltafin.errors import UsageError

            raise UsageError("this model has no tokenizer files, so chat is not possible; use /v1/completions "
                             "with token ids")
        with self.worker.codec_lock:
            return codec.chat(messages, tools=tools, **(opts or self.thinking).chat_kwargs())

    def splitters(self, parsed: Parsed) -> list | None:
        """Chat replies: reasoning apart from content, markup and special tokens dropped."""
        codec = self.worker.engine.codec
        if parsed.kind != "chat" or codec is None:
            return None
        from deltafin.runtime.reasoning import splitter_for

        with self.worker.codec_lock:
            return [splitter_for(codec, spec.prompt, chat=True) for spec in parsed.specs]


def _constrained(body: object) -> bool:
    """Whether a chat request's reply is held to a grammar (JSON mode or schema, or a forced tool call)."""
    if not isinstance(body, dict):
        return False
    fmt = body.get("response_format")
    choice = body.get("tool_choice")
    return ((isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"))
            or (bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))))


def _grammars(codec, vocab: int, timeout_s: float = 20.0):
    """Constrained decoding when xgrammar is installed (it is optional); None otherwise. Compiled in a child
    process under a deadline, cancelled when the client leaves (serve/grammar_worker.py)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        log.info("xgrammar is not installed: response_format and forced tool calls will be refused")
        return None
    from deltafin.serve.grammar_worker import BoundedGrammars

    return BoundedGrammars(Grammars(codec, vocab), timeout_s)


async def parse_watched(request: Request, fn, *args):
    """``fn(*args, cancel=event)`` in the thread pool; the event is set as soon as the client hangs up, so a
    grammar compilation for nobody stops."""
    cancel = threading.Event()

    async def watch() -> None:
        while not cancel.is_set():
            if await request.is_disconnected():
                cancel.set()
                return
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    try:
        return await run_in_threadpool(fn, *args, cancel=cancel)
    finally:
        watcher.cancel()


async def read_json(request: Request) -> object:
    raw = await request.body()
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # a lone surrogate (\ud800) is not text
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"we could not parse the JSON body of your request ({e}); send a JSON object") from None
    except UnicodeEncodeError as e:
        raise APIError(400, f"the JSON body holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a}), which is "
                       f"not Unicode text; send valid UTF-8", code="invalid_unicode") from None
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise APIError(400, f"the JSON body holds a number we cannot read ({e}); send numbers of usual size") from None
    return body


def submit(srv: Server, parsed: Parsed) -> tuple[list[Job], asyncio.Queue]:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def deliver_to(i: int):
        return lambda ev: loop.call_soon_threadsafe(q.put_nowait, (i, ev))

    jobs = [Job(spec, deliver_to(i), i) for i, spec in enumerate(parsed.specs)]
    try:
        srv.worker.submit(jobs)
    except QueueFull as e:
        raise APIError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full") from None
    return jobs, q


def cancel(jobs: list[Job]) -> None:
    for j in jobs:
        j.cancelled.set()


def failure_error(f: Failure) -> APIError:
    return APIError(f.status, redact(f.message), f.type)


class ClientGone(Exception):
    pass


class Waiter:
    """Events of one request, checking about twice a second that the client is still there."""

    def __init__(self, request: Request, q: asyncio.Queue, every_s: float = 0.5):
        self.request, self.q, self.every_s = request, q, every_s
        self.checked = time.monotonic()

    async def next(self) -> tuple[int, object]:
        while True:
            if time.monotonic() - self.checked >= self.every_s:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise ClientGone()
            try:
                return await asyncio.wait_for(self.q.get(), self.every_s)
            except TimeoutError:
                pass


async def collect(request: Request, srv: Server, parsed: Parsed, fmt: Formatter) -> Response:
    jobs, q = submit(srv, parsed)
    choices = {j.index: Choice(j.index, len(j.spec.prompt)) for j in jobs}
    pending = set(choices)
    waiter = Waiter(request, q)
    tally = request.state.tally
    try:
        while pending:
            try:
                i, ev = await waiter.next()
            except ClientGone:
                return Response(status_code=499)  # nobody is listening; the finally cancels
            if isinstance(ev, Failure):
                return error_response(failure_error(ev))
            if not tally["completion"]:
                srv.first_token(request, fmt.kind)
            choices[i].add(ev, fmt.stop_ids)
            tally["completion"] += 1
            tally["cached"] = sum(c.cached_tokens for c in choices.values())
            if ev.finish_reason:
                pending.discard(i)
    finally:
        cancel(jobs)
    return JSONResponse(fmt.final(list(choices.values()), parsed.logprobs))


async def stream(request: Request, srv: Server, parsed: Parsed, fmt: Formatter) -> Response:
    jobs, q = submit(srv, parsed)
    try:
        first = await Waiter(request, q).next()  # a failure before the first token still gets a proper status
    except ClientGone:
        cancel(jobs)
        return Response(status_code=499)
    except BaseException:  # the task was cancelled (server shutting down)
        cancel(jobs)
        raise
    if isinstance(first[1], Failure):
        cancel(jobs)
        return error_response(failure_error(first[1]))
    srv.first_token(request, fmt.kind)
    return CancellingStream(_events(parsed, fmt, jobs, q, first, request.state.tally), lambda: cancel(jobs),
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _events(parsed: Parsed, fmt: Formatter, jobs: list[Job], q: asyncio.Queue,
                  first: tuple[int, object], tally: dict) -> AsyncIterator[str]:
    pending = {j.index for j in jobs}
    offsets = dict.fromkeys(pending, 0)
    calling = {i: ToolStream(parsed.tool_format) for i in pending} if parsed.tool_format else {}
    completion, cached = 0, {}
    if fmt.kind == "chat":
        for j in jobs:
            yield sse(fmt.role_chunk(j.index))
    item = first
    while True:
        i, ev = item
        if isinstance(ev, Failure):
            yield sse(failure_error(ev).body())
            return
        assert isinstance(ev, TokenOut)
        completion += 1
        cached[i] = ev.seq.cached
        tally["completion"], tally["cached"] = completion, sum(cached.values())
        calls = []
        if i in calling:  # text that may be a tool call is held back until it is known
            shown = calling[i].feed(ev.text)
            if ev.finish_reason:
                rest, calls = calling[i].finish()
                shown += rest
            ev = replace(ev, text=shown, finish_reason=None if calls else ev.finish_reason)
        chunk = fmt.chunk(i, ev, parsed.logprobs, offsets[i])
        offsets[i] += len(ev.text)
        if chunk is not None:
            yield sse(chunk)
        if calls:
            yield sse(fmt.tool_chunk(i, calls))
        if ev.finish_reason or calls:
            pending.discard(i)
        if not pending:
            break
        item = await q.get()
    if parsed.include_usage:
        yield sse(fmt.usage_chunk(sum(len(j.spec.prompt) for j in jobs), completion, sum(cached.values())))
    yield sse("[DONE]")


def create_app(worker: Worker, model_name: str, api_key: str | None = None, limits: Limits | None = None,
               thinking: ThinkingOptions | None = None) -> FastAPI:
    """``thinking``: the chat requests' defaults (``--think/--no-think``, ``--effort``)."""
    limits = limits or Limits()
    srv = Server(worker, model_name, api_key, limits, thinking)
    app = FastAPI(title="deltafin", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.add_middleware(Gate, max_bytes=limits.max_body_bytes, counts=srv.http, body_timeout_s=limits.body_timeout_s,
                       metrics=srv.metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        path = clip(request.url.path)
        msg = {404: f"no such endpoint: {request.method} {path}",
               405: f"method {request.method} is not allowed on {path}"}.get(e.status_code, clip(str(e.detail)))
        return error_response(APIError(e.status_code, msg, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(APIError(400, f"invalid request: {e.errors()[:3]}"))

    def guarded(fn):
        """Route wrapper: API errors pass through; anything else is a 500 JSON without a stack trace."""

        async def route(request: Request):
            try:
                srv.check_key(request)
                return await fn(request)
            except APIError as e:
                return error_response(e)
            except Exception:
                log.exception("request failed: %s %s", request.method, clip(request.url.path))
                return error_response(APIError(500, "internal server error; see the server log", "server_error"))

        route.__name__ = fn.__name__
        return route

    async def completions(request: Request):
        parsed = await parse_watched(request, parse_completion, await read_json(request), srv.info, srv.limits,
                                     srv.encode, srv.ctx)
        return await respond(request, parsed)

    async def chat_completions(request: Request):
        body = await read_json(request)
        codec = worker.engine.codec
        opts = take_thinking(body, srv.thinking, kimi=codec is not None and codec.kind == "kimi")
        if _constrained(body) and opts.thinking is not False:
            # the grammar holds the whole reply to JSON or a call: a reasoning channel before it cannot be
            # written, so constrained replies are rendered with thinking off
            opts = replace(opts, thinking=False, effort=None)
        parsed = await parse_watched(request, parse_chat, body, srv.info, srv.limits,
                                     lambda m, tools=None: srv.chat(m, tools, opts), srv.ctx)
        return await respond(request, parsed)

    async def respond(request: Request, parsed: Parsed) -> Response:
        fmt = Formatter(parsed.kind, srv.info.name, srv.pieces, worker.engine.eos_ids, parsed.token_ids,
                        parsed.tool_format, srv.splitters(parsed))
        request.state.tally = {"prompt": sum(len(sp.prompt) for sp in parsed.specs), "cached": 0, "completion": 0}
        return await (stream(request, srv, parsed, fmt) if parsed.stream else collect(request, srv, parsed, fmt))

    def card() -> dict:
        return {"id": srv.info.name, "object": "model", "created": srv.started, "owned_by": "deltafin",
                "max_model_len": srv.info.max_len}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [card()]})

    async def model(request: Request):
        wanted = request.path_params["model_id"]
        if wanted != srv.info.name:
            raise APIError(404, f"the model {clip(wanted)!r} does not exist; this server serves {srv.info.name!r}",
                           param="model", code="model_not_found")
        return JSONResponse(card())

    async def metrics(request: Request):
        from deltafin.serve.metrics import CONTENT_TYPE

        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/v1/completions", guarded(completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", guarded(chat_completions), methods=["POST"])
    app.add_api_route("/v1/models", guarded(models), methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", guarded(model), methods=["GET"])
    app.add_api_route("/metrics", guarded(metrics), methods=["GET"])

    @app.get("/health")
    async def health():
        problems = await run_in_threadpool(srv.model_problems)
        ok = worker.alive and not problems
        status = "ok" if ok else ("engine stopped" if not worker.alive else "model files missing or moved")
        body = {"status": status, "in_flight": worker.in_flight, "queued": worker.queued}
        if problems:
            body["problems"] = [redact(p) for p in problems]
        return JSONResponse(body, status_code=200 if ok else 503)

    return app
