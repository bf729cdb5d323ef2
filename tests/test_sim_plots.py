"""Simulator plots: policy names as in the CLI, value axes from 0, no line drawn on another, and the
README's striping argument (stripe by rate vs RAID-0 vs one file per expert) drawn."""

from __future__ import annotations

import pytest

from deltafin.interfaces.cmd_drives import POLICIES
from deltafin.sim import plots
from deltafin.sim.model import MoEShape
from deltafin.sim.scenarios import scaling_curves

SHAPE = MoEShape("small", layers=4, experts=64, top_k=8, expert_bytes=8 << 20)


@pytest.fixture(scope="module")
def curves():
    return scaling_curves(SHAPE, tokens=1)


def test_series_use_cli_policy_names_and_never_coincide(curves):
    s = plots.scaling_series(curves)
    assert set(s["lines"]) | set(s["merged"]) == {"bandwidth", "stripe", "raid0", "roundrobin"}
    for key in plots.SERIES:
        assert plots.legend(key).split(" ")[0] in POLICIES
    span = max(s["bound"])
    keys = list(s["lines"])
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            gap = max(abs(x - y) for x, y in zip(s["lines"][a], s["lines"][b], strict=True))
            assert gap > plots.SEPARATION * span, (a, b)
    for k, onto in s["merged"].items():
        assert onto in s["lines"] and k not in s["lines"]


def test_striping_argument(curves):
    s = plots.striping_series(curves["striping"])
    assert len(s["sets"]) == 2 and set(s["bars"]) == {"bandwidth", "raid0", "stripe"}
    for j in range(2):
        assert s["bars"]["stripe"][j] >= s["bars"]["raid0"][j] * 0.99  # pieces by rate never lose to RAID-0
        assert all(s["bars"][k][j] <= s["bound"][j] * (1 + 1e-9) for k in s["bars"])
    # with the internal drive twice as fast, RAID-0 is held to N x the slowest drive; pieces by rate are not
    assert s["bars"]["stripe"][1] / s["bound"][1] > s["bars"]["raid0"][1] / s["bound"][1] + 0.1


def test_plots_have_honest_axes(curves, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    seen = {}
    real = plots._save

    def spy(plt, fig, ax, out_dir, name, where):
        seen[name] = (ax.get_ylim(), ax.get_legend_handles_labels()[1])
        return real(plt, fig, ax, out_dir, name, where)

    monkeypatch.setattr(plots, "_save", spy)
    paths = plots.write_plots(curves, str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["scaling_cache.png", "scaling_drives.png", "striping.png"]
    for name, ((low, high), labels) in seen.items():
        assert low == 0 and high > 0, name
        assert labels, name
    assert any(lb.startswith("stripe-bandwidth") for lb in seen["striping.png"][1])
    assert any(lb.startswith("stripe-equal") for lb in seen["striping.png"][1])
