"""Kimi K3 XTML chat format (spec §5.2): OpenAI-style messages -> segments -> token ids.

A segment is `(text, allow_special)`. Only the four markup tokens (`<|open|>`, `<|close|>`,
`<|sep|>`, `<|end_of_msg|>`) are control segments; tag names, attribute fragments and all content
are plain text, so a user who types `<|open|>` gets ordinary BPE tokens. Each segment is encoded
on its own: ` role`, `="`, `user`, `"` are four encodes, as in the reference encoder, and
concatenating them first can give different ids.

Tool results map to `role="tool" tool="NAME" index="i"`: `i` counts the tool messages since the
last assistant message (1-based). NAME is the name of the assistant tool call whose `id` equals
the message's `tool_call_id`; failing that the message's `tool` or `name` field; failing that the
i-th call of the last assistant message. A run of tool results that all match call ids is first
put in call order, since XTML binds results to calls by position.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from deltafin.errors import UsageError

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"

THINKING_EFFORTS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")

_TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
_NEW_TOOLS_BODY = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n```json\n{}\n```"
)
_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)


class Segment(NamedTuple):
    text: str
    allow_special: bool


class TextEncoder(Protocol):
    def encode(self, text: str, allow_special: bool = False) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str | None
    name: str
    arguments: dict[str, Any] | None  # None when `raw` holds arguments that are not valid JSON
    raw: str | None = None


# ---- segment builders ---------------------------------------------------------------------------


def _seg(text: str, allow_special: bool = False) -> list[Segment]:
    return [Segment(text, allow_special)] if text else []


def escape_attr(value: Any) -> str:
    # `&` first, or the `&` of `&quot;` would be escaped again.
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open_tag(tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> list[Segment]:
    out = _seg(OPEN, True) + _seg(tag)
    for key, value in attrs:
        out += _seg(f" {key}") + _seg('="') + _seg(escape_attr(value)) + _seg('"')
    return out + _seg(SEP, True)


def _close_tag(tag: str) -> list[Segment]:
    return _seg(CLOSE, True) + _seg(tag) + _seg(SEP, True)


def _message(attrs: list[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _open_tag("message", attrs) + body + _close_tag("message") + _seg(END_OF_MSG, True)


def _system_note(kind: str, body: str) -> list[Segment]:
    return _message([("role", "system"), ("type", kind)], _seg(body.strip()))


def render_text(segments: Iterable[Segment]) -> str:
    """The prompt as one string, for logs and tests; never encode this in one call."""
    return "".join(seg.text for seg in segments)


# ---- values -------------------------------------------------------------------------------------


def _json_compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _deep_sort(value: Any) -> Any:
    # Same tools in any key order give the same prompt bytes (and prefix-cache hits).
    if isinstance(value, Mapping):
        return {k: _deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_deep_sort(v) for v in value]
    return value


def argument_type(value: Any) -> str:
    """XTML `type` of a tool argument; bool before number because bool is an int in Python."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    raise UsageError(f"tool argument {value!r} of type {type(value).__name__} is not JSON; pass JSON values")


def _argument_text(value: Any) -> str:
    # Strings go in bare (the type attribute says what they are); the rest as JSON.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ---- messages -----------------------------------------------------------------------------------


def _content(content: Any, where: str) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return _seg(content)
    if isinstance(content, list):
        return [seg for part in content for seg in _content_part(part, where)]
    raise UsageError(
        f"{where}: content of type {type(content).__name__}; expected a string or a list of text parts"
    )


def _content_part(part: Any, where: str) -> list[Segment]:
    if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return _seg(part["text"])
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise UsageError(f"{where}: content part of type {kind!r} is not supported; send text parts only")


def _named_attrs(role: str, msg: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [("role", role), ("name", msg["name"])] if msg.get("name") else [("role", role)]


def _plain_message(msg: Mapping[str, Any], role: str, where: str) -> list[Segment]:
    return _message(_named_attrs(role, msg), _content(msg.get("content"), where))


def _tool_declare(tools: Sequence[Any], dynamic: bool = False) -> list[Segment]:
    declared = [_as_tool(t) for t in tools]
    body = (_NEW_TOOLS_BODY if dynamic else _TOOLS_BODY).format(_json_compact(_deep_sort(declared)))
    return _message([("role", "system"), ("type", "tool-declare")], _seg(body))


def _as_tool(tool: Any) -> Any:
    # A bare function schema ({"name", "parameters", ...}) gets the OpenAI wrapper.
    if isinstance(tool, Mapping) and "function" not in tool and "name" in tool:
        return {"type": "function", "function": dict(tool)}
    return tool


def parse_tool_calls(msg: Mapping[str, Any], where: str) -> list[ToolCall]:
    """The assistant message's `tool_calls` as ToolCall records (arguments parsed from JSON)."""
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise UsageError(f"{where}: tool_calls is {type(calls).__name__}; expected a list")
    return [_parse_call(call, f"{where} tool_calls[{i}]") for i, call in enumerate(calls)]


def _parse_call(call: Any, where: str) -> ToolCall:
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise UsageError(
            f"{where}: {call!r} has no function name; expected {{'function': {{'name': ..., 'arguments': ...}}}}"
        )
    arguments, raw = _parse_arguments(fn.get("arguments"), where)
    call_id = call.get("id")
    return ToolCall(None if call_id is None else str(call_id), fn["name"], arguments, raw)


def _parse_arguments(arguments: Any, where: str) -> tuple[dict[str, Any] | None, str | None]:
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}, None
    if isinstance(arguments, Mapping):
        return dict(arguments), None
    if not isinstance(arguments, str):
        raise UsageError(
            f"{where}: arguments of type {type(arguments).__name__}; expected a JSON object or its string"
        )
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return None, arguments  # shown back verbatim, as the model wrote it
    if not isinstance(parsed, dict):
        raise UsageError(
            f"{where}: arguments {arguments[:80]!r} are JSON but not an object; send a JSON object"
        )
    return parsed, None


def _tools_section(calls: list[ToolCall]) -> list[Segment]:
    out = _open_tag("tools")
    for index, call in enumerate(calls, start=1):
        out += _open_tag("call", [("tool", call.name), ("index", index)])
        if call.arguments is None:
            out += _open_tag("json", [("type", "object")]) + _seg(call.raw or "") + _close_tag("json")
        else:
            for key, value in call.arguments.items():
                out += _open_tag("argument", [("key", key), ("type", argument_type(value))])
                out += _seg(_argument_text(value)) + _close_tag("argument")
        out += _close_tag("call")
    return out + _close_tag("tools")


def _assistant_message(
    msg: Mapping[str, Any], calls: list[ToolCall], thinking: bool, where: str
) -> list[Segment]:
    body: list[Segment] = []
    if thinking:
        # The think channel is structural: present (maybe empty) on every turn when thinking is on.
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        text = str(reasoning) if reasoning is not None and str(reasoning).strip() else ""
        body += _open_tag("think") + _seg(text) + _close_tag("think")
    body += _open_tag("response") + _content(msg.get("content"), where) + _close_tag("response")
    if calls:
        body += _tools_section(calls)
    return _message(_named_attrs("assistant", msg), body)


def _tool_result(msg: Mapping[str, Any], calls: list[ToolCall], position: int, where: str) -> list[Segment]:
    name = _tool_name(msg, calls, position)
    if not name:
        raise UsageError(
            f"{where}: cannot tell which tool this result is for; give it a 'tool_call_id' matching an "
            "assistant tool call, or a 'name'"
        )
    attrs = [("role", "tool"), ("tool", name), ("index", position)]
    return _message(attrs, _content(msg.get("content"), where))


def _tool_name(msg: Mapping[str, Any], calls: list[ToolCall], position: int) -> str | None:
    by_id = _call_with_id(calls, msg.get("tool_call_id"))
    if by_id is not None:
        return by_id.name
    if msg.get("tool") or msg.get("name"):
        return str(msg.get("tool") or msg.get("name"))
    return calls[position - 1].name if position <= len(calls) else None


def _call_with_id(calls: list[ToolCall], call_id: Any) -> ToolCall | None:
    if call_id is None:
        return None
    return next((c for c in calls if c.id == str(call_id)), None)


def _in_call_order(results: list[Mapping[str, Any]], calls: list[ToolCall]) -> list[Mapping[str, Any]]:
    """A run of tool results sorted by call position, when every one matches a call id."""
    ids = [c.id for c in calls]
    keys = [msg.get("tool_call_id") for msg in results]
    if any(k is None or str(k) not in ids for k in keys):
        return results
    return sorted(results, key=lambda msg: ids.index(str(msg.get("tool_call_id"))))


# ---- conversation -------------------------------------------------------------------------------


def _role(msg: Any, where: str) -> str:
    role = msg.get("role") if isinstance(msg, Mapping) else None
    if role not in ROLES:
        raise UsageError(f"{where}: role {role!r} is not supported; expected one of {', '.join(ROLES)}")
    return role


def _conversation(messages: Sequence[Mapping[str, Any]], thinking: bool) -> list[Segment]:
    out: list[Segment] = []
    calls: list[ToolCall] = []
    i = 0
    while i < len(messages):
        where = f"messages[{i}]"
        role = _role(messages[i], where)
        if role == "tool":
            run_end = _tool_run_end(messages, i)
            for offset, msg in enumerate(_in_call_order(list(messages[i:run_end]), calls)):
                out += _tool_result(msg, calls, offset + 1, f"messages[{i}..{run_end - 1}]")
            i = run_end
            continue
        msg = messages[i]
        if role == "assistant":
            calls = parse_tool_calls(msg, where)
            out += _assistant_message(msg, calls, thinking, where)
        elif role == "system" and msg.get("tools"):
            out += _tool_declare(msg["tools"], dynamic=True)
        else:
            out += _plain_message(msg, role, where)
        i += 1
    return out


def _tool_run_end(messages: Sequence[Mapping[str, Any]], start: int) -> int:
    end = start
    while end < len(messages) and isinstance(messages[end], Mapping) and messages[end].get("role") == "tool":
        end += 1
    return end


def check_thinking_effort(effort: str | None) -> None:
    if effort is not None and effort not in THINKING_EFFORTS:
        raise UsageError(
            f"thinking_effort={effort!r} is not supported; use one of {', '.join(THINKING_EFFORTS)}"
        )


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    thinking: bool = True,
    thinking_effort: str | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """Render a conversation as XTML segments.

    Order: tool declarations, the thinking-effort note (thinking on and effort given), the
    messages, then the open assistant turn with its `think` (or `response`) channel.
    """
    check_thinking_effort(thinking_effort)
    out: list[Segment] = []
    if tools:
        out += _tool_declare(tools)
    if thinking and thinking_effort is not None:
        out += _system_note("thinking-effort", _EFFORT_BODY.format(thinking_effort))
    out += _conversation(messages, thinking)
    if add_generation_prompt:
        out += _open_tag("message", [("role", "assistant")]) + _open_tag("think" if thinking else "response")
    return out


def encode_segments(tokenizer: TextEncoder, segments: Iterable[Segment]) -> list[int]:
    ids: list[int] = []
    for seg in segments:
        ids.extend(tokenizer.encode(seg.text, allow_special=seg.allow_special))
    return ids


def encode_chat(tokenizer: TextEncoder, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
    """Token ids of `render(messages, **kwargs)`, each segment encoded on its own."""
    return encode_segments(tokenizer, render(messages, **kwargs))
