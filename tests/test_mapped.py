"""Expert files on a drive in memory (tmpfs) are mapped, not copied (``io.mapped``): the same logits bit for bit as
reading them, no read buffers, and the same checks (a corrupted file fails over to its replica or names itself)."""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from deltafin.errors import ExpertFileError, ReadError
from deltafin.io import mapped
from deltafin.io.direct import FileDriveReader, aligned_buffer
from deltafin.io.pool import BufferPool, Checksum, ReaderPool
from deltafin.store import place as place_mod
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import pack
from deltafin.store.place import Layout
from tests import tiny_families as tf

SHM = "/dev/shm"
ON_TMPFS = os.path.isdir(SHM) and mapped.memory_fs(SHM) == "tmpfs"
needs_tmpfs = pytest.mark.skipif(not ON_TMPFS, reason="no tmpfs at /dev/shm")


@pytest.fixture(scope="module")
def shm_models(tmp_path_factory):
    """family -> (model packed on two tmpfs drives, the same files copied to disk drives), built as asked."""
    made: dict[str, tuple[str, str]] = {}
    dirs: list[str] = []

    def get(family: str, replicas: bool = False) -> tuple[str, str]:
        key = f"{family}-{replicas}"
        if key not in made:
            root = tmp_path_factory.mktemp(key)
            tf.build_any(family, root / "src")
            shm = Path(tempfile.mkdtemp(prefix="deltafin-test-mapped-", dir=SHM))
            dirs.append(str(shm))
            pack(str(root / "src"), str(shm / "m"), parse_drives([f"{shm}/d0=2", f"{shm}/d1=1"]), tf.DEFAULT)
            if replicas:  # every expert on both drives
                pm = PackedModel.open(str(shm / "m"))
                both = {L: [[0, 1] for _ in range(pm.num_experts)] for L in pm.moe_layers}
                place_mod.apply_layout(pm, Layout("replicas", both))
            made[key] = (str(shm / "m"), str(shm))
        return made[key]

    yield get
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _logits(model: str, premap: bool = False, **kw) -> tuple[torch.Tensor, object]:
    """``premap``: every file mapped before the first step (else each at its first read, by a reader thread)."""
    eng = tf.engine(model, **{"exact": False, **kw})
    try:
        if premap:
            eng.source.premap()
        st = eng.new_state()
        with torch.inference_mode():
            out = [eng.step([(torch.tensor(tf.prompt(9)), st)], all_logits=True)[0].float()]
            tok = int(out[0][-1].argmax())
            for _ in range(4):
                got = eng.forward([tok], st)
                tok = int(got[-1].argmax())
                out.append(got.float().reshape(-1, got.shape[-1]))
        return torch.cat(out), eng.source
    finally:
        eng.close()


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_tmpfs
def test_memory_fs_names_tmpfs_and_nothing_else(tmp_path):
    assert mapped.memory_fs(SHM) == "tmpfs"
    assert mapped.memory_fs("/proc") is None  # procfs: in memory, but not a drive of files
    assert mapped.memory_fs(str(tmp_path / "no-such-folder")) is None


@needs_tmpfs
@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
@pytest.mark.parametrize("cache_gb", [0.0, 1.0])
def test_mapped_logits_are_the_read_logits_bit_for_bit(shm_models, family, cache_gb, monkeypatch):
    model, _ = shm_models(family)
    got, src = _logits(model, cache_gb=cache_gb)
    assert src.mapped and all(r.maps is not None for r in src.mapped), "tmpfs drives are mapped"
    assert src.stats.reads > 0 and src.pool.buffers.allocated == 0, "mapped reads take no read buffers"
    premapped, src1 = _logits(model, premap=True, cache_gb=cache_gb)
    assert src1.stats.checked_later > 0, "files mapped already were checked while the math read them"
    assert _bitwise(premapped, got)
    monkeypatch.setattr(mapped, "MAP_FILES", False)
    want, src2 = _logits(model, cache_gb=cache_gb)
    assert not src2.mapped and src2.pool.buffers.allocated > 0, "the read path ran"
    assert _bitwise(got, want)


def _corrupt(path: str, header: bool = False) -> None:
    """Flip a byte in the middle of the file's first weight section (its math changes, not only its checksum), or
    with ``header`` the first byte of its magic (the header no longer parses)."""
    from deltafin.store import expert_file as ef

    data = Path(path).read_bytes()
    sec = ef.parse_header(memoryview(data), path)[0].tensors[0].sections[0]
    with open(path, "r+b") as f:
        f.seek(0 if header else sec.offset + sec.nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


@needs_tmpfs
def test_a_corrupt_mapped_expert_is_named(shm_models):
    model, _ = shm_models("qwen3_moe")
    pm = PackedModel.open(model)
    path = pm.expert_path(pm.moe_layers[0], 0)
    saved = Path(path).read_bytes()
    try:
        _corrupt(path)
        with pytest.raises((ExpertFileError, ReadError), match=os.path.basename(path)):
            eng = tf.engine(model, exact=False)
            try:
                for _ in eng.source.fetch(pm.moe_layers[0], list(range(pm.num_experts))):
                    pass
            finally:
                eng.close()
    finally:
        Path(path).write_bytes(saved)


@needs_tmpfs
@pytest.mark.parametrize(("family", "cache_gb", "header"), [("qwen3_moe", 0.0, False), ("qwen3_moe", 1.0, False),
                                                          ("kimi_k3", 0.0, False), ("kimi_k3", 1.0, False),
                                                          ("qwen3_moe", 0.0, True)])
def test_a_corrupt_mapped_expert_fails_over_to_its_replica(shm_models, family, cache_gb, header):
    """Checked while the math reads them (``LaterChecked``): a copy that fails is read from its replica and its
    expert computed again, before any result is used; the cache never keeps the bad copy."""
    model, _ = shm_models(family, replicas=True)
    want, _ = _logits(model, cache_gb=cache_gb)
    pm = PackedModel.open(model)
    paths = [pm.expert_path(L, e, 0) for L in pm.moe_layers for e in range(pm.num_experts)]
    saved = {p: Path(p).read_bytes() for p in paths[: 2 * pm.num_experts]}  # every expert of the first two layers
    try:
        for p in saved:
            _corrupt(p, header)
        got, src = _logits(model, premap=True, cache_gb=cache_gb)
        assert src.stats.failed_reads > 0 and src.stats.checked_later > 0, "the corrupted copies were caught"
        assert _bitwise(got, want)
    finally:
        for p, b in saved.items():
            Path(p).write_bytes(b)


@needs_tmpfs
def test_a_corrupt_mapped_expert_with_no_replica_stops_the_step_naming_it(shm_models):
    """Through the engine's step (the math runs before the check ends): the mismatch's error, naming the file."""
    model, _ = shm_models("qwen3_moe")
    pm = PackedModel.open(model)
    paths = [pm.expert_path(pm.moe_layers[0], e) for e in range(pm.num_experts)]
    saved = {p: Path(p).read_bytes() for p in paths}
    try:
        for p in saved:
            _corrupt(p)
        with pytest.raises(ExpertFileError, match="checksum"):
            _logits(model, premap=True)
    finally:
        for p, b in saved.items():
            Path(p).write_bytes(b)


def test_pool_takes_mapped_pages_and_never_recycles_them(tmp_path):
    """On any filesystem, a reader with maps hands out the file's pages: checked, and never put back in the pool."""
    import xxhash

    data = os.urandom(3 * 4096 + 123)
    (tmp_path / "f").write_bytes(data)
    r = FileDriveReader("d", str(tmp_path))
    r.maps = mapped.FileMaps("d")
    pool = ReaderPool([r], threads=2, buffers=BufferPool())
    done: queue.SimpleQueue = queue.SimpleQueue()
    good = Checksum(xxhash.xxh3_64_hexdigest(data), lambda got: ReadError(f"bad {got}"))
    bad = Checksum("0" * 16, lambda got: ReadError(f"mismatch {got}"))
    pool.submit(0, str(tmp_path / "f"), len(data), "a", done, check=good)
    pool.submit(0, str(tmp_path / "f"), len(data), "b", done, check=bad)
    got = {c.tag: c for c in (done.get(timeout=10), done.get(timeout=10))}
    assert got["a"].error is None and got["a"].buf.readonly and bytes(got["a"].buf[: len(data)]) == data
    assert isinstance(got["b"].error, ReadError)
    assert pool.buffers.allocated == 0 and r.maps.mapped == 1
    pool.buffers.put(got["a"].buf)
    assert not pool.buffers._free[len(got["a"].buf)], "a mapped view never becomes a read buffer"
    w = aligned_buffer(4096)
    pool.buffers.put(w)
    assert pool.buffers.get(4096) is w
    # a file replaced since it was mapped (a repack's rename over it) is mapped again; old views keep their bytes
    old = r.maps.view(str(tmp_path / "f"), len(data))
    fresh = os.urandom(len(data))
    (tmp_path / "f.tmp").write_bytes(fresh)
    os.replace(tmp_path / "f.tmp", tmp_path / "f")
    assert bytes(r.maps.view(str(tmp_path / "f"), len(data))) == fresh and bytes(old) == data
    assert r.maps.mapped == 1
    # past the mapping limit, or for a file shorter than asked, the drive reads as usual
    r.maps.limit = 1
    (tmp_path / "g").write_bytes(data)
    assert r.maps.view(str(tmp_path / "g"), len(data)) is None
    assert r.maps.view(str(tmp_path / "f"), len(data) + 1) is None
    pool.close()
    r.maps.close()


@needs_tmpfs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_mapped_logits_on_cuda_are_the_read_logits_bit_for_bit(shm_models, family, monkeypatch):
    """On CUDA each mapping is page-locked read-only and the slab copy is a DMA from the file's pages."""
    model, _ = shm_models(family)
    got, src = _logits(model, device="cuda")
    assert src.mapped and all(r.maps.off is None for r in src.mapped), [r.maps.off for r in src.mapped]
    assert src.stats.reads > 0 and src.pool.buffers.allocated == 0
    monkeypatch.setattr(mapped, "MAP_FILES", False)
    want, _ = _logits(model, device="cuda")
    assert _bitwise(got.cpu(), want.cpu())


def test_the_stats_line_counts_reads_checked_beside_the_math():
    from deltafin.runtime.stats import RunStats

    assert "3 of them mapped files checked while the math read them" in RunStats(checked_later=3).summary()
    assert "while the math read them" not in RunStats().summary()
    assert "while the math read them" not in RunStats(checked_later=3, checks="gpu").summary()


@needs_tmpfs
def test_a_run_reports_its_reads_checked_beside_the_math(shm_models):
    model, _ = shm_models("qwen3_moe")
    eng = tf.engine(model, exact=False)
    try:
        eng.source.premap()
        list(eng.generate(tf.prompt(9), 3))
        st = eng.last_stats
        assert 0 < st.checked_later <= st.reads and st.mapped_drives == 2
        assert f"{st.checked_later:,} of them mapped files checked while the math read them" in st.summary()
    finally:
        eng.close()


@needs_tmpfs
@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3"])
def test_the_exact_path_on_mapped_files_checked_beside_the_math_is_the_read_path_bit_for_bit(shm_models, family,
                                                                                             monkeypatch):
    """``--exact`` (the float32 torch path) over files checked beside the math gives the read path's logits."""
    model, _ = shm_models(family)
    got, src = _logits(model, premap=True, exact=True)
    assert src.stats.checked_later > 0
    monkeypatch.setattr(mapped, "MAP_FILES", False)
    want, _ = _logits(model, exact=True)
    assert _bitwise(got, want)
