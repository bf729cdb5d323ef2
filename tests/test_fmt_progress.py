"""Human-readable figures, progress lines that suit logs, and per-drive rates over the time a drive was busy."""

from __future__ import annotations

import io

import pytest

from deltafin import fmt, progress


def test_sizes_rates_durations():
    assert fmt.size(0) == "0 B" and fmt.size(512) == "512 B"
    assert fmt.size(17_551_360) == "17.6 MB" and fmt.size(1_446_800_000_000) == "1.45 TB"
    assert fmt.size(57.4e9) == "57.4 GB" and fmt.size(4096) == "4.10 kB"
    assert fmt.gbps(6.5) == "6.50 GB/s" and fmt.gbps(0.45) == "450 MB/s" and fmt.rate(2.5e6) == "2.50 MB/s"
    assert fmt.duration(0.35) == "350 ms" and fmt.duration(4.2) == "4.20 s"
    assert fmt.duration(1447) == "24 min 07 s" and fmt.duration(7300) == "2 h 01 min"
    assert fmt.duration(3 * 86400 + 4 * 3600) == "3 d 04 h" and fmt.duration(float("nan")) == "?"


def test_plain_progress_lines_with_eta():
    out = io.StringIO()
    p = progress.PlainProgress(4e9, "pack", "B", out, every_s=0.0)
    p.update(1e9)
    p.update(1e9)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[0].startswith("pack: 1.00 GB of 4.00 GB (25%), ") and "ETA " in lines[0]
    assert lines[1].startswith("pack: 2.00 GB of 4.00 GB (50%)")


def test_bar_is_plain_off_a_terminal_and_silent_when_disabled():
    out = io.StringIO()
    assert isinstance(progress.bar(10, "x", "rec", file=out), progress.PlainProgress)
    quiet = progress.bar(10, "x", "rec", enabled=False, file=out)
    quiet.update(10)
    quiet.close()
    fast = progress.bar(10, "x", "rec", file=out)
    fast.update(10)
    fast.close()  # under two seconds and never shown: no line
    assert out.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress.bar(10, "x", file=Tty()), progress.PlainProgress)  # tqdm on a terminal


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from tests.tiny import pack_tiny

    return pack_tiny(tmp_path_factory.mktemp("fmtp"), "qwen3_moe")


def test_drive_rates_over_busy_time_and_prefill_progress(model, monkeypatch):
    from deltafin.runtime.engine import Engine, EngineOptions

    ticks = []

    class Recorder(progress.NoProgress):
        def update(self, n=1):
            ticks.append((self.desc, n))

    monkeypatch.setattr(progress, "bar", lambda total, desc, *a, **k: Recorder(total, desc))
    eng = Engine(model, EngineOptions(exact=True, cache_gb=0.0, max_len=256, progress=True))
    try:
        assert sum(n for d, n in ticks if d == "loading trunk") == int(eng.packed.doc["trunk"]["bytes"])
        ticks.clear()
        list(eng.generate(list(range(3, 83)), 3))  # 80 tokens: long enough for prefill progress
        st = eng.last_stats
    finally:
        eng.close()
    assert [d for d, _ in ticks] == ["prefill"] * eng.model.num_layers * (80 // st.prefill_chunk)
    for d in st.per_drive.values():
        assert d["bytes"] > 0 and 0 < d["active_s"]
        assert d["gbps_busy"] == pytest.approx(d["bytes"] / d["active_s"] / 1e9)
        assert d["gbps_busy"] >= d["gbps_over_run"]  # busy time is part of the run
    text = st.summary()
    assert "while reading (busy " in text and "rated 2.00 GB/s" in text and "GB/s over the run" not in text
