"""``deltafin classify``: the probability of each label as the model's next tokens after an input.

Inputs are prefilled together in groups (``Engine.prefill``: each routed expert read once per group).
A label of one token is scored from the next-token distribution; a label of several tokens is scored as
the product of its tokens' conditional probabilities: its tokens but the last run on copies of the
input's state, all (input, label) copies of a group in one batched pass. Probabilities are reported raw
(under the whole vocabulary) and normalised over the label set. An input that cannot be scored (longer
than the context, unreadable, empty) gets an "error" entry and the job goes on.

A folder's special files (FIFOs, sockets, devices, also behind symlinks) are skipped with a note: reading
one could block forever or never end. A file name that is not UTF-8 becomes an id with the bad bytes
escaped (``bad\xff.txt``); a symlink loop or a dangling link is an input with an error.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import time
from dataclasses import dataclass

import torch

from deltafin.errors import UsageError
from deltafin.jobs.batch import size
from deltafin.jobs.files import kind as _kind
from deltafin.jobs.records import iter_jsonl
from deltafin.jobs.results import ResultLog

log = logging.getLogger(__name__)
MAX_INPUT_BYTES = 64 << 20  # far beyond any context; keeps one stray huge file from exhausting memory


@dataclass(frozen=True, slots=True)
class Item:
    key: str
    id: str | int
    text: str | None
    error: str | None = None
    path: str | None = None  # read when its batch comes (a file, or the JSONL file the record is in)
    offset: int | None = None  # the record's line in a JSONL file


MAX_BYTES_PER_TOKEN = 64  # no tokenizer's token is longer: more bytes than this per context token cannot fit


def read_cap(max_len: int) -> int:
    """Bytes of one input read at most: what a context of ``max_len`` tokens could hold."""
    return min(MAX_INPUT_BYTES, max(max_len, 1) * MAX_BYTES_PER_TOKEN)


def load_text(it: Item, cap: int) -> tuple[str | None, str | None]:
    """(text, None) or (None, why not) for an input read lazily, at most ``cap`` bytes of it."""
    if it.text is not None or it.error is not None or it.path is None:
        return it.text, it.error
    if it.offset is None:
        return _read_text(it.path, cap)
    from deltafin.jobs.files import MAX_LINE_BYTES, open_regular
    from deltafin.jobs.records import parse_line

    with os.fdopen(open_regular(it.path, "input file"), "rb") as f:
        f.seek(it.offset)
        raw = f.readline(MAX_LINE_BYTES + 1)
    rec = parse_line(raw.rstrip(b"\n"), f"{it.path}", ("id", "text"))
    text = rec.get("text")
    if len(text.encode("utf-8", "surrogatepass")) > cap:
        return None, f"{it.key}: longer than the context could hold ({cap:,} bytes read at most); split it or raise --max-len"
    return text, None


def _read_text(path: str, cap: int = MAX_INPUT_BYTES) -> tuple[str | None, str | None]:
    """(text, None) or (None, why not). Opened without blocking and checked to be a regular file first, so a
    FIFO or a device that takes the place of a file between listing and reading cannot hang the job."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        return None, f"{_shown(path)}: cannot read ({e.strerror or e})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{_shown(path)}: not a regular file ({_kind(st.st_mode)}); inputs must be files"
        if st.st_size > cap:
            return None, (f"{_shown(path)}: {st.st_size:,} bytes, more than the context could hold ({cap:,} bytes "
                          f"read at most); split it or raise --max-len")
        try:
            raw = f.read(cap + 1)
        except OSError as e:
            return None, f"{_shown(path)}: cannot read ({e.strerror or e})"
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"{_shown(path)}: not valid UTF-8 text ({e.reason} at byte {e.start})"


def _shown(name: str) -> str:
    """A file name as text that can be written anywhere: bytes that are not UTF-8 escaped as \\xNN."""
    try:
        raw = name.encode("utf-8", "surrogateescape")  # how os functions decode undecodable bytes
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def _folder_inputs(path: str, skipped: list[str] | None) -> list[Item]:
    items: list[Item] = []
    seen: set[str] = set()
    for root, dirs, files in os.walk(path):  # symlinked folders are not followed: no loops
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            full = os.path.join(root, name)
            rel = _shown(os.path.relpath(full, path))
            try:
                mode = os.stat(full).st_mode
            except OSError as e:  # a dangling symlink or a symlink loop: an input that cannot be read
                why = "a symlink loop" if e.errno == errno.ELOOP else (e.strerror or str(e))
                items.append(Item(rel, rel, None, f"{rel}: cannot read ({why})"))
                continue
            if not stat.S_ISREG(mode):
                note = f"{rel}: skipped, {_kind(mode)}"
                if skipped is not None:
                    skipped.append(note)
                else:
                    log.warning("%s", note)
                continue
            if rel in seen:  # a name whose escaped form equals another file's name
                items.append(Item(rel + "#2", rel + "#2", None, f"{rel}: another input has this name once escaped; "
                                                                  f"rename one of them"))
                continue
            seen.add(rel)
            items.append(Item(rel, rel, None, None, full))  # read when its batch comes
    return items


def gather_inputs(path: str, skipped: list[str] | None = None) -> list[Item]:
    """A folder (each file one input, id = its path inside the folder), a .jsonl file of {"id", "text"},
    or one file (id = its name). A folder's special files are skipped, each with a note in ``skipped``."""
    if os.path.isdir(path):
        items = _folder_inputs(path, skipped)
        if not items:
            raise UsageError(f"{path}: the folder holds no input files; put one input per file there, or pass a file or a .jsonl")
        return items
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such input file or folder; pass a file, a folder of files or a .jsonl of {{\"id\", \"text\"}}")
    from deltafin.jobs.files import open_regular

    if path.endswith(".jsonl"):
        items = []
        for rec in iter_jsonl(path, ("id", "text")):  # every record checked; texts read again per batch
            text = rec.fields.get("text")
            if not isinstance(text, str):
                raise UsageError(f"{path} line {rec.line}: field 'text' must be a string, got {repr(text)[:80]}")
            items.append(Item(rec.key, rec.id, None, None, path, rec.offset))
        return items
    os.close(open_regular(path, "input"))
    name = _shown(os.path.basename(path))
    return [Item(name, name, None, None, path)]


def check_text(value: str, what: str) -> str:
    """``value`` itself, or a UsageError when it cannot be encoded (bytes that are not UTF-8 in argv)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what} {_shown(value)!r}: not valid UTF-8 text (at character {e.start}); "
                         f"give it as UTF-8") from None
    return value


def parse_labels(spec: str) -> list[str]:
    check_text(spec, "--labels")
    labels = [s.strip() for s in spec.split(",")]
    if not spec.strip() or not all(labels):
        raise UsageError(f"--labels {spec!r}: give a comma-separated list of non-empty labels, e.g. yes,no")
    if len(set(labels)) != len(labels):
        raise UsageError(f"--labels {spec!r}: a label is repeated; give each label once, e.g. --labels yes,no")
    return labels


def check_template(template: str) -> str:
    check_text(template, "--template")
    if "{input}" not in template:
        raise UsageError(f"--template {template!r} has no {{input}} placeholder; "
                         f"e.g. --template 'Is this spam?\\n{{input}}\\nAnswer:'")
    return template


class Classifier:
    def __init__(self, engine, labels: list[str], template: str = "{input}", chat: bool = False,
                 label_prefix: str = ""):
        if not labels:
            raise UsageError("the label set is empty; give --labels yes,no")
        if "{input}" not in template:
            raise UsageError(f"--template {template!r} has no {{input}} placeholder; e.g. --template 'Is this spam?\\n{{input}}\\nAnswer:'")
        if engine.codec is None:
            raise UsageError("this model has no tokenizer files, so text inputs and labels cannot be encoded")
        self.engine, self.labels, self.template, self.chat = engine, labels, template, chat
        self.label_ids = [engine.codec.encode(label_prefix + lab) for lab in labels]
        for lab, ids in zip(labels, self.label_ids, strict=True):
            if not ids:
                raise UsageError(f"label {lab!r} encodes to no tokens; use a non-empty label")
        if len({tuple(ids) for ids in self.label_ids}) != len(labels):
            raise UsageError(f"labels {labels} do not all encode to different tokens; choose labels that differ in text (or try --label-prefix ' ')")
        self.longest_label = max(map(len, self.label_ids))

    def prompt(self, text: str) -> list[int]:
        body = self.template.replace("{input}", text)
        codec = self.engine.codec
        return codec.chat([{"role": "user", "content": body}]) if self.chat else codec.prompt_ids(body)

    def check(self, ids: list[int]) -> str | None:
        """Why these prompt ids cannot be scored, or None."""
        if not ids:
            return "the input (with the template) encodes to no tokens"
        need = len(ids) + self.longest_label - 1
        if need > self.engine.opts.max_len:
            return (f"{len(ids)} prompt tokens (+{self.longest_label - 1} label tokens) exceed the context limit "
                    f"of {self.engine.opts.max_len}; raise --max-len or shorten the input")
        return None

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """Log-probability of each label after each prompt: [input][label]."""
        eng = self.engine
        states = [eng.new_state() for _ in prompts]
        logits, _ = eng.prefill(prompts, states)
        first = [torch.log_softmax(lg.float(), -1) for lg in logits]  # [V] each
        out = [[float(lp[ids[0]]) for ids in self.label_ids] for lp in first]
        multi = [(i, j) for i in range(len(prompts)) for j, ids in enumerate(self.label_ids) if len(ids) > 1]
        if multi:
            seqs = [(torch.tensor(self.label_ids[j][:-1], dtype=torch.long, device=eng.device),
                     eng.copy_state(states[i])) for i, j in multi]
            for (i, j), lg in zip(multi, eng.step(seqs, all_logits=True), strict=True):
                lp = torch.log_softmax(lg.float(), -1)  # [m-1, V]: position t predicts label token t+1
                nxt = torch.tensor(self.label_ids[j][1:], device=lp.device)
                out[i][j] += float(lp.gather(1, nxt[:, None]).sum())
        return out

    def result(self, item: Item, logps: list[float]) -> dict:
        top = max(logps)
        z = top + math.log(sum(math.exp(v - top) for v in logps))
        norm = {lab: math.exp(v - z) for lab, v in zip(self.labels, logps, strict=True)}
        raw = {lab: math.exp(v) for lab, v in zip(self.labels, logps, strict=True)}
        return {"id": item.id, "label": self.labels[logps.index(top)], "probs": norm, "raw_probs": raw}


def csv_columns(labels: list[str]) -> list[str]:
    return ["id", "label", *[f"p_{lab}" for lab in labels], *[f"raw_{lab}" for lab in labels], "error"]


def flatten(rec: dict) -> dict:
    """A result record as CSV columns (p_LABEL, raw_LABEL)."""
    flat = {"id": rec["id"], "label": rec.get("label"), "error": rec.get("error")}
    for lab, p in (rec.get("probs") or {}).items():
        flat[f"p_{lab}"] = f"{p:.6g}"
    for lab, p in (rec.get("raw_probs") or {}).items():
        flat[f"raw_{lab}"] = f"{p:.6g}"
    return flat


@dataclass
class ClassifySummary:
    inputs: int = 0
    skipped: int = 0
    errors: int = 0
    scored: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    bytes_read: int = 0

    @property
    def per_hour(self) -> float:
        return self.scored / self.seconds * 3600 if self.seconds else 0.0

    def to_json(self) -> dict:
        return {**self.__dict__, "inputs_per_hour": self.per_hour,
                "bytes_read_per_input": self.bytes_read / max(self.scored, 1)}

    def line(self) -> str:
        return (f"{self.inputs} inputs ({self.skipped} already done, {self.errors} errors): {self.scored} scored "
                f"in {self.seconds:.1f} s = {self.per_hour:,.0f} inputs/hour; {self.prompt_tokens} prompt tokens; "
                f"read {size(self.bytes_read)} ({size(self.bytes_read / max(self.scored, 1))} per input)")


def _check_written_ids(items: list[Item], out: ResultLog) -> None:
    """Two ids that read back the same from the output (CSV turns newlines into spaces) would make a re-run
    skip one of them: refused before any work."""
    seen: dict[str, str] = {}
    for it in items:
        k = out.key_of(it.key)
        if seen.setdefault(k, it.key) != it.key:
            raise UsageError(f"ids {seen[k]!r} and {it.key!r} are the same once written to {out.path} (a CSV cell "
                             f"holds no line breaks); give them ids that differ, or write JSONL")


class ClassifyRun:
    def __init__(self, clf: Classifier, out: ResultLog, batch_size: int, progress=None):
        if batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
        self.clf, self.out, self.batch_size, self.progress = clf, out, batch_size, progress
        self.summary = ClassifySummary()

    def _write(self, rec: dict) -> None:
        self.out.append(rec if self.out.fmt == "jsonl" else flatten(rec))
        if self.progress is not None:
            self.progress.update(1)

    def run(self, items: list[Item]) -> ClassifySummary:
        _check_written_ids(items, self.out)
        s = self.summary
        todo = [it for it in items if not self.out.has(it.key)]
        s.inputs, s.skipped = len(items), len(items) - len(todo)
        src = self.clf.engine.source.stats
        b0, t0 = src.bytes_read, time.perf_counter()
        ready: list[tuple[Item, list[int]]] = []
        cap = read_cap(self.clf.engine.opts.max_len)
        for it in todo:  # one batch of texts in memory at a time, each read at most ``cap`` bytes
            text, err = load_text(it, cap)
            ids, err = (None, err) if err else self._prompt(it, text)
            if err:
                s.errors += 1
                self._write({"id": it.id, "error": err})
                continue
            ready.append((it, ids))
            if len(ready) == self.batch_size:
                self._group(ready)
                ready = []
        if ready:
            self._group(ready)
        s.seconds, s.bytes_read = time.perf_counter() - t0, src.bytes_read - b0
        return s

    def _prompt(self, it: Item, text: str) -> tuple[list[int] | None, str | None]:
        try:
            ids = self.clf.prompt(text)
        except Exception as e:  # a chat template refusing the text
            return None, f"cannot build the prompt: {e}"
        return ids, self.clf.check(ids)

    def _group(self, group: list[tuple[Item, list[int]]]) -> None:
        scores = self.clf.score([ids for _, ids in group])
        self.summary.scored += len(group)
        self.summary.prompt_tokens += sum(len(ids) for _, ids in group)
        for (it, _), lp in zip(group, scores, strict=True):
            self._write(self.clf.result(it, lp))
