"""``deltafin verify``: re-read every expert file (direct I/O) and check it against the manifest.

A striped expert is checked as a whole: its pieces are read into one buffer at their offsets and the
expert's checksum is taken over the reassembled file (the pieces have none of their own).
"""

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

LINK = "a symbolic link, not an expert file Deltafin wrote; 'deltafin pack --repair' replaces the link itself"


@dataclass
class VerifyReport:
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, problem)
    trunk_files: int = 0

    @property
    def ok(self) -> bool:
        return not self.bad


def verify(model: PackedModel, threads: int = 4, on_file: Callable[[int], None] | None = None) -> VerifyReport:
    readers = [FileDriveReader(d.label, d.path) for d in model.drives]
    jobs = [(L, e, d) for L in model.moe_layers for e in range(model.num_experts)
            for d in ([None] if model.stripe(L) else model.locations(L, e))]
    rep = VerifyReport()
    t0 = time.perf_counter()

    def check(job: tuple[int, int, int | None]) -> tuple[int, str | None, str]:
        L, e, d = job
        if d is None:
            return _check_striped(model, readers, L, e)
        n = model.file_bytes(L)
        try:
            path = model.expert_path(L, e, d)
        except DeltafinError as err:
            return n, str(err), f"layer {L} expert {e} on drive {model.drives[d].label}"
        if os.path.islink(path):
            return n, LINK, path
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
    from deltafin.store.trunk import verify_trunk

    rep.trunk_files = len({m["file"] for m in model.doc["trunk"]["tensors"].values()})
    rep.bad.extend(verify_trunk(model.path, model.doc))
    rep.seconds = time.perf_counter() - t0
    return rep


def _check_striped(model: PackedModel, readers, L: int, e: int) -> tuple[int, str | None, str]:
    files = model.expert_files(L, e)
    n = model.file_bytes(L)
    where = f"layer {L} expert {e} ({', '.join(f.path for f in files)})"
    buf = aligned_buffer(n)
    for f in files:
        if os.path.islink(f.path):
            return n, LINK, f.path
        try:
            size = os.path.getsize(f.path)
            if size != f.nbytes:
                return n, f"piece of size {size} bytes, expected {f.nbytes}", f.path
            if readers[f.drive].read_into(f.path, 0, buf[f.offset : f.offset + f.nbytes]) != f.nbytes:
                return n, "short read", f.path
        except FileNotFoundError:
            return n, "missing (a piece of a striped expert)", f.path
        except (DeltafinError, OSError) as err:
            return n, str(err), f.path
    data = buf[:n]
    got = ef.checksum(data)
    if got != model.checksum(L, e):
        return n, f"checksum mismatch over the reassembled pieces (expected {model.checksum(L, e)}, got {got})", where
    try:
        _, hl, he = ef.parse_header(data, where)
    except ExpertFileError as err:
        return n, str(err), where
    if (hl, he) != (L, e):
        return n, f"holds layer {hl} expert {he}, expected layer {L} expert {e}", where
    return n, None, where


def repair_hint(model: PackedModel) -> str:
    source = model.doc.get("source", {})
    placement = source.get("placement", "bandwidth")
    extra = f" --placement {placement}" if placement != "bandwidth" else ""  # the pack's own settings, or it repacks
    if source.get("trace"):
        extra += f" --trace {source['trace']}" + (f" --spare-gb {source['spare_gb']:g}" if source.get("spare_gb") else "")
    return f"deltafin pack {source.get('path', 'SRC')} {model.path} --repair{extra}"
