"""The catalog of packed models (home()/models.json): which model folders 'deltafin pack' wrote, so that
'deltafin list', 'deltafin rm' and 'deltafin run ID' find them. The model folders stay the truth: an
entry whose folder is gone is shown as missing, never trusted."""

from __future__ import annotations

import json
import os

from deltafin import home

FILE = "models.json"


def _load() -> dict[str, dict]:
    try:
        with open(os.path.join(home.home(), FILE), encoding="utf-8") as f:
            doc = json.load(f)
        return doc.get("models", {}) if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _save(models: dict[str, dict]) -> None:
    from deltafin.store.manifest import write_json_atomic

    write_json_atomic(home.path(FILE), {"format": "deltafin-catalog", "version": 1, "models": models})


def record(model_dir: str, model_id: str) -> None:
    models = _load()
    models[os.path.abspath(model_dir)] = {"id": model_id}
    _save(models)


def forget(model_dir: str) -> None:
    models = _load()
    if models.pop(os.path.abspath(model_dir), None) is not None:
        _save(models)


def entries() -> list[tuple[str, str]]:
    """(model folder, model id) in the order they were packed."""
    return [(p, e.get("id", os.path.basename(p))) for p, e in _load().items()]


def find(name: str) -> str | None:
    """The folder of the packed model whose id (or folder name) is ``name``, if exactly one matches."""
    hits = [p for p, mid in entries() if name in (mid, os.path.basename(p)) and os.path.isdir(p)]
    return hits[0] if len(hits) == 1 else None
