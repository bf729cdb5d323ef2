"""``deltafin pack``: checkpoint -> model directory + one file per expert over the drives.

Resumable and crash-safe: every file is written under a temporary name, fsynced and renamed; progress
(with the placement, so a resumed pack puts every expert where the first run did) is kept in
``pack-state.json``; the manifest is written last, so a model without one is never used. Re-running a
finished pack with the same settings starts from its manifest: nothing is rewritten, and ``repair``
re-checks every file and rewrites only the bad ones.

``placement`` is any policy of ``deltafin.store.placement.ALL_POLICIES``: whole files placed by read rate
(``bandwidth``), by a routing trace (``coactivation``, ``replicas``: ``trace`` names the JSONL file), equal
counts (``roundrobin``), or every expert cut into one piece per drive (``stripe-bandwidth``: pieces sized
by read rate; ``stripe-equal``: RAID-0-like). ``deltafin place`` changes it later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass

from deltafin.errors import CheckpointError, ExpertFileError, ManifestError, UsageError
from deltafin.io.pool import BufferPool
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf
from deltafin.store import ownership as own
from deltafin.store.checkpoint import Checkpoint, read_into
from deltafin.store.convert import (
    TrunkStream,
    check_expert_sources,
    check_mxfp4_scales,
    expert_tensors,
    passthrough_sections,
)
from deltafin.store.drives import DriveArg, check_space
from deltafin.store.fileio import file_sha256, peak_rss_bytes, return_freed_memory
from deltafin.store.load_checks import check_distinct_drives
from deltafin.store.locks import LockedError, model_lock
from deltafin.store.pack_layout import PackSummary, plan_drive_layout, resolve_drives  # noqa: F401 (also from here)
from deltafin.store.pack_state import (
    STATE,
    fingerprint,
    layout_doc,
    load_state,
    new_state,
    state_from_manifest,
)
from deltafin.store.place import Layout, relpath
from deltafin.store.placement import ALL_POLICIES, TRACE_POLICIES
from deltafin.store.plan import build_plan, refuse_unused
from deltafin.store.safetensors_io import write_streamed
from deltafin.store.trunk import trunk_intact

log = logging.getLogger(__name__)
WRITERS = 3  # experts in flight: source reads and encoding overlap the direct writes
COMMIT_BATCH = 16  # experts made durable by one flush, then renamed to their final names
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "tiktoken.model", "vocab.json", "merges.txt", "tokenizer.model",
    "generation_config.json",
)
TOKENIZER_PATTERNS = (re.compile(r"tokenization_.*\.py"), re.compile(r"encoding_.*\.py"))
_STALE_TMP = re.compile(r".+\.tmp-\d+(-\d+)?")  # temporary names written by this module and expert_file


@dataclass(frozen=True, slots=True)
class PackOptions:
    experts: str = "auto"
    trunk: str = "int8"
    placement: str = "bandwidth"
    model_id: str | None = None
    repair: bool = False
    progress: bool = True
    trace: str | None = None  # routing trace (JSONL) for the coactivation and replicas placements
    spare_gb: float | None = None  # replicas: GB per drive for extra copies (default: a tenth of its share)
    allow_nonfinite: bool = False  # pack NaN/inf weights as they are (refused by default: they are damage)
    overwrite: bool = False  # OUT holds another checkpoint's model: remove it first (else refused)
    allow_unused: bool = False  # pack trunk tensors the model code never reads (refused by default)


def pack(src: str | Checkpoint, out: str, drive_args: list[DriveArg], opts: PackOptions = PackOptions()) -> PackSummary:
    """Pack ``src`` into ``out``; one writer per model folder (``locks.model_lock``)."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{out}: exists and is not a folder; OUT is the model folder to write: pass a new or "
                         f"existing folder")
    if os.path.isdir(out) and _prior_manifest(out) is None and not os.path.exists(os.path.join(out, STATE)):
        stray = own.out_foreign(out, is_side_file)
        if stray:
            raise own.OwnershipError(f"{out} already holds files Deltafin did not write ({', '.join(stray)}); "
                                     f"give a new or empty folder as OUT")
    from deltafin.kernels import serial

    # torch's own threads off while packing: the packer's threads each encode an expert, and torch's wake-ups
    # on its small steps cost more than they gain (a pack took 2-3x as long with them)
    with model_lock(out, "pack"), serial():
        return _pack(src, out, drive_args, opts)


def _pack(src: str | Checkpoint, out: str, drive_args: list[DriveArg], opts: PackOptions) -> PackSummary:
    t0 = time.perf_counter()
    return_freed_memory()
    _check_policy(opts)
    ckpt = src if isinstance(src, Checkpoint) else Checkpoint(src)  # deltafin pull passes one that streams
    missing = [sh for sh in ckpt.shards() if not ckpt.has_shard(sh)]
    if missing:
        raise CheckpointError(f"{ckpt.path}: shard(s) {', '.join(missing)} named in the index are missing; "
                              f"download them, then re-run")
    plan = build_plan(ckpt, opts.experts, opts.trunk)
    refuse_unused(plan, opts.allow_unused)
    identity = own.source_identity(ckpt)
    if opts.model_id is not None:
        mf.check_model_id(opts.model_id)
    seen = _prior_manifest(out)  # what can be refused is refused before --overwrite removes anything
    check_distinct_drives(drive_args or ([DriveArg(d.label, d.path, None) for d in mf.drives(seen)] if seen else []),
                          "--drive")
    prior, replaced = _settle_prior(out, ckpt, identity, opts)
    if not drive_args and prior is not None:  # a re-run (e.g. --repair) keeps the packed drives
        drive_args = [DriveArg(d.label, d.path, None if d.measured else d.gbps) for d in mf.drives(prior)]
    if not drive_args:
        drive_args = [DriveArg("d0", os.path.join(out, "experts"), None)]
    check_distinct_drives(drive_args, "--drive")
    model_id = mf.check_model_id(opts.model_id or (prior or {}).get("model_id") or _default_id(out))
    digest = fingerprint(plan, drive_args, model_id, opts)
    state = load_state(out, digest)
    uid = (state or {}).get("uid") or (prior or {}).get("uid") or own.new_uid()
    legacy = _legacy_folders(prior, state)
    for a in drive_args:  # before anything is written: each drive folder must be free or this model's
        folder = os.path.join(a.path, model_id)
        own.check_claim(folder, uid, a.label, os.path.realpath(folder) in legacy)
    from deltafin.store.repack import move_to_new_rates, same_files_other_rates

    if same_files_other_rates(out, prior, plan, drive_args, model_id, opts, digest):
        _readers_gone_or_refuse(out, prior)
        return move_to_new_rates(out, plan, drive_args, opts, digest)
    state = state or state_from_manifest(prior, digest) or new_state(digest)
    state.setdefault("uid", uid)
    state["identity"], state["model_id"] = identity, model_id
    drives = resolve_drives(out, drive_args, state.get("drives"))
    if state.get("locations") is None:
        layout = plan_drive_layout(plan, drives, opts)
        state["locations"] = {str(L): layout.locations[L] for L in plan.moe_layers}
        state["stripe"] = {str(L): st for L, st in layout.stripe.items()}
        state["placement"] = opts.placement
    state["drives"] = {d.label: [d.gbps, d.measured] for d in drives}
    state["drive_paths"] = [d.path for d in drives]
    locations = {int(L): locs for L, locs in state["locations"].items()}
    job = _Job(ckpt, plan, out, drives, model_id, locations, state, opts)
    job.check_space()
    job._save_state(force=True)  # the uid first: a re-run after any failure from here finds its folders
    for d in drives:
        folder = os.path.join(d.path, model_id)
        own.claim(folder, state["uid"], out, model_id, d.label, os.path.realpath(folder) in legacy)
    job.remove_stale_tmp()
    if prior is not None and prior.get("fingerprint") != digest:
        # other settings: files are about to be rewritten, so the old manifest must not outlive them; the old
        # layout's files are listed in the state and removed once the new layout is verified
        _readers_gone_or_refuse(out, prior)
        state["replaces"] = _old_layout(prior)
        job._save_state(force=True)
        log.warning("%s: repacking with new settings; the old layout's files are removed once the new one is "
                    "verified", out)
        os.unlink(os.path.join(out, mf.MANIFEST))
    job.write_all()
    side = _copy_side_files(ckpt, out)
    doc = job.manifest(ckpt.path) | {"fingerprint": digest, "uid": state["uid"], "side_files": side,
                               "generation": int((prior or {}).get("generation", 0)) + 1}
    doc["source"]["identity"] = identity
    doc["config_sha256"] = file_sha256(os.path.join(out, "config.json"))
    mf.write_json_atomic(os.path.join(out, mf.MANIFEST), doc)
    removed = replaced.files
    if state.get("replaces"):
        removed += _remove_old_layout(out, doc, state["replaces"]).files
    os.unlink(os.path.join(out, STATE))
    peak = peak_rss_bytes()
    return PackSummary(out, model_id, plan.expert_files, job.written, job.skipped, job.repaired, plan.expert_bytes,
                       job.bytes_written, plan.trunk_bytes, time.perf_counter() - t0, peak, job.per_drive(),
                       removed=removed)


def _legacy_folders(prior: dict | None, state: dict | None) -> set[str]:
    """Drive folders of this model packed before markers existed (its manifest has no uid): adopted."""
    if prior is None or prior.get("uid") is not None or state is not None:
        return set()
    return {os.path.realpath(os.path.join(d.path, prior["model_id"])) for d in mf.drives(prior)}


def _settle_prior(out: str, ckpt: Checkpoint, identity: str, opts: PackOptions):
    """The model already in OUT, if it is this checkpoint's; another checkpoint's is refused, or removed first
    with --overwrite (its expert files on every drive, counted). Returns (prior manifest or None, removal)."""
    from deltafin.store.remove import RemoveReport, remove_model

    prior = _prior_manifest(out)
    state = _read_state(out)
    recorded = (prior or {}).get("source", {}).get("identity") if prior else (state or {}).get("identity")
    legacy_other = (prior is not None and recorded is None
                    and os.path.realpath(prior.get("source", {}).get("path", "")) != os.path.realpath(ckpt.path))
    other = (recorded is not None and recorded != identity) or legacy_other
    if not other:
        return prior, RemoveReport()
    if not opts.overwrite:
        if opts.repair:
            own.check_same_source(recorded, identity, ckpt.path, out, (prior or {}).get("source", {}).get("path"))
        what = (prior or {}).get("source", {}).get("path") or "another checkpoint"
        raise own.OwnershipError(f"{out} holds another model (packed from {what}); pass --overwrite to replace it "
                                 f"(its expert files are removed from every drive first), or give another OUT")
    if prior is not None:
        _readers_gone_or_refuse(out, prior)
        rep = remove_model(out, prior, keep_out=True)
    else:
        rep = RemoveReport()
    if state is not None and state.get("drive_paths") and state.get("model_id"):
        rep.folders += _remove_old_layout(out, None, _state_layout(state)).folders
    for name in (mf.MANIFEST, STATE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out, name))
    log.warning("%s: --overwrite removed the model that was there: %d expert files (%d bytes)", out, rep.files,
                rep.bytes)
    return None, rep


def _read_state(out: str) -> dict | None:
    try:
        import json

        with open(os.path.join(out, STATE)) as f:
            st = json.load(f)
        return st if isinstance(st, dict) else None
    except (OSError, ValueError):
        return None


def _old_layout(doc: dict) -> dict:
    """What a repack must remove once the new layout is verified: the old layout's expert files."""
    from deltafin.store.remove import drive_paths

    keep = ("layers", "num_experts", "layouts", "locations", "placement", "stripe")
    return {"model_id": doc["model_id"], "uid": doc.get("uid"), "drive_paths": drive_paths(doc),
            "experts": {k: v for k, v in doc["experts"].items() if k in keep}}


def _state_layout(state: dict) -> dict:
    ex = {"layers": [int(L) for L in state.get("locations") or {}], "locations": state.get("locations") or {},
          "stripe": state.get("stripe") or {}, "placement": state.get("placement", "bandwidth")}
    return {"model_id": state["model_id"], "uid": state.get("uid"), "drive_paths": state["drive_paths"],
            "experts": ex, "files_from_state": True}


def _remove_old_layout(out: str, new: dict | None, old: dict):
    """Delete the old layout's files that the new manifest ``new`` does not list (all of them when None),
    once every file of the new layout has been read back and matched its checksum."""
    from deltafin.store.remove import RemoveReport, layout_files, remove_files

    rep = RemoveReport()
    new_files: set[str] = set()
    new_folders: set[str] = set()
    if new is not None:
        from deltafin.store.model_dir import PackedModel
        from deltafin.store.verify import verify

        pm = PackedModel.open(out, reader=False)
        check = verify(pm, threads=4)
        if not check.ok:
            log.warning("%s: the new layout did not verify (%d bad files): the old layout's files are kept; run "
                        "'deltafin verify' and repair", out, len(check.bad))
            return rep
        for folder, files in layout_files(new, [d.path for d in pm.drives]).items():
            new_files |= set(files)
            new_folders.add(folder)
    doc = {"model_id": old["model_id"], "experts": old["experts"],
           "drives": [{"label": f"d{i}", "path": p, "gbps": 1.0} for i, p in enumerate(old["drive_paths"])]}
    if old.get("files_from_state"):
        doc["experts"] = dict(old["experts"]) | {"num_experts": _state_experts(old["experts"]),
                                                 "layouts": None}
    for folder, files in _old_files(doc).items():
        gone = {p: n for p, n in files.items() if p not in new_files}
        rep.folders.append(remove_files(folder, gone, old.get("uid"), release=folder not in new_folders))
    if rep.files:
        log.warning("%s: removed %d files (%d bytes) of the old layout", out, rep.files, rep.bytes)
    return rep


def _state_experts(ex: dict) -> int:
    return max((len(v) for v in ex["locations"].values()), default=0)


def _old_files(doc: dict) -> dict[str, dict[str, int]]:
    """The old layout's files: sizes from the manifest's layouts, or (an interrupted pack's state, which has
    none) from the files on disk."""
    from deltafin.store.remove import layout_files

    paths = [d["path"] for d in doc["drives"]]
    if doc["experts"].get("layouts") is not None:
        return layout_files(doc, paths)
    ex = doc["experts"]
    sized = dict(ex) | {"layouts": {str(L): {"file_bytes": 0} for L in ex["layers"]}}
    out = layout_files(doc | {"experts": sized}, paths)
    for files in out.values():
        for p in list(files):
            files[p] = os.path.getsize(p) if os.path.isfile(p) else 0
    return out


def _readers_gone_or_refuse(out: str, doc: dict) -> None:
    """Files are about to change under the same names: no reader may be using the model."""
    from deltafin.store.locks import readers_gone

    if not readers_gone(out, int(doc.get("generation", 0))):
        raise LockedError(f"{out} is in use by a running deltafin (run, serve, batch, classify or verify); stop it "
                          f"first, then pack again")


def _check_policy(opts: PackOptions) -> None:
    if opts.placement not in ALL_POLICIES:
        raise UsageError(f"--placement {opts.placement!r}: choose one of {', '.join(ALL_POLICIES)}")
    if opts.placement in TRACE_POLICIES and not opts.trace:
        raise UsageError(f"--placement {opts.placement!r} needs a routing trace: add --trace routes.jsonl (record "
                         f"one with 'deltafin run MODEL --record-routes routes.jsonl'), or use bandwidth, "
                         f"roundrobin, stripe-bandwidth or stripe-equal")
    if opts.trace and not os.path.isfile(opts.trace):
        raise UsageError(f"--trace {opts.trace}: no such file; record one with 'deltafin run MODEL --record-routes "
                         f"{opts.trace}'")


def _default_id(out: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.basename(out.rstrip("/"))).lstrip(".-_") or "model"
    return base[:128]


def _prior_manifest(out: str) -> dict | None:
    try:
        return mf.load(out)
    except ManifestError:
        return None


class _Job:
    def __init__(self, ckpt, plan, out, drives, model_id, locations, state, opts: PackOptions):
        self.ckpt, self.plan, self.out, self.drives = ckpt, plan, out, drives
        self.model_id, self.locations, self.state, self.opts = model_id, locations, state, opts
        self.layout = Layout(opts.placement, locations, {int(L): st for L, st in (state.get("stripe") or {}).items()})
        self.written = self.skipped = self.repaired = self.bytes_written = 0
        self._last_save = time.monotonic()
        self._buffers = BufferPool()
        self._lock = threading.Lock()

    def path(self, d: int, L: int, e: int) -> str:
        return mf.leaf_under(self.drives[d].path, mf.expert_relpath(self.model_id, L, e))

    def files(self, L: int, e: int) -> list[tuple[int, str, int, int]]:
        """(drive, final path, offset, nbytes) of every file of one expert: whole copies or striped pieces."""
        keys = sorted(self.layout.files(L, e, self.plan.layouts[L].file_bytes))
        return [(k[0], mf.leaf_under(self.drives[k[0]].path, relpath(self.model_id, L, e, k)), k[1], k[2])
                for k in keys]

    def _done(self, L: int) -> dict[str, str]:
        return self.state["experts"].setdefault(str(L), {})

    def remove_stale_tmp(self) -> None:
        """Temporary files an interrupted run left behind (never under a final name) are removed."""
        dirs = [os.path.join(self.out, "trunk"), self.out]
        dirs += [os.path.join(d.path, self.model_id, f"L{L:03d}") for d in self.drives for L in self.plan.moe_layers]
        n = 0
        for folder in dirs:
            if os.path.isdir(folder):
                for name in os.listdir(folder):
                    if _STALE_TMP.fullmatch(name):
                        os.unlink(os.path.join(folder, name))
                        n += 1
        if n:
            log.info("removed %d temporary files left by an interrupted pack", n)

    def check_space(self) -> None:
        need = {d.label: (d.path, 0) for d in self.drives}
        for L in self.plan.moe_layers:
            done = self._done(L)
            for e in range(self.plan.num_experts):
                if str(e) not in done:
                    for d, _path, _off, nbytes in self.files(L, e):
                        p, n = need[self.drives[d].label]
                        need[self.drives[d].label] = (p, n + nbytes)
        trunk_label = "model directory"
        need[trunk_label] = (self.out, 0 if self.state["trunk"] else self.plan.trunk_bytes)
        check_space(need)

    def write_all(self) -> None:
        from deltafin.progress import bar as progress_bar

        groups: dict = {}
        for t in self.plan.trunk:
            groups.setdefault(t.layer if t.layer is not None else "global", []).append(t)
        self.trunk_groups = groups
        layers = sorted({g for g in groups if g != "global"} | set(self.plan.moe_layers))
        total = self.plan.expert_bytes + self.plan.trunk_bytes
        try:
            with progress_bar(total, "pack", enabled=self.opts.progress) as bar:
                for L in layers:
                    if L in groups:
                        self._write_trunk(L, bar)
                    if L in self.plan.layouts:
                        self._write_layer(L, bar)
                if "global" in groups:
                    self._write_trunk("global", bar)
        finally:  # an error or Ctrl-C keeps what is already under final names
            self._save_state(force=True)

    def _write_trunk(self, group, bar) -> None:
        """One trunk file, streamed a block of rows at a time: memory holds a block, not the tensors."""
        entries = self.trunk_groups[group]
        bar.update(sum(t.out_bytes for t in entries))
        rel = _trunk_file(group)
        full = os.path.join(self.out, rel)
        if rel in self.state["trunk"]:
            if not self.opts.repair or trunk_intact(full, self.state["trunk_files"].get(rel)):
                return
            self.repaired += 1
        streams = {s[0]: ts for ts in (TrunkStream(self.ckpt, t, self.opts.allow_nonfinite) for t in entries)
                   for s in ts.specs}
        specs = [s for ts in dict.fromkeys(streams.values()) for s in ts.specs]
        os.makedirs(os.path.dirname(full), exist_ok=True)
        tmp = full + f".tmp-{os.getpid()}"
        try:
            size, digest = write_streamed(tmp, specs, lambda name: streams[name].chunks(name),
                                          {"format": "deltafin-trunk"})
        except BaseException:  # a full disk, bad weights or Ctrl-C: no partial file stays behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        was = self.state["trunk_files"].get(rel)
        if was is not None and was.get("xxh3") != digest:
            os.unlink(tmp)
            raise CheckpointError(f"{full}: {self.ckpt.path} does not reproduce the packed trunk (checksum {digest}, "
                                  f"packed {was.get('xxh3')}): this is not the checkpoint the model was packed from; "
                                  f"repair from the original checkpoint")
        os.replace(tmp, full)
        ef.fsync_dir(os.path.dirname(full))
        self.bytes_written += size
        if rel not in self.state["trunk"]:
            self.state["trunk"].append(rel)
        self.state["trunk_files"][rel] = {"bytes": size, "xxh3": digest}
        self._save_state(force=True)

    def _write_layer(self, L: int, bar) -> None:
        """Experts of one layer; reads+encoding and direct writes overlap across a few threads."""
        from concurrent.futures import ThreadPoolExecutor

        done = self._done(L)
        nbytes = self.plan.layouts[L].file_bytes
        todo = []
        for e in range(self.plan.num_experts):
            if str(e) in done and (not self.opts.repair or self._intact(L, e, done[str(e)])):
                self.skipped += 1
                bar.update(nbytes)
            else:
                self.repaired += str(e) in done
                todo.append(e)
        with ThreadPoolExecutor(WRITERS) as ex:
            for first in range(0, len(todo), COMMIT_BATCH):
                batch = todo[first : first + COMMIT_BATCH]
                staged = list(ex.map(lambda e: self._stage_expert(L, e), batch))
                os.sync()  # one flush makes the whole batch durable before any final name appears
                for e, digest, moves in staged:
                    if str(e) in done and done[str(e)] != digest:
                        for tmp, _final in moves:
                            os.unlink(tmp)
                        raise CheckpointError(
                            f"layer {L} expert {e} from {self.ckpt.path} does not reproduce the packed bytes "
                            f"(checksum {digest}, packed {done[str(e)]}): this is not the checkpoint the model was "
                            f"packed from; repair from the original checkpoint")
                    for tmp, final in moves:
                        os.replace(tmp, final)
                    done[str(e)] = digest
                    self.written += 1
                    bar.update(nbytes)
                for folder in {os.path.dirname(f[1]) for e in batch for f in self.files(L, e)}:
                    ef.fsync_dir(folder)
                self._save_state()
        self._save_state(force=True)

    def _intact(self, L: int, e: int, digest: str) -> bool:
        refs = self.files(L, e)
        files = [f[1] for f in refs]
        for p in files:
            _check_not_folder(p)
        for _d, p, _off, nbytes in refs:  # a link, or a file of the wrong size, is rewritten unread
            if os.path.islink(p) or not os.path.isfile(p) or os.path.getsize(p) != nbytes:
                if os.path.lexists(p):
                    log.warning("repair: %s is %s; rewriting it", p, "a link" if os.path.islink(p) else "the wrong size")
                return False
        # a striped expert's pieces are checked together: only the whole expert has a checksum
        for group in ([files] if L in self.layout.stripe else [[p] for p in files]):
            data = b"".join(_read(p) for p in group)
            if ef.checksum(data) != digest:
                log.warning("repair: %s is corrupt; rewriting it", ", ".join(group))
                return False
        return True

    def _stage_expert(self, L: int, e: int) -> tuple[int, str, list[tuple[str, str]]]:
        """Encode one expert and write it under temporary names: (expert, checksum, [(tmp, final)])."""
        layout = self.plan.layouts[L]
        check_expert_sources(self.ckpt, self.plan, L, e)
        buf = self._buffers.get(layout.file_bytes)
        try:
            sources = passthrough_sections(self.plan, L, e)
            if sources is None:
                data = ef.encode_into(expert_tensors(self.ckpt, self.plan, L, e, self.opts.allow_nonfinite), L, e, buf)
            else:  # released bytes: read straight into place, one copy
                data = buf[: layout.file_bytes]
                ef.header_into(layout, L, e, data)
                secs = [sec for t in layout.tensors for sec in t.sections]
                for sec, (name, row) in zip(secs, sources, strict=True):
                    read_into(self.ckpt, name, data[sec.offset : sec.offset + sec.nbytes], row)
                    if sec.kind == "scale" and not self.opts.allow_nonfinite and layout_format(layout, sec) == "mxfp4":
                        check_mxfp4_scales(data[sec.offset : sec.offset + sec.nbytes], name, row)
            assert len(data) == layout.file_bytes
            moves = []
            for _d, final, off, nbytes in self.files(L, e):
                _check_not_folder(final)
                moves.append((ef.write_tmp(final, data[off : off + nbytes], direct=True, sync=False), final))
                with self._lock:
                    self.bytes_written += nbytes
            return e, ef.checksum(data), moves
        finally:
            self._buffers.put(buf)

    def _save_state(self, force: bool = False) -> None:
        if force or time.monotonic() - self._last_save > 2.0:
            mf.write_json_atomic(os.path.join(self.out, STATE), self.state)
            self._last_save = time.monotonic()

    def per_drive(self) -> dict[str, dict]:
        out = {d.label: {"path": d.path, "gbps": d.gbps, "files": 0, "bytes": 0} for d in self.drives}
        for L in self.plan.moe_layers:
            for e in range(self.plan.num_experts):
                for d, _path, _off, nbytes in self.files(L, e):
                    out[self.drives[d].label]["files"] += 1
                    out[self.drives[d].label]["bytes"] += nbytes
        return out

    def manifest(self, src: str) -> dict:
        plan = self.plan
        trunk = {}
        for group, entries in self.trunk_groups.items():
            for t in entries:
                trunk[t.name] = {"file": _trunk_file(group), "format": t.format, "shape": list(t.shape)}
        return {
            "format": mf.FORMAT,
            "version": mf.VERSION,
            "model_id": self.model_id,
            "family": plan.family.name,
            "model_type": plan.config.get("model_type"),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": {"path": os.path.abspath(src), "experts": self.opts.experts, "trunk": self.opts.trunk,
                       "placement": self.opts.placement}
            | ({"trace": os.path.abspath(self.opts.trace), "spare_gb": self.opts.spare_gb} if self.opts.trace else {}),
            "config": "config.json",
            "trunk": {"bytes": plan.trunk_bytes, "default": self.opts.trunk, "tensors": trunk,
                      "files": {rel: self.state["trunk_files"][rel] for rel in sorted(self.state["trunk_files"])}},
            "experts": {
                "layers": plan.moe_layers,
                "num_experts": plan.num_experts,
                "placement": self.state.get("placement", self.opts.placement),
                "layouts": {str(L): layout_doc(plan.layouts[L]) for L in plan.moe_layers},
                "locations": {str(L): self.locations[L] for L in plan.moe_layers},
                "checksums": {str(L): [self._done(L)[str(e)] for e in range(plan.num_experts)] for L in plan.moe_layers},
            } | ({"stripe": {str(L): st for L, st in sorted(self.layout.stripe.items())}} if self.layout.stripe else {}),
            "drives": [{"label": d.label, "path": d.path, "gbps": round(d.gbps, 3), "measured": d.measured}
                       for d in self.drives],
            "skipped": len(plan.skipped),
        }


def layout_format(layout: ef.ExpertLayout, sec: ef.Section) -> str:
    return next(t.format for t in layout.tensors if sec in t.sections)


def _check_not_folder(path: str) -> None:
    """Something other than a file (or a link, which is replaced itself) under an expert's name is never
    replaced: it may be someone's data."""
    if os.path.lexists(path) and not os.path.islink(path) and not os.path.isfile(path):
        raise ExpertFileError(f"{path}: is a folder or special file, not an expert file; move it out of the way "
                              f"and re-run the same command")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _trunk_file(group) -> str:
    return os.path.join("trunk", f"layer-{group:03d}.safetensors" if isinstance(group, int) else "global.safetensors")


def is_side_file(name: str) -> bool:
    """A tokenizer, template or generation file a pack copies beside the manifest."""
    return name in TOKENIZER_FILES or any(p.fullmatch(name) for p in TOKENIZER_PATTERNS)


def _copy_side_files(ckpt: Checkpoint, out: str) -> list[str]:
    """config.json and the side files, copied atomically; returns the side files' names (for rm)."""
    copied = []
    for name in sorted(os.listdir(ckpt.path)):
        if (is_side_file(name) or name == "config.json") and os.path.isfile(os.path.join(ckpt.path, name)):
            dst = os.path.join(out, name)
            tmp = dst + f".tmp-{os.getpid()}"
            shutil.copyfile(os.path.join(ckpt.path, name), tmp)
            os.replace(tmp, dst)
            copied += [name] if name != "config.json" else []
    return copied
