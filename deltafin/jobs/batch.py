"""``deltafin batch``: many prompts, prefilled together in groups (shared expert reads), decoded together.

Input: JSONL records {"id", "prompt"} or {"id", "messages"} with optional max_tokens, temperature,
top_p, seed, stop. Output: one JSONL line per id, appended durably as each finishes, so a re-run skips
what is done and an interruption loses only the records in flight. A record that cannot run (prompt
longer than the context, chat template refusing the messages) gets an "error" line and the job goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deltafin.errors import UsageError
from deltafin.jobs.records import Record, messages, opt_float, opt_int, opt_stops, read_jsonl
from deltafin.jobs.results import ResultLog
from deltafin.runtime.batched import BatchDecoder, GenSpec, Seq
from deltafin.runtime.sampling import SEED_MAX, SamplingParams

FIELDS = ("id", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop")


@dataclass(frozen=True, slots=True)
class Defaults:
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchItem:
    rec: Record
    prompt: str | None
    messages: list | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]


def load_batch(path: str, d: Defaults) -> list[BatchItem]:
    """Every record checked before any work starts (a bad one names its line and field)."""
    items = []
    for rec in read_jsonl(path, FIELDS):
        f = rec.fields
        if ("prompt" in f) == ("messages" in f):
            raise UsageError(f"{path} line {rec.line}: give exactly one of \"prompt\" or \"messages\"")
        prompt = f.get("prompt")
        if "prompt" in f and (not isinstance(prompt, str) or not prompt):
            raise UsageError(f"{path} line {rec.line}: field 'prompt' must be a non-empty string, got {prompt!r}")
        msgs = messages(rec, path) if "messages" in f else None
        p = d.sampling
        temp = opt_float(rec, path, "temperature", 0.0, 2.0)
        top_p = opt_float(rec, path, "top_p", 0.0, 1.0, lo_open=True)
        seed = opt_int(rec, path, "seed", 0, SEED_MAX)
        sampling = SamplingParams(p.temperature if temp is None else temp, p.top_p if top_p is None else top_p,
                                  p.top_k, p.seed if seed is None else seed)
        stops = opt_stops(rec, path)
        max_tokens = opt_int(rec, path, "max_tokens", 1)
        items.append(BatchItem(rec, prompt, msgs, d.max_tokens if max_tokens is None else max_tokens, sampling,
                               d.stop if stops is None else stops))
    return items


@dataclass
class BatchSummary:
    records: int = 0
    skipped: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    per_drive: dict = field(default_factory=dict)
    repaired_bytes: int = 0

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / max(self.prompt_tokens + self.generated_tokens, 1)

    def to_json(self) -> dict:
        return {**self.__dict__, "tok_s": self.tok_s, "bytes_read_per_token": self.bytes_per_token}

    def line(self) -> str:
        drives = ", ".join(f"{k} {size(v['bytes'])}" for k, v in self.per_drive.items())
        return (f"{self.records} records ({self.skipped} already done, {self.errors} errors): "
                f"{self.generated_tokens} tokens generated in {self.seconds:.1f} s = {self.tok_s:.2f} tok/s; "
                f"{self.prompt_tokens} prompt tokens; read {size(self.bytes_read)} "
                f"({size(self.bytes_per_token)} per prompt or generated token; {drives})")


def size(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


class BatchRun:
    def __init__(self, engine, out: ResultLog, batch_size: int, progress=None):
        if batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
        self.engine, self.out, self.batch_size, self.progress = engine, out, batch_size, progress
        self.dec = BatchDecoder(engine)
        self.summary = BatchSummary()

    def run(self, items: list[BatchItem]) -> BatchSummary:
        todo = [it for it in items if not self.out.has(it.rec.key)]
        s = self.summary
        s.records, s.skipped, s.repaired_bytes = len(items), len(items) - len(todo), self.out.repaired_bytes
        src = self.engine.source
        bytes0, drives0 = src.stats.bytes_read, src.per_drive()
        t0 = time.perf_counter()
        for i in range(0, len(todo), self.batch_size):
            self._group(todo[i : i + self.batch_size])
        s.seconds = time.perf_counter() - t0
        s.bytes_read = src.stats.bytes_read - bytes0
        s.per_drive = {k: {"bytes": v["bytes"] - drives0[k]["bytes"], "reads": v["reads"] - drives0[k]["reads"]}
                       for k, v in src.per_drive().items()}
        s.prompt_tokens, s.generated_tokens = self.dec.counters.prompt_tokens, self.dec.counters.generated_tokens
        return s

    def _spec(self, it: BatchItem) -> GenSpec:
        codec = self.engine.codec
        if codec is None:
            raise UsageError("this model has no tokenizer files, so text prompts cannot be encoded")
        try:
            ids = codec.chat(it.messages) if it.messages is not None else codec.encode(it.prompt)
        except UsageError:
            raise
        except Exception as e:  # the chat template refused these messages, or the tokenizer the text
            what = "the chat template rejected the messages" if it.messages is not None else "cannot encode the prompt"
            raise UsageError(f"{what}: {e}") from None
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        room = self.engine.opts.max_len - len(ids) + 1  # the last token needs no forward pass
        if room < 1:
            raise UsageError(f"the prompt has {len(ids)} tokens; the context limit is {self.engine.opts.max_len} "
                             f"(--max-len); shorten it")
        return GenSpec(tuple(ids), min(it.max_tokens, room), it.sampling, it.stop)

    def _error(self, it: BatchItem, msg: str) -> None:
        self.summary.errors += 1
        self.out.append({"id": it.rec.id, "error": msg})
        self._tick()

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress.update(1)
            c = self.dec.counters
            self.progress.set_postfix_str(f"{c.generated_tokens / max(c.prefill_s + c.decode_s, 1e-9):.2f} tok/s",
                                          refresh=False)

    def _group(self, group: list[BatchItem]) -> None:
        seqs: list[Seq] = []
        for it in group:
            try:
                seqs.append(Seq(self._spec(it), it))
            except UsageError as e:
                self._error(it, str(e))
        for s, e in self.dec.prefill(seqs):
            if not isinstance(e, UsageError):
                raise e  # a read error or a bug: stop the job; what is written stays, a re-run resumes
            self._error(s.tag, str(e))
        active = [s for s in seqs if s.state is not None]
        while active:
            for out in self.dec.sample(active):
                if out.finish_reason:
                    self._done(out.seq)
            active = [s for s in active if not s.done]
            self.dec.advance(active)

    def _done(self, s: Seq) -> None:
        it: BatchItem = s.tag
        self.out.append({"id": it.rec.id, "text": self.dec.final_text(s), "finish_reason": s.finish_reason,
                         "prompt_tokens": len(s.spec.prompt), "completion_tokens": len(s.emitted)})
        s.state = s.logits = None  # free the KV cache now
        self._tick()
