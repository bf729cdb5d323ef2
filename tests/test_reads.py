"""Expert reads under faults: errors in reader threads reach the engine, late reads are retried then served by
a replica or reported, every read is checked against its checksum, and a bad copy fails over to a good one."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import threading
import time

import pytest
import torch

from deltafin.cli import main
from deltafin.errors import ExpertChecksumError, ReadError
from deltafin.io.direct import FileDriveReader, align_up, aligned_buffer
from deltafin.io.pool import BufferPool, ReadDeadline, ReaderPool
from deltafin.models import registry
from deltafin.models.base import ResidentExperts
from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.runtime.source import StreamingExperts
from deltafin.store.drives import parse_drives
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from tests import tiny_families as tf
from tests.waiting import bounded

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]
FAST = ReadDeadline(min_s=0.3, factor=10.0)


@pytest.fixture(scope="module")
def k3(k3_model):
    """The tiny K3 (conftest's ``k3_model``) and its prompt logits with every expert resident."""
    root = k3_model
    pm = PackedModel.open(str(root / "model"))
    model = registry.build(pm.family, pm.text_config, pm.trunk_records())
    experts = ResidentExperts({(L, e): pm.read_expert(L, e) for L in pm.moe_layers for e in range(pm.num_experts)})
    ref = model.forward(torch.tensor(PROMPT), model.new_state(64), experts)
    return root, ref


def _copy(k3_root, dst, replicas: bool = False) -> PackedModel:
    """A copy of the packed model (its drives too); with ``replicas`` every expert also on the other drive."""
    return PackedModel.open(str(tf.copy_packed(k3_root, dst, replicas) / "model"))


def _bounded(fn, seconds: float = 60.0):
    return bounded(fn, seconds, "the engine must never wait forever")


class HangingReader(FileDriveReader):
    """A drive whose reads of matching paths never return until released (a hung device); with
    ``hangs`` only that many reads hang and the later ones are served."""

    def __init__(self, label, root, match: str, hangs: int | None = None):
        super().__init__(label, root)
        self.match, self.hangs = match, hangs
        self.release = threading.Event()
        self.hung: list[str] = []
        self._lock = threading.Lock()

    def read_into(self, path, offset, buf):
        if self.match in path:
            with self._lock:
                hang = self.hangs is None or len(self.hung) < self.hangs
                if hang:
                    self.hung.append(path)
            if hang:
                self.release.wait(120)
        return super().read_into(path, offset, buf)


def _forward(pm: PackedModel, readers=None, deadline=FAST, verify=True):
    source = StreamingExperts(pm, cache_bytes=0, threads=2, readers=readers, deadline=deadline, verify=verify)
    model = registry.build(pm.family, pm.text_config, pm.trunk_records())
    try:
        return _bounded(lambda: model.forward(torch.tensor(PROMPT), model.new_state(64), source)), source
    finally:
        for r in readers or ():
            if isinstance(r, HangingReader):
                r.release.set()
        source.close()


def _readers(pm: PackedModel, hang_drive: int, match: str, hangs: int | None = None):
    return [HangingReader(d.label, d.path, match, hangs) if i == hang_drive else FileDriveReader(d.label, d.path)
            for i, d in enumerate(pm.drives)]


# ------------------------------------------------------------------ errors in reader threads


def test_buffer_allocation_failure_reaches_the_consumer(tmp_path):
    class NoMemory(BufferPool):
        def get(self, nbytes):
            raise MemoryError

    (tmp_path / "f").write_bytes(b"x" * 4096)
    pool = ReaderPool([FileDriveReader("d0", str(tmp_path))], 1, NoMemory())
    done: queue.SimpleQueue = queue.SimpleQueue()
    pool.submit(0, str(tmp_path / "f"), 4096, "t", done)
    c = done.get(timeout=10)
    pool.close()
    assert isinstance(c.error, ReadError) and c.tag == "t"
    assert "cannot allocate a 4,096-byte buffer" in str(c.error) and str(tmp_path / "f") in str(c.error)


def test_any_exception_in_a_reader_thread_becomes_a_completion(tmp_path):
    class Broken(FileDriveReader):
        def read_into(self, path, offset, buf):
            raise ZeroDivisionError("bug")

    pool = ReaderPool([Broken("d0", str(tmp_path))], 1)
    done: queue.SimpleQueue = queue.SimpleQueue()
    pool.submit(0, "p", 4096, 1, done, check=None)
    assert isinstance(done.get(timeout=10).error, ZeroDivisionError)
    pool.close()


@pytest.mark.parametrize("file_bytes", [10**15, 2**62])
def test_absurd_file_bytes_is_an_error_not_a_hang(k3, tmp_path, file_bytes):
    root, _ = k3
    pm = PackedModel.open(str(root / "model"))
    for layout in pm.doc["experts"]["layouts"].values():  # what a damaged manifest would say
        layout["file_bytes"] = file_bytes
    with pytest.raises(ReadError, match="cannot allocate"):
        _forward(pm)


# ------------------------------------------------------------------ deadlines


def test_a_hung_read_is_retried_once_then_served_by_a_replica(k3, tmp_path, caplog):
    root, ref = k3
    pm = _copy(root, tmp_path / "m", replicas=True)
    readers = _readers(pm, 0, "/L0")  # every expert read on d0 hangs
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        got, source = _forward(pm, readers)
    assert torch.equal(got, ref)
    assert source.stats.late_reads >= 2  # the first read and its retry on d0
    retried = {r.getMessage().split(" (offset")[0] for r in caplog.records if r.getMessage().endswith("retrying it")}
    failed_over = [r.getMessage() for r in caplog.records if "twice" in r.getMessage()]
    assert retried and failed_over and all("reading the copy on drive d1" in m for m in failed_over)
    assert {m.split(" (offset")[0] for m in failed_over} <= retried  # each failover came after one retry
    assert time.monotonic() - t0 < 30


def test_a_late_read_retried_on_its_drive_succeeds(k3, tmp_path):
    root, ref = k3
    pm = _copy(root, tmp_path / "m")
    readers = _readers(pm, 1, "/L0", hangs=1)  # one read hangs; the drive's other thread serves its retry
    got, source = _forward(pm, readers)
    assert torch.equal(got, ref)
    assert len(readers[1].hung) == 1 and source.stats.late_reads == 1 and source.stats.failed_reads == 0


def test_a_hung_drive_without_replica_is_reported(k3, tmp_path):
    root, _ = k3
    pm = _copy(root, tmp_path / "m")
    readers = _readers(pm, 0, "/L0")
    with pytest.raises(ReadError) as err:
        _forward(pm, readers)
    msg = str(err.value)
    assert f"drive {pm.drives[0].label}" in msg and "did not complete in" in msg and "twice" in msg
    assert "offset 0" in msg and ".dfx" in msg and "--read-deadline" in msg


def test_the_default_deadline_follows_the_drive_rate():
    d = ReadDeadline()
    assert d.seconds(4096, 6.0) == d.min_s  # a small read: the floor
    assert d.seconds(60 * 10**9, 6.0) == pytest.approx(100.0)  # 10 s of queued bytes at 6 GB/s, x10
    with pytest.raises(ValueError):
        ReadDeadline(min_s=float("nan"))


def test_slow_emulated_reads_are_retried_or_failed_over(k3, tmp_path):
    from deltafin.io.emulator import emulated_readers

    root, ref = k3
    pm = _copy(root, tmp_path / "m", replicas=True)
    readers = emulated_readers("d0:2GBps,lat=100us,slow=0.3x20000;d1:1GBps,lat=100us", pm)
    got, source = _forward(pm, readers)
    assert torch.equal(got, ref)
    assert source.stats.late_reads > 0


# ------------------------------------------------------------------ checksums


def _flip_bit(path: str, offset: int = 4096 + 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_bit_flip_fails_over_to_a_good_replica(k3, tmp_path):
    root, ref = k3
    pm = _copy(root, tmp_path / "m", replicas=True)
    for e in range(pm.num_experts):
        _flip_bit(pm.expert_path(pm.moe_layers[0], e))  # the primary copies of a whole layer
    got, source = _forward(pm)
    assert torch.equal(got, ref)
    assert source.stats.failed_reads > 0


def test_a_bit_flip_without_replica_names_the_file_and_the_repair(k3, tmp_path):
    root, ref = k3
    pm = _copy(root, tmp_path / "m")
    victim = pm.expert_path(pm.moe_layers[0], 1)
    _flip_bit(victim)
    with pytest.raises(ExpertChecksumError) as err:
        _forward(pm)
    msg = str(err.value)
    assert victim in msg and "checksum mismatch" in msg and "--repair" in msg
    got, _ = _forward(pm, verify=False)  # opted out: the run goes on with the damaged bytes
    assert got.shape == ref.shape


def test_cli_reads_are_verified_by_default_and_can_opt_out(k3, tmp_path, capsys):
    root, _ = k3
    pm = _copy(root, tmp_path / "m")
    for e in range(pm.num_experts):
        _flip_bit(pm.expert_path(pm.moe_layers[0], e))
    args = ["run", str(tmp_path / "m" / "model"), "--prompt-ids", "5,17,99", "-n", "2", "--greedy", "--quiet",
            "--cache-gb", "0"]
    assert main(args) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert main(args + ["--verify-reads"]) == 2
    assert main(args + ["--no-verify-reads"]) == 0


def test_a_striped_expert_with_a_bit_flip_is_named(k3, tmp_path):
    model = str(tmp_path / "model")
    pack(str(k3[0] / "src"), model, parse_drives([f"{tmp_path}/d0=2", f"{tmp_path}/d1=1"]),
         PackOptions(placement="stripe-bandwidth", progress=False))
    pm = PackedModel.open(model)
    L = pm.moe_layers[0]
    piece = pm.stripe(L)[0]
    _flip_bit(pm.piece_path(L, 2, piece), 10)
    source = StreamingExperts(pm, cache_bytes=0, threads=2, deadline=FAST)
    try:
        with pytest.raises(ExpertChecksumError, match=f"layer {L} expert 2 .*--repair"):
            _bounded(lambda: list(source.fetch(L, [0, 1, 2, 3])))
    finally:
        source.close()
    engine = Engine(model, EngineOptions(exact=True, cache_gb=0.0, verify_reads=False))  # the opt-out reaches the source
    assert engine.source.verify is False
    engine.close()


def test_bench_decode_reports_the_checksum_cost_beside_the_drive(tmp_path, capsys):
    out = tmp_path / "decode.json"
    main(["bench", "decode", "--layers", "1", "--experts", "8", "--k", "4", "--tokens", "1", "--threads", "2",
          "--io-only", "--dir", str(tmp_path), "--json", str(out)])
    line = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["verify_reads"] is True and rec["xxh3_GBps"] > 0
    assert rec["verify_cores_at_raw"] == pytest.approx(rec["raw_GBps"] / rec["xxh3_GBps"])
    assert len(rec["raw_GBps_before_after"]) == 2 and rec["raw_GBps"] == max(rec["raw_GBps_before_after"])
    assert "reads verified: xxh3" in line and "GB/s on one core vs raw" in line
    from deltafin.bench.decode import _print

    _print({**rec, "verify_reads": False})  # what --no-verify-reads prints
    assert "reads not verified (--no-verify-reads)" in capsys.readouterr().out


def test_bench_decode_takes_another_expert_shape(tmp_path, capsys):
    """--shape deepseek-v4-flash with --hidden/--inter overrides sizes the synthetic experts; a bad width is one
    line."""
    out = tmp_path / "decode.json"
    main(["bench", "decode", "--shape", "deepseek-v4-flash", "--hidden", "128", "--inter", "64", "--layers", "1",
          "--experts", "4", "--k", "2", "--tokens", "1", "--threads", "2", "--dir", str(tmp_path), "--json", str(out)])
    rec = json.loads(out.read_text())
    assert rec["expert_file_bytes"] >= 3 * (128 * 64 // 2 + 128 * 64 // 32) and rec["bytes_read"] > 0
    capsys.readouterr()
    assert main(["bench", "decode", "--shape", "deepseek-v4-flash", "--inter", "100"]) != 0
    assert "must be multiples of 32" in capsys.readouterr().err


def test_bench_prefill_reports_reads_math_and_their_limits(tmp_path, capsys):
    """Full mode on a small case (K3-size experts, 1 layer of 8, 16 tokens x 2): the floor from the unique bytes and
    the raw rate, each expert read once, the math beside its floor at the int16 peak (where the GEMM is built), and
    the read buffers mapped at open reported apart from the timing."""
    from deltafin.bench.synthetic import K3_INTER, K3_LATENT
    from deltafin.kernels import cpu

    out = tmp_path / "prefill.json"
    main(["bench", "prefill", "--layers", "1", "--experts", "8", "--k", "2", "--prompt", "16", "--threads", "2",
          "--dir", str(tmp_path), "--json", str(out)])
    line = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["mode"] == "full" and rec["read_amplification"] == 1.0
    assert rec["floor_s"] == pytest.approx(rec["unique_bytes"] / (rec["raw_GBps"] * 1e9))
    before, after = rec["raw_GBps_before_after"]  # the floor takes the higher (the stricter) of the two probes
    assert rec["raw_GBps"] == max(before, after) and f"the higher of {before:.2f} and {after:.2f}" in line
    assert rec["ratio"] == pytest.approx(rec["ttft_s"] / rec["floor_s"]) and 0 < rec["math_s"] < rec["ttft_s"]
    assert rec["expert_ops"] == 2 * 3 * K3_LATENT * K3_INTER * 16 * 2
    if cpu.gemm_enabled():
        assert rec["math_floor_s"] == pytest.approx(rec["expert_ops"] / (rec["int16_peak_GOPs"] * 1e9))
        assert rec["math_over_floor"] == pytest.approx(rec["math_s"] / rec["math_floor_s"])
        assert "at the int16 dot-product peak measured around the run" in line
    assert rec["reserved_buffers"] > 0 and "Read buffers mapped at open, outside the timing" in line
    # 32 routes over at most 8 touched experts; Kimi K3's 16 tokens touch ~224 of its 896 experts, 1.14 tokens each
    assert 4 <= rec["tokens_per_expert"] <= 32 and rec["k3_tokens_per_expert"] == pytest.approx(1.141, abs=1e-3)
    assert f"{rec['tokens_per_expert']:.1f} tokens per touched expert (Kimi K3 at this prompt length: 1.1)" in line


def test_a_late_piece_of_a_striped_expert_is_retried_then_reported(k3, tmp_path):
    model = str(tmp_path / "model")
    pack(str(k3[0] / "src"), model, parse_drives([f"{tmp_path}/d0=2", f"{tmp_path}/d1=1"]),
         PackOptions(placement="stripe-bandwidth", progress=False))
    pm = PackedModel.open(model)
    readers = _readers(pm, 0, "/L0", hangs=1)  # one piece read hangs; the drive's other thread serves its retry
    got, source = _forward(pm, readers)
    assert torch.equal(got, k3[1]) and source.stats.late_reads == 1
    assert not source.pool.buffers._retired  # the buffer the late read holds was dropped, not reused
    readers = _readers(pm, 1, "/L0")  # every piece on d1 hangs: no other copy
    with pytest.raises(ReadError, match=r"did not complete in .*twice \(the piece at byte \d+ of layer \d+ expert"):
        _forward(pm, readers)


def test_read_deadline_option():
    from deltafin.errors import UsageError
    from deltafin.runtime.engine import _deadline

    assert _deadline(None) == ReadDeadline() and _deadline(2.5).min_s == 2.5
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="--read-deadline"):
            _deadline(bad)


def test_a_hung_read_does_not_keep_the_process_from_exiting(tmp_path):
    import subprocess
    import sys

    code = (
        "import queue, threading\n"
        "from deltafin.io.pool import ReaderPool\n"
        "class Hung:\n"
        "    label, direct = 'd0', True\n"
        "    def read_into(self, path, offset, buf):\n"
        "        threading.Event().wait()\n"
        "pool = ReaderPool([Hung()], 2)\n"
        "pool.submit(0, 'x', 4096, 0, queue.SimpleQueue())\n"
        "pool.close(wait=False)\n"
        "print('reported')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "reported" in out.stdout, out.stderr


def test_deadlines_assume_the_rate_the_drive_delivers_when_lower():
    from deltafin.io.pool import DriveCounters
    from deltafin.runtime.layer_reads import deadline_rate

    assert deadline_rate(7.0, DriveCounters()) == 7.0  # nothing read yet: the known rate
    slow = DriveCounters(bytes=10**9, active_seconds=2.0)  # 0.5 GB/s delivered
    assert deadline_rate(7.0, slow) == pytest.approx(0.5) and deadline_rate(0.2, slow) == 0.2
    assert deadline_rate(0.0, DriveCounters()) == 0.1  # a rate of 0 never divides


def test_emulated_read_failures_are_served_by_replicas(k3, tmp_path):
    from deltafin.io.emulator import emulated_readers

    root, ref = k3
    pm = _copy(root, tmp_path / "m", replicas=True)
    readers = emulated_readers("d0:2GBps,lat=100us,jitter=0.3,fail=0.4;d1:1GBps,lat=100us,jitter=0.3", pm)
    got, source = _forward(pm, readers)
    assert torch.equal(got, ref)
    assert source.stats.failed_reads == readers[0].stats()["failures"] > 0


@pytest.mark.parametrize("layout", ["files", "stripe"])
@pytest.mark.parametrize("ahead", [1, 2])
def test_drives_read_a_bounded_number_of_experts_ahead_of_a_slow_consumer(k3, tmp_path, ahead, layout):
    """A whole layer's fetch with a consumer slower than the drives: each drive reads at most ``read_ahead`` experts
    ahead (a striped layer: ``read_ahead`` experts, a piece of each on every drive), so the read buffers stay that
    many (not the layer's); every expert still arrives once, intact. With read_ahead 0 the whole layer is read at
    once (as many buffers as experts)."""
    root, _ = k3
    if layout == "files":
        pm = _copy(root, tmp_path / "m")
    else:
        pack(str(root / "src"), str(tmp_path / "model"), parse_drives([f"{tmp_path}/d0=2", f"{tmp_path}/d1=1"]),
             PackOptions(placement="stripe-bandwidth", progress=False))
        pm = PackedModel.open(str(tmp_path / "model"))
    L, n, nbytes = pm.moe_layers[0], pm.num_experts, pm.file_bytes(pm.moe_layers[0])
    drives = len(pm.drives)
    assert (pm.stripe(L) is not None) == (layout == "stripe")
    lanes = drives if layout == "files" else 1
    for read_ahead, most in ((ahead, ahead * lanes + 1), (0, n)):
        source = StreamingExperts(pm, cache_bytes=0, threads=1, read_ahead=read_ahead)
        try:
            seen = []
            for e, t in source.fetch(L, list(range(n))):
                if not seen:  # let the drives run as far ahead as they may
                    deadline = time.monotonic() + 5
                    while source.pool.pending_bytes() != [0] * drives and time.monotonic() < deadline:
                        time.sleep(0.01)
                    time.sleep(0.05)
                want = pm.read_expert(L, e)
                assert all(torch.equal(t[k].data, want[k].data) for k in want)
                seen.append(e)
            assert sorted(seen) == list(range(n))
            buffers = source.pool.buffers.allocated // -(-nbytes // 4096) // 4096
            assert buffers <= most if read_ahead else buffers == most, (read_ahead, buffers)
        finally:
            source.close()


# ------------------------------------------------------------------ reads in parts, reserved buffers


class _Gated(FileDriveReader):
    """Records every call; each waits at a barrier of ``n`` calls, so the reads pass only when ``n`` of them run at
    once (reads in parts of one file: the threads share it; whole reads would never meet there)."""

    def __init__(self, label, root, n: int, fail_at: int | None = None):
        super().__init__(label, root)
        self.barrier = threading.Barrier(n, timeout=20) if n > 1 else None
        self.fail_at = fail_at
        self.calls: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def read_into(self, path, offset, buf):
        with self._lock:
            self.calls.append((os.path.basename(path), offset, len(buf)))
        if self.barrier is not None:
            self.barrier.wait()
        if offset == self.fail_at:
            raise OSError(5, "Input/output error")
        return super().read_into(path, offset, buf)


def test_a_long_read_goes_in_parts_the_threads_share_and_lands_once_whole(tmp_path):
    data = os.urandom(4 * 8192 - 123)  # four parts of 8 KiB, the last one short (not a multiple of 4 KiB)
    (tmp_path / "a").write_bytes(data)
    reader = _Gated("d0", str(tmp_path), 4)
    pool = ReaderPool([reader], 4, part_bytes=8192)
    done: queue.SimpleQueue = queue.SimpleQueue()
    checked = []
    pool.submit(0, str(tmp_path / "a"), len(data), "a", done, check=lambda b: checked.append(bytes(b)))
    c = done.get(timeout=30)
    assert c.error is None and c.tag == "a" and c.nbytes == len(data)
    assert bytes(c.buf[: len(data)]) == data and checked == [data]  # the check saw the whole file, once
    assert sorted(off for _, off, _ in reader.calls) == [0, 8192, 16384, 24576]
    with pytest.raises(queue.Empty):
        done.get(timeout=0.2)  # one completion for the read, not one per part
    assert pool.pending_bytes() == [0] and pool.counters[0].reads == 1 and pool.counters[0].bytes == len(data)
    # into a caller's view (a striped expert's piece) the same way
    dst = aligned_buffer(align_up(len(data)) + 8192)[8192:]
    pool.submit(0, str(tmp_path / "a"), len(data), "b", done, into=dst)
    c = done.get(timeout=30)
    pool.close()
    assert c.error is None and bytes(dst[: len(data)]) == data


def test_a_failed_part_fails_the_read_once_and_gives_its_buffer_back(tmp_path):
    (tmp_path / "a").write_bytes(os.urandom(3 * 8192))
    pool = ReaderPool([_Gated("d0", str(tmp_path), 1, fail_at=8192)], 2, part_bytes=8192)
    done: queue.SimpleQueue = queue.SimpleQueue()
    pool.submit(0, str(tmp_path / "a"), 3 * 8192, "a", done, check=lambda b: None)
    c = done.get(timeout=30)
    assert isinstance(c.error, OSError) and c.buf is None
    with pytest.raises(queue.Empty):
        done.get(timeout=0.2)
    assert pool.counters[0].errors == 1 and pool.counters[0].reads == 0 and pool.pending_bytes() == [0]
    assert len(pool.buffers._free[3 * 8192]) == 1  # back in the pool for the next read
    pool.close()


def test_the_engine_reads_in_parts_give_the_same_tokens(k3, tmp_path):
    root, ref = k3
    pm = PackedModel.open(str(root / "model"))
    source = StreamingExperts(pm, cache_bytes=0, threads=3, deadline=FAST)
    source.pool.part_bytes = 4096  # the tiny experts' files are a few parts each
    assert pm.file_bytes(pm.moe_layers[0]) > 2 * 4096
    model = registry.build(pm.family, pm.text_config, pm.trunk_records())
    try:
        got = _bounded(lambda: model.forward(torch.tensor(PROMPT), model.new_state(64), source))
    finally:
        source.close()
    assert torch.equal(got, ref)


def test_the_source_maps_its_read_buffers_when_it_opens(k3):
    root, _ = k3
    pm = PackedModel.open(str(root / "model"))
    L, nbytes = pm.moe_layers[0], pm.file_bytes(pm.moe_layers[0])
    source = StreamingExperts(pm, cache_bytes=0, threads=1, read_ahead=2)
    try:
        lanes = len(pm.drives)  # whole files: a lane per drive, read_ahead experts each, and the consumer's one
        assert source.reserved[:2] == (2 * lanes + 1, (2 * lanes + 1) * align_up(nbytes))
        before = source.pool.buffers.allocated
        assert sorted(e for e, _ in source.fetch(L, list(range(pm.num_experts)))) == list(range(pm.num_experts))
        assert source.pool.buffers.allocated == before  # the layer's reads took no new buffer
    finally:
        source.close()
    from deltafin.runtime.engine import ForeignDrive

    own = [FileDriveReader(pm.drives[0].label, pm.drives[0].path), ForeignDrive(pm.drives[1].label)]
    source = StreamingExperts(pm, cache_bytes=0, threads=1, read_ahead=2, readers=own)
    assert source.reserved[0] == 2 + 1  # a cluster rank: its own drive's lane only
    source.close()
    for kw in ({"reserve": False}, {"read_ahead": 0}):  # opted out; an unbounded read-ahead has no count to map
        source = StreamingExperts(pm, cache_bytes=0, threads=1, **kw)
        assert source.reserved == (0, 0, 0.0) and source.pool.buffers.allocated == 0
        source.close()
    buf = aligned_buffer(3 * 4096 + 5, populate=True)
    assert len(buf) == 4 * 4096 and not any(buf) and ctypes.addressof(ctypes.c_char.from_buffer(buf)) % 4096 == 0


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
@pytest.mark.parametrize("populate", [False, True])
def test_huge_buffers_advise_whole_huge_pages_inside_the_buffer_only(monkeypatch, populate):
    import mmap

    from deltafin.io import direct

    advised = []

    class Recording(mmap.mmap):
        def madvise(self, option, start=0, length=None):
            advised.append((option, start, length, ctypes.addressof(ctypes.c_char.from_buffer(self))))
            return super().madvise(option, start, length)

    monkeypatch.setattr(direct.mmap, "mmap", Recording)
    HUGE = direct.HUGE
    for nbytes in (HUGE + 12345, 3 * HUGE, 5 * HUGE + 4096):
        advised.clear()
        buf = aligned_buffer(nbytes, populate=populate, huge=True)
        assert len(buf) == align_up(nbytes) and not any(buf[::4096])  # its size, zero-filled
        buf[-1] = 7  # writable to its end
        (option, start, length, addr), = advised
        assert option == mmap.MADV_HUGEPAGE and length > 0 and length % HUGE == 0
        assert (addr + start) % HUGE == 0 and start + length <= len(buf)  # whole pages, no byte past the buffer
        assert start < HUGE and len(buf) - (start + length) < HUGE  # no whole huge page left out
    advised.clear()
    aligned_buffer(3 * HUGE)  # not asked for: small pages
    aligned_buffer(HUGE // 2, huge=True)  # less than a huge page: nothing to advise
    assert advised == []
