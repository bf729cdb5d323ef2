"""Shapes of MoE models and the drive sets the simulator runs them on."""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.io.emulator import DriveModel, parse_spec


@dataclass(frozen=True, slots=True)
class MoEShape:
    """What the simulator needs of a model: MoE layers, experts per layer, routed per token, and
    the bytes of one expert file's payload (all experts the same size)."""

    name: str
    layers: int
    experts: int
    top_k: int
    expert_bytes: int

    def __post_init__(self) -> None:
        if min(self.layers, self.experts, self.top_k, self.expert_bytes) <= 0 or self.top_k > self.experts:
            raise ValueError(f"model shape {self.name}: need layers, experts, expert_bytes > 0 and "
                             f"0 < top_k <= experts, got {self}")

    @property
    def bytes_per_token(self) -> int:
        """Routed expert bytes one decoded token needs (no cache)."""
        return self.layers * self.top_k * self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers * self.experts * self.expert_bytes


KIMI_K3 = MoEShape("kimi-k3", layers=92, experts=896, top_k=16, expert_bytes=17_547_264)

# Assumed figures (not measured): NVMe-class latency, Thunderbolt adding some latency and tail.
INTERNAL_SPEC = "internal:7GBps,lat=70us,jitter=0.1"
EXTERNAL_SPEC = "tb{i}:6GBps,lat=120us,jitter=0.2,slow=0.001x4"


def report_drives(n: int = 4) -> tuple[DriveModel, ...]:
    """The original report's drive mix extended to ``n`` drives: the internal drive plus
    ``n - 1`` Thunderbolt 5 enclosures (``n = 4`` is the ``report4`` preset)."""
    if n < 1:
        raise ValueError(f"need at least one drive, got {n}")
    parts = [INTERNAL_SPEC] + [EXTERNAL_SPEC.format(i=i) for i in range(1, n)]
    return parse_spec(";".join(parts))
