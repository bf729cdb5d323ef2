from __future__ import annotations

import os
import statistics
import threading
import time

import pytest

from deltafin.errors import ReadError, UsageError
from deltafin.io.calibrate import calibrate, measure_reader, write_test_file
from deltafin.io.direct import aligned_buffer
from deltafin.io.emulator import (
    PRESETS,
    DriveModel,
    DriveTimeline,
    EmulatedDriveSet,
    emulated_readers,
    format_spec,
    parse_spec,
)
from deltafin.io.replicas import read_with_replicas

MiB = 1 << 20


def _eventually(check, attempts: int = 5, pause: float = 0.5):
    """Run ``check`` (returns (ok, detail)) up to ``attempts`` times, ``pause`` seconds apart: a stray
    preemption spoils one measurement, and a burst of them on a shared virtual machine lasts a moment (a
    wrong emulator fails every attempt)."""
    for i in range(attempts):
        ok, detail = check()
        if ok:
            return
        if i + 1 < attempts:
            time.sleep(pause)
    raise AssertionError(detail)


class VirtualClock:
    """A clock the test moves: a read starts at ``t`` and its modelled completion is kept in ``woke``,
    so the emulated drives' timing is checked exactly, whatever else the machine is doing."""

    overhead = 0.0

    def __init__(self) -> None:
        self.t = 0.0
        self.woke = 0.0

    def now(self) -> float:
        return self.t

    def sleep_until(self, deadline: float) -> float:
        self.woke = max(self.t, deadline)
        return 0.0


def _streams(readers, clock: VirtualClock, path: str, size: int, per_reader: int, reads: int):
    """``per_reader`` back-to-back read streams on each reader, run in virtual time (each read issued
    by the stream that is free first); return (bytes, seconds until the last read ends, latencies)."""
    buf = aligned_buffer(size)
    free = [(0.0, i % len(readers)) for i in range(per_reader * len(readers))]
    done, lat = 0, []
    for _ in range(reads):
        free.sort()
        t, r = free.pop(0)
        clock.t = t
        done += readers[r].read_into(path, 0, buf)
        lat.append(clock.woke - t)
        free.append((clock.woke, r))
    return done, max(t for t, _ in free), lat


# ---------------------------------------------------------------- spec grammar


def test_parse_spec_example():
    models = parse_spec("internal:6.0GBps,lat=80us;ext1:2.5GBps;ext2:2.5GBps;ext3:2.5GBps,jitter=0.1")
    assert [m.label for m in models] == ["internal", "ext1", "ext2", "ext3"]
    assert [m.gbps for m in models] == [6.0, 2.5, 2.5, 2.5]
    assert models[0].lat_us == 80.0 and models[3].jitter == 0.1


def test_parse_spec_all_options_and_round_trip():
    spec = "a:800MBps,lat=0.2ms,jitter=0.3,slow=0.01x8,qd=32,iops=500k,fail=0.001,failpath=E0513"
    (m,) = parse_spec(spec)
    assert (m.gbps, m.lat_us, m.jitter, m.slow_p, m.slow_x) == (0.8, 200.0, 0.3, 0.01, 8.0)
    assert (m.qd, m.iops, m.fail_p, m.fail_paths) == (32, 500_000.0, 0.001, ("E0513",))
    assert parse_spec(format_spec([m])) == (m,)


def test_report4_preset_and_scale():
    models = parse_spec("report4")
    assert len(models) == 4 and sum(m.gbps for m in models) == pytest.approx(25.0)
    scaled = parse_spec("report4@0.04")
    assert sum(m.gbps for m in scaled) == pytest.approx(1.0)
    assert [m.lat_us for m in scaled] == [m.lat_us for m in models]  # latency is not scaled
    assert parse_spec("report4", scale=0.5)[0].gbps == pytest.approx(3.5)
    assert set(PRESETS) >= {"report4", "internal"}


@pytest.mark.parametrize("spec, bad", [
    ("", "''"),
    ("ssd", "'ssd'"),
    ("a:6", "'6'"),
    ("a:6GBps,lat=80", "'lat=80'"),
    ("a:6GBps,color=red", "'color=red'"),
    ("a:6GBps,slow=0.1", "'slow=0.1'"),
    ("a:6GBps,qd=x", "'qd=x'"),
    ("a:6GBps,jitter", "'jitter'"),
    ("a:6GBps;a:1GBps", "'a' appears twice"),
    ("a:-1GBps", "read rate must be > 0"),
    ("report4@zero", "'@zero'"),
])
def test_bad_specs_name_the_part_and_the_form(spec, bad):
    with pytest.raises(UsageError) as e:
        parse_spec(spec)
    assert bad in str(e.value)
    assert "expected" in str(e.value) or "twice" in str(e.value) or "must be" in str(e.value)


def test_emulated_readers_follow_the_model_drives():
    class Drive:
        def __init__(self, label):
            self.label = label

    class Packed:
        drives = [Drive("tb1"), Drive("internal")]

    readers = emulated_readers("internal:7GBps;tb1:6GBps", Packed())
    assert [r.label for r in readers] == ["tb1", "internal"] and readers[0].model.gbps == 6.0
    by_position = emulated_readers("a:1GBps;b:2GBps", Packed())
    assert [r.model.gbps for r in by_position] == [1.0, 2.0]
    with pytest.raises(UsageError, match="describes 4 drive"):
        emulated_readers("report4", Packed())


# ---------------------------------------------------------------- timing model


def test_timeline_shares_rate_and_overlaps_latency():
    t = DriveTimeline(DriveModel("d", 1.0, lat_us=1000.0))
    ends = [t.reserve(0.0, 10**9) for _ in range(3)]
    assert ends == pytest.approx([1.001, 2.001, 3.001])  # bus shared, latencies overlap
    assert t.backlog_bytes(1.001) == pytest.approx(2e9)


def test_timeline_queue_depth_slots():
    t = DriveTimeline(DriveModel("d", 1.0, lat_us=1000.0, qd=1))
    ends = [t.reserve(0.0, 10**6) for _ in range(3)]
    assert ends == pytest.approx([0.002, 0.004, 0.006])  # one slot: each read pays latency alone


def test_rate_grows_with_depth_up_to_saturation():
    m = DriveModel("d", 2.0, lat_us=100.0)
    assert m.saturation_depth(64 * 1024) == 5
    rates = [m.rate_at(q, 64 * 1024) for q in (1, 2, 4, 8, 32)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(2.0) and rates[0] < 0.5
    assert DriveModel("d", 2.0, lat_us=100.0, qd=2).rate_at(32, 64 * 1024) == pytest.approx(rates[1])


def test_jitter_keeps_mean_and_slow_reads_add_tail():
    import statistics

    t = DriveTimeline(DriveModel("d", 1.0, lat_us=100.0, jitter=0.5), seed=3)
    f = [t.sample_jitter() for _ in range(20000)]
    assert statistics.fmean(f) == pytest.approx(1.0, rel=0.03)
    slow = DriveTimeline(DriveModel("d", 1.0, lat_us=100.0, slow_p=0.5, slow_x=10.0), seed=1)
    times = [slow.reserve(i * 1.0, 4096) - i * 1.0 for i in range(200)]
    assert min(times) == pytest.approx(104.096e-6) and max(times) == pytest.approx(1040.96e-6)


# ---------------------------------------------------------------- emulated reads


def test_serves_real_bytes_from_file_and_memory(tmp_path):
    data = os.urandom(3 * 4096 + 100)
    path = tmp_path / "E0001.dfx"
    path.write_bytes(data)
    drives = EmulatedDriveSet(parse_spec("a:5GBps,lat=10us"), memory={"mem://x": data})
    r = drives.readers()[0]
    buf = aligned_buffer(4 * 4096)
    assert r.read_into(str(path), 0, buf) == len(data) and bytes(buf[: len(data)]) == data
    assert r.read_into("mem://x", 4096, buf[:4096]) == 4096 and bytes(buf[:4096]) == data[4096:8192]
    with pytest.raises(ReadError, match="drive a: cannot open .*missing"):
        r.read_into(str(tmp_path / "missing"), 0, buf)


def _within(a: float, b: float, rel: float = 0.1) -> bool:
    return abs(a - b) <= rel * abs(b)


def _run_threads(target, args_list):
    ts = [threading.Thread(target=target, args=a) for a in args_list]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.monotonic() - t0


def test_emulated_reads_keep_the_promised_rate_in_virtual_time():
    # four streams of 4 MiB reads on a 0.4 GB/s drive: the bus is shared, the latencies overlap
    clock = VirtualClock()
    drives = EmulatedDriveSet(parse_spec("a:0.4GBps,lat=100us,jitter=0.2"), memory={"m": os.urandom(4 * MiB)},
                              clock=clock)
    moved, seconds, _ = _streams(drives.readers(), clock, "m", 4 * MiB, per_reader=4, reads=64)
    assert moved == 64 * 4 * MiB
    assert moved / seconds / 1e9 == pytest.approx(0.4, rel=0.01)


def test_emulated_reads_keep_the_promised_latency_in_virtual_time(tmp_path):
    path = write_test_file(str(tmp_path / "t.bin"), MiB)  # a real file: the bytes come from the disk
    clock = VirtualClock()
    drives = EmulatedDriveSet(parse_spec("a:1GBps,lat=500us,jitter=0.3"), clock=clock)
    _, _, lat = _streams(drives.readers(), clock, path, 4096, per_reader=1, reads=4000)
    us = [x * 1e6 for x in lat]
    expected = 500 + 4.096
    assert statistics.fmean(us) == pytest.approx(expected, rel=0.03)
    # lognormal jitter of deviation 0.3 keeps the mean: its median is exp(-s^2/2) = 0.956 of it
    assert statistics.median(us) == pytest.approx(expected * 0.956, rel=0.03)


def test_emulated_drives_add_up_in_virtual_time():
    clock = VirtualClock()
    drives = EmulatedDriveSet(parse_spec("a:0.2GBps,lat=50us;b:0.2GBps,lat=50us"), memory={"m": os.urandom(2 * MiB)},
                              clock=clock)
    moved, seconds, _ = _streams(drives.readers(), clock, "m", 2 * MiB, per_reader=1, reads=40)
    assert moved / seconds / 1e9 == pytest.approx(0.4, rel=0.01)


def test_sleep_clock_never_wakes_before_its_deadline():
    from deltafin.io.emulator import _Clock

    clock = _Clock()
    for wait in (0.0, 20e-6, 200e-6, 2e-3) * 5:
        deadline = clock.now() + wait
        late = clock.sleep_until(deadline)
        assert late >= 0 and clock.now() >= deadline


@pytest.mark.timing
def test_emulator_keeps_promised_rate(timing):
    # 4 MiB reads at 0.4 GB/s: ~10 ms each, so OS scheduling noise stays small beside them
    drives = EmulatedDriveSet(parse_spec("a:0.4GBps,lat=100us,jitter=0.2"), memory={"m": os.urandom(4 * MiB)})
    r = drives.readers()[0]

    def work():
        buf = aligned_buffer(4 * MiB)
        for _ in range(4):
            r.read_into("m", 0, buf)

    def check():
        rate = 16 * 4 * MiB / _run_threads(work, [()] * 4) / 1e9
        return _within(rate, 0.4), f"emulated 0.4 GB/s drive moved {rate:.3f} GB/s"

    _eventually(check)


@pytest.mark.timing
def test_emulator_keeps_promised_latency(timing, tmp_path):
    path = write_test_file(str(tmp_path / "t.bin"), MiB)
    drives = EmulatedDriveSet(parse_spec("a:1GBps,lat=500us,jitter=0.3"))
    expected = 500 + 4.096

    def check():
        m = measure_reader(drives.readers()[0], path, size=4096, qd=1, seconds=0.25)
        # lognormal median: exp(-s^2/2) times the mean
        return _within(m.lat_mean_us, expected) and _within(m.lat_p50_us, expected * 0.956), m

    _eventually(check)


@pytest.mark.timing
def test_concurrent_drives_add_up(timing):
    drives = EmulatedDriveSet(parse_spec("a:0.2GBps,lat=50us;b:0.2GBps,lat=50us"), memory={"m": os.urandom(2 * MiB)})

    def work(r):
        buf = aligned_buffer(2 * MiB)
        for _ in range(4):
            r.read_into("m", 0, buf)

    def check():
        rate = 8 * 2 * MiB / _run_threads(work, [(r,) for r in drives.readers()]) / 1e9
        return _within(rate, 0.4), f"two emulated 0.2 GB/s drives moved {rate:.3f} GB/s together"

    _eventually(check)


# ---------------------------------------------------------------- failures and replicas


def test_failed_read_names_drive_and_file_and_replica_serves():
    data = {"/d0/L001/E0005.dfx": b"x" * 4096, "/d1/L001/E0005.dfx": b"x" * 4096}
    drives = EmulatedDriveSet(parse_spec("ssd0:5GBps,lat=10us,failpath=E0005;ssd1:5GBps,lat=10us"), memory=data)
    readers = drives.readers()
    buf = aligned_buffer(4096)
    with pytest.raises(ReadError) as e:
        readers[0].read_into("/d0/L001/E0005.dfx", 0, buf)
    assert "drive ssd0" in str(e.value) and "/d0/L001/E0005.dfx" in str(e.value) and "emulated I/O error" in str(e.value)
    used, got = read_with_replicas(readers, [0, 1], lambda d: f"/d{d}/L001/E0005.dfx", buf)
    assert (used, got) == (1, 4096) and bytes(buf) == b"x" * 4096
    assert drives.stats()[0]["failures"] == 2


def test_all_copies_failing_names_every_drive():
    drives = EmulatedDriveSet(parse_spec("p:5GBps,lat=10us,fail=1;q:5GBps,lat=10us,fail=1"), memory={"f": b"\0" * 4096})
    with pytest.raises(ReadError) as e:
        read_with_replicas(drives.readers(), [0, 1], lambda d: "f", aligned_buffer(4096))
    assert "drive p" in str(e.value) and "drive q" in str(e.value) and "2 tried" in str(e.value)


def test_failure_fraction_and_runtime_injection():
    drives = EmulatedDriveSet(parse_spec("a:50GBps,lat=1us,fail=0.25"), memory={"f": b"\0" * 4096}, seed=4)
    r = drives.readers()[0]
    buf = aligned_buffer(4096)
    fails = 0
    for _ in range(400):
        try:
            r.read_into("f", 0, buf)
        except ReadError:
            fails += 1
    assert 60 < fails < 140
    r.set_failures(fraction=0.0)
    assert r.read_into("f", 0, buf) == 4096


# ---------------------------------------------------------------- calibration against the real disk


@pytest.mark.timing
def test_calibration_reproduces_real_disk(timing, tmp_path):
    path = write_test_file(str(tmp_path / "cal.bin"), 16 * MiB)

    def check():
        cal = calibrate(path, seconds=0.25, big=MiB, big_qd=4, deep_qd=4)
        if not cal.direct:
            pytest.skip(f"{tmp_path} refuses O_DIRECT: nothing real to calibrate against")
        lat_real, rate_real = cal.point(4096, 1), cal.point(MiB, 4)
        emulated = EmulatedDriveSet([cal.model]).readers()[0]
        lat_emu = measure_reader(emulated, path, size=4096, qd=1, seconds=0.25)
        rate_emu = measure_reader(emulated, path, size=MiB, qd=4, seconds=0.4)
        ok = (_within(lat_emu.lat_p50_us, lat_real.lat_p50_us) and _within(lat_emu.lat_mean_us, lat_real.lat_mean_us)
              and _within(rate_emu.gbps, rate_real.gbps))
        return ok, (cal.model.spec(), lat_real, lat_emu, rate_real, rate_emu)

    _eventually(check)
