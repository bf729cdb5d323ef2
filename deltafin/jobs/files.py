"""Job inputs and outputs are regular files (or ``-`` for stdout), read a bounded amount at a time.

A terminal, a FIFO or a device (``/dev/stdout`` on a terminal, ``/dev/zero``, ``/dev/full``, ``/dev/null``)
given as an input or an output would hang, stream without end, or swallow the results: each is refused
with one line before any work. So is an output that is one of the inputs (a link to it included) or lies
inside the input folder, where it would be read back as an input or its lines taken for done work.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

from deltafin.errors import UsageError

MAX_LINE_BYTES = 64 << 20  # one JSONL record: far beyond any context's text
BLOCK = 1 << 20


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, what: str) -> int:
    """A read descriptor on ``path``, opened without blocking and checked to be a regular file (so a FIFO or
    device put in its place cannot hang or flood the reader)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UsageError(f"{path}: not a regular file ({kind(mode)}); the {what} must be a file")
    return fd


def read_regular(path: str, cap: int, what: str) -> bytes:
    """The whole of a regular file of at most ``cap`` bytes."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > cap:
            raise UsageError(f"{path}: {size:,} bytes, over the {cap:,} a {what} may have; give a smaller file")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise UsageError(f"{path}: over the {cap:,} bytes a {what} may have; give a smaller file")
    return data


def lines(path: str, what: str = "input file") -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, bytes) of each line of a regular file, one line in memory at a time."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        offset = 0
        for n in range(1, 1 << 62):
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise UsageError(f"{path} line {n}: longer than {MAX_LINE_BYTES >> 20} MiB; one record per line, "
                                 f"each of a usual size")
            yield n, offset, raw.rstrip(b"\n")
            offset += len(raw)


def check_output(path: str, inputs: list[str], what: str = "output") -> None:
    """``path`` may be written: '-', a new file in an existing folder, or a regular file; never an input."""
    if path == "-":
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise UsageError(f"{path}: the folder {parent} does not exist; create it or write elsewhere") from None
        st = None
    except OSError as e:
        raise UsageError(f"{path}: cannot use the {what} ({e.strerror or e})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path}: the {what} is {kind(st.st_mode)}, not a regular file; give a file (or '-' for "
                         f"stdout)")
    real = os.path.realpath(path)
    for src in inputs:
        if os.path.isdir(src):
            top = os.path.realpath(src)
            if os.path.commonpath([top, real]) == top:
                raise UsageError(f"{path}: the {what} is inside the input folder {src}, where it would be read as "
                                 f"an input; write it elsewhere")
        elif os.path.exists(src) and (real == os.path.realpath(src) or (st is not None and os.path.samefile(path, src))):
            raise UsageError(f"{path}: the {what} is the input file {src} (or a link to it); write to another file")
