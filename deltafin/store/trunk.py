"""The packed trunk on disk: safetensors files under ``trunk/``, each with its size and xxh3-64 checksum in
the manifest (``trunk.files``). Loaded with every header entry checked against the file and the manifest,
so a truncated or damaged trunk is one line naming the file, never a library traceback."""

from __future__ import annotations

import os

from deltafin.errors import TrunkFileError
from deltafin.quant.record import QTensor
from deltafin.store import manifest as mf
from deltafin.store.safetensors_io import file_checksum, read_header, read_tensors


def _fix(model_dir: str, doc: dict) -> str:
    src = (doc.get("source") or {}).get("path", "SRC")
    return f"re-run 'deltafin pack {src} {model_dir} --repair' to rewrite it"


def _files(doc: dict) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name, meta in doc["trunk"]["tensors"].items():
        by_file.setdefault(meta["file"], []).append(name)
    return by_file


def load_records(model_dir: str, doc: dict, progress=None) -> dict[str, QTensor]:
    """Every trunk tensor as a record (int8 stays int8 with its scales); ``progress(nbytes)`` per file."""
    tensors, fix, out = doc["trunk"]["tensors"], _fix(model_dir, doc), {}
    for rel, names in _files(doc).items():
        path = mf.resolve_under(model_dir, rel)
        want = [n for name in names for n in ([name, name + "#scale"] if tensors[name]["format"] == "int8" else [name])]
        got = read_tensors(path, TrunkFileError, fix, want)
        for name in names:
            meta = tensors[name]
            data = got[name]
            if tuple(data.shape) != tuple(meta["shape"]):
                raise TrunkFileError(f"{path}: tensor {name} is {list(data.shape)}, the manifest says {meta['shape']}; "
                                     f"{fix}")
            out[name] = QTensor(meta["format"], tuple(meta["shape"]), data, got.get(name + "#scale"))
        if progress is not None:
            progress(sum(t.nbytes for t in got.values()))
    return out


def check_file(path: str, rec: dict | None, names: list[str], fix: str) -> str | None:
    """The problem with one trunk file, or None: present, every tensor inside it, size and checksum as
    recorded (``rec``: {"bytes", "xxh3"}; older packs have none, and get the header checks only)."""
    try:
        entries, _, size = read_header(path, TrunkFileError, fix)
        missing = [n for n in names if n not in entries]
        if missing:
            return f"tensor(s) {', '.join(missing[:3])} missing"
        if rec is not None:
            if size != rec["bytes"]:
                return f"size {size:,} bytes, expected {rec['bytes']:,}"
            got = file_checksum(path, TrunkFileError, fix)
            if got != rec["xxh3"]:
                return f"checksum mismatch (expected {rec['xxh3']}, got {got})"
    except TrunkFileError as e:
        return str(e).removeprefix(f"{path}: ").split("; re-run")[0]
    return None


def trunk_intact(path: str, rec: dict | None) -> bool:
    """For ``pack --repair``: the file is there with the recorded size and checksum."""
    if rec is None or not os.path.isfile(path):
        return False
    return check_file(path, rec, [], "") is None


def verify_trunk(model_dir: str, doc: dict) -> list[tuple[str, str]]:
    """(path, problem) for every bad trunk file."""
    files = doc["trunk"].get("files") or {}
    fix = _fix(model_dir, doc)
    bad = []
    for rel, names in sorted(_files(doc).items()):
        path = mf.resolve_under(model_dir, rel)
        if not os.path.isfile(path):
            bad.append((path, "missing"))
            continue
        problem = check_file(path, files.get(rel), names, fix)
        if problem:
            bad.append((path, problem))
    return bad


def trunk_bytes(model_dir: str, doc: dict) -> int:
    return sum(os.path.getsize(mf.resolve_under(model_dir, rel)) for rel in _files(doc)
               if os.path.isfile(mf.resolve_under(model_dir, rel)))
