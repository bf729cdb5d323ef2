"""An append-only results file that survives crashes: one record per line, JSONL or CSV.

Each record is one ``os.write`` of a whole line on an ``O_APPEND`` descriptor, then ``fsync``: a crash can
leave at most one partial last line, never a torn earlier one. On open, a partial last line is cut away
(and reported); every complete line's id counts as done, so a re-run skips it.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import logging
import os
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
        from deltafin.jobs.files import check_output

        check_output(path, [])  # a terminal, FIFO or device would hang, flood or swallow the resume read
        self._recover()
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"{path}: cannot open the output file for appending ({e.strerror or e})") from None
        if fmt == "csv" and not self._had_header:
            self._write(_csv_line(columns))

    def _recover(self) -> None:
        """Ids already written, read a line at a time; a partial last line is cut away first."""
        from deltafin.jobs.files import lines as file_lines

        self._had_header = False
        if not os.path.exists(self.path):
            return
        try:
            with open(self.path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                cut = size
                while cut > 0:  # back to the last newline, a block at a time
                    start = max(0, cut - (1 << 16))
                    f.seek(start)
                    block = f.read(cut - start)
                    at = block.rfind(b"\n")
                    if at >= 0:
                        cut = start + at + 1
                        break
                    cut = start
                if cut < size:
                    self.repaired_bytes = size - cut
                    f.truncate(cut)
                    f.flush()
                    os.fsync(f.fileno())
                    log.warning("%s: removed a partial last line (%d bytes) left by an interrupted run",
                                self.path, self.repaired_bytes)
        except OSError as e:
            raise UsageError(f"{self.path}: cannot read the output file to resume ({e.strerror or e})") from None
        lines = (raw.decode("utf-8", errors="replace") for _n, _off, raw in file_lines(self.path, "output file"))
        if self.fmt == "csv":
            self._load_csv(lines)
        else:
            self._load_jsonl(lines)

    def _load_jsonl(self, lines) -> None:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self.done.add(str(rec["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError(f"{self.path} line {n}: not a result record with an \"id\"; is this the right "
                                 f"output file? (it is left as it is)") from None

    def _load_csv(self, lines) -> None:
        rows = csv.reader(lines)
        head = next(rows, None)
        if head is None:
            return
        if head != self.columns:
            raise UsageError(f"{self.path}: its columns {head[:20]} differ from this run's {self.columns} "
                             f"(other labels?); write to a new file")
        self._had_header = True
        self.done.update(r[0] for r in rows if r)

    def _write(self, line: bytes) -> None:
        try:
            n = os.write(self.fd, line)
            if n != len(line):  # a short write to a file means the disk is full; the next start cuts it away
                raise OSError(errno.ENOSPC, f"short write ({n} of {len(line)} bytes)")
            if not self.stdout:
                os.fsync(self.fd)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise UsageError(f"{self.path}: cannot write the results ({e.strerror or e}); free space (or fix the "
                             f"output) and re-run the same command: records already written are kept and "
                             f"skipped") from None

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
