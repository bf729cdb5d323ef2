"""OpenAI request bodies as pydantic models (strict types, ranges, no unknown fields), and their validation
errors in OpenAI's shape: a 400 whose ``param`` names the field and whose message says what was wrong.

Fields vLLM and mlx_lm.server accept beside OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``,
``return_tokens_as_token_ids``) come through the client's ``extra_body``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Finite = Annotated[float, Field(allow_inf_nan=False)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool | None = None


class JSONSchemaFormat(Strict):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(Strict):
    name: Name
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: Name


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str | dict | None = None


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message; fields OpenAI adds that the prompt does not use (``refusal``, ``audio``) are dropped."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class Common(Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[Finite, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # 0 or -1: no limit (vLLM's convention)
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    presence_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0, le=10)] | None = None
    logit_bias: dict[str, Annotated[Finite, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: log-probability tokens as "token_id:N"


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None


class ChatRequest(Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def param_of(loc: tuple) -> str:
    """pydantic's error location -> the field as a client writes it (``messages[0].content``); union
    member tags (``list[int]``, ``NamedToolChoice``) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper():
            out += f".{part}" if out else part
    return out or "body"


def explain(e: ValidationError) -> tuple[str, str, str | None]:
    """(message, param, code) for the first problem of a failed validation."""
    err = e.errors(include_url=False)[0]
    param = param_of(err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unrecognized request argument supplied: {param!r}", param, "unknown_parameter"
    if err["type"] == "missing":
        return f"you must provide {param!r}", param, "missing_required_parameter"
    if param == "prompt":
        return ("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
                param, None)
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{param}: {err['msg'].lower()}, got {got}", param, None
