"""Run statistics: where the time went, what was read, from which drive, and how well the cache did."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunStats:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    ttft_s: float = 0.0  # prompt in -> first new token out (prefill + first sample)
    prefill_tok_s: float = 0.0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    io_wait_s: float = 0.0
    expert_math_s: float = 0.0
    trunk_math_s: float = 0.0
    bytes_read: int = 0
    reads: int = 0
    cache_hit_rate: float = 0.0
    cache_bytes: int = 0
    per_drive: dict = field(default_factory=dict)
    prefill_read_amplification: float = 0.0  # expert bytes read in prefill / bytes of the unique experts needed
    prefill_chunk: int = 0
    prefill_bytes_read: int = 0
    union_per_layer: dict = field(default_factory=dict)  # layer -> distinct experts the prompt touched
    direct_io: bool = True
    device: str = "cpu"
    stop_reason: str = ""
    kernels: list = field(default_factory=list)  # fast-path kernels used so far ("triton:int8_linear", ...)

    def to_json(self) -> dict:
        d = asdict(self)
        d["bytes_read_per_token"] = self.bytes_read / max(len(self.tokens), 1)
        return d

    def summary(self) -> str:
        io = "direct I/O" if self.direct_io else "buffered I/O (the filesystem refused direct I/O)"
        total = max(self.io_wait_s + self.expert_math_s + self.trunk_math_s, 1e-9)
        lines = [
            f"{len(self.tokens)} tokens; prompt {self.prompt_tokens} tokens, time to first token {self.ttft_s:.2f} s "
            f"({self.prefill_tok_s:.1f} tok/s prefill, chunk {self.prefill_chunk}, read amplification "
            f"{self.prefill_read_amplification:.2f}); decode {self.decode_tok_s:.2f} tok/s",
            f"time: waiting on I/O {self.io_wait_s:.2f} s ({self.io_wait_s / total:.0%}), expert math "
            f"{self.expert_math_s:.2f} s ({self.expert_math_s / total:.0%}), trunk math {self.trunk_math_s:.2f} s "
            f"({self.trunk_math_s / total:.0%})",
            f"read {self.bytes_read / 1e6:,.1f} MB in {self.reads:,} reads ({io}); cache hit rate "
            f"{self.cache_hit_rate:.1%} of {self.cache_bytes / 1e9:.2f} GB",
        ]
        lines.append(f"math on {self.device}: " + (", ".join(self.kernels) if self.kernels
                                                   else "plain torch path (float32 reference or no fast path)"))
        for label, d in self.per_drive.items():
            rated = f" of its {d['rated_gbps']:.2f} GB/s" if d.get("rated_gbps") else ""
            lines.append(f"  drive {label}: {d['reads']:,} reads, {d['bytes'] / 1e6:,.1f} MB, "
                         f"{d['gbps_over_run']:.3f} GB/s over the run{rated}"
                         + (f", {d['errors']} failed reads" if d.get("errors") else ""))
        return "\n".join(lines)
