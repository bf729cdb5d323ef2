"""Reasoning apart from the answer: generated text split into channels as it streams, markup never shown.

- Kimi K3 (XTML, ../shared/specs/KIMI_K3.md §5.2): a reply is a ``think`` channel (when thinking is on),
  a ``response`` channel and an optional ``tools`` section, each between ``<|open|>NAME ...<|sep|>`` and
  ``<|close|>NAME<|sep|>``, then ``<|end_of_msg|>``. Think text is reasoning, response text is content,
  the tools section is kept whole (markup included) for a tool-call parser; the markup itself is dropped.
- Chat templates with ``<think>`` (Qwen3, DeepSeek-R1 style): text between ``<think>`` and ``</think>``
  is reasoning, the rest content; the prompt may already have opened the tag.
- Anything else: all text is content, with the tokenizer's special-token names removed.

Every splitter holds back a tail that could be the start of a marker until the next text decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.tokenizers.xtml import CLOSE, END_OF_MSG, OPEN, SEP

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Parts:
    reasoning: str = ""
    content: str = ""
    tools: str = ""  # Kimi K3's tools section, markup included

    def __iadd__(self, other: Parts) -> Parts:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tools += other.tools
        return self


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``."""
    longest = max(map(len, markers), default=0)
    tail = text[len(text) - min(len(text), longest - 1) :] if longest > 1 else ""
    starts = {m[0] for m in markers}
    for i, ch in enumerate(tail):  # the earliest start gives the longest candidate
        if ch in starts and any(len(m) > len(tail) - i and m.startswith(tail[i:]) for m in markers):
            return len(tail) - i
    return 0


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, None)


class Plain:
    """All text is content; the names in ``hide`` (special tokens) are removed."""

    reasons = False

    def __init__(self, hide: tuple[str, ...] = ()):
        self.hide = tuple(h for h in hide if h)
        self.buf = ""

    def feed(self, text: str) -> Parts:
        self.buf += text
        for h in self.hide:
            if h in self.buf:
                self.buf = self.buf.replace(h, "")
        keep = partial_tail(self.buf, self.hide)
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        return Parts(content=out)

    def flush(self) -> Parts:
        out, self.buf = self.buf, ""
        return Parts(content=out)


class ThinkTags:
    """``<think>`` ... ``</think>`` is reasoning; the whitespace just after either tag is dropped."""

    reasons = True
    MARKERS = (THINK_OPEN, THINK_CLOSE)

    def __init__(self, open_at_start: bool, hide: tuple[str, ...] = ()):
        self.thinking, self.skip_ws = open_at_start, open_at_start
        self.plain = Plain(tuple(h for h in hide if h not in self.MARKERS))  # removes special-token names first
        self.buf = ""

    def feed(self, text: str) -> Parts:
        self.buf += self.plain.feed(text).content
        out = Parts()
        while True:
            i, m = _earliest(self.buf, self.MARKERS)
            if m is None:
                keep = partial_tail(self.buf, self.MARKERS)
                self._emit(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            self._emit(out, self.buf[:i])
            self.buf = self.buf[i + len(m) :]
            self.thinking, self.skip_ws = m == THINK_OPEN, True

    def _emit(self, out: Parts, text: str) -> None:
        if self.skip_ws:
            text = text.lstrip()
            self.skip_ws = not text
        if self.thinking:
            out.reasoning += text
        else:
            out.content += text

    def flush(self) -> Parts:
        out = Parts()
        self.buf += self.plain.flush().content
        self._emit(out, self.buf)
        self.buf = ""
        return out


class XTMLChannels:
    """Kimi K3's reply channels. ``thinking``: the prompt opened ``think`` (else ``response``)."""

    reasons = True
    MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
    CHANNEL = {"think": "reasoning", "response": "content"}

    def __init__(self, thinking: bool, hide: tuple[str, ...] = ()):
        self.stack = ["message", "think" if thinking else "response"]
        self.tag: str | None = None  # OPEN or CLOSE while reading a tag up to its <|sep|>
        self.plain = Plain(tuple(h for h in hide if h not in self.MARKERS))  # other specials: removed
        self.buf = ""

    def feed(self, text: str) -> Parts:
        self.buf += self.plain.feed(text).content
        out = Parts()
        while self.buf:
            if self.tag is not None:
                j = self.buf.find(SEP)
                if j < 0:
                    break
                self._tag(out, self.tag, self.buf[:j])
                self.buf, self.tag = self.buf[j + len(SEP) :], None
                continue
            i, m = _earliest(self.buf, self.MARKERS)
            if m is None:
                keep = partial_tail(self.buf, self.MARKERS)
                self._emit(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            self._emit(out, self.buf[:i])
            self.buf = self.buf[i + len(m) :]
            if m in (OPEN, CLOSE):
                self.tag = m
            elif m == END_OF_MSG:
                self.stack = []
        return out

    def _tag(self, out: Parts, kind: str, body: str) -> None:
        name = body.split(" ", 1)[0]
        in_tools = "tools" in self.stack
        if kind == OPEN:
            self.stack.append(name)
        elif name in self.stack:  # close the innermost channel of that name (and any left open inside it)
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(name) :]
        if in_tools or "tools" in self.stack:
            out.tools += f"{kind}{body}{SEP}"

    def _emit(self, out: Parts, text: str) -> None:
        if not text or not self.stack:
            return
        if "tools" in self.stack:
            out.tools += text
        elif (field := self.CHANNEL.get(self.stack[-1])) is not None:
            setattr(out, field, getattr(out, field) + text)

    def flush(self) -> Parts:
        out = Parts()
        self.buf += self.plain.flush().content
        if self.tag is None:
            self._emit(out, self.buf)
        self.buf, self.tag = "", None
        return out


def splitter_for(codec, prompt: list[int] | tuple[int, ...], chat: bool):
    """The splitter for a reply to ``prompt``: Kimi K3's channels when the prompt opened one (its chat
    format), ``<think>`` tags for a chat prompt of a template that uses them, else plain text."""
    if codec is None:
        return Plain()
    hide = codec.special_names()
    tail = codec.decode(list(prompt[-24:]))  # enough for the generation prompt even with byte tokens
    if codec.kind == "kimi":
        for channel in ("think", "response"):
            if tail.endswith(f"{OPEN}{channel}{SEP}"):
                return XTMLChannels(channel == "think", hide)
        return Plain(hide)
    if chat and THINK_OPEN in str(getattr(codec.impl, "chat_template", "") or ""):
        return ThinkTags(tail.rstrip().endswith(THINK_OPEN), hide)
    return Plain(hide)


def split_all(splitter, text: str) -> Parts:
    """The whole of ``text`` through a fresh splitter."""
    out = splitter.feed(text)
    out += splitter.flush()
    return out
