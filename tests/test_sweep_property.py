"""Property: whatever sequence of pack / place / rm / repack runs over shared and overlapping drive folders
(two checkpoints, two model folders, model ids that collide, a drive that is a link to another, user files
everywhere), no file of the user or of another model is ever removed or changed, and every model still
packed verifies."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafin.errors import DeltafinError
from deltafin.store import manifest as mf
from deltafin.store.drives import DriveArg
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from deltafin.store.place import place_model
from deltafin.store.remove import rm_model
from deltafin.store.verify import verify

OUTS = ("x", "y")
DRIVES = ("D0", "D1", "D2", "L0")  # L0: a link to D0
IDS = ("model", "other")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from deltafin.tiny import build_tiny

    root = tmp_path_factory.mktemp("sweep")
    for name, seed in (("A", 0), ("B", 1)):
        build_tiny("qwen3_moe", root / name, seed=seed, num_hidden_layers=2)
    return {"A": root / "A", "B": root / "B"}


def pack_op(out=st.sampled_from(OUTS)):
    return st.tuples(st.just("pack"), st.sampled_from("AB"), out,
                     st.lists(st.sampled_from(DRIVES), min_size=1, max_size=3, unique=True), st.sampled_from(IDS),
                     st.booleans())


op = st.one_of(
    pack_op(),
    st.tuples(st.just("place"), st.sampled_from(OUTS), st.sampled_from(["roundrobin", "stripe-equal", "bandwidth"])),
    st.tuples(st.just("rm"), st.sampled_from(OUTS)),
)
# both model folders packed first (over any drives, ids that may collide), then anything
sequences = st.tuples(pack_op(st.just("x")), pack_op(st.just("y")), st.lists(op, min_size=1, max_size=4)).map(
    lambda t: [t[0], t[1], *t[2]])


def _snapshot(paths: list[Path]) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in paths}


def _model_files(out: Path) -> dict[str, bytes]:
    """Every file a packed model reads: its expert files, trunk, manifest and config."""
    pm = PackedModel.open(str(out), reader=False)
    files = [r.path for L in pm.moe_layers for e in range(pm.num_experts) for r in pm.expert_files(L, e)]
    files += [str(out / t) for t in pm.doc["trunk"]["files"]] + [str(out / mf.MANIFEST), str(out / "config.json")]
    return {p: Path(p).read_bytes() for p in files}


def _user_files(root: Path) -> list[Path]:
    """A user's files: in every drive root, inside a drive folder a model may use, and in a model folder."""
    made = []
    for rel in ("D0/notes.txt", "D1/notes.txt", "D2/notes.txt", "D1/other/keep.bin"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(64))
        made.append(p)
    p = root / "D2" / "model" / "L000" / "E0000.dfx"  # a user's file under an expert's name
    p.parent.mkdir(parents=True)
    p.write_bytes(b"not an expert")
    return [*made, p]


def _run(op_, root: Path, sources: dict[str, Path], live: dict[str, str]) -> None:
    kind = op_[0]
    if kind == "pack":
        _, src, out, drives, model_id, overwrite = op_
        args = [DriveArg(f"d{i}", str(root / d), 1.0) for i, d in enumerate(drives)]
        pack(str(sources[src]), str(root / out), args, PackOptions(progress=False, model_id=model_id,
                                                                  overwrite=overwrite))
        live[out] = src
    elif kind == "place":
        place_model(str(root / op_[1]), op_[2])
    else:
        rm_model(str(root / op_[1]))
        live.pop(op_[1], None)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sequences)
def test_no_sequence_of_store_commands_loses_a_file_it_does_not_own(sources, ops):
    root = Path(tempfile.mkdtemp(prefix="sweep-"))
    try:
        for d in ("D0", "D1", "D2"):
            (root / d).mkdir()
        os.symlink(root / "D0", root / "L0")
        user = _user_files(root)
        kept = _snapshot(user)
        live: dict[str, str] = {}
        for op_ in ops:
            others = {o: _model_files(root / o) for o in live if op_[0] == "pack" or o != op_[1]}
            if op_[0] == "pack":  # the model in the target folder may be replaced; the other may not change
                others.pop(op_[2], None)
            try:
                _run(op_, root, sources, live)
            except DeltafinError:  # refused (one line on the CLI): nothing of anyone else may have changed
                if op_[0] == "pack" and not (root / op_[2] / mf.MANIFEST).exists():
                    live.pop(op_[2], None)  # --overwrite removed it as asked, then the pack was refused
            assert _snapshot(user) == kept, f"a user file changed after {op_}"
            for o, files in others.items():
                assert o in live and _model_files(root / o) == files, f"model {o} changed after {op_}"
            for o in live:
                assert verify(PackedModel.open(str(root / o), reader=False)).ok, f"model {o} broken after {op_}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
