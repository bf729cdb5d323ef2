"""The cluster projection: machines own equal shares, cache what their memory holds after the trunk, read
the rest from their drives; a collective per layer. Its figures move the way the model says they must."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deltafin.cli import main
from deltafin.sim.cluster import ClusterConfig, Machine, Network, format_cluster, simulate_cluster
from deltafin.sim.model import KIMI_K3

K3_4 = replace(KIMI_K3, layers=4)  # four MoE layers: the same per-layer picture, quick


def _sim(n: int, gbit: float = 100.0, **kw) -> dict:
    kw.setdefault("tokens", 2)
    kw.setdefault("prompt", 0)
    kw.setdefault("shape", K3_4)
    return simulate_cluster(ClusterConfig(n, Network(gbit), **kw))


def test_allreduce_time_is_zero_alone_and_grows_with_machines_and_bytes():
    net = Network(10.0, hop_us=25.0)
    assert net.allreduce_s(1e6, 1) == 0.0
    assert net.allreduce_s(1e6, 2) < net.allreduce_s(1e6, 8) < net.allreduce_s(1e7, 8)
    # 2 machines, 1 MB on 10 Gb/s: one doubling step, 25 us + 0.8 ms
    assert net.allreduce_s(1e6, 2) == pytest.approx(25e-6 + 1e6 / 1.25e9)


def test_more_machines_cache_more_and_read_less():
    one, four = _sim(1, shape=KIMI_K3, tokens=1), _sim(4, shape=KIMI_K3, tokens=1)  # all 92 layers: memory binds
    assert four["cached_fraction"] == pytest.approx(4 * one["cached_fraction"], rel=0.01)
    assert four["read_gb_per_token"] < one["read_gb_per_token"]
    assert four["tok_s"] > one["tok_s"]
    for r in (one, four):
        assert 0 < r["tok_s"] <= r["bound_tok_s"] * 1.001


def test_whole_model_resident_reads_nothing_and_meets_the_memory_bound():
    big = Machine(memory_gb=1e4)  # every owned expert fits: no drive is touched after the first pass
    r = _sim(2, machine=big)
    assert r["cached_fraction"] == 1.0 and r["read_gb_per_token"] == 0.0
    assert r["tok_s"] == pytest.approx(r["bound_tok_s"], rel=0.02)


def test_slower_network_costs_time_and_ttft_counts_the_prompt_buffers():
    fast, slow = _sim(4, 100.0, prompt=64), _sim(4, 10.0, prompt=64)
    assert slow["net_ms_per_token"] > fast["net_ms_per_token"]
    assert slow["ttft_net_s"] > fast["ttft_net_s"] > 0
    assert slow["ttft_s"] > fast["ttft_s"]
    assert "TTFT" in format_cluster([fast, slow])


def test_machine_without_room_for_the_trunk_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        ClusterConfig(2, Network(10.0), Machine(memory_gb=64.0))


def test_simulate_cluster_cli(tmp_path, capsys):
    rc = main(["simulate", "--cluster", "--layers", "2", "--tokens", "1", "--prompt", "16", "--machines", "1,2",
               "--net-gbit", "10", "--json", str(tmp_path / "c.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "machines" in out and (tmp_path / "c.json").exists()
    assert main(["simulate", "--cluster", "--machines", "0"]) == 2
    assert "--machines" in capsys.readouterr().err
