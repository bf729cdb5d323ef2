"""Expert layouts over drives, planned for a policy, and ``deltafin place``: change a packed model's layout
moving only the files that must move.

A layout gives, per MoE layer, each expert's drives (primary first, then replicas) or, for a striped
layer, the pieces every expert is cut into. Files are named by what they hold (``E0003.dfx`` is the whole
expert, ``E0003.dfx.p<offset>+<nbytes>`` those bytes of it), so one name never holds two contents and a
change of layout is a set difference per expert: for whole files it is exactly ``placement.moves``.

``deltafin place`` is crash-safe and idempotent:
  1. journal: ``place-journal.json`` in the model folder records the old and the new layout;
  2. copy: for every expert whose files change, each file of its new layout is built from the old layout's
     bytes (checked against the expert's checksum, every old copy tried), written under a temporary name on
     its drive, fsynced, renamed, and its folder fsynced; a file already under its final name (kept from the
     old layout, or left by an interrupted run) is kept only if its bytes match, else rewritten; then every
     file of the new layout is read back from its drive and checked against the expert's checksum;
  3. commit: the manifest is rewritten atomically with the new layout;
  4. delete: files of the old layout the new one does not use are deleted (an expert's old files only once
     its new files have been read back and checked: a resumed run checks them first), then the journal.
Re-running after an interruption at any point first finishes the journaled change.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from deltafin.errors import DeltafinError, ExpertChecksumError, ManifestError, UsageError
from deltafin.io.direct import FileDriveReader, aligned_buffer
from deltafin.io.pool import BufferPool
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf
from deltafin.store.drives import check_space
from deltafin.store.model_dir import PackedModel
from deltafin.store.placement import (
    ALL_POLICIES,
    STRIPE_POLICIES,
    TRACE_POLICIES,
    DriveSpec,
    place,
    stripe_pieces,
)

log = logging.getLogger(__name__)
JOURNAL = "place-journal.json"
WORKERS = 4  # experts copied at once
_TMP = re.compile(r".+\.tmp-\d+(-\d+)?")

FileKey = tuple[int, int, int, bool]  # (drive, offset, nbytes, is a piece)


@dataclass
class Layout:
    """Where every expert file of a model lives. ``stripe`` holds only the striped layers."""

    policy: str
    locations: dict[int, list[list[int]]]
    stripe: dict[int, dict] = field(default_factory=dict)  # layer -> {"mode", "pieces": [{drive, offset, nbytes}]}
    ranks: dict | None = None  # expert ownership over a cluster's ranks (store/ranks.py), or None

    @classmethod
    def from_doc(cls, experts: dict) -> Layout:
        stripe = {int(L): st for L, st in (experts.get("stripe") or {}).items()}
        return cls(experts.get("placement", "bandwidth"), {int(L): v for L, v in experts["locations"].items()}, stripe,
                   experts.get("ranks"))

    def to_doc(self) -> dict:
        doc = {"placement": self.policy, "locations": {str(L): v for L, v in sorted(self.locations.items())}}
        if self.stripe:
            doc["stripe"] = {str(L): v for L, v in sorted(self.stripe.items())}
        if self.ranks is not None:
            doc["ranks"] = self.ranks
        return doc

    def same_files(self, other: Layout) -> bool:
        return self.locations == other.locations and self.stripe == other.stripe

    def files(self, layer: int, expert: int, file_bytes: int) -> set[FileKey]:
        st = self.stripe.get(layer)
        if st is not None:
            return {(p["drive"], p["offset"], p["nbytes"], True) for p in st["pieces"]}
        return {(d, 0, file_bytes, False) for d in self.locations[layer][expert]}


def relpath(model_id: str, layer: int, expert: int, key: FileKey) -> str:
    _d, offset, nbytes, piece = key
    if piece:
        return mf.piece_relpath(model_id, layer, expert, offset, nbytes)
    return mf.expert_relpath(model_id, layer, expert)


# ---------------------------------------------------------------- planning


def replica_capacity(file_bytes: dict[int, int], num_experts: int, drives: list[DriveSpec],
                     spare_bytes: list[float]) -> list[int]:
    """Bytes each drive may hold for this model: its read-rate share of the experts, plus one expert
    of rounding room, plus its spare space for replicas."""
    total = sum(n * num_experts for n in file_bytes.values())
    rate = sum(d.gbps for d in drives)
    largest = max(file_bytes.values(), default=0)
    return [int(total * d.gbps / rate + largest + s) for d, s in zip(drives, spare_bytes, strict=True)]


def plan_layout(file_bytes: dict[int, int], num_experts: int, drives: list[DriveSpec], policy: str, *,
                trace=None, spare_gb: float | None = None) -> Layout:
    """The layout ``policy`` gives experts of ``file_bytes[layer]`` bytes over ``drives``.

    ``trace`` (a routing trace) is needed by "coactivation" and "replicas"; "replicas" copies the most-used
    experts onto ``spare_gb`` GB per drive (default: a tenth of the drive's share of the model).
    """
    if policy not in ALL_POLICIES:
        raise UsageError(f"placement policy {policy!r} is unknown; choose one of {', '.join(ALL_POLICIES)}")
    if policy in TRACE_POLICIES and trace is None:
        raise UsageError(f"placement policy {policy!r} needs a routing trace: pass --trace routes.jsonl (record one "
                         f"with 'deltafin run MODEL --record-routes routes.jsonl'), or use bandwidth, roundrobin, "
                         f"stripe-bandwidth or stripe-equal")
    if policy in STRIPE_POLICIES:
        mode = STRIPE_POLICIES[policy]
        stripe, locations = {}, {}
        for L, n in file_bytes.items():
            pieces = stripe_pieces(n, drives, mode)
            stripe[L] = {"mode": mode, "pieces": [{"drive": d, "offset": o, "nbytes": b} for d, o, b in pieces]}
            locations[L] = [[d for d, _o, _b in pieces] for _ in range(num_experts)]
        return Layout(policy, locations, stripe)
    sizes = {L: [n] * num_experts for L, n in file_bytes.items()}
    capacity = None
    if policy == "replicas":
        total = sum(n * num_experts for n in file_bytes.values())
        rate = sum(d.gbps for d in drives)
        spare = [spare_gb * 1e9 if spare_gb is not None else 0.1 * total * d.gbps / rate for d in drives]
        capacity = replica_capacity(file_bytes, num_experts, drives, spare)
    try:
        placed = place(sizes, drives, policy, trace=trace, capacity=capacity)
    except ValueError as e:
        raise UsageError(f"placement {policy!r}: {e}") from e
    return Layout(policy, {L: placed[L] for L in file_bytes}, {})


def model_layout(pm: PackedModel, policy: str, *, trace_path: str | None = None,
                 spare_gb: float | None = None) -> Layout:
    """The layout ``policy`` gives a packed model's experts over its drives (at their packed rates)."""
    trace = None
    if trace_path is not None:
        from deltafin.io.routes import read_routes

        trace = read_routes(trace_path, pm.num_experts)
    drives = [DriveSpec(d.label, d.gbps) for d in pm.drives]
    return plan_layout({L: pm.file_bytes(L) for L in pm.moe_layers}, pm.num_experts, drives, policy,
                       trace=trace, spare_gb=spare_gb)


# ---------------------------------------------------------------- applying


@dataclass
class PlaceReport:
    policy: str
    files_copied: int = 0
    bytes_copied: int = 0
    files_kept: int = 0  # already in place (unchanged, or finished by an interrupted run)
    files_verified: int = 0  # files of the new layout read back and checked before any old copy was deleted
    files_deleted: int = 0
    bytes_deleted: int = 0
    files_foreign: int = 0  # old files not deleted: their folder does not carry this model's marker
    experts_changed: int = 0
    resumed: bool = False
    seconds: float = 0.0
    per_drive: dict[str, dict] = field(default_factory=dict)


def rank_layout(pm: PackedModel, spec: str) -> Layout:
    """The layout giving each rank of ``spec`` (store/ranks.py grammar) its experts on its own drives."""
    from deltafin.store import ranks as rk

    labels = [d.label for d in pm.drives]
    specs = rk.parse_ranks(spec, labels)
    rank_drives = [[labels.index(x) for x in r.drives] for r in specs]
    rate = [d.gbps for d in pm.drives]
    per_layer = sum(pm.file_bytes(L) for L in pm.moe_layers)
    counts = rk.quotas(pm.num_experts, per_layer, specs, [sum(rate[d] for d in ds) for ds in rank_drives])
    old = Layout.from_doc(pm.doc["experts"])
    owners, locs = rk.plan_owners(old.locations, {L: pm.file_bytes(L) for L in pm.moe_layers}, rate, rank_drives,
                                  counts)
    return Layout("ranks", locs, {}, rk.ranks_doc(specs, owners))


def place_model(model_dir: str, policy: str | None, *, trace_path: str | None = None, spare_gb: float | None = None,
                drive_map: dict[str, str] | None = None, progress: bool = False,
                ranks: str | None = None) -> PlaceReport:
    """Change a packed model's placement to ``policy`` (or to the ownership of ``ranks``), moving only
    what must move (crash-safe)."""
    from deltafin.store.locks import model_lock

    t0 = time.perf_counter()
    model_dir = os.path.abspath(model_dir)
    check_writable(model_dir)
    with model_lock(model_dir, "place"):
        pm = PackedModel.open(model_dir, drive_map, reader=False)  # checks the drives before any change
        for d in pm.drives:
            check_writable(os.path.join(d.path, pm.model_id), f"drive {d.label}")
        resumed = resume(model_dir, drive_map, progress)
        return _place(model_dir, policy, trace_path, spare_gb, drive_map, progress, ranks, resumed, t0)


def check_writable(folder: str, what: str = "the model folder") -> None:
    """Placing writes a journal, new files and a manifest: a read-only folder is refused before any of it."""
    if not os.path.isdir(folder):
        return
    probe = os.path.join(folder, f".deltafin-write-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{what} {folder} is not writable ({e.strerror}); 'deltafin place' moves files and "
                         f"rewrites the manifest there: fix its permissions (or mount it read-write) and run it "
                         f"again") from None


def _place(model_dir, policy, trace_path, spare_gb, drive_map, progress, ranks, resumed, t0) -> PlaceReport:
    pm = PackedModel.open(model_dir, drive_map, reader=False)
    if ranks is not None:
        new = rank_layout(pm, ranks)
    else:
        new = model_layout(pm, policy, trace_path=trace_path, spare_gb=spare_gb)
    rep = apply_layout(pm, new, progress=progress)
    rep.resumed = resumed
    rep.seconds = time.perf_counter() - t0
    return rep


def resume(model_dir: str, drive_map: dict[str, str] | None = None, progress: bool = False) -> bool:
    """Finish a placement change that was interrupted; True when there was one."""
    path = os.path.join(os.path.abspath(model_dir), JOURNAL)
    if not os.path.exists(path):
        return False
    journal = _read_journal(path)
    pm = PackedModel.open(model_dir, drive_map, reader=False)
    old, new = Layout.from_doc(journal["old"]), Layout.from_doc(journal["new"])
    now = Layout.from_doc(pm.doc["experts"])
    log.warning("%s: finishing an interrupted placement change to %r", model_dir, new.policy)
    if now.same_files(new):  # committed: only old files are left to delete
        _remove_tmp(pm)
        _delete_old(pm, old, new, PlaceReport(new.policy), set(), journal.get("generation"))
        _remove_journal(pm)
    elif now.same_files(old):
        apply_layout(pm, new, progress=progress)
    else:
        raise ManifestError(f"{path}: the manifest matches neither side of this interrupted placement change (the "
                            f"model was repacked since?); delete {path} and run 'deltafin verify'")
    return True


def apply_layout(pm: PackedModel, new: Layout, *, progress: bool = False) -> PlaceReport:
    """Move ``pm``'s expert files to layout ``new``: journal, copy, commit, delete (module docstring)."""
    old = Layout.from_doc(pm.doc["experts"])
    rep = PlaceReport(new.policy)
    if old.same_files(new):
        if old.policy != new.policy or old.ranks != new.ranks:
            _commit(pm, new)
        rep.per_drive = _per_drive(pm, new)
        return rep
    _remove_tmp(pm)
    _check_space(pm, old, new)
    gen = pm.generation
    mf.write_json_atomic(os.path.join(pm.path, JOURNAL),
                         {"format": "deltafin-place-journal", "version": 1, "old": old.to_doc(), "new": new.to_doc(),
                          "generation": gen})
    checked = _copy_new(pm, old, new, rep, progress)
    _commit(pm, new)
    _delete_old(pm, old, new, rep, checked, gen)
    _remove_journal(pm)
    rep.per_drive = _per_drive(pm, new)
    return rep


def _read_journal(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != "deltafin-place-journal" or "old" not in doc or "new" not in doc:
            raise ValueError("not a placement journal")
    except (OSError, ValueError, AttributeError) as e:
        raise ManifestError(f"{path}: unreadable placement journal ({e}); the manifest is still consistent: "
                            f"delete {path}, run 'deltafin verify', and place again") from e
    return doc


def _changes(pm: PackedModel, old: Layout, new: Layout):
    """(layer, expert, files to add, files to drop) for every expert whose files differ."""
    for L in pm.moe_layers:
        n = pm.file_bytes(L)
        for e in range(pm.num_experts):
            a, b = old.files(L, e, n), new.files(L, e, n)
            if a != b:
                yield L, e, sorted(b - a), sorted(a - b)


def _path(pm: PackedModel, L: int, e: int, key: FileKey) -> str:
    return mf.leaf_under(pm.drives[key[0]].path, relpath(pm.model_id, L, e, key))


def _check_space(pm: PackedModel, old: Layout, new: Layout) -> None:
    need = {d.label: (os.path.join(d.path, pm.model_id), 0) for d in pm.drives}
    for _L, _e, add, _drop in _changes(pm, old, new):
        for key in add:
            label = pm.drives[key[0]].label
            need[label] = (need[label][0], need[label][1] + key[2])
    check_space(need)


def _remove_tmp(pm: PackedModel) -> None:
    """Temporary files an interrupted copy left behind (never under a final name)."""
    for d in pm.drives:
        for L in pm.moe_layers:
            folder = os.path.join(d.path, pm.model_id, f"L{L:03d}")
            if os.path.isdir(folder):
                for name in os.listdir(folder):
                    if _TMP.fullmatch(name):
                        os.unlink(os.path.join(folder, name))


def _copy_new(pm: PackedModel, old: Layout, new: Layout, rep: PlaceReport, progress: bool) -> set[tuple[int, int]]:
    """Every changed expert's new files, installed and read back; returns the experts checked."""
    from deltafin.progress import bar as progress_bar

    # every file of the new layout, kept ones too: a kept copy may be the damaged one, and the good copy
    # is about to be deleted (it is rewritten from a good copy instead)
    jobs = [(L, e, sorted(new.files(L, e, pm.file_bytes(L)))) for L, e, _add, _drop in _changes(pm, old, new)]
    rep.experts_changed = len(jobs)
    checked: set[tuple[int, int]] = set()
    readers = [FileDriveReader(d.label, d.path) for d in pm.drives]
    buffers, lock, stop = BufferPool(), threading.Lock(), threading.Event()
    total = sum(key[2] for _L, _e, add in jobs for key in add)
    with progress_bar(total, "place", enabled=progress) as bar:

        def one(job) -> None:
            if stop.is_set():
                return
            L, e, add = job
            n = pm.file_bytes(L)
            buf = buffers.get(n)
            try:
                data = _read_verified(pm, old, L, e, readers, buf[:n])
                for key in add:
                    wrote = _install(_path(pm, L, e, key), data[key[1] : key[1] + key[2]])
                    with lock:
                        rep.files_copied += wrote
                        rep.files_kept += not wrote
                        rep.bytes_copied += key[2] * wrote
                        bar.update(key[2])
                for folder in {os.path.dirname(_path(pm, L, e, key)) for key in add}:
                    ef.fsync_dir(folder)
                _check_new(pm, new, L, e, readers, buf[:n])
                with lock:
                    rep.files_verified += len(add)
                    checked.add((L, e))
            finally:
                buffers.put(buf)

        with ThreadPoolExecutor(WORKERS) as ex:
            try:
                futures = [ex.submit(one, job) for job in jobs]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                if any(f.exception() for f in done):
                    stop.set()
                for f in futures:
                    f.result()  # raises the first failure, after the others have stopped
            except BaseException:  # Ctrl-C too: experts not started are skipped, the journal stays
                stop.set()
                raise
    return checked


def _check_new(pm: PackedModel, new: Layout, L: int, e: int, readers, buf: memoryview) -> None:
    """Read every file of the expert's new layout back from its drive and check the expert's checksum
    (a striped expert's pieces together); a bad one stops the change before anything is deleted."""
    files = sorted(new.files(L, e, len(buf)))
    for group in ([files] if new.stripe.get(L) else [[f] for f in files]):
        paths = [_path(pm, L, e, key) for key in group]
        for key, path in zip(group, paths, strict=True):
            got = readers[key[0]].read_into(path, 0, buf[key[1] : key[1] + key[2]])
            if got != key[2]:
                raise ExpertChecksumError(f"{path}: read back {got} of {key[2]} bytes after writing it; the drive "
                                          f"lost data: nothing was deleted; check the drive and place again")
        ef.check(buf, pm.checksum(L, e), ", ".join(paths), "read back after writing it: the drive returns other "
                 "bytes than were written; nothing was deleted; check the drive and place again")


def _read_verified(pm: PackedModel, old: Layout, L: int, e: int, readers, buf: memoryview) -> memoryview:
    """The expert's bytes from the old layout, checked against its checksum (each whole copy is tried)."""
    n = len(buf)
    files = sorted(old.files(L, e, n))
    tries = [files] if old.stripe.get(L) else [[f] for f in files]
    problems = []
    for group in tries:
        try:
            for key in group:
                path = _path(pm, L, e, key)
                got = readers[key[0]].read_into(path, 0, buf[key[1] : key[1] + key[2]])
                if got != key[2]:
                    raise ExpertChecksumError(f"{path}: {got} of {key[2]} bytes (truncated)")
            ef.check(buf, pm.checksum(L, e), f"layer {L} expert {e}", "")
            return buf
        except (OSError, DeltafinError) as err:
            problems.append(str(err).rstrip("; "))
    raise ExpertChecksumError(f"layer {L} expert {e}: no good copy to move ({'; '.join(problems)}); nothing was "
                              f"changed for it: repair the model first ('deltafin verify', then 'deltafin pack SRC "
                              f"{pm.path} --repair') and place again")


def _install(final: str, data: memoryview) -> bool:
    """Put ``data`` under ``final`` durably (temporary name, fsync, rename); False when it was already there."""
    try:
        with open(final, "rb") as f:
            if f.read(len(data) + 1) == data:
                return False
    except FileNotFoundError:
        pass
    os.replace(ef.write_tmp(final, data, direct=True), final)
    return True


def _commit(pm: PackedModel, new: Layout) -> None:
    doc = dict(pm.doc)
    experts = {k: v for k, v in doc["experts"].items() if k not in ("stripe", "locations", "placement", "ranks")}
    doc["experts"] = experts | new.to_doc()
    doc["generation"] = pm.generation + 1  # readers (a server) take the new layout up between two steps
    mf.validate(doc, os.path.join(pm.path, mf.MANIFEST))
    mf.write_json_atomic(os.path.join(pm.path, mf.MANIFEST), doc)
    pm.doc = doc
    pm._stripes.clear()


READERS_WAIT_S = 600.0  # how long place waits for readers of the old layout (a run to end, a server to move on)


def _delete_old(pm: PackedModel, old: Layout, new: Layout, rep: PlaceReport, checked: set[tuple[int, int]],
                generation: int | None = None) -> None:
    """Delete the old layout's unused files; an expert's only once its new files are known good (``checked``,
    else read back here: a resumed run deletes nothing it has not checked), and only once no reader uses the
    old layout (``generation``). Only files in folders carrying the model's marker are deleted."""
    from deltafin.store.locks import gen_lock_path, readers_gone
    from deltafin.store.ownership import owned_by

    if generation is not None and not readers_gone(pm.path, generation, READERS_WAIT_S, lambda: log.warning(
            "%s: waiting for the readers of the old layout (a deltafin run, serve or batch) to finish or move to "
            "the new one before deleting its files", pm.path)):
        raise DeltafinError(f"{pm.path}: the new layout is in place, but a process still reads the old one after "
                            f"{READERS_WAIT_S:g} s, so its files are kept; run 'deltafin place' again later to "
                            f"delete them")
    uid = pm.doc.get("uid")
    ours = {d: uid is None or owned_by(os.path.join(pm.drives[d].path, pm.model_id), uid)
            for d in range(len(pm.drives))}
    folders = set()
    readers = [FileDriveReader(d.label, d.path) for d in pm.drives]
    for L, e, _add, drop in _changes(pm, old, new):
        if drop and (L, e) not in checked:
            try:
                _check_new(pm, new, L, e, readers, aligned_buffer(pm.file_bytes(L)))
            except (OSError, DeltafinError) as err:
                raise ExpertChecksumError(f"layer {L} expert {e}: its new copy is not good ({err}); its old files "
                                          f"are kept: run 'deltafin verify', repair, and place again") from err
            rep.files_verified += len(new.files(L, e, pm.file_bytes(L)))
        for key in drop:
            path = _path(pm, L, e, key)
            if not ours[key[0]]:
                rep.files_foreign += 1
                continue
            if _remove(path):
                rep.files_deleted += 1
                rep.bytes_deleted += key[2]
            folders.add(os.path.dirname(path))
    for folder in folders:
        if os.path.isdir(folder):
            ef.fsync_dir(folder)
    if generation is not None:
        with contextlib.suppress(OSError):
            os.unlink(gen_lock_path(pm.path, generation))


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _remove_journal(pm: PackedModel) -> None:
    try:
        os.unlink(os.path.join(pm.path, JOURNAL))
    except FileNotFoundError:
        return
    ef.fsync_dir(pm.path)


def _per_drive(pm: PackedModel, layout: Layout) -> dict[str, dict]:
    out = {d.label: {"path": d.path, "gbps": d.gbps, "files": 0, "bytes": 0} for d in pm.drives}
    for L in pm.moe_layers:
        n = pm.file_bytes(L)
        for e in range(pm.num_experts):
            for key in layout.files(L, e, n):
                out[pm.drives[key[0]].label]["files"] += 1
                out[pm.drives[key[0]].label]["bytes"] += key[2]
    return out
