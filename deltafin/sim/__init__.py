"""Discrete-event simulator of MoE decode and prefill over several drives (no bytes move).

Entry points: ``simulate(SimConfig(...))`` for one run, ``run_scenarios()`` for the standard
what-ifs (Kimi K3 on the report's drives, one drive, 8/16/40 drives, RAID-0, cache sizes),
``scaling_curves()`` + ``write_plots()`` for PNG curves, ``crosscheck()`` against the emulator.
"""

from __future__ import annotations

from deltafin.sim.emulated import crosscheck
from deltafin.sim.engine import SimConfig, simulate, simulate_decode, simulate_prefill
from deltafin.sim.model import KIMI_K3, MoEShape, report_drives
from deltafin.sim.scenarios import format_table, run_scenarios, scaling_curves, scenario_configs, write_plots

__all__ = [
    "KIMI_K3",
    "MoEShape",
    "SimConfig",
    "crosscheck",
    "format_table",
    "report_drives",
    "run_scenarios",
    "scaling_curves",
    "scenario_configs",
    "simulate",
    "simulate_decode",
    "simulate_prefill",
    "write_plots",
]
