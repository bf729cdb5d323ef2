"""Advisory file locks: one writer per model folder (``pack``, ``place``, ``rm``), one per job output
(``batch``, ``classify``), and readers of a model's layout generation (``run``, ``serve``, ``verify``).

Writer locks are ``flock`` locks on a lock file (the model folder's ``.deltafin.lock``, or
``.<output name>.deltafin-lock`` beside a job's output): the kernel drops them when the holder exits,
crashed or not, so a stale lock never blocks anyone. The file holds the holder's pid and command, for
the message a second writer gets.

Reader locks are POSIX record locks (``lockf``) on ``.deltafin-gen-<N>.lock``, one file per layout
generation of the manifest. ``place`` takes the old generation's lock exclusively before it deletes
the old layout's files, so it waits for every reader still on it (a server moves to the new generation
between two steps). POSIX locks belong to the process, so a reader and a writer in one process (a
server reloading its own layout, a test) never wait on each other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time

from deltafin.errors import DeltafinError

LOCK = ".deltafin.lock"


class LockedError(DeltafinError):
    """Another process holds the lock (names it and what to do)."""


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(400).strip()
    except OSError:
        text = ""
    return f" ({text[:200]})" if text else ""


class WriterLock:
    """``flock`` held on ``path`` until ``release()`` or the process ends. ``what``/``fix`` word the
    refusal: ``{path's folder} is being written by another deltafin {what}; {fix}``."""

    def __init__(self, path: str, what: str, fix: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise LockedError(f"{path}: cannot create the lock file ({e.strerror}); check that its folder is "
                              f"writable") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise LockedError(f"{what} is in use by another deltafin process{_holder(path)}; {fix}") from None
        me = f"pid {os.getpid()}: deltafin {' '.join(os.path.basename(a) for a in sys.argv[1:3])}".strip()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, me.encode()[:200], 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> WriterLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def model_lock(model_dir: str, command: str) -> WriterLock:
    """The one-writer lock of a model folder (created if missing)."""
    os.makedirs(model_dir, exist_ok=True)
    return WriterLock(os.path.join(model_dir, LOCK), f"model folder {model_dir}",
                      f"wait for it to finish before 'deltafin {command}' (a crashed one holds nothing)")


def output_lock(output: str, command: str) -> WriterLock | None:
    """The one-writer lock of a job's output file (None for stdout)."""
    if output == "-":
        return None
    folder, name = os.path.split(os.path.abspath(output))
    return WriterLock(os.path.join(folder, f".{name}.deltafin-lock"), f"output {output}",
                      f"wait for that 'deltafin {command}' to finish, or write to another file")


def gen_lock_path(model_dir: str, generation: int) -> str:
    return os.path.join(model_dir, f".deltafin-gen-{int(generation)}.lock")


class ReaderLock:
    """A shared POSIX lock on one layout generation; ``move(g)`` takes generation g's, then drops the old."""

    def __init__(self, model_dir: str, generation: int):
        self.model_dir, self.generation, self.fd = model_dir, generation, None
        self.fd = self._take(generation)

    def _take(self, generation: int) -> int | None:
        try:
            fd = os.open(gen_lock_path(self.model_dir, generation), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None  # a read-only model folder: nobody can place or repack it either
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH)
        except OSError:
            os.close(fd)
            return None
        return fd

    def move(self, generation: int) -> None:
        if generation == self.generation:
            return
        fd = self._take(generation)
        self.release()
        self.fd, self.generation = fd, generation

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.release()


def readers_gone(model_dir: str, generation: int, wait_s: float = 0.0, on_wait=None) -> bool:
    """Whether no other process reads ``generation`` (waiting up to ``wait_s`` for them to finish or move
    on); ``on_wait()`` once, when it has to wait."""
    path = gen_lock_path(model_dir, generation)
    if not os.path.exists(path):
        return True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return True
    deadline, told = time.monotonic() + wait_s, False
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                if not told and on_wait is not None:
                    on_wait()
                    told = True
                time.sleep(0.05)
                continue
            fcntl.lockf(fd, fcntl.LOCK_UN)
            return True
    finally:
        os.close(fd)
