"""Is everything a reader of a packed model uses still where it opened it? (``/health`` of ``deltafin serve``.)

Checks the manifest (still there, still this model, its layout the one in use), each drive folder (there,
with this model's marker) and every expert file of the layout (present, the right size): a stat per file.
"""

from __future__ import annotations

import os

from deltafin.errors import ManifestError
from deltafin.store import manifest as mf
from deltafin.store import ownership as own


def problems(pm, limit: int = 5) -> list[str]:
    out: list[str] = []
    try:
        doc = mf.load(pm.path)
    except ManifestError as e:
        return [f"manifest: {str(e)[:300]}"]
    if doc.get("uid") != pm.doc.get("uid") or doc["model_id"] != pm.model_id:
        out.append(f"{pm.path} now holds another model or a repack; restart the server to serve it")
    elif int(doc.get("generation", 0)) != pm.generation:
        out.append(f"{pm.path}: its layout changed (generation {doc.get('generation')}) and is not taken up yet")
    uid = pm.doc.get("uid")
    for d in pm.drives:
        folder = os.path.join(d.path, pm.model_id)
        if not os.path.isdir(folder):
            out.append(f"drive {d.label}: {folder} is missing (drive unmounted or files moved)")
        elif uid is not None and not own.owned_by(folder, uid):
            out.append(f"drive {d.label}: {folder} no longer carries this model's marker")
    if out:
        return out[:limit]
    missing = 0
    first = None
    for L in pm.moe_layers:
        for e in range(pm.num_experts):
            try:
                refs = [(r.path, r.nbytes) for r in pm.expert_files(L, e)]
            except ManifestError as err:
                return [str(err)[:300]]
            for path, nbytes in refs:
                try:
                    ok = os.stat(path).st_size == nbytes
                except OSError:
                    ok = False
                if not ok:
                    missing += 1
                    first = first or path
    if missing:
        out.append(f"{missing:,} expert files missing or of the wrong size (first: {first}); run 'deltafin verify'")
    return out
