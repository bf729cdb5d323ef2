"""Hostile and unlucky inputs on the store side: reads and writes of any size, `place` never deleting the
last good copy, and damaged checkpoints, configs, manifests and trunks refused with one line naming them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from deltafin import cli
from deltafin.errors import CheckpointError, ExpertChecksumError
from deltafin.io.direct import FileDriveReader, aligned_buffer
from deltafin.k3_tiny import write_tiny_k3
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf
from deltafin.store import place as place_mod
from deltafin.store.checkpoint import Checkpoint, read_into
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from deltafin.store.place import Layout, place_model
from deltafin.store.verify import verify

GIB = 1 << 30


@pytest.fixture(scope="module")
def k3src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("k3src")
    write_tiny_k3(root / "src")
    return root / "src"


def _pack(src: Path, root: Path, **kw) -> Path:
    pack(str(src), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
         PackOptions(progress=False, **kw))
    return root / "model"


def _expect_error(capsys, argv: list[str], *needles: str) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


# ---------------------------------------------------------------- reads and writes of any size


def _cap_syscalls(monkeypatch, cap: int) -> list[int]:
    """Make every preadv/pwrite/write move at most ``cap`` bytes, as Linux does past 2,147,479,552."""
    sizes: list[int] = []
    real_preadv, real_write, real_pwrite = os.preadv, os.write, os.pwrite

    def preadv(fd, bufs, off):
        (b,) = bufs
        sizes.append(len(b))
        return real_preadv(fd, [memoryview(b)[:cap]], off)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "write", lambda fd, b: real_write(fd, memoryview(b)[:cap]))
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: real_pwrite(fd, memoryview(b)[:cap], off))
    return sizes


def test_short_syscalls_are_continued(k3src, tmp_path, monkeypatch):
    ck = Checkpoint(str(k3src))
    name = "language_model.model.embed_tokens.weight"
    want = ck.read_bytes(name)
    p = tmp_path / "f.bin"
    data = os.urandom(3 * 4096)
    with monkeypatch.context() as m:
        _cap_syscalls(m, 1000)
        got = bytearray(len(want))
        read_into(ck, name, memoryview(got))  # one preadv used to fail: "the shard is truncated"
        assert got == want
        ef.write_atomic(str(p), data)
        buf = aligned_buffer(len(data))
        assert FileDriveReader("d", str(tmp_path), direct=False).read_into(str(p), 0, buf) == len(data)
        assert bytes(buf[: len(data)]) == data
    assert p.read_bytes() == data


def test_one_syscall_never_asks_past_the_kernel_cap(tmp_path, monkeypatch):
    p = tmp_path / "sparse.bin"
    with open(p, "wb") as f:
        f.truncate(3 * GIB)
    sizes = _cap_syscalls(monkeypatch, 4096)
    from deltafin.store.fileio import pread_full

    fd = os.open(p, os.O_RDONLY)
    try:  # a view of 3 GiB is never handed to one call, only the first pages are read
        view = memoryview(bytearray(8192))
        pread_full(fd, view, 0, str(p), CheckpointError)
    finally:
        os.close(fd)
    assert max(sizes) <= 2_147_479_552


def _sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], meta: dict | None = None) -> int:
    """A safetensors file whose data is a hole (no disk cost): the header, then truncate to size."""
    header, off = {}, 0
    sizes = {"U8": 1, "I8": 1, "BF16": 2, "F32": 4}
    for name, (dt, shape) in tensors.items():
        n = sizes[dt]
        for s in shape:
            n *= s
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(({"__metadata__": meta} if meta else {}) | header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + off)
    return 8 + len(raw) + off


@pytest.mark.slow
def test_checkpoint_tensor_over_2gib(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    n = 2 * GIB + 8192
    _sparse_safetensors(src / "model.safetensors", {"big": ("U8", (n,))})
    ck = Checkpoint(str(src))
    buf = bytearray(n)
    buf[-1] = 7
    read_into(ck, "big", memoryview(buf))
    assert buf[-1] == 0 and buf[0] == 0


# ---------------------------------------------------------------- place never deletes the last good copy


def _replicate_everywhere(model: Path) -> tuple[PackedModel, dict]:
    """Every expert on both drives (a replicas layout), returning the original one-copy locations."""
    pm = PackedModel.open(str(model))
    before = json.loads(json.dumps(pm.doc["experts"]["locations"]))
    both = {L: [[0, 1] for _ in range(pm.num_experts)] for L in pm.moe_layers}
    place_mod.apply_layout(pm, Layout("replicas", both))
    return PackedModel.open(str(model)), before


def test_place_keeps_the_good_copy_when_the_kept_one_is_damaged_or_missing(k3src, tmp_path, capsys):
    model = _pack(k3src, tmp_path)
    pm, before = _replicate_everywhere(model)
    L = pm.moe_layers[0]
    damaged, missing = 1, 2
    for e in (damaged, missing):  # the copy the bandwidth layout keeps is the first drive of `before`
        p = pm.expert_path(L, e, before[str(L)][e][0])
        if e == damaged:
            with open(p, "r+b") as f:
                f.seek(5000)
                b = f.read(1)
                f.seek(5000)
                f.write(bytes([b[0] ^ 0xFF]))
        else:
            os.unlink(p)
    assert cli.main(["place", str(model), "--policy", "bandwidth", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "read back and matched their checksums before any delete" in out, out
    pm = PackedModel.open(str(model))
    assert pm.doc["experts"]["locations"] == before
    rep = verify(pm)
    assert rep.ok, rep.bad  # both experts rewritten from their good copies; nothing lost


def test_place_deletes_nothing_when_no_copy_is_good(k3src, tmp_path):
    model = _pack(k3src, tmp_path)
    pm, before = _replicate_everywhere(model)
    L = pm.moe_layers[0]
    for d in (0, 1):
        with open(pm.expert_path(L, 3, d), "r+b") as f:
            f.seek(4096)
            f.write(b"\x00" * 64 + b"\x01")
    files = sorted(str(p) for d in pm.drives for p in Path(d.path).rglob("*.dfx"))
    with pytest.raises(ExpertChecksumError, match=f"layer {L} expert 3: no good copy"):
        place_model(str(model), "bandwidth")
    assert sorted(str(p) for d in pm.drives for p in Path(d.path).rglob("*.dfx")) == files


def test_resumed_delete_checks_the_new_copies_first(k3src, tmp_path, monkeypatch):
    model = _pack(k3src, tmp_path)
    pm, before = _replicate_everywhere(model)
    with monkeypatch.context() as m:  # committed, nothing deleted yet
        m.setattr(place_mod, "_delete_old", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            place_model(str(model), "bandwidth")
    pm = PackedModel.open(str(model))
    L = pm.moe_layers[0]
    kept = pm.expert_path(L, 4)
    os.unlink(kept)  # the new layout's copy vanished before the resumed delete
    with pytest.raises(ExpertChecksumError, match=f"layer {L} expert 4: its new copy is not good"):
        place_model(str(model), "bandwidth")
    other = pm.expert_path(L, 4, 1 - before[str(L)][4][0])
    assert os.path.exists(other)  # the only copy left was not deleted
