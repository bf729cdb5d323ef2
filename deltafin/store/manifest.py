"""The model manifest (deltafin.json): versioned, validated on load, the last file a pack writes.

Expert files live on drives at ``<drive root>/<model_id>/L{layer:03d}/E{expert:04d}.dfx``; the manifest
names drives by label only, and paths are derived, so a manifest can never point outside its drive roots.

A layer may instead be striped (optional ``experts.stripe[layer]``): each expert file is cut into 4 KiB-aligned
pieces, one per drive, stored as ``E{expert:04d}.dfx.p{offset}+{nbytes}``. A piece's name says which bytes of
the expert it holds, so two layouts never disagree about what a file under one name contains.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from deltafin.errors import ManifestError

MANIFEST = "deltafin.json"
FORMAT = "deltafin-model"
VERSION = 1
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
STRIPE_MODES = ("bandwidth", "equal")  # pieces sized by drive read rate, or equal (RAID-0-like)
_REQUIRED = ("format", "version", "model_id", "family", "model_type", "config", "trunk", "experts", "drives")


@dataclass(frozen=True, slots=True)
class DriveEntry:
    label: str
    path: str  # mount point at pack time; remappable at run time
    gbps: float
    measured: bool


def expert_relpath(model_id: str, layer: int, expert: int) -> str:
    return os.path.join(model_id, f"L{layer:03d}", f"E{expert:04d}.dfx")


def piece_relpath(model_id: str, layer: int, expert: int, offset: int, nbytes: int) -> str:
    """Where bytes [offset, offset + nbytes) of a striped expert file live on their drive."""
    return f"{expert_relpath(model_id, layer, expert)}.p{offset}+{nbytes}"


def check_model_id(model_id: str) -> str:
    if not isinstance(model_id, str) or not _SAFE_ID.fullmatch(model_id) or model_id in (".", ".."):
        raise ManifestError(
            f"model id {model_id!r} is not a safe folder name (letters, digits, '.', '_', '-'; no '/' or '..')"
        )
    return model_id


def resolve_under(root: str, rel: str) -> str:
    """root/rel, refusing anything that escapes root (absolute paths, '..', symlinked parents)."""
    if os.path.isabs(rel) or ".." in rel.split(os.sep):
        raise ManifestError(f"path {rel!r} escapes its drive root {root}; the manifest is corrupt")
    root_real = os.path.realpath(root)
    full = os.path.realpath(os.path.join(root_real, rel))
    if os.path.commonpath([root_real, full]) != root_real:
        raise ManifestError(f"path {rel!r} resolves outside its drive root {root}; the manifest is corrupt")
    return full


def leaf_under(root: str, rel: str) -> str:
    """root/rel with its folders resolved under root (``resolve_under``) but its last part not followed: an
    expert file that is a link is reported, or replaced itself, never taken for its target."""
    folder = resolve_under(root, os.path.dirname(rel))
    return os.path.join(folder, os.path.basename(rel))


def validate(doc: dict, where: str) -> dict:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise ManifestError(f"{where}: not a Deltafin model manifest (format {got!r} "
                            f"is not {FORMAT!r}); pass the directory written by 'deltafin pack'")
    if doc.get("version") != VERSION:
        raise ManifestError(f"{where}: manifest version {doc.get('version')!r} is not supported (this Deltafin "
                            f"reads version {VERSION}); repack the model with this version")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise ManifestError(f"{where}: manifest is missing field(s) {', '.join(missing)}; repack the model")
    check_model_id(doc["model_id"])
    ex = doc["experts"]
    if not isinstance(ex, dict):
        raise ManifestError(f"{where}: manifest experts section is not an object; repack the model")
    for k in ("layers", "num_experts", "layouts", "locations", "checksums"):
        if k not in ex:
            raise ManifestError(f"{where}: manifest experts section is missing {k!r}; repack the model")
    _check_types(doc, where)
    if not isinstance(doc["drives"], list) or not doc["drives"]:
        raise ManifestError(f"{where}: manifest drives must be a non-empty list; repack the model")
    for d in doc["drives"]:
        if not (isinstance(d, dict) and isinstance(d.get("label"), str) and isinstance(d.get("path"), str)
                and _number(d.get("gbps")) and 0 < d["gbps"] < math.inf):
            raise ManifestError(f"{where}: drive entry {d!r} needs a label, a path and a read rate gbps > 0; "
                                f"repack the model")
    labels = [d["label"] for d in doc["drives"]]
    if len(set(labels)) != len(labels):
        raise ManifestError(f"{where}: duplicate drive labels {labels}")
    n = len(labels)
    for L in ex["layers"]:
        locs, sums = ex["locations"].get(str(L)), ex["checksums"].get(str(L))
        if locs is None or sums is None or len(locs) != ex["num_experts"] or len(sums) != ex["num_experts"]:
            raise ManifestError(f"{where}: layer {L} has incomplete expert locations or checksums; repack the model")
        if any(not isinstance(loc, list) or not loc or any(isinstance(d, bool) or not isinstance(d, int)
                                                            or not 0 <= d < n for d in loc) for loc in locs):
            raise ManifestError(f"{where}: layer {L} names a drive that is not in the drive list; repack the model")
        rep = next((e for e, loc in enumerate(locs) if len(set(loc)) != len(loc)), None)
        if rep is not None:
            raise ManifestError(f"{where}: layer {L} expert {rep} lists drive(s) {locs[rep]} more than once (one "
                                f"copy counted twice); the manifest is damaged: repack the model, or run "
                                f"'deltafin place' from a backup of {MANIFEST}")
    stripe = ex.get("stripe")
    if stripe is not None:
        if not isinstance(stripe, dict):
            raise ManifestError(f"{where}: manifest experts.stripe is not an object; repack the model")
        for L, st in stripe.items():
            _check_stripe(ex, L, st, n, where)
    if "generation" in doc:
        _int_field(where, "generation", doc["generation"], 0)
    if "uid" in doc and not (isinstance(doc["uid"], str) and re.fullmatch(r"[0-9a-f]{32}", doc["uid"])):
        raise _bad(where, "uid", doc["uid"], "32 hex digits")
    if ex.get("ranks") is not None:  # optional: expert ownership over the ranks of a cluster
        from deltafin.store.ranks import check_ranks

        check_ranks(ex, labels, where)
    return doc


MAX_FILE_BYTES = 1 << 36  # 64 GiB: far past any expert file, short of sizes no reader can allocate
_HEX16 = re.compile(r"[0-9a-f]{16}")


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _bad(where: str, field: str, v, need: str) -> ManifestError:
    return ManifestError(f"{where}: field {field} = {json.dumps(v)[:80]} must be {need}; the manifest is damaged: "
                         f"repack the model (or restore {MANIFEST} from a backup)")


def _int_field(where: str, field: str, v, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _bad(where, field, v, f"an integer >= {lo}" + (f" and <= {hi:,}" if hi is not None else ""))
    return v


def _check_types(doc: dict, where: str) -> None:
    """One schema for every field the readers use: type, sign and range, named by its path on failure."""
    for k in ("family", "config"):
        if not isinstance(doc[k], str) or not doc[k]:
            raise _bad(where, k, doc[k], "a non-empty string")
    ex, tr = doc["experts"], doc["trunk"]
    layers = ex["layers"]
    if not isinstance(layers, list) or len(set(map(str, layers))) != len(layers):
        raise _bad(where, "experts.layers", layers, "a list of distinct layer numbers")
    for i, L in enumerate(layers):
        _int_field(where, f"experts.layers[{i}]", L)
    n = _int_field(where, "experts.num_experts", ex["num_experts"], 1)
    for k in ("layouts", "locations", "checksums"):
        if not isinstance(ex[k], dict):
            raise _bad(where, f"experts.{k}", ex[k], "an object keyed by layer")
    for L in layers:
        lay = ex["layouts"].get(str(L))
        if not isinstance(lay, dict):
            raise _bad(where, f"experts.layouts.{L}", lay, "an object with file_bytes")
        fb = _int_field(where, f"experts.layouts.{L}.file_bytes", lay.get("file_bytes"), 4096, MAX_FILE_BYTES)
        if fb % 4096:
            raise _bad(where, f"experts.layouts.{L}.file_bytes", fb, "a multiple of 4096")
        sums = ex["checksums"].get(str(L))
        if not isinstance(sums, list) or len(sums) != n or not all(isinstance(c, str) and _HEX16.fullmatch(c)
                                                                  for c in sums):
            raise _bad(where, f"experts.checksums.{L}", "...", f"a list of {n} xxh3-64 hex checksums")
    if not isinstance(tr, dict) or not isinstance(tr.get("tensors"), dict):
        raise _bad(where, "trunk.tensors", tr.get("tensors") if isinstance(tr, dict) else tr, "an object")
    for name, t in tr["tensors"].items():
        if not (isinstance(t, dict) and isinstance(t.get("file"), str) and isinstance(t.get("format"), str)
                and isinstance(t.get("shape"), list)):
            raise _bad(where, f"trunk.tensors.{name}", t, "an object with file, format and shape")
        for i, x in enumerate(t["shape"]):
            _int_field(where, f"trunk.tensors.{name}.shape[{i}]", x)
    files = tr.get("files") or {}
    if not isinstance(files, dict):
        raise _bad(where, "trunk.files", files, "an object")
    for rel, rec in files.items():
        if not (isinstance(rec, dict) and isinstance(rec.get("xxh3"), str) and _HEX16.fullmatch(rec["xxh3"])):
            raise _bad(where, f"trunk.files.{rel}", rec, "an object with bytes and an xxh3 checksum")
        _int_field(where, f"trunk.files.{rel}.bytes", rec.get("bytes"), 8)


def _check_stripe(ex: dict, L: str, st, ndrives: int, where: str) -> None:
    """A striped layer: contiguous 4 KiB-aligned pieces covering the file, one per distinct drive."""
    fix = "repack the model, or re-run 'deltafin place' to finish an interrupted placement"
    bad = f"{where}: layer {L} stripe"
    if L not in {str(x) for x in ex["layers"]}:
        raise ManifestError(f"{bad}: {L!r} is not one of the MoE layers {ex['layers']}; {fix}")
    if not isinstance(st, dict) or st.get("mode") not in STRIPE_MODES or not isinstance(st.get("pieces"), list) \
            or not st["pieces"]:
        raise ManifestError(f"{bad}: needs a mode (one of {', '.join(STRIPE_MODES)}) and a non-empty list of "
                            f"pieces; {fix}")
    offset, drives = 0, []
    for p in st["pieces"]:
        if not (isinstance(p, dict) and all(isinstance(p.get(k), int) for k in ("drive", "offset", "nbytes"))):
            raise ManifestError(f"{bad}: piece {p!r} needs integer drive, offset and nbytes; {fix}")
        if not 0 <= p["drive"] < ndrives:
            raise ManifestError(f"{bad}: piece {p!r} names drive {p['drive']}, not in the drive list; {fix}")
        if p["offset"] != offset or p["offset"] % 4096 or p["nbytes"] <= 0 or p["nbytes"] % 4096:
            raise ManifestError(f"{bad}: piece {p!r} must start at byte {offset} and be a positive multiple of "
                                f"4096 bytes (pieces are contiguous and 4 KiB-aligned); {fix}")
        offset += p["nbytes"]
        drives.append(p["drive"])
    file_bytes = (ex["layouts"].get(L) or {}).get("file_bytes")
    if offset != file_bytes:
        raise ManifestError(f"{bad}: pieces cover {offset} bytes, but the layer's expert files are {file_bytes}; {fix}")
    if len(set(drives)) != len(drives):
        raise ManifestError(f"{bad}: drives {drives} repeat; each drive holds at most one piece of an expert; {fix}")
    if any(loc != drives for loc in ex["locations"][L]):
        raise ManifestError(f"{bad}: every expert's locations must list the pieces' drives {drives}; {fix}")


def load(model_dir: str) -> dict:
    p = os.path.join(model_dir, MANIFEST)
    if not os.path.exists(p):
        hint = " (a pack is in progress or was interrupted: re-run 'deltafin pack' to finish it)" if os.path.exists(
            os.path.join(model_dir, "pack-state.json")) else ""
        raise ManifestError(f"{model_dir}: no {MANIFEST}; not a packed Deltafin model{hint}")
    try:
        with open(p) as f:
            doc = json.load(f)
    except ValueError as e:
        raise ManifestError(f"{p}: invalid JSON ({e}); the manifest is corrupt, re-run 'deltafin pack'") from e
    return validate(doc, p)


def write_json_atomic(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drives(doc: dict) -> list[DriveEntry]:
    return [DriveEntry(d["label"], d["path"], float(d["gbps"]), bool(d.get("measured", False))) for d in doc["drives"]]


def parse_drive_map(items: list[str] | None) -> dict[str, str]:
    """'LABEL=PATH' pairs from --drive-map."""
    out = {}
    for it in items or []:
        label, sep, path = it.partition("=")
        if not sep or not label or not path:
            raise ManifestError(f"--drive-map {it!r}: expected LABEL=PATH, e.g. d1=/mnt/ssd2")
        out[label] = path
    return out
