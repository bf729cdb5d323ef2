"""``deltafin verify``: re-read every expert file (direct I/O) and check it against the manifest."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deltafin.errors import DeltafinError, ExpertFileError
from deltafin.io.direct import FileDriveReader, aligned_buffer, read_file
from deltafin.store import expert_file as ef
from deltafin.store.model_dir import PackedModel


@dataclass
class VerifyReport:
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, problem)

    @property
    def ok(self) -> bool:
        return not self.bad


def verify(model: PackedModel, threads: int = 4, on_file: Callable[[int], None] | None = None) -> VerifyReport:
    readers = [FileDriveReader(d.label, d.path) for d in model.drives]
    jobs = [(L, e, d) for L in model.moe_layers for e in range(model.num_experts) for d in model.locations(L, e)]
    rep = VerifyReport()
    t0 = time.perf_counter()

    def check(job: tuple[int, int, int]) -> tuple[int, str | None, str]:
        L, e, d = job
        path = model.expert_path(L, e, d)
        n = model.file_bytes(L)
        try:
            size = os.path.getsize(path)
            if size != n:
                return n, f"size {size} bytes, expected {n}", path
            data = read_file(readers[d], path, n, aligned_buffer(n))
            got = ef.checksum(data)
            if got != model.checksum(L, e):
                return n, f"checksum mismatch (expected {model.checksum(L, e)}, got {got})", path
            _, hl, he = ef.parse_header(data, path)
            if (hl, he) != (L, e):
                return n, f"holds layer {hl} expert {he}, expected layer {L} expert {e}", path
        except FileNotFoundError:
            return n, "missing", path
        except (DeltafinError, ExpertFileError, OSError) as err:
            return n, str(err), path
        return n, None, path

    with ThreadPoolExecutor(threads) as ex:
        for n, problem, path in ex.map(check, jobs):
            rep.files += 1
            rep.bytes += n
            if problem:
                rep.bad.append((path, problem))
            if on_file:
                on_file(n)
    rep.seconds = time.perf_counter() - t0
    return rep


def repair_hint(model: PackedModel) -> str:
    src = model.doc.get("source", {}).get("path", "SRC")
    return f"deltafin pack {src} {model.path} --repair"
