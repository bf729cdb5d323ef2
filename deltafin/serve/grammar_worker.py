"""Grammar compilation for the server in a child process, under a deadline and cancellable.

xgrammar compiles a schema in native code that cannot be interrupted, and a hostile schema can take
minutes and gigabytes. Here each compilation runs in one long-lived child process; the request thread
waits on it in short polls, so a deadline (``Limits.grammar_timeout_s``) or a client that leaves
(``cancel``) ends it: the child is killed, which also returns its memory, and a fresh one starts with
the next request. The compiled grammar comes back serialized and is rebuilt against the server's
tokenizer info: what the engine gets is exactly what an in-process compile would give.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
import time

from deltafin.errors import UsageError

log = logging.getLogger(__name__)


class GrammarTimeout(UsageError):
    pass


class Cancelled(UsageError):
    pass


def _child(conn, tokenizer_json: str) -> None:  # pragma: no cover  (runs in the child process)
    import xgrammar as xgr

    from deltafin.runtime.grammar import _part

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_json), max_threads=1)
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        try:
            if kind == "schema":
                g = compiler.compile_json_schema(payload, any_whitespace=False)
            else:
                seqs = json.loads(payload)
                parts = [xgr.Grammar.concat(*[_part(xgr, p) for p in seq]) for seq in seqs]
                g = compiler.compile_grammar(parts[0] if kind == "sequence" else xgr.Grammar.union(*parts))
            conn.send(("ok", g.serialize_json()))
        except Exception as e:  # noqa: BLE001  (xgrammar's message says what it cannot take)
            conn.send(("error", str(e)[:500]))


class BoundedGrammars:
    """The interface of ``runtime.grammar.Grammars`` (json_schema, json_object, sequence, union), compiled in a
    child process; every method takes ``cancel`` (a threading.Event set when the client has gone)."""

    def __init__(self, inner, timeout_s: float = 20.0):
        self.inner, self.timeout_s = inner, timeout_s
        self._lock = threading.Lock()
        self._proc = self._conn = None
        self._info = None

    @property
    def stats(self):
        return self.inner.stats

    def _start(self) -> None:
        import xgrammar as xgr

        from deltafin.runtime.grammar import tokenizer_info

        if self.inner.codec is None:
            raise UsageError("constrained decoding needs the model's tokenizer; this model has none")
        if self._info is None:
            self._info = tokenizer_info(xgr, self.inner.codec, self.inner.vocab_size)
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, self._info.serialize_json()), daemon=True,
                                 name="deltafin-grammar")
        self._proc.start()
        child.close()
        self._conn = parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _run(self, kind: str, payload: str, what: str, cancel: threading.Event | None):
        from deltafin.runtime.grammar import Compiled, _xgr

        xgr = _xgr()
        deadline = time.monotonic() + self.timeout_s
        while not self._lock.acquire(timeout=0.1):  # another request is compiling: wait, but not past ours
            if cancel is not None and cancel.is_set():
                raise Cancelled("the client left before its grammar was compiled")
            if time.monotonic() > deadline:
                raise GrammarTimeout(f"{what}: the grammar was not compiled within {self.timeout_s:g} s (the server "
                                     f"was busy compiling others); retry, or send a smaller schema")
        try:
            if self._proc is None or not self._proc.is_alive():
                self._start()  # the child's start (imports) is not the schema's time
                deadline = time.monotonic() + self.timeout_s
            self._conn.send((kind, payload))
            while not self._conn.poll(0.05):
                gone = cancel is not None and cancel.is_set()
                if gone or time.monotonic() > deadline or not self._proc.is_alive():
                    self._kill()  # the only way to stop native code; frees what it allocated
                    if gone:
                        raise Cancelled("the client left; its grammar compilation was stopped")
                    raise GrammarTimeout(f"{what}: compiling the grammar took longer than {self.timeout_s:g} s "
                                         f"(--grammar-timeout); simplify the schema or send fewer tools")
            status, body = self._conn.recv()
        finally:
            self._lock.release()
        if status != "ok":
            raise UsageError(f"{what} cannot be compiled to a grammar: {body}")
        return Compiled(xgr.CompiledGrammar.deserialize_json(body, self._info), self.inner)

    def json_schema(self, schema: dict, cancel: threading.Event | None = None):
        return self._run("schema", json.dumps(schema), "the JSON schema", cancel)

    def json_object(self, cancel: threading.Event | None = None):
        return self.json_schema({"type": "object"}, cancel)

    def sequence(self, parts: list, cancel: threading.Event | None = None):
        return self._run("sequence", json.dumps([parts]), "the tool's parameters", cancel)

    def union(self, sequences: list, cancel: threading.Event | None = None):
        return self._run("union", json.dumps(sequences), "the tools' parameters", cancel)
