"""Reading job inputs: JSONL records with ids, checked line by line before any work starts.

Every problem names the file, the line and the field: invalid JSON (numbers too long to read and nesting
too deep included), a line that is not an object, an unknown field, a missing or ill-typed id, a duplicate
id (with the line of the first), text that is not valid Unicode (a lone surrogate such as "\ud800", which
JSON escapes allow but no output can hold).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from deltafin.errors import UsageError
from deltafin.jobs.files import lines


@dataclass(frozen=True, slots=True)
class Record:
    key: str  # str(id): the id as it is matched against results already written
    id: str | int
    line: int
    fields: dict
    offset: int = 0  # byte offset of the record's line in its file


def read_jsonl(path: str, allowed: tuple[str, ...]) -> list[Record]:
    """Records of a JSONL file (blank lines skipped). Each needs an "id" (string or integer)."""
    return list(iter_jsonl(path, allowed))


def iter_jsonl(path: str, allowed: tuple[str, ...], keep_fields: bool = True) -> Iterator[Record]:
    """``read_jsonl`` one line at a time (the file must be a regular file); ``keep_fields=False`` checks every
    record but keeps only its id and where it is (``offset``), for inputs read again in batches."""
    first: dict[str, int] = {}
    for n, offset, raw in lines(path):
        if not raw.strip():
            continue
        rec = parse_line(raw, f"{path} line {n}", allowed)
        rid = rec.get("id")
        key = str(rid)
        if key in first:
            raise UsageError(f"{path} line {n}: duplicate id {rid!r} (first on line {first[key]}); ids must be unique")
        first[key] = n
        yield Record(key, rid, n, rec if keep_fields else {}, offset)


def parse_line(raw: bytes, where: str, allowed: tuple[str, ...]) -> dict:
    """One JSONL record, checked: an object of allowed fields, Unicode text, a usable id."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise UsageError(f"{where}: invalid JSON ({str(e).split(';')[0]})") from None
    except RecursionError:
        raise UsageError(f"{where}: invalid JSON (nested too deeply to read); flatten the record") from None
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for k in rec:
        if k not in allowed:
            raise UsageError(f"{where}: unknown field {k[:80]!r} (allowed: {', '.join(allowed)})")
    bad = _not_unicode(rec)
    if bad is not None:
        raise UsageError(f"{where}: field {bad[0][:80]!r} holds a lone surrogate (U+{bad[1]:04X}), which is not valid "
                         f"Unicode text and cannot be written out; fix the text on that line")
    rid = rec.get("id")
    if isinstance(rid, bool) or not isinstance(rid, str | int) or rid == "":
        raise UsageError(f"{where}: \"id\" must be a non-empty string or an integer, got {repr(rid)[:80]}")
    return rec


def _not_unicode(v, field: str | None = None) -> tuple[str, int] | None:
    """(top-level field, code point) of the first string (key or value) in ``v`` holding a lone surrogate."""
    stack = [(field, v)]
    while stack:
        f, x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                return f if f is not None else x.encode("utf-8", "backslashreplace").decode(), ord(x[e.start])
        elif isinstance(x, dict):
            stack += [(k if f is None else f, k) for k in x] + [(k if f is None else f, y) for k, y in x.items()]
        elif isinstance(x, list):
            stack += [(f, y) for y in x]
    return None


def field_error(rec: Record, path: str, name: str, what: str) -> UsageError:
    return UsageError(f"{path} line {rec.line}: field {name!r} must be {what}, got {rec.fields.get(name)!r}")


def opt_int(rec: Record, path: str, name: str, lo: int, hi: int | None = None) -> int | None:
    v = rec.fields.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise field_error(rec, path, name, f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
    return v


def opt_float(rec: Record, path: str, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = rec.fields.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise field_error(rec, path, name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def opt_stops(rec: Record, path: str, name: str = "stop") -> tuple[str, ...] | None:
    v = rec.fields.get(name)
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise field_error(rec, path, name, "a non-empty string or a list of non-empty strings")
    return tuple(stops)


def messages(rec: Record, path: str) -> list[dict]:
    v = rec.fields.get("messages")
    ok = isinstance(v, list) and v and all(
        isinstance(m, dict) and set(m) <= {"role", "content", "name"} and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in v)
    if not ok:
        raise field_error(rec, path, "messages", "a non-empty list of {\"role\": str, \"content\": str} objects")
    return [{"role": m["role"], "content": m["content"]} for m in v]
