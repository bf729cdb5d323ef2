"""Several sequences decoded together: one batched step per token, each sequence with its own rules.

Used by the server and by batch jobs. New sequences are prefilled together (``Engine.prefill``: each routed
expert read once for all of their prompt tokens); then every step samples one token per sequence from its
own logits (its own ``Sampler``, stop tokens, stop strings and token limit) and advances all unfinished
sequences by one ``Engine.forward_batch`` pass, so each routed expert is read once per step for all of them.
Greedy tokens equal ``Engine.generate`` on the sequence alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from deltafin.models.base import SequenceState
from deltafin.runtime.sampling import Sampler, SamplingParams
from deltafin.runtime.stops import StopMatcher


@dataclass(frozen=True, slots=True)
class GenSpec:
    """What one sequence asks for. ``top_logprobs``: None for no log-probabilities, else how many
    alternatives to report per token (0: only the chosen token's). ``grammar``: a compiled constraint
    (``runtime.grammar.Compiled``) the tokens must keep to, or None."""

    prompt: tuple[int, ...]
    max_new: int
    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple[str, ...] = ()
    top_logprobs: int | None = None
    grammar: object | None = None

    def __post_init__(self) -> None:
        assert self.prompt, "a prompt needs at least one token"
        assert self.max_new >= 1, f"max_new must be >= 1, got {self.max_new}"


class StopText:
    """Text released to the reader: stop strings cut it, and a tail that could begin a stop string is held
    back until it cannot (so a streamed reply never shows part of a stop string). Per token it costs time
    linear in the new characters (``StopMatcher``)."""

    def __init__(self, stops: tuple[str, ...]):
        self.match = StopMatcher(stops)
        self.stops = self.match.stops
        self.text = ""
        self.sent = 0

    def update(self, text: str) -> tuple[str, bool]:
        """``text``: everything decoded so far -> (new text to release, whether a stop string was hit)."""
        hit = self.match.feed(text)
        if hit is not None:
            self.text = text[:hit]
            return self._release(len(self.text)), True
        self.text = text
        return self._release(len(text) - self.match.held), False

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out


@dataclass
class TokenOut:
    """One sampled token of one sequence: the text it releases, its log-probabilities if asked."""

    seq: Seq
    token: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" (stop token or string) or "length"; None while running


@dataclass(eq=False)
class Seq:
    spec: GenSpec
    tag: object = None  # the caller's handle (request, record)
    state: SequenceState | None = None
    logits: torch.Tensor | None = None  # next-token logits [V]
    emitted: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sampler: Sampler | None = None
    stop: StopText | None = None
    content: list[int] = field(default_factory=list)  # emitted minus stop tokens
    cached: int = 0  # prompt tokens restored from the prompt cache instead of prefilled

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class DecodeCounters:
    prompt_tokens: int = 0  # prefilled (prompt tokens restored from the prompt cache are not counted)
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0


class BatchDecoder:
    """Prefill, sample and advance lists of ``Seq`` on one engine (call from the thread that owns it).
    With a ``PromptCache``, each prompt resumes the longest cached state it may and finished sequences
    are stored (``deltafin.runtime.prompt_cache``)."""

    def __init__(self, engine, codec_lock=None, prompt_cache=None):
        self.engine = engine
        self.codec_lock = codec_lock
        self.prompt_cache = prompt_cache
        self.counters = DecodeCounters()

    def prefill(self, seqs: list[Seq]) -> list[tuple[Seq, Exception]]:
        """Prefill new sequences together. If that fails, each is retried alone on a fresh state so one
        bad sequence cannot fail the others; returns the sequences that failed, with their errors."""
        if not seqs:
            return []
        try:
            self._prefill(seqs)
            return []
        except Exception as e:
            if len(seqs) == 1:
                return [(seqs[0], e)]
        failed = []
        for s in seqs:
            try:
                self._prefill([s])
            except Exception as e:
                failed.append((s, e))
        return failed

    def _prefill(self, seqs: list[Seq]) -> None:
        t0 = time.perf_counter()
        states = [self.engine.new_state() for _ in seqs]
        ready: dict[int, torch.Tensor] = {}
        pc = self.prompt_cache
        for j, (s, st) in enumerate(zip(seqs, states, strict=True)):
            s.cached, lg = pc.resume(s.spec.prompt, st) if pc is not None else (0, None)
            if lg is not None:
                ready[j] = lg.to(self.engine.device)
        todo = [j for j in range(len(seqs)) if j not in ready]
        stops = {j: self._stops(seqs[j], states[j]) for j in todo}
        while live := [j for j in todo if stops[j]]:  # one shared prefill per round; rounds end at turn boundaries
            logits, _ = self.engine.prefill([list(seqs[j].spec.prompt[states[j].pos : stops[j][0]]) for j in live],
                                            [states[j] for j in live])
            for j, lg in zip(live, logits, strict=True):
                if stops[j].pop(0) < len(seqs[j].spec.prompt):
                    pc.store(seqs[j].spec.prompt[: states[j].pos], states[j], lg)
                else:
                    ready[j] = lg
        for j, (s, st) in enumerate(zip(seqs, states, strict=True)):
            s.state, s.logits = st, ready[j]
            constraint = s.spec.grammar.constraint() if s.spec.grammar is not None else None
            s.sampler = Sampler(s.spec.sampling, s.spec.prompt, constraint)
            s.stop = StopText(s.spec.stop_strings)
        if pc is not None and not pc.cuttable_state(states[0]):  # recurrent state: keep each prompt's end too
            for j in todo:
                pc.store(seqs[j].spec.prompt, states[j], ready[j])
        self.counters.prompt_tokens += sum(len(s.spec.prompt) - s.cached for s in seqs)
        self.counters.cached_tokens += sum(s.cached for s in seqs)
        self.counters.prefill_s += time.perf_counter() - t0

    def _stops(self, s: Seq, state) -> list[int]:
        """Where a prefill pauses: recurrent state (no cut-back) is stored at the turn boundary before the
        prompt's last message (just after the next-to-last end-of-message token), so a conversation whose
        last message changes, or a shared system prompt, resumes there; then the prompt's end."""
        P = len(s.spec.prompt)
        if self.prompt_cache is None or self.prompt_cache.cuttable_state(state):
            return [P]
        eos = set(self.engine.eos_ids)
        marks = [i + 1 for i in range(s.cached, P - 1) if s.spec.prompt[i] in eos]
        return [*marks[-2:-1], P]

    def sample(self, seqs: list[Seq]) -> list[TokenOut]:
        """One token per sequence from its current logits; sets ``finish_reason`` on those that end."""
        return [self._sample_one(s) for s in seqs]

    def _sample_one(self, s: Seq) -> TokenOut:
        assert s.logits is not None and not s.done
        lg = s.logits
        tok = s.sampler(lg)
        s.emitted.append(tok)
        self.counters.generated_tokens += 1
        out = TokenOut(s, tok, "")
        if s.spec.top_logprobs is not None:
            lp = torch.log_softmax(lg.float(), dim=-1)  # the model's own distribution (temperature 1)
            out.logprob = float(lp[tok])
            if s.spec.top_logprobs:
                v, i = torch.topk(lp, min(s.spec.top_logprobs, lp.numel()))
                out.top = list(zip(i.tolist(), v.tolist(), strict=True))
        if tok in self.engine.eos_ids:
            s.finish_reason = "stop"
            out.text, _ = s.stop.update(self._decode(s.content, partial_ok=True)) if s.content else ("", False)
        else:
            s.content.append(tok)
            last = len(s.emitted) >= s.spec.max_new
            out.text, hit = s.stop.update(self._decode(s.content, partial_ok=last))
            if hit:
                s.finish_reason = "stop"
            elif last:
                s.finish_reason = "length"
        if s.done:
            out.text += s.stop.flush()
            if self.prompt_cache is not None:  # the state has consumed the prompt and all but the last token
                self.prompt_cache.store(s.spec.prompt + tuple(s.emitted[:-1]), s.state, s.logits)
        out.finish_reason = s.finish_reason
        return out

    def _decode(self, ids: list[int], partial_ok: bool) -> str:
        codec = self.engine.codec
        if codec is None:
            return ""
        if self.codec_lock is None:
            text = codec.decode(ids)
        else:
            with self.codec_lock:
                text = codec.decode(ids)
        # hold back a split UTF-8 character until its next bytes arrive (the last token releases all)
        return text if partial_ok else text.rstrip("\ufffd")

    def advance(self, seqs: list[Seq]) -> None:
        """Feed each unfinished sequence its last token, all in one batched pass."""
        live = [s for s in seqs if not s.done]
        if not live:
            return
        t0 = time.perf_counter()
        out = self.engine.forward_batch([([s.emitted[-1]], s.state) for s in live])
        for s, lg in zip(live, out, strict=True):
            s.logits = lg
        self.counters.decode_s += time.perf_counter() - t0
        self.counters.steps += 1

    def final_text(self, s: Seq) -> str:
        """The whole released text of a finished sequence (cut at a stop string)."""
        return s.stop.text if s.stop else ""


def new_seqs(specs: list[GenSpec], tags: list | None = None) -> list[Seq]:
    return [Seq(sp, tag) for sp, tag in zip(specs, tags or [None] * len(specs), strict=True)]
