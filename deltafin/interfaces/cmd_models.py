"""``deltafin list`` and ``deltafin rm``: the packed models, whose files span a model folder and every drive."""

from __future__ import annotations

import os
import sys

from deltafin.errors import DeltafinError, UsageError


def add_list_args(p) -> None:
    p.add_argument("folders", nargs="*", metavar="FOLDER",
                   help="also list packed models in these folders (and the folders themselves, if packed models)")
    p.add_argument("--json", metavar="PATH", help="also write the list as JSON")


def add_rm_args(p) -> None:
    p.add_argument("model", help="packed model folder, or its id as 'deltafin list' shows it")
    p.add_argument("--drive-map", action="append", metavar="LABEL=PATH", help="drive LABEL is now mounted at PATH")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask; needed when stdin is not a terminal")


def run(args) -> int:
    return _list(args) if args.command == "list" else _rm(args)


def describe(model_dir: str, drive_map: dict[str, str] | None = None) -> dict:
    """What a packed model holds and whether each of its drives is there (works with drives missing)."""
    from deltafin.store import manifest as mf

    doc = mf.load(model_dir)
    ex = doc["experts"]
    expert_bytes = sum(ex["layouts"][str(L)]["file_bytes"] * ex["num_experts"] for L in ex["layers"])
    drives = []
    for d in mf.drives(doc):
        root = os.path.abspath((drive_map or {}).get(d.label, d.path))
        folder = os.path.join(root, doc["model_id"])
        drives.append({"label": d.label, "path": root, "folder": folder, "present": os.path.isdir(folder)})
    return {"id": doc["model_id"], "path": os.path.abspath(model_dir), "family": doc["family"],
            "expert_bytes": expert_bytes, "trunk_bytes": doc["trunk"]["bytes"], "drives": drives}


def _candidates(folders: list[str]) -> list[str]:
    from deltafin.store.catalog import entries
    from deltafin.store.manifest import MANIFEST

    seen = [p for p, _ in entries()]
    for f in folders:
        if not os.path.isdir(f):
            raise UsageError(f"{f}: no such folder; give a folder that holds packed models (or none, for the recorded ones)")
        subs = [f] + [os.path.join(f, n) for n in sorted(os.listdir(f))]
        seen += [os.path.abspath(s) for s in subs if os.path.isfile(os.path.join(s, MANIFEST))]
    return list(dict.fromkeys(seen))


def _list(args) -> int:
    from deltafin import fmt

    rows = []
    for path in _candidates(args.folders):
        try:
            rows.append(describe(path))
        except DeltafinError as e:  # folder gone or not a model any more: say so, keep listing
            rows.append({"id": os.path.basename(path), "path": path, "error": str(e)})
    if not rows:
        print("no packed models yet ('deltafin pack SRC OUT' records the models it packs; "
              "'deltafin list FOLDER' looks in a folder)")
    for r in rows:
        if "error" in r:
            print(f"{r['id']:<24} MISSING  {r['path']}  ({r['error'].split(';')[0]})")
            continue
        gone = [d["label"] for d in r["drives"] if not d["present"]]
        state = f"drive(s) {', '.join(gone)} not mounted" if gone else "ok"
        print(f"{r['id']:<24} {r['family']:<12} experts {fmt.size(r['expert_bytes']):>9} + trunk "
              f"{fmt.size(r['trunk_bytes']):>9}  {len(r['drives'])} drive(s)  {state}  {r['path']}")
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(os.path.abspath(args.json), {"models": rows})
    return 0


def _confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError("not removing anything without confirmation: pass --yes (stdin is not a terminal)")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _rm(args) -> int:
    from deltafin import fmt
    from deltafin.interfaces.paths import resolve_packed
    from deltafin.store.catalog import forget
    from deltafin.store.manifest import parse_drive_map
    from deltafin.store.remove import rm_model, rm_plan

    path = os.path.abspath(resolve_packed(args.model))
    drive_map = parse_drive_map(args.drive_map)
    info, plan = describe(path, drive_map), rm_plan(path, drive_map)
    print(f"{info['id']}: {fmt.size(info['expert_bytes'] + info['trunk_bytes'])}; deletes only the files its "
          f"manifest lists:")
    for line in plan:
        print(line)
    if not _confirm(f"remove {info['id']}?", args.yes):
        print("nothing removed")
        return 1
    rep = rm_model(path, drive_map)
    for line in rep.lines():
        print(line)
    if rep.folders and rep.folders[-1].gone:
        forget(path)
    print(f"removed {info['id']}: deleted {rep.files:,} files ({fmt.size(rep.bytes)})")
    return 0
