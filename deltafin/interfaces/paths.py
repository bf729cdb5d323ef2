"""Model arguments as users of other runners give them: a folder, the id of a packed model (as
``deltafin list`` shows), or a Hugging Face repo id (``org/name``) found in the local Hugging Face cache.
Nothing is downloaded here ('deltafin pull' downloads)."""

from __future__ import annotations

import os
import re

from deltafin.errors import UsageError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_cached(repo_id: str) -> str | None:
    """The newest cached snapshot folder of ``repo_id`` in the local Hugging Face cache, or None."""
    if not _REPO_ID.match(repo_id):
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return snapshot_download(repo_id, local_files_only=True)  # never touches the network
    except Exception:  # not cached (LocalEntryNotFoundError) or a malformed cache entry
        return None


def resolve_checkpoint(arg: str) -> str:
    """A checkpoint folder, or a repo id in the local Hugging Face cache."""
    if os.path.exists(arg) or not _REPO_ID.match(arg):
        return arg
    snap = hf_cached(arg)
    if snap is None:
        top = arg.split("/", 1)[0]
        if os.path.isdir(top):  # a local folder with a mistyped name inside it, not a repo id
            raise UsageError(f"{arg}: no such folder in {top}/; check the name (ls {top})")
        raise UsageError(f"{arg}: no such folder, and not a Hugging Face repo in the local cache; download and pack "
                         f"it with 'deltafin pull {arg} OUT', or give the checkpoint folder")
    return snap


def resolve_packed(arg: str) -> str:
    """A packed model folder, or the id of a packed model recorded by 'deltafin pack'."""
    if os.path.exists(arg):
        from deltafin.store.manifest import MANIFEST

        if os.path.isfile(os.path.join(arg, "config.json")) and not os.path.exists(os.path.join(arg, MANIFEST)) \
                and not os.path.exists(os.path.join(arg, "pack-state.json")):
            raise UsageError(f"{arg} is a Hugging Face checkpoint, not a packed model; pack it first: "
                             f"deltafin pack {arg} OUT (then use OUT)")
        return arg
    from deltafin.store.catalog import find

    hit = find(arg)
    if hit is not None:
        return hit
    if _REPO_ID.match(arg) and hf_cached(arg):
        raise UsageError(f"{arg} is a Hugging Face checkpoint, not a packed model; pack it first: "
                         f"deltafin pack {arg} OUT --drive PATH")
    raise UsageError(f"{arg}: no such model folder or packed model id; 'deltafin list' shows the packed models")
