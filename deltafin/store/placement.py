"""Placement of expert files over drives. Plain Python: no torch, no files.

Every MoE layer waits for its slowest read, so balance is kept *per layer*: within each layer, each
drive gets a share of the layer's expert bytes proportional to its read rate.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("bandwidth",)


@dataclass(frozen=True, slots=True)
class DriveSpec:
    label: str
    gbps: float  # read rate, GB/s

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"drive {self.label}: read rate must be > 0 GB/s, got {self.gbps}")


def place_bandwidth(sizes: dict[int, list[int]], drives: list[DriveSpec]) -> dict[int, list[list[int]]]:
    """Greedy per layer: each expert goes to the drive whose finish time (bytes / rate) stays lowest.

    ``sizes[layer][e]`` is expert e's file size; the result maps layer -> expert -> [drive index].
    Ties go to the lower drive index, so the result is deterministic.
    """
    out: dict[int, list[list[int]]] = {}
    for layer, layer_sizes in sizes.items():
        load = [0.0] * len(drives)
        row: list[list[int]] = []
        for nbytes in layer_sizes:
            best = min(range(len(drives)), key=lambda d: ((load[d] + nbytes) / drives[d].gbps, d))
            load[best] += nbytes
            row.append([best])
        out[layer] = row
    return out


def place(sizes: dict[int, list[int]], drives: list[DriveSpec], policy: str = "bandwidth") -> dict[int, list[list[int]]]:
    if not drives:
        raise ValueError("placement needs at least one drive")
    if policy == "bandwidth":
        return place_bandwidth(sizes, drives)
    raise ValueError(f"unknown placement policy {policy!r}; known: {', '.join(POLICIES)}")
