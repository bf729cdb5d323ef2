"""The ingestion path: reads hashed part by part as they land, the threads a checked read may take, the whole
file slab, and ``deltafin bench ingest`` end to end at a small size."""

from __future__ import annotations

import json
import os
import queue
import threading
import time

import pytest
import xxhash

from deltafin.errors import ExpertChecksumError
from deltafin.io import hashing
from deltafin.io.direct import FileDriveReader
from deltafin.io.pool import Checksum, ReaderPool
from deltafin.store import expert_file as ef


def _checksum(path, data: bytes) -> Checksum:
    want = xxhash.xxh3_64_hexdigest(data)
    return Checksum(want, lambda got: ef.checksum_error(str(path), want, got, "repack it"))


def test_streaming_hash_is_xxh3_of_the_whole():
    h = hashing.hasher()
    assert h is not None, "the xxhash package's library exports its streaming functions"
    data = os.urandom(5 * 65536 + 17)
    for lo in range(0, len(data), 65536):
        h.update(memoryview(data)[lo : lo + 65536])
    assert h.hexdigest() == xxhash.xxh3_64_hexdigest(data)


class _Slow(FileDriveReader):
    """Parts take a while (so several are in flight) and the concurrency per file is recorded."""

    def __init__(self, label, root, delay=0.02):
        super().__init__(label, root)
        self.delay, self.lock, self.active, self.peak = delay, threading.Lock(), {}, {}

    def read_into(self, path, offset, buf):
        with self.lock:
            self.active[path] = self.active.get(path, 0) + 1
            self.peak[path] = max(self.peak.get(path, 0), self.active[path])
        try:
            time.sleep(self.delay)
            return super().read_into(path, offset, buf)
        finally:
            with self.lock:
                self.active[path] -= 1


@pytest.mark.parametrize("streams", [True, False])
def test_a_checked_read_in_parts_lands_once_and_a_bad_one_names_its_file(tmp_path, monkeypatch, streams):
    if not streams:
        monkeypatch.setattr(hashing, "hasher", lambda: None)
        monkeypatch.setattr(hashing, "streams", lambda: False)
    good, bad = os.urandom(6 * 8192 - 100), os.urandom(6 * 8192)
    (tmp_path / "a").write_bytes(good)
    (tmp_path / "b").write_bytes(bad)
    pool = ReaderPool([_Slow("d0", str(tmp_path), 0.005)], 4, part_bytes=8192)
    done: queue.SimpleQueue = queue.SimpleQueue()
    pool.submit(0, str(tmp_path / "a"), len(good), "a", done, check=_checksum(tmp_path / "a", good))
    pool.submit(0, str(tmp_path / "b"), len(bad), "b", done, check=_checksum(tmp_path / "b", bad[:-1] + b"x"))
    got = {c.tag: c for c in (done.get(timeout=30), done.get(timeout=30))}
    with pytest.raises(queue.Empty):
        done.get(timeout=0.2)  # one completion a read
    assert got["a"].error is None and bytes(got["a"].buf[: len(good)]) == good
    assert isinstance(got["b"].error, ExpertChecksumError) and str(tmp_path / "b") in str(got["b"].error)
    c = pool.counters[0]
    assert c.reads == 1 and c.errors == 1 and c.check_seconds > 0 and pool.pending_bytes() == [0]
    pool.close()


def test_the_threads_a_checked_read_takes_follow_the_hash_and_read_rates(tmp_path):
    """Before rates are known a read's parts all go at once; once a thread reads at half the hash rate, a checked
    read takes 2 threads while another read waits, and unchecked reads are never capped. No thread idles while a
    part waits: with one read left, it takes every thread."""
    reader = _Slow("d0", str(tmp_path), 0.03)
    pool = ReaderPool([reader], 4, part_bytes=8192)
    assert pool._cap(0) == 4
    c = pool.counters[0]
    c.bytes, c.busy_seconds = 100 << 20, (100 << 20) / 3e9  # 3 GB/s a thread
    pool._hashed = [200 << 20, (200 << 20) / 6e9]  # 6 GB/s hashing
    assert pool._cap(0) == 2
    files = {}
    for name, parts in (("a", 8), ("b", 24), ("c", 8)):  # b outlasts a: a's threads never lack other work
        files[name] = os.urandom(parts * 8192)
        (tmp_path / name).write_bytes(files[name])
    done: queue.SimpleQueue = queue.SimpleQueue()
    with pool._exec[0]._cv:  # both queued before any thread takes a part (the condition's lock is reentrant)
        for name in "ab":
            pool.submit(0, str(tmp_path / name), len(files[name]), name, done,
                        check=_checksum(tmp_path / name, files[name]))
    for _ in "ab":
        assert done.get(timeout=30).error is None
    assert reader.peak[str(tmp_path / "a")] == 2  # b waited for threads meanwhile
    assert reader.peak[str(tmp_path / "b")] > 2  # once a was done, b took the free threads
    pool.submit(0, str(tmp_path / "c"), 8 * 8192, "c", done, check=_checksum(tmp_path / "c", files["c"]))
    assert done.get(timeout=30).error is None
    assert reader.peak[str(tmp_path / "c")] == 4  # alone: every thread on it
    pool.close()


def test_bench_ingest_small(tmp_path, capsys):
    from deltafin.cli import main

    out = tmp_path / "ingest.json"
    png = tmp_path / "curve.png"
    main(["bench", "ingest", "--dir", str(tmp_path), "--layers", "2", "--experts", "16", "--k", "8", "--tokens", "1",
          "--threads", "2", "--offered", "4", "--guess", "0.5", "--plot", str(png), "--json", str(out)])
    rec = json.loads(out.read_text())
    row = rec["settings"][0]
    assert row["in_flight"] == 2 and row["raw_GBps"] > 0 and row["guess"] == 0.5
    for name in ("io_verified", "io_unverified", "full", "io_guess", "full_guess"):  # guesses change no byte delivered
        assert row[name]["bytes"] == 2 * 8 * rec["expert_file_bytes"]
    assert 0 < row["full_guess_over_limit"] and "cpu_guess_GBps" in rec["curve"][0]
    assert 0 < row["full_guess"]["guess_used"] < row["full_guess"]["guessed"] and row["full"]["guessed"] == 0
    assert row["io_verified"]["check_s"] > 0 and row["io_unverified"]["check_s"] == 0
    assert rec["limits"]["memcpy_GBps"] > 0 and rec["limits"]["math_s_per_token"] > 0
    assert rec["curve"][0]["offered_GBps"] == 4 and 0 < rec["curve"][0]["cpu_over_offered"] <= 1.05
    assert png.stat().st_size > 1000
    assert "of raw" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("deltafin-bench")] == []  # scratch removed


def test_guessed_routes_keep_the_share_asked_for():
    from deltafin.bench.decode import routes
    from deltafin.bench.ingest import guessed_routes

    rts = routes([1, 2, 3], 64, 16, 4, 0)
    for right, kept in ((1.0, 16), (0.75, 12), (0.0, 0)):
        for step, guess in zip(rts, guessed_routes(rts, right, 64), strict=True):
            for L, ids in step.items():
                assert len(set(guess[L])) == 16 and len(set(guess[L]) & set(ids)) == kept


@pytest.mark.parametrize("argv, needle", [
    (["--guess", "1.5"], "--guess 1.5"),
    (["--k", "20", "--experts", "8"], "--k 20"),
    (["--threads", "8,x"], "--threads"),
    (["--threads", "0"], "--threads"),
    (["--offered", "-2"], "--offered"),
    (["--k3-shape"], "--k3-shape"),
    (["--dir", "/no/such/folder"], "/no/such/folder"),
    (["--drives", "d0:fast"], "--emulate-drives"),
])
def test_bench_ingest_refuses_bad_arguments_in_one_line(argv, needle, capsys):
    from deltafin.cli import main

    assert main(["bench", "ingest", *argv]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


@pytest.mark.parametrize("argv, needle", [
    (["--dir", "/no/such/folder"], "/no/such/folder"),
    (["--experts", "4", "--k", "8"], "--k 8"),
])
def test_bench_decode_and_prefill_refuse_bad_arguments_in_one_line(argv, needle, capsys):
    from deltafin.cli import main

    for bench in ("decode", "prefill"):
        assert main(["bench", bench, *argv]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]
