"""OpenAI request bodies -> generation specs; errors in OpenAI's shape.

Types and ranges are checked by the pydantic models of ``schemas``; what needs the served model (its name,
context length, vocabulary, tokenizer, tool format) is checked here. Every problem becomes an ``APIError``
with a 4xx status whose message names the field and the value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from pydantic import BaseModel, ValidationError

from deltafin.errors import UsageError
from deltafin.runtime.batched import GenSpec
from deltafin.runtime.sampling import SamplingParams
from deltafin.serve import tools
from deltafin.serve.schemas import ChatRequest, Common, CompletionRequest, Message, NamedToolChoice, explain


class APIError(Exception):
    """An error for the client: HTTP status and OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class Limits:
    max_tokens: int = 4096  # largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    max_prompts: int = 16  # prompts in one /v1/completions request
    max_stops: int = 16
    max_choices: int = 16  # sequences one request may ask for (prompts x n)
    max_stop_chars: int = 1000  # longest stop string (each is matched per token in time linear in its length)
    body_timeout_s: float = 30.0  # a request body must arrive whole within this
    max_tools: int = 128  # tools in one chat request (OpenAI's limit)
    max_schema_bytes: int = 64 << 10  # JSON of a response_format schema, or of all tools' parameters together
    grammar_timeout_s: float = 20.0  # compiling one request's grammar (the server's child process is killed past it)

    def __post_init__(self) -> None:
        if min(self.max_tokens, self.max_body_bytes, self.max_prompts, self.max_stops, self.max_stop_chars) < 1:
            raise UsageError(f"server limits must be >= 1, got {self}")
        if not self.body_timeout_s > 0:
            raise UsageError(f"the body timeout must be > 0 s, got {self.body_timeout_s}")
        if min(self.max_tools, self.max_schema_bytes) < 1 or not 0 < self.grammar_timeout_s <= 3600:
            raise UsageError(f"--max-schema-bytes must be >= 1 and --grammar-timeout in (0, 3600] s, got "
                             f"{self.max_schema_bytes} and {self.grammar_timeout_s}")


@dataclass
class Parsed:
    kind: str  # "chat" | "completion"
    specs: list[GenSpec]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    token_ids: bool = False  # log-probability tokens as "token_id:N"
    tool_format: str | None = None  # parse replies for tool calls in this format (tools given, choice not "none")


_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"`,;:()<>\[\]{}]+/)+([^\s/'\"`,;:()<>\[\]{}]*)")


def redact(message: str) -> str:
    """``message`` with server-side absolute paths cut to their last part (``.../E0513.dfx``): errors from
    the engine name files, and a client has no business learning the server's folders."""
    return _PATH.sub(lambda m: ".../" + m.group(1), message)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validate(model: type[BaseModel], body: object) -> BaseModel:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param, code = explain(e)
        raise bad(message, param, code) from None


def clip(text: str, n: int = 100) -> str:
    """A client's value as echoed in a message or a log line: at most ``n`` characters."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text):,} characters)"


def check_model(model: str | None, served: str) -> None:
    """``model`` is optional (the one model served); a wrong name is a 404 as OpenAI gives it."""
    if model is not None and model != served:
        raise APIError(404, f"the model {clip(model)!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _schema_size(v, what: str, param: str, limits: Limits) -> None:
    n = len(json.dumps(v, ensure_ascii=False).encode("utf-8"))
    if n > limits.max_schema_bytes:
        raise bad(f"{what} is {n:,} bytes of JSON; this server compiles at most {limits.max_schema_bytes:,} "
                  f"(--max-schema-bytes): send a smaller schema", param=param, code="schema_too_large")


def _compile(g, method: str, *args, cancel=None):
    """Call a grammar compiler, passing ``cancel`` where it takes one (the server's bounded compiler)."""
    fn = getattr(g, method)
    return fn(*args) if cancel is None else fn(*args, cancel=cancel)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What parsing needs to know about the served model."""

    name: str
    max_len: int
    vocab_size: int  # 0: unknown (token ids are then not range-checked here)


@dataclass(frozen=True, slots=True)
class Context:
    """The served model's helpers: ``grammars`` compiles constraints (None: not available), ``tool_format``
    is the checkpoint's tool-call format (None: its template declares no tools)."""

    grammars: object | None = None
    tool_format: str | None = None


def _max_new(want: int | None, prompt_len: int, info: ModelInfo, limits: Limits, default: int | None, name: str,
             prompt_param: str) -> int:
    room = info.max_len - prompt_len
    if want is not None and want > limits.max_tokens:
        raise bad(f"{name} is {want}, but this server allows at most {limits.max_tokens} (--max-tokens-limit)",
                  param=name)
    if room < 1:
        raise bad(f"this model's maximum context length is {info.max_len} tokens, but the prompt has "
                  f"{prompt_len} tokens; shorten it", param=prompt_param,
                  code="context_length_exceeded")
    if want is None:
        return min(default or limits.max_tokens, limits.max_tokens, room)
    if want > room:
        raise bad(f"this model's maximum context length is {info.max_len} tokens; you requested "
                  f"{prompt_len + want} ({prompt_len} in the prompt, {want} for the completion); reduce the "
                  f"prompt or {name}", param=name, code="context_length_exceeded")
    return want


def _stops(stop: str | list[str] | None, limits: Limits) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not all(stops):
        raise bad(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r:.100}", param="stop")
    if len(stops) > limits.max_stops:
        raise bad(f"stop has {len(stops)} strings; at most {limits.max_stops} are allowed", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise bad(f"a stop string has {longest} characters; at most {limits.max_stop_chars} are allowed",
                  param="stop")
    return tuple(stops)


def _stream(r: Common) -> tuple[bool, bool]:
    if r.stream_options is not None and not r.stream:
        raise bad("stream_options is only allowed with stream=true", param="stream_options")
    return bool(r.stream), bool(r.stream_options and r.stream_options.include_usage)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or (vocab and int(key) >= vocab):
            raise bad(f"logit_bias keys must be token ids in [0, {vocab or 'vocabulary size'}), got {key!r:.40}",
                      param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _sampling(r: Common, vocab: int) -> SamplingParams:
    seed = None if r.seed is None else r.seed % 2**63
    return SamplingParams(1.0 if r.temperature is None else r.temperature, 1.0 if r.top_p is None else r.top_p,
                          max(r.top_k or 0, 0), seed, r.min_p or 0.0, r.presence_penalty or 0.0,
                          r.frequency_penalty or 0.0, r.repetition_penalty or 1.0, _logit_bias(r.logit_bias, vocab))


def _grammars(ctx: Context, what: str):
    if ctx.grammars is None:
        raise bad(f"{what} needs constrained decoding, which needs xgrammar on the server: "
                  f"pip install 'deltafin[grammar]'", param=what)
    return ctx.grammars


def _response_format(r: Common, ctx: Context, limits: Limits, check_only: bool = False, cancel=None):
    """The compiled grammar of ``response_format`` (None for plain text); ``check_only``: its checks, no compile."""
    rf = r.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
        raise bad("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                  param="response_format.json_schema")
    g = _grammars(ctx, "response_format")
    if rf.type == "json_schema":
        _schema_size(rf.json_schema.schema_, "response_format's schema", "response_format", limits)
    if check_only:
        return None
    try:
        if rf.type == "json_object":
            return _compile(g, "json_object", cancel=cancel)
        return _compile(g, "json_schema", rf.json_schema.schema_, cancel=cancel)
    except UsageError as e:
        raise bad(redact(str(e)), param="response_format") from None


def _choices(specs_of_prompt: list[GenSpec], n: int, limits: Limits) -> list[GenSpec]:
    """``n`` sequences per prompt, prompt-major (choice index = prompt x n + j); a given seed is advanced
    per choice so that sampled choices differ and stay reproducible."""
    if len(specs_of_prompt) * n > limits.max_choices:
        raise bad(f"{len(specs_of_prompt)} prompt(s) x n={n} asks for {len(specs_of_prompt) * n} sequences; at "
                  f"most {limits.max_choices}", param="n")
    out = []
    for spec in specs_of_prompt:
        for j in range(n):
            sp = spec.sampling
            if j and sp.seed is not None:
                sp = replace(sp, seed=(sp.seed + j) % 2**63)
            out.append(replace(spec, sampling=sp))
    return out


# ---- chat ----------------------------------------------------------------------------------------


def template_message(m: Message) -> dict:
    """A validated message as chat templates take it: text parts joined; tool-call arguments as objects
    where they are JSON (templates write them out themselves)."""
    content = m.content
    if isinstance(content, list):
        content = "".join(p.text for p in content)
    out: dict = {"role": m.role, "content": content if content is not None else ""}
    for name in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, name) is not None:
            out[name] = getattr(m, name)
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _as_object(c.function.arguments)}}
                             for c in m.tool_calls]
    return out


def _as_object(arguments: str | dict | None) -> dict | str:
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments or {}


def _tool_grammar(r: ChatRequest, ctx: Context, check_only: bool = False, cancel=None):
    """The grammar that makes the reply a call (tool_choice "required" or a named function), else None;
    ``check_only``: its checks, no compile."""
    choice = r.tool_choice
    if choice in (None, "none", "auto"):
        return None
    by_name = {t.function.name: t.function for t in r.tools or []}
    if isinstance(choice, NamedToolChoice) and choice.function.name not in by_name:
        raise bad(f"tool_choice names {choice.function.name!r}, which is not in tools ({clip(', '.join(by_name))})",
                  param="tool_choice")
    g = _grammars(ctx, "tool_choice")
    if check_only:
        return None
    try:
        if isinstance(choice, NamedToolChoice):
            f = by_name[choice.function.name]
            return _compile(g, "sequence", tools.forced(ctx.tool_format, f.name, f.parameters), cancel=cancel)
        return _compile(g, "union", [tools.forced(ctx.tool_format, f.name, f.parameters) for f in by_name.values()],
                        cancel=cancel)
    except UsageError as e:
        raise bad(redact(str(e)), param="tool_choice") from None


def _tools(r: ChatRequest, ctx: Context, limits: Limits) -> list[dict] | None:
    """The tools to render in the prompt (None: no tools, or tool_choice "none")."""
    if r.tool_choice is not None and not r.tools:
        raise bad("tool_choice needs tools", param="tool_choice")
    if r.tools and len(r.tools) > limits.max_tools:
        raise bad(f"{len(r.tools):,} tools in one request; at most {limits.max_tools}", param="tools",
                  code="too_many_tools")
    if r.tools:
        _schema_size([t.function.parameters for t in r.tools], "the tools' parameters", "tools", limits)
    if not r.tools or r.tool_choice == "none":
        return None
    if ctx.tool_format is None:
        raise bad("this model's chat template declares no tools, so it cannot be given tools; leave tools out",
                  param="tools")
    return [t.model_dump(exclude_none=True) for t in r.tools]


def parse_chat(body: object, info: ModelInfo, limits: Limits, chat, ctx: Context = Context(),
               cancel=None) -> Parsed:
    """``chat(messages, tools) -> prompt ids`` (the checkpoint's template; may raise). The prompt's length is
    checked before any grammar is compiled; ``cancel`` (an Event) stops a compilation when the client leaves."""
    r = validate(ChatRequest, body)
    check_model(r.model, info.name)
    if r.top_logprobs is not None and not r.logprobs:
        raise bad("top_logprobs requires logprobs=true", param="top_logprobs")
    if r.max_tokens is not None and r.max_completion_tokens is not None:
        raise bad("give max_tokens or max_completion_tokens, not both", param="max_tokens")
    stream, usage = _stream(r)
    declared = _tools(r, ctx, limits)
    forced = r.tool_choice not in (None, "none", "auto")
    _tool_grammar(r, ctx, check_only=True)
    if forced and r.response_format is not None and r.response_format.type != "text":
        raise bad("give response_format or a required tool call, not both", param="response_format")
    _response_format(r, ctx, limits, check_only=True)
    messages = [template_message(m) for m in r.messages]
    try:
        prompt = chat(messages, declared)
    except UsageError as e:
        raise bad(redact(str(e)), param="messages") from None
    except Exception as e:  # a template that raises on these messages (roles out of order, ...)
        raise bad(f"the model's chat template rejected these messages: {redact(str(e))}", param="messages") from None
    if not prompt:
        raise bad("the chat template gave an empty prompt for these messages", param="messages")
    name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    want = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    max_new = _max_new(want, len(prompt), info, limits, None, name, "messages")
    sampling, stops = _sampling(r, info.vocab_size), _stops(r.stop, limits)
    grammar = (_tool_grammar(r, ctx, cancel=cancel) if forced else None) or _response_format(r, ctx, limits,
                                                                                            cancel=cancel)
    spec = GenSpec(tuple(prompt), max_new, sampling, stops, (r.top_logprobs or 0) if r.logprobs else None, grammar)
    return Parsed("chat", _choices([spec], r.n or 1, limits), stream, usage, bool(r.logprobs),
                  bool(r.return_tokens_as_token_ids), ctx.tool_format if declared else None)


# ---- completions ---------------------------------------------------------------------------------


def _prompts(v: str | list, encode, vocab: int) -> list[list[int]]:
    if isinstance(v, str):
        return [encode(v)]
    if v and all(isinstance(t, int) for t in v):
        return [_ids(v, vocab, "prompt")]
    if v and all(isinstance(p, str) for p in v):
        return [encode(p) for p in v]
    if v and all(isinstance(p, list) for p in v):
        return [_ids(p, vocab, f"prompt[{i}]") for i, p in enumerate(v)]
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
              param="prompt")


def _ids(ids: list, vocab: int, where: str) -> list[int]:
    if not all(0 <= t and (not vocab or t < vocab) for t in ids):
        raise bad(f"{where}: token ids must be integers in [0, {vocab or 'vocabulary size'})", param="prompt")
    return list(ids)


def parse_completion(body: object, info: ModelInfo, limits: Limits, encode, ctx: Context = Context(),
                     cancel=None) -> Parsed:
    """``encode(text) -> ids`` (raises UsageError when the model has no tokenizer)."""
    r = validate(CompletionRequest, body)
    check_model(r.model, info.name)
    if r.echo:
        raise bad("echo is not supported", param="echo")
    if r.best_of not in (None, 1):
        raise bad("best_of is not supported; leave it at 1 (n gives several choices)", param="best_of")
    if r.suffix is not None:
        raise bad("suffix is not supported", param="suffix")
    stream, usage = _stream(r)
    try:
        prompts = _prompts(r.prompt, encode, info.vocab_size)
    except UsageError as e:
        raise bad(redact(str(e)), param="prompt") from None
    if len(prompts) > limits.max_prompts:
        raise bad(f"{len(prompts)} prompts in one request; at most {limits.max_prompts}", param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise bad(f"prompt{f'[{i}]' if len(prompts) > 1 else ''} is empty", param="prompt")
    _response_format(r, ctx, limits, check_only=True)
    sampling, stops = _sampling(r, info.vocab_size), _stops(r.stop, limits)
    room = [_max_new(r.max_tokens, len(p), info, limits, 16, "max_tokens", "prompt") for p in prompts]
    grammar = _response_format(r, ctx, limits, cancel=cancel)  # compiled only once the prompts fit
    specs = [GenSpec(tuple(p), n, sampling, stops, r.logprobs, grammar) for p, n in zip(prompts, room, strict=True)]
    return Parsed("completion", _choices(specs, r.n or 1, limits), stream, usage, r.logprobs is not None,
                  bool(r.return_tokens_as_token_ids))
