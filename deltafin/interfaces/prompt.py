"""Where a prompt comes from (-p TEXT, -p -, -f FILE, piped stdin) and how text flags are read (escapes)."""

from __future__ import annotations

import re
import sys

from deltafin.errors import UsageError

_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|[nrt0\\'\"])")
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "\\": "\\", "'": "'", '"': '"'}


def unescape(s: str) -> str:
    r"""Backslash escapes as a shell user means them: '\n\n' -> two newlines; other text (UTF-8 too) unchanged."""
    def one(m: re.Match) -> str:
        e = m.group(1)
        return _SIMPLE[e] if len(e) == 1 else chr(int(e[1:], 16))

    return _ESCAPE.sub(one, s)


def stop_strings(args) -> tuple[str, ...]:
    return tuple(unescape(s) for s in args.stop)


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"-f {path}: cannot read the prompt file ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"-f {path}: the prompt file is not UTF-8 text; save it as UTF-8") from None


def prompt_text(args, stdin=None) -> str | None:
    """The prompt from -p TEXT, -p - (stdin), -f FILE, or stdin when it is piped; None when none was given."""
    stdin = stdin or sys.stdin
    if args.prompt is not None and args.file is not None:
        raise UsageError("give the prompt once: -p TEXT or -f FILE, not both")
    if args.file is not None:
        return _read_file(args.file) if args.file != "-" else stdin.read()
    if args.prompt == "-":
        return stdin.read()
    if args.prompt is None and not args.prompt_ids and not _isatty(stdin):
        try:
            return stdin.read() or None
        except (OSError, ValueError):  # stdin closed or not readable (e.g. under a test runner)
            return None
    return args.prompt


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False
