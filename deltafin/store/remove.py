"""Removing a packed model's files, and only those: ``deltafin rm``, ``pack --overwrite`` and the old
layout of a repack.

A file is deleted only when the manifest lists it and it lies in a folder carrying the model's marker
(``ownership``); a model packed before markers existed (no uid) has an expert file deleted only when its
own header names the layer and expert the manifest puts there. Everything else is kept and reported:
files a user put beside the model, a drive folder that now holds another model, a folder that is a link.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field

from deltafin.store import manifest as mf
from deltafin.store import ownership as own

_TMP = re.compile(r".+\.tmp-\d+(-\d+)?")


@dataclass
class FolderReport:
    folder: str
    files: int = 0
    bytes: int = 0
    kept: list[str] = field(default_factory=list)  # names left because Deltafin did not write them
    skipped: str | None = None  # why nothing in the folder was touched
    gone: bool = False  # the folder itself was removed


@dataclass
class RemoveReport:
    folders: list[FolderReport] = field(default_factory=list)

    @property
    def files(self) -> int:
        return sum(f.files for f in self.folders)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.folders)

    def lines(self) -> list[str]:
        from deltafin import fmt

        out = []
        for f in self.folders:
            if f.skipped:
                out.append(f"  kept {f.folder}: {f.skipped}")
                continue
            line = f"  {f.folder}: deleted {f.files:,} files ({fmt.size(f.bytes)})"
            line += "; folder removed" if f.gone else ""
            if f.kept:
                line += f"; kept {len(f.kept)} file(s) Deltafin did not write: {', '.join(f.kept[:5])}"
            out.append(line)
        return out


def layout_files(doc: dict, drive_paths: list[str]) -> dict[str, dict[str, int]]:
    """drive folder -> {path of each expert file or piece the manifest lists there: its size}."""
    from deltafin.store.place import Layout, relpath

    ex, mid = doc["experts"], doc["model_id"]
    layout = Layout.from_doc(ex)
    out: dict[str, dict[str, int]] = {os.path.join(p, mid): {} for p in drive_paths}
    for L in ex["layers"]:
        n = int(ex["layouts"][str(L)]["file_bytes"])
        for e in range(int(ex["num_experts"])):
            for key in layout.files(int(L), e, n):
                folder = os.path.join(drive_paths[key[0]], mid)
                out[folder][os.path.join(drive_paths[key[0]], relpath(mid, int(L), e, key))] = key[2]
    return out


def drive_paths(doc: dict, drive_map: dict[str, str] | None = None) -> list[str]:
    return [os.path.abspath((drive_map or {}).get(d.label, d.path)) for d in mf.drives(doc)]


def _legacy_ok(path: str, rel: str) -> bool:
    """A model without a uid: the file is a Deltafin expert file holding the expert its name says."""
    from deltafin.store.expert_file import parse_header

    m = re.search(r"L(\d{3})/E(\d{4})\.dfx(\.p(\d+)\+\d+)?$", rel)
    if m is None:
        return False
    if m.group(3) and int(m.group(4)) != 0:
        return True  # a later piece has no header of its own; its name and its folder's pieces say what it is
    try:
        with open(path, "rb") as f:
            _, layer, expert = parse_header(f.read(4096), path)
    except Exception:  # noqa: BLE001  (not an expert file: kept)
        return False
    return (layer, expert) == (int(m.group(1)), int(m.group(2)))


def remove_files(folder: str, files: dict[str, int], uid: str | None, keep: set[str] = frozenset(),
                 release: bool = True) -> FolderReport:
    """Delete ``files`` (path -> size) under one drive folder if the folder is the model's, except ``keep``;
    temporaries of an interrupted pack or placement go too. ``release``: drop the marker and the folder when
    nothing else is left."""
    rep = FolderReport(folder)
    if os.path.islink(folder):
        rep.skipped = "it is a link, not the folder Deltafin wrote"
        return rep
    if not os.path.isdir(folder):
        rep.skipped = "not found (drive not mounted? pass --drive-map LABEL=PATH)"
        return rep
    if uid is not None and not own.owned_by(folder, uid):
        other = own.read_owner(folder)
        rep.skipped = (f"it holds another model ({other.get('model_dir', '?')})" if other
                       else "it carries no marker of this model")
        return rep
    layer_dirs = set()
    for path, size in sorted(files.items()):
        if path in keep:
            continue
        layer_dirs.add(os.path.dirname(path))
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        if uid is None and not _legacy_ok(path, os.path.relpath(path, os.path.dirname(folder))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            rep.files += 1
            rep.bytes += size
    for d in sorted(layer_dirs):
        if os.path.isdir(d) and not os.path.islink(d):
            for name in os.listdir(d):
                if _TMP.fullmatch(name) and os.path.isfile(os.path.join(d, name)):
                    os.unlink(os.path.join(d, name))
            with contextlib.suppress(OSError):
                os.rmdir(d)
    if release:
        rep.kept = own.foreign_entries(folder, limit=20)
        rep.gone = own.release(folder, uid) if uid is not None else _rmdir(folder)
    return rep


def _rmdir(folder: str) -> bool:
    try:
        os.rmdir(folder)
        return True
    except OSError:
        return False


def out_files(out: str, doc: dict) -> list[str]:
    """The files a pack wrote into the model folder, as the manifest records them."""
    trunk = set((doc["trunk"].get("files") or {}).keys()) | {t["file"] for t in doc["trunk"]["tensors"].values()}
    from deltafin.store.pack import is_side_file

    side = doc.get("side_files")
    if not isinstance(side, list):  # packed before side files were recorded: the names a pack copies
        side = os.listdir(out)
    side = [n for n in side if isinstance(n, str) and is_side_file(n)]
    names = [mf.MANIFEST, "pack-state.json", "place-journal.json", doc.get("config", "config.json"), *side]
    return [os.path.join(out, n) for n in dict.fromkeys(names) if "/" not in n] + [
        os.path.join(out, t) for t in sorted(trunk) if t.startswith("trunk/") and ".." not in t]


def remove_model(out: str, doc: dict, drive_map: dict[str, str] | None = None, keep_out: bool = False) -> RemoveReport:
    """Every file of the model the manifest ``doc`` describes: expert files on each drive first, then (unless
    ``keep_out``) the model folder's own files, the manifest last, so an interrupted rm can be run again."""
    rep = RemoveReport()
    uid = doc.get("uid")
    for folder, files in layout_files(doc, drive_paths(doc, drive_map)).items():
        rep.folders.append(remove_files(folder, files, uid))
    if keep_out:
        return rep
    unmounted = [f.folder for f in rep.folders if f.skipped and f.skipped.startswith("not found")]
    if unmounted:  # the manifest stays, so that a re-run with --drive-map finds what is left
        rep.folders.append(FolderReport(out, skipped=f"kept with its manifest: {', '.join(unmounted)} not found; "
                                                     f"re-run 'deltafin rm' with --drive-map LABEL=PATH"))
        return rep
    f = FolderReport(out)
    paths = out_files(out, doc)
    manifest = os.path.join(out, mf.MANIFEST)
    for p in [x for x in paths if x != manifest] + [manifest]:
        if os.path.isfile(p) and not os.path.islink(p):
            f.bytes += os.path.getsize(p)
            os.unlink(p)
            f.files += 1
    for name in os.listdir(out):
        if re.fullmatch(r"\.deltafin-gen-\d+\.lock|.+\.tmp-\d+(-\d+)?", name) and os.path.isfile(
                os.path.join(out, name)):
            os.unlink(os.path.join(out, name))
    for sub in ("trunk", "experts"):
        _rmdir(os.path.join(out, sub))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(out, ".deltafin.lock"))
    f.kept = sorted(os.listdir(out))[:20] if os.path.isdir(out) else []
    f.gone = _rmdir(out)
    rep.folders.append(f)
    return rep


def rm_plan(out: str, drive_map: dict[str, str] | None = None) -> list[str]:
    """What ``rm_model`` would delete, one line per folder (nothing is touched)."""
    from deltafin import fmt

    doc = mf.load(out)
    uid = doc.get("uid")
    lines = []
    for folder, files in layout_files(doc, drive_paths(doc, drive_map)).items():
        there = {p: n for p, n in files.items() if os.path.isfile(p) and not os.path.islink(p)}
        if not os.path.isdir(folder) or os.path.islink(folder):
            lines.append(f"  {folder}: not found or a link; nothing deleted there")
        elif uid is not None and not own.owned_by(folder, uid):
            lines.append(f"  {folder}: does not carry this model's marker; nothing deleted there")
        else:
            lines.append(f"  {folder}: {len(there):,} expert files ({fmt.size(sum(there.values()))})")
    mine = [p for p in out_files(out, doc) if os.path.isfile(p)]
    lines.append(f"  {out}: {len(mine)} files (manifest, config, tokenizer, trunk)")
    return lines


def rm_model(out: str, drive_map: dict[str, str] | None = None) -> RemoveReport:
    """``deltafin rm``: under the model folder's writer lock, refused while a reader uses the model."""
    from deltafin.store.locks import LockedError, model_lock, readers_gone

    with model_lock(out, "rm"):
        doc = mf.load(out)
        if not readers_gone(out, int(doc.get("generation", 0))):
            raise LockedError(f"{out} is in use by a running deltafin (run, serve, batch, classify or verify); stop "
                              f"it first, then rm again")
        return remove_model(out, doc, drive_map)
