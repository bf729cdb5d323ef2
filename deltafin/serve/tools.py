"""Tool calls in each checkpoint's own format: told apart by the chat template, parsed out of the generated
text into OpenAI ``tool_calls``, and written as grammar parts when a call is required.

Formats:
- ``hermes`` (Qwen2.5/Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call.
- ``deepseek``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a json code block
  (V3) or the bare JSON (V3.1) + ``<｜tool▁call▁end｜>`` ... ``<｜tool▁calls▁end｜>``.
- ``kimi`` (Kimi K2): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
  {...}<|tool_call_end|>`` ... ``<|tool_calls_section_end|>``.
- ``xtml`` (Kimi K3, spec §5.2): a ``tools`` block of ``call`` elements whose ``argument`` elements carry
  a key, a JSON type and the value.
"""

from __future__ import annotations

import html
import json
import re
import uuid
from dataclasses import dataclass

from deltafin.errors import UsageError

DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                   "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
K2_SECTION, K2_CALL, K2_ARGS, K2_END, K2_SECTION_END = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                                        "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                                                        "<|tool_calls_section_end|>")
XTML_TOOLS = "<|open|>tools<|sep|>"
START = {"hermes": "<tool_call>", "deepseek": DS_CALLS, "kimi": K2_SECTION, "xtml": XTML_TOOLS}


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def openai(self) -> dict:
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def detect(codec) -> str | None:
    """The tool-call format of this checkpoint, or None when its template declares no tools."""
    if codec is None:
        return None
    if codec.kind == "kimi":
        return "xtml"
    template = getattr(codec.impl, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    for fmt, mark in (("deepseek", "tool▁calls▁begin"), ("kimi", "tool_calls_section_begin"), ("hermes", "<tool_call>")):
        if mark in template:
            return fmt
    return None


def split(fmt: str, text: str) -> tuple[str, list[Call]]:
    """Generated text -> (the content before the first call, the calls). No calls: (text, [])."""
    at = text.find(START[fmt])
    if at < 0:
        return text, []
    calls = {"hermes": _hermes, "deepseek": _deepseek, "kimi": _kimi, "xtml": _xtml}[fmt](text[at:])
    return (text[:at].rstrip(), calls) if calls else (text, [])


def _args(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _hermes(text: str) -> list[Call]:
    calls = []
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            args = _args(args) if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            if args is not None:
                calls.append(Call(obj["name"], args))
    return calls


def _deepseek(text: str) -> list[Call]:
    calls = []
    for m in re.finditer(re.escape(DS_CALL) + r"(.*?)" + re.escape(DS_END), text, re.S):
        body = m.group(1)
        if body.startswith("function" + DS_SEP):  # V3: function<sep>NAME, then a json code block
            fenced = re.match(r"([^\n`]+?)\s*\n```(?:json)?\s*(.*?)\s*```\s*$", body[len("function" + DS_SEP):], re.S)
            name, raw = fenced.groups() if fenced else ("", "")
        else:  # V3.1: NAME<sep>{...}
            name, _, raw = body.partition(DS_SEP)
        args = _args(raw.strip())
        if args is not None and name.strip():
            calls.append(Call(name.strip(), args))
    return calls


def _kimi(text: str) -> list[Call]:
    calls = []
    pat = re.escape(K2_CALL) + r"\s*(.*?)\s*" + re.escape(K2_ARGS) + r"\s*(.*?)\s*" + re.escape(K2_END)
    for m in re.finditer(pat, text, re.S):
        ident, raw = m.groups()
        name = re.sub(r":\d+$", "", ident).removeprefix("functions.")
        args = _args(raw)
        if args is not None and name:
            calls.append(Call(name, args))
    return calls


_XTML_CALL = re.compile(r'<\|open\|>call tool="([^"]*)"[^<]*?<\|sep\|>(.*?)<\|close\|>call<\|sep\|>', re.S)
_XTML_ARG = re.compile(r'<\|open\|>argument key="([^"]*)" type="([^"]*)"<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>', re.S)
_XTML_JSON = re.compile(r"<\|open\|>json[^<]*?<\|sep\|>(.*?)<\|close\|>json<\|sep\|>", re.S)


def _xtml(text: str) -> list[Call]:
    calls = []
    for m in _XTML_CALL.finditer(text):
        name, body = html.unescape(m.group(1)), m.group(2)
        whole = _XTML_JSON.search(body)
        if whole:
            args = _args(whole.group(1))
        else:
            values = {}
            for key, kind, value in _XTML_ARG.findall(body):
                if kind == "string":
                    values[html.unescape(key)] = value
                else:
                    try:
                        values[html.unescape(key)] = json.loads(value)
                    except json.JSONDecodeError:
                        values[html.unescape(key)] = value
            args = json.dumps(values, ensure_ascii=False)
        if args is not None and name:
            calls.append(Call(name, args))
    return calls


def forced(fmt: str, name: str, parameters: dict | None) -> list[str | dict]:
    """Grammar parts of one call of ``name``: the format's markup around its arguments' JSON schema."""
    params = parameters or {"type": "object"}
    if fmt == "hermes":
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False}
        return ["<tool_call>\n", schema, "\n</tool_call>"]
    if fmt == "deepseek":
        return [f"{DS_CALLS}{DS_CALL}function{DS_SEP}{name}\n```json\n", params, f"\n```{DS_END}{DS_CALLS_END}"]
    if fmt == "kimi":
        return [f"{K2_SECTION}{K2_CALL}functions.{name}:0{K2_ARGS}", params, f"{K2_END}{K2_SECTION_END}"]
    raise UsageError(f"tool_choice 'required' or a named function is not supported for the {fmt} tool format; "
                     f"use tool_choice 'auto'")
