"""Generated tokens -> OpenAI response bodies and stream chunks (completions and chat completions)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from deltafin.runtime.batched import TokenOut
from deltafin.runtime.reasoning import split_all
from deltafin.serve import tools


def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode), inverted: token character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenPieces:
    """Token id -> (text, raw bytes). Byte-level tokenizers give a token's exact bytes even when they are
    part of a UTF-8 character (the text then shows U+FFFD, the bytes stay exact)."""

    def __init__(self, codec, lock):
        self.codec, self.lock = codec, lock
        self.byte_dec: dict[str, int] | None = None
        self.special: set[int] = set()
        impl = getattr(codec, "impl", None)
        backend = getattr(impl, "backend_tokenizer", None)
        if codec is not None and codec.kind == "hf" and type(getattr(backend, "decoder", None)).__name__ == "ByteLevel":
            self.byte_dec = _gpt2_byte_decoder()
            self.special = set(getattr(impl, "added_tokens_decoder", {}) or {})

    def __call__(self, tok: int) -> tuple[str, list[int]]:
        if self.codec is None:
            return str(tok), list(str(tok).encode())
        with self.lock:
            text = self.codec.decode([tok])
            raw = self.codec.impl.convert_ids_to_tokens(tok) if self.byte_dec and tok not in self.special else None
        if raw and all(c in self.byte_dec for c in raw):
            b = bytes(self.byte_dec[c] for c in raw)
            if "\ufffd" in text and b != text.encode("utf-8"):  # part of a UTF-8 character: OpenAI's notation
                text = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            return text, list(b)
        return text, list(text.encode("utf-8"))


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage object; ``cached``: prompt tokens restored from the prompt cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class Choice:
    """What one sequence produced so far, for the final (non-streamed) body."""

    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)  # with log-probabilities, stop tokens left out
    completion_tokens: int = 0
    finish_reason: str | None = None
    cached_tokens: int = 0

    def add(self, out: TokenOut, stop_ids: tuple[int, ...]) -> None:
        self.cached_tokens = out.seq.cached
        self.completion_tokens += 1
        self.text.append(out.text)
        if out.logprob is not None and out.token not in stop_ids:
            self.tokens.append(out)
        self.finish_reason = out.finish_reason or self.finish_reason


class Formatter:
    """Bodies and chunks for one request."""

    def __init__(self, kind: str, model: str, pieces: TokenPieces, stop_ids: tuple[int, ...], token_ids: bool = False,
                 tool_format: str | None = None, splitters: list | None = None):
        """``splitters``: one ``deltafin.runtime.reasoning`` splitter per chat choice (reasoning apart from
        content, markup dropped); None sends the text as it is."""
        self.kind, self.model, self.stop_ids, self.tool_format = kind, model, stop_ids, tool_format
        self.splitters = splitters
        self.pieces = pieces if not token_ids else lambda t: (f"token_id:{t}", list(f"token_id:{t}".encode()))
        self.id, self.created = new_id(kind), int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- log-probabilities
    def _chat_logprobs(self, outs: list[TokenOut]) -> dict:
        content = []
        for o in outs:
            text, raw = self.pieces(o.token)
            alts = []
            for t, lp in o.top or []:
                at, ab = self.pieces(t)
                alts.append({"token": at, "logprob": lp, "bytes": ab})
            content.append({"token": text, "logprob": o.logprob, "bytes": raw, "top_logprobs": alts})
        return {"content": content}

    def _completion_logprobs(self, outs: list[TokenOut], offset: int) -> dict:
        toks, lps, tops, offs = [], [], [], []
        for o in outs:
            text, _ = self.pieces(o.token)
            toks.append(text)
            lps.append(o.logprob)
            tops.append({self.pieces(t)[0]: lp for t, lp in o.top or []} if o.top is not None else None)
            offs.append(offset)
            offset += len(text)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def logprobs(self, outs: list[TokenOut], offset: int = 0) -> dict:
        return self._chat_logprobs(outs) if self.kind == "chat" else self._completion_logprobs(outs, offset)

    # -- whole responses
    def final(self, choices: list[Choice], want_logprobs: bool) -> dict:
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            lp = self.logprobs(c.tokens) if want_logprobs else None
            text = "".join(c.text)
            if self.kind == "chat":
                (message, tools_text), finish = self._message(c.index, text), c.finish_reason
                calls = []
                if self.tool_format:  # Kimi K3's tools section comes apart from the content, markup included
                    content, calls = tools.split(self.tool_format, (message["content"] or "") + tools_text)
                if calls:
                    message = {**message, "content": content or None,
                               "tool_calls": [call.openai() for call in calls]}
                    finish = "tool_calls"
                out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        body["choices"] = out
        body["usage"] = usage(sum(c.prompt_tokens for c in choices), sum(c.completion_tokens for c in choices),
                              sum(c.cached_tokens for c in choices))
        return body

    def _message(self, index: int, text: str) -> tuple[dict, str]:
        """The assistant message of one choice, and the tools section the splitter took out of it."""
        if not self.splitters:
            return {"role": "assistant", "content": text}, ""
        sp = self.splitters[index]
        parts = split_all(sp, text)
        msg = {"role": "assistant", "content": parts.content}
        if sp.reasons:
            msg["reasoning_content"] = parts.reasoning
        return msg, parts.tools

    def _delta(self, index: int, out: TokenOut) -> dict:
        if not self.splitters:
            return {"content": out.text} if out.text else {}
        sp = self.splitters[index]
        parts = sp.feed(out.text)
        if out.finish_reason:
            parts += sp.flush()
        delta = {"reasoning_content": parts.reasoning} if parts.reasoning else {}
        return delta | ({"content": parts.content} if parts.content else {})

    # -- stream chunks
    def chunk(self, index: int, out: TokenOut, want_logprobs: bool, offset: int = 0) -> dict | None:
        """The chunk for one token; None when it carries nothing (held-back text, no log-probabilities)."""
        lp_outs = [out] if want_logprobs and out.logprob is not None and out.token not in self.stop_ids else []
        if not out.text and not lp_outs and not out.finish_reason:
            return None
        lp = self.logprobs(lp_outs, offset) if lp_outs else None
        if self.kind == "chat":
            delta = self._delta(index, out)
            if not delta and not lp_outs and not out.finish_reason:
                return None
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def tool_chunk(self, index: int, calls: list[tools.Call]) -> dict:
        """The calls of one choice, whole, in one delta (the stream's last for that choice)."""
        delta = {"tool_calls": [{"index": k, **call.openai()} for k, call in enumerate(calls)]}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": "tool_calls"}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def role_chunk(self, index: int) -> dict:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, prompt: int, completion: int, cached: int = 0) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt, completion, cached)}


class ToolStream:
    """A streamed choice that may call tools: its text passes as content until the format's start marker;
    from there it is held to the end, then sent as tool calls (or as text, if it parses as none)."""

    def __init__(self, fmt: str):
        self.fmt, self.mark = fmt, tools.START[fmt]
        self.held, self.open = "", False

    def feed(self, text: str) -> str:
        """New text -> the part that can be shown now."""
        if self.open:
            self.held += text
            return ""
        buf = self.held + text
        at = buf.find(self.mark)
        if at >= 0:
            self.open, self.held = True, buf[at:]
            return buf[:at]
        k = max((k for k in range(1, len(self.mark)) if buf.endswith(self.mark[:k])), default=0)
        self.held = buf[len(buf) - k:] if k else ""
        return buf[: len(buf) - k]

    def finish(self) -> tuple[str, list[tools.Call]]:
        """(text still to show, the calls) at the end of the choice."""
        held, self.held = self.held, ""
        if not self.open:
            return held, []
        _, calls = tools.split(self.fmt, held)
        return ("", calls) if calls else (held, [])
