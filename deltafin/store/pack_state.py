"""The packer's progress record (``pack-state.json``) and the settings fingerprint that ties a resumed
or repeated pack to the run that started it."""

from __future__ import annotations

import hashlib
import json
import os

from deltafin.errors import UsageError
from deltafin.store import expert_file as ef
from deltafin.store.drives import DriveArg
from deltafin.store.plan import PackPlan

STATE = "pack-state.json"


def fingerprint(plan: PackPlan, drives: list[DriveArg], model_id: str, opts) -> str:
    """A digest of everything that decides what a pack writes (``opts``: the PackOptions)."""
    doc = {
        "config": plan.config, "experts": opts.experts, "trunk": opts.trunk, "placement": opts.placement,
        "model_id": model_id, "drives": [(d.label, os.path.realpath(d.path), d.gbps) for d in drives],
        "expert_file": [ef.VERSION, {str(L): layout_doc(plan.layouts[L]) for L in plan.moe_layers}],
    }
    if opts.trace:  # only when set, so packs without one keep their fingerprints
        with open(opts.trace, "rb") as f:
            doc["trace"] = [hashlib.sha256(f.read()).hexdigest(), opts.spare_gb]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def new_state(digest: str) -> dict:
    return {"fingerprint": digest, "experts": {}, "trunk": [], "trunk_files": {}, "locations": None, "stripe": {},
            "drives": None}


def load_state(out: str, digest: str) -> dict | None:
    p = os.path.join(out, STATE)
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            st = json.load(f)
    except ValueError as e:
        raise UsageError(f"{p}: unreadable pack state ({e}); remove it and re-run to start the pack over") from e
    if st.get("fingerprint") != digest:
        raise UsageError(
            f"{out} holds an interrupted pack with different settings (source config, formats, drives or "
            f"placement); re-run with the same arguments to resume, or remove {p} and the expert folders to start over"
        )
    return new_state(digest) | st


def state_from_manifest(prior: dict | None, digest: str) -> dict | None:
    """A finished pack with the same settings: its files are done, where its manifest says they are."""
    if prior is None or prior.get("fingerprint") != digest:
        return None
    ex = prior["experts"]
    return {
        "fingerprint": digest,
        "experts": {str(L): {str(e): c for e, c in enumerate(ex["checksums"][str(L)])} for L in ex["layers"]},
        "trunk": sorted({t["file"] for t in prior["trunk"]["tensors"].values()}),
        "trunk_files": dict(prior["trunk"].get("files") or {}),
        "locations": {str(L): ex["locations"][str(L)] for L in ex["layers"]},
        "stripe": ex.get("stripe") or {},  # 'deltafin place' may have changed the layout since
        "placement": ex.get("placement", "bandwidth"),
        "drives": {d["label"]: [d["gbps"], d.get("measured", False)] for d in prior["drives"]},
    }


def layout_doc(layout: ef.ExpertLayout) -> dict:
    return {
        "file_bytes": layout.file_bytes,
        "payload_bytes": layout.payload_bytes,
        "tensors": [{"name": t.name, "format": t.format, "shape": list(t.shape)} for t in layout.tensors],
    }
