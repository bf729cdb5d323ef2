"""``deltafin bench kernels --device mlx`` and ``bench decode --device mlx`` run on MLX's CPU build and report
each figure beside its limit measured in the same run (no speed target here). Kernels at reduced widths."""

from __future__ import annotations

import json

import pytest

from deltafin.cli import main
from deltafin.kernels import mlx as km

pytestmark = pytest.mark.skipif(bool(km.available()), reason=km.available() or "mlx present")


def test_bench_kernels_mlx_reports_gbps_beside_the_copy_rate(tmp_path, capsys, monkeypatch):
    from deltafin.mlx import bench as mb

    for name, v in (("K3_LATENT", 512), ("K3_INTER", 256), ("INT8_SHAPES", [(256, 512)]), ("COPY_GIB", 0.05)):
        monkeypatch.setattr(mb, name, v)
    out = tmp_path / "k.json"
    main(["bench", "kernels", "--device", "mlx", "--seconds", "0.05", "--json", str(out)])
    text = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["device"] == "mlx" and rec["copy_GBps"] == max(rec["copy_GBps_before_after"]) > 0
    assert [c["tokens"] for c in rec["cases"]] == [1, 4, 32, 1]
    for c in rec["cases"] + [rec["k3_layer_step"]]:
        assert c["GBps"] > 0 and c["over_copy_rate"] == pytest.approx(c["GBps"] / rec["copy_GBps"])
    assert rec["k3_layer_step"]["experts"] == 16
    assert "of the copy rate" in text and "one gather_qmm pass from the slab" in text


def test_bench_decode_mlx_reads_into_the_slab_beside_the_raw_rate(tmp_path, capsys):
    out = tmp_path / "d.json"
    main(["bench", "decode", "--device", "mlx", "--layers", "1", "--experts", "8", "--k", "4", "--tokens", "2",
          "--threads", "2", "--dir", str(tmp_path), "--json", str(out)])
    text = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["bytes_read"] >= 4 * rec["expert_file_bytes"] and rec["mode"] == "full"
    assert rec["efficiency"] == pytest.approx(rec["read_GBps"] / rec["raw_GBps"])
    assert "read into the MLX slab" in text and "of the drive's raw" in text
