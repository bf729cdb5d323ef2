"""An append-only results file that survives crashes: one record per line, JSONL or CSV.

Each record is one ``os.write`` of a whole line on an ``O_APPEND`` descriptor, then ``fsync``: a crash can
leave at most one partial last line, never a torn earlier one. On open, a partial last line is cut away
(and reported); every complete line's id counts as done, so a re-run skips it.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import stat
import sys

from deltafin.errors import UsageError

log = logging.getLogger(__name__)


def _cell(v) -> str:
    # one record per line, always: newlines inside fields would defeat the partial-line repair
    return "" if v is None else str(v).replace("\r", " ").replace("\n", " ")


def _csv_line(values: list) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([_cell(v) for v in values])
    return buf.getvalue().encode("utf-8")


class ResultLog:
    """``fmt`` "jsonl" (records are dicts with "id") or "csv" (``columns``, first one "id")."""

    def __init__(self, path: str, fmt: str = "jsonl", columns: list[str] | None = None):
        assert fmt in ("jsonl", "csv") and (fmt == "jsonl" or columns and columns[0] == "id")
        self.path, self.fmt, self.columns = path, fmt, columns
        self.done: set[str] = set()
        self.repaired_bytes = 0
        self.stdout = path == "-"
        if self.stdout:
            self.fd = sys.stdout.fileno()
            if fmt == "csv":
                self._write(_csv_line(columns))
            return
        try:
            if stat.S_ISFIFO(os.stat(path).st_mode):  # reading it back to resume would wait for a writer forever
                raise UsageError(f"{path}: the output is a FIFO; give a regular file (or '-' for stdout)")
        except OSError:
            pass
        self._recover()
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"{path}: cannot open the output file for appending ({e.strerror or e})") from None
        if fmt == "csv" and not self._had_header:
            self._write(_csv_line(columns))

    def _recover(self) -> None:
        self._had_header = False
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            raise UsageError(f"{self.path}: cannot read the output file to resume ({e.strerror or e})") from None
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            self.repaired_bytes = len(data) - cut
            with open(self.path, "r+b") as f:
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())
            data = data[:cut]
            log.warning("%s: removed a partial last line (%d bytes) left by an interrupted run",
                        self.path, self.repaired_bytes)
        lines = data.decode("utf-8", errors="replace").split("\n")[:-1] if data else []
        if self.fmt == "csv":
            self._load_csv(lines)
        else:
            self._load_jsonl(lines)

    def _load_jsonl(self, lines: list[str]) -> None:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self.done.add(str(rec["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError(f"{self.path} line {n}: not a result record with an \"id\"; is this the right "
                                 f"output file? (it is left as it is)") from None

    def _load_csv(self, lines: list[str]) -> None:
        if not lines:
            return
        rows = list(csv.reader(lines))
        if rows[0] != self.columns:
            raise UsageError(f"{self.path}: its columns {rows[0]} differ from this run's {self.columns} "
                             f"(other labels?); write to a new file")
        self._had_header = True
        self.done.update(r[0] for r in rows[1:] if r)

    def _write(self, line: bytes) -> None:
        n = os.write(self.fd, line)
        if n != len(line):  # a short write to a file means the disk is full; the next start cuts it away
            raise OSError(f"{self.path}: short write ({n} of {len(line)} bytes); is the disk full?")
        if not self.stdout:
            os.fsync(self.fd)

    def key_of(self, key: str) -> str:
        """``key`` as it reads back from this file (CSV cells hold no newlines)."""
        return _cell(key) if self.fmt == "csv" else key

    def has(self, key: str) -> bool:
        """Whether the record with this id (as ``str(id)``) is already written."""
        return (_cell(key) if self.fmt == "csv" else key) in self.done

    def append(self, rec: dict) -> None:
        """Write one result durably; ``rec["id"]`` is then done."""
        if self.fmt == "jsonl":
            line = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
        else:
            line = _csv_line([rec.get(c) for c in self.columns])
        self._write(line)
        self.done.add(_cell(rec["id"]) if self.fmt == "csv" else str(rec["id"]))

    def close(self) -> None:
        if not self.stdout:
            os.close(self.fd)
