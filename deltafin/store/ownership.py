"""Which model every file Deltafin writes belongs to.

A pack gives its model a random ``uid`` (kept in the manifest and ``pack-state.json``) and writes a marker
``.deltafin-owner.json`` holding it into each drive folder (``<drive>/<model_id>/``) before any expert
file. Deleting (``rm``, ``place``, a repack) removes only files the manifest lists, from folders whose
marker carries the model's uid; packing refuses a folder whose marker names another model or that holds
anything Deltafin did not write. The marker is claimed with a hard link (atomic, fails if it exists), so
two packs racing for one folder cannot both win.

The source checkpoint's identity (a digest of its config, its shard headers and sizes, and the first and
last MiB of each shard's data) is recorded too: ``--repair`` and a resumed pack read only from the
checkpoint the model was packed from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import struct

from deltafin.errors import CheckpointError, DeltafinError

OWNER = ".deltafin-owner.json"
OWNER_FORMAT = "deltafin-owner"
_UID = re.compile(r"[0-9a-f]{32}")
# what Deltafin writes inside a drive folder: layer folders of expert files and pieces (and their temporaries)
_DRIVE_NAME = re.compile(r"L\d{3}")
_EXPERT_NAME = re.compile(r"E\d{4}\.dfx(\.p\d+\+\d+)?(\.tmp-\d+(-\d+)?)?")
SAMPLE = 1 << 20  # bytes of each shard's data hashed at its start and its end


class OwnershipError(DeltafinError):
    """A folder holds another model's files or files Deltafin did not write."""


def new_uid() -> str:
    return secrets.token_hex(16)


def valid_uid(uid) -> bool:
    return isinstance(uid, str) and bool(_UID.fullmatch(uid))


def read_owner(folder: str) -> dict | None:
    """The marker of a drive folder, or None (no marker, or not a readable one)."""
    p = os.path.join(folder, OWNER)
    if os.path.islink(p) or not os.path.isfile(p):
        return None
    try:
        with open(p, "rb") as f:
            doc = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != OWNER_FORMAT or not valid_uid(doc.get("uid")):
        return None
    return doc


def owned_by(folder: str, uid: str | None) -> bool:
    """Whether ``folder`` carries ``uid``'s marker (a real folder, not a link to one)."""
    if uid is None or os.path.islink(folder) or not os.path.isdir(folder):
        return False
    doc = read_owner(folder)
    return doc is not None and doc["uid"] == uid


def foreign_entries(folder: str, limit: int = 3) -> list[str]:
    """Up to ``limit`` names under a drive folder that Deltafin does not write there."""
    out = []
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if name in (OWNER,) or name.startswith(OWNER + ".tmp-"):
            continue
        if _DRIVE_NAME.fullmatch(name) and os.path.isdir(full) and not os.path.islink(full):
            out += [os.path.join(name, n) for n in sorted(os.listdir(full))
                    if not _EXPERT_NAME.fullmatch(n) or os.path.islink(os.path.join(full, n))][: limit - len(out)]
        else:
            out.append(name)
        if len(out) >= limit:
            break
    return out


def check_claim(folder: str, uid: str, label: str, adopt: bool = False) -> bool:
    """Whether ``folder`` is already this model's; refused (naming it) when it is another model's or, without
    a marker, holds anything at all (an expert-named file there may be anyone's). ``adopt``: the folder of this
    model packed before markers existed, whose Deltafin-named files are taken as its own. Writes nothing."""
    if os.path.islink(folder) or (os.path.exists(folder) and not os.path.isdir(folder)):
        raise OwnershipError(f"drive {label}: {folder} is a link or a file, not a folder Deltafin wrote; move it "
                             f"away, or pass --model-id NAME to use another folder on the drive")
    doc = read_owner(folder) if os.path.isdir(folder) else None
    if doc is not None:
        if doc["uid"] == uid:
            return True
        raise OwnershipError(f"drive {label}: {folder} holds the expert files of another model "
                             f"({doc.get('model_dir', '?')}); pass --model-id NAME to give this one its own "
                             f"folder, or 'deltafin rm' the other model first")
    if os.path.isdir(folder):
        stray = foreign_entries(folder) if adopt else sorted(n for n in os.listdir(folder)
                                                              if not n.startswith(OWNER + ".tmp-"))[:3]
        if stray:
            raise OwnershipError(f"drive {label}: {folder} already holds files Deltafin did not write "
                                 f"({', '.join(stray)}); pass --model-id NAME to use another folder on the drive, "
                                 f"or empty that folder")
    return False


def claim(folder: str, uid: str, model_dir: str, model_id: str, label: str, adopt: bool = False) -> None:
    """Make ``folder`` this model's (``uid``): refused, naming it, when another model's marker is there or
    the folder holds files Deltafin did not write (``check_claim``). Idempotent for the owner."""
    if check_claim(folder, uid, label, adopt):
        return
    os.makedirs(folder, exist_ok=True)
    body = json.dumps({"format": OWNER_FORMAT, "version": 1, "uid": uid, "model_id": model_id,
                       "model_dir": os.path.abspath(model_dir)}, indent=1).encode()
    tmp = os.path.join(folder, f"{OWNER}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, os.path.join(folder, OWNER))  # atomic: fails if another pack claimed it first
    except FileExistsError:
        os.unlink(tmp)
        if read_owner(folder) is None:
            raise OwnershipError(f"drive {label}: {os.path.join(folder, OWNER)} is not a marker Deltafin can read; "
                                 f"move the folder away, or pass --model-id NAME to use another one") from None
        return claim(folder, uid, model_dir, model_id, label, adopt)
    os.unlink(tmp)
    from deltafin.store.expert_file import fsync_dir

    fsync_dir(folder)


def release(folder: str, uid: str) -> bool:
    """Remove the marker and the folder itself when it is empty after that; True when the folder is gone."""
    if not owned_by(folder, uid):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, OWNER))
    try:
        os.rmdir(folder)
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- the model folder (OUT)

# what a pack writes into OUT: the manifest, its progress records, side files, the trunk, the default drive
OUT_NAMES = {"deltafin.json", "pack-state.json", "place-journal.json", "config.json", "trunk", "experts",
             ".deltafin.lock", "source"}  # source: where deltafin pull downloads the checkpoint
_OUT_TEMP = re.compile(r"(.+\.tmp-\d+(-\d+)?|\.deltafin-gen-\d+\.lock|\.deltafin-write-probe-\d+|\.deltafin-probe-\d+)")


def out_foreign(out: str, side_files) -> list[str]:
    """Names in OUT that no pack writes there (``side_files(name)``: tokenizer and template files)."""
    if not os.path.isdir(out):
        return []
    return [n for n in sorted(os.listdir(out)) if n not in OUT_NAMES and not _OUT_TEMP.fullmatch(n)
            and not side_files(n)][:3]


# ---------------------------------------------------------------- the source checkpoint's identity


def source_identity(ckpt) -> str:
    """A digest that tells this checkpoint's weights apart from another of the same architecture, read in a
    few MiB per shard (headers, sizes, the first and last MiB of data), not the whole checkpoint. A checkpoint
    still being downloaded (``deltafin pull``) gives its own, from the Hub's checksums."""
    if hasattr(ckpt, "source_identity"):
        return ckpt.source_identity()
    h = hashlib.sha256()
    with open(os.path.join(ckpt.path, "config.json"), "rb") as f:
        h.update(f.read(1 << 24))
    for shard in sorted(ckpt.shards()):
        path = os.path.join(ckpt.path, shard)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                start = 8 + n if 8 + n <= size else 8
                f.seek(0)
                h.update(shard.encode() + b"\0" + str(size).encode() + f.read(min(start, 1 << 26)))
                f.seek(start)
                h.update(f.read(SAMPLE))
                f.seek(max(start, size - SAMPLE))
                h.update(f.read(SAMPLE))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror}); check the checkpoint") from None
    return h.hexdigest()[:32]


def check_same_source(recorded: str | None, current: str, src: str, out: str, packed_from: str | None) -> None:
    """``--repair`` and resumed packs read only from the checkpoint the model was packed from."""
    if recorded is not None and recorded != current:
        raise CheckpointError(f"{src} is not the checkpoint {out} was packed from ({packed_from or 'recorded'}: "
                              f"identity {recorded}, this one {current}); repair from the original checkpoint, or "
                              f"pass --overwrite to replace the model with this one")
