"""OpenAI request bodies -> generation specs, validated field by field; errors in OpenAI's shape.

Every problem becomes an ``APIError`` with a 4xx status whose message names the field and the value.
Fields OpenAI defines but Deltafin does not implement are accepted only at their neutral value
(``n=1``, penalties 0, no logit bias) so a client that sends them by default keeps working.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from deltafin.errors import UsageError
from deltafin.runtime.batched import GenSpec
from deltafin.runtime.sampling import SamplingParams


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
    max_stop_chars: int = 1000  # longest stop string (each is matched per token in time linear in its length)
    body_timeout_s: float = 30.0  # a request body must arrive whole within this

    def __post_init__(self) -> None:
        if min(self.max_tokens, self.max_body_bytes, self.max_prompts, self.max_stops, self.max_stop_chars) < 1:
            raise UsageError(f"server limits must be >= 1, got {self}")
        if not self.body_timeout_s > 0:
            raise UsageError(f"the body timeout must be > 0 s, got {self.body_timeout_s}")


@dataclass
class Parsed:
    kind: str  # "chat" | "completion"
    specs: list[GenSpec]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    token_ids: bool = False  # log-probability tokens as "token_id:N"


_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"`,;:()<>\[\]{}]+/)+([^\s/'\"`,;:()<>\[\]{}]*)")


def redact(message: str) -> str:
    """``message`` with server-side absolute paths cut to their last part (``.../E0513.dfx``): errors from
    the engine name files, and a client has no business learning the server's folders."""
    return _PATH.sub(lambda m: ".../" + m.group(1), message)


COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
          "user", "presence_penalty", "frequency_penalty", "logit_bias",
          "return_tokens_as_token_ids"}  # vLLM's extension: log-probability tokens as "token_id:N"
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
ROLES = ("system", "developer", "user", "assistant", "tool")


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _check_fields(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for k in body:
        if k not in allowed:
            raise bad(f"unrecognized request argument supplied: {k!r}", param=k, code="unknown_parameter")
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(f"{name} must be a number between {lo} and {hi}, got {v!r}", param=name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"{name} must be an integer {span}, got {v!r}", param=name)
    return v


def _neutral(body: dict) -> None:
    """OpenAI fields Deltafin does not implement: accepted at their neutral value only."""
    if body.get("n") not in (None, 1):
        raise bad(f"n={body['n']!r} is not supported; this server returns one choice per prompt", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(f"{name} is not supported; leave it at 0 (got {body[name]!r})", param=name)
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias is not supported", param="logit_bias")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user must be a string", param="user")


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v not in (None, True, False):
        raise bad(f"{name} must be true or false, got {v!r}", param=name)
    return bool(v)


def _stops(body: dict, limits: Limits) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"stop must be a non-empty string or a list of non-empty strings, got {v!r}", param="stop")
    if len(stops) > limits.max_stops:
        raise bad(f"stop has {len(stops)} strings; at most {limits.max_stops} are allowed", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise bad(f"a stop string has {longest} characters; at most {limits.max_stop_chars} are allowed",
                  param="stop")
    return tuple(stops)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"} or opts.get("include_usage") not in (None, True, False):
        raise bad(f"stream_options must be {{\"include_usage\": true|false}}, got {opts!r}", param="stream_options")
    return True, bool(opts.get("include_usage"))


def check_model(body: dict, served: str) -> None:
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise bad("you must provide a model parameter (this server serves " + repr(served) + ")", param="model")
    if m != served:
        raise APIError(404, f"the model {m!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What parsing needs to know about the served model."""

    name: str
    max_len: int
    vocab_size: int  # 0: unknown (token ids are then not range-checked here)


def _max_new(body: dict, prompt_len: int, info: ModelInfo, limits: Limits, default: int | None, name: str,
             prompt_param: str) -> int:
    want = _int(body, name, 1)
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


def _sampling(body: dict) -> SamplingParams:
    temp = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad("top_p must be greater than 0", param="top_p")
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    return SamplingParams(temp, top_p, 0, None if seed is None else seed % 2**63)


def message_text(m: object, i: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise bad(f"messages[{i}] must be an object with a role in {ROLES}, got {m!r:.200}", param=f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported, got {p!r:.200}",
                          param=f"messages[{i}].content")
            parts.append(p["text"])
        content = "".join(parts)
    if content is None and m["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")
    return {"role": m["role"], "content": content}


def parse_chat(body: object, info: ModelInfo, limits: Limits, chat) -> Parsed:
    """``chat(messages) -> prompt ids`` (the checkpoint's template; may raise)."""
    body = _check_fields(body, CHAT_FIELDS)
    check_model(body, info.name)
    _neutral(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list of {role, content} objects", param="messages")
    messages = [message_text(m, i) for i, m in enumerate(msgs)]
    lp = _flag(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not lp:
        raise bad("top_logprobs requires logprobs=true", param="top_logprobs")
    stream, usage = _stream(body)
    try:
        prompt = chat(messages)
    except UsageError as e:
        raise bad(redact(str(e)), param="messages") from None
    except Exception as e:  # a template that raises on these messages (roles out of order, ...)
        raise bad(f"the model's chat template rejected these messages: {redact(str(e))}", param="messages") from None
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad("give max_tokens or max_completion_tokens, not both", param="max_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    spec = GenSpec(tuple(prompt), _max_new(body, len(prompt), info, limits, None, name, "messages"), _sampling(body),
                   _stops(body, limits), (top or 0) if lp else None)
    return Parsed("chat", [spec], stream, usage, bool(lp), _flag(body, "return_tokens_as_token_ids"))


def _prompts(v: object, encode, vocab: int) -> list[list[int]]:
    if isinstance(v, str):
        return [encode(v)]
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return [_ids(v, vocab, "prompt")]
    if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        return [encode(p) for p in v]
    if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
        return [_ids(p, vocab, f"prompt[{i}]") for i, p in enumerate(v)]
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
              param="prompt")


def _ids(ids: list, vocab: int, where: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t and (not vocab or t < vocab) for t in ids):
        raise bad(f"{where}: token ids must be integers in [0, {vocab or 'vocabulary size'})", param="prompt")
    return list(ids)


def parse_completion(body: object, info: ModelInfo, limits: Limits, encode) -> Parsed:
    """``encode(text) -> ids`` (raises UsageError when the model has no tokenizer)."""
    body = _check_fields(body, COMPLETION_FIELDS)
    check_model(body, info.name)
    _neutral(body)
    if body.get("echo"):
        raise bad("echo is not supported", param="echo")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of is not supported; leave it at 1", param="best_of")
    if body.get("suffix") is not None:
        raise bad("suffix is not supported", param="suffix")
    if "prompt" not in body:
        raise bad("you must provide a prompt", param="prompt")
    top = _int(body, "logprobs", 0, 5)
    stream, usage = _stream(body)
    try:
        prompts = _prompts(body["prompt"], encode, info.vocab_size)
    except UsageError as e:
        raise bad(redact(str(e)), param="prompt") from None
    if len(prompts) > limits.max_prompts:
        raise bad(f"{len(prompts)} prompts in one request; at most {limits.max_prompts}", param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise bad(f"prompt{f'[{i}]' if len(prompts) > 1 else ''} is empty", param="prompt")
    sampling, stops = _sampling(body), _stops(body, limits)
    specs = [GenSpec(tuple(p), _max_new(body, len(p), info, limits, 16, "max_tokens", "prompt"), sampling, stops, top)
             for p in prompts]
    return Parsed("completion", specs, stream, usage, top is not None, _flag(body, "return_tokens_as_token_ids"))
