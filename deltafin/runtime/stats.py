"""Run statistics: where the time went, what was read, from which drive, and how well the cache did."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

_CLOCK = {"gpu": "; on the GPU's clock (CUDA events): I/O is the time the GPU sat idle for want of experts",
          "gpu+graphs": "; on the GPU's clock (CUDA events): I/O is the time the GPU sat idle for want of experts, "
                        "and the expert math of decode steps replayed as CUDA graphs counts as trunk math"}


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
    mapped_drives: int = 0  # drives in memory whose files were mapped, not read (``io.mapped``)
    device: str = "cpu"
    stop_reason: str = ""
    kernels: list = field(default_factory=list)  # fast-path kernels used so far ("triton:int8_linear", ...)
    checks: str = "host"  # where expert reads were checked: "host" (reader threads), "gpu" (slab slots), "off"
    check_s: float = 0.0  # host time checking reads, summed over the reader threads
    checked_later: int = 0  # of the reads, mapped files checked while the CPU's math read them
    gpu_check_s: float = 0.0  # GPU time of the checks' launches
    clock: str = "host"  # "host" (CPU, MLX), "gpu" (CUDA events), "gpu+graphs" (decode steps replayed as graphs)
    guessed: int = 0  # expert reads started on a guess of the next layer's routing (--guess-next)
    guess_used: int = 0  # of those, experts the layer asked for
    guess_cancelled: int = 0  # of the rest, reads cancelled before they started
    guess_note: str = ""  # why the guesses were not read, where they were not

    def to_json(self) -> dict:
        d = asdict(self)
        d["bytes_read_per_token"] = self.bytes_read / max(len(self.tokens), 1)
        return d

    def summary(self, verbose: bool = False) -> str:
        """Where the run's time went and what it read, in a few lines; ``verbose`` adds the prefill plan
        and the kernels that ran."""
        from deltafin import fmt

        io = "direct I/O" if self.direct_io else "buffered I/O (the filesystem refused direct I/O)"
        if self.mapped_drives:
            io = f"files mapped on {self.mapped_drives} drive(s) in memory"
        total = max(self.io_wait_s + self.expert_math_s + self.trunk_math_s, 1e-9)
        lines = [
            f"{len(self.tokens)} tokens at {self.decode_tok_s:.2f} tok/s; time to first token {fmt.duration(self.ttft_s)} "
            f"(prompt of {self.prompt_tokens} tokens read at {self.prefill_tok_s:.1f} tok/s)",
            f"time: waiting on I/O {fmt.duration(self.io_wait_s)} ({self.io_wait_s / total:.0%}), expert math "
            f"{fmt.duration(self.expert_math_s)} ({self.expert_math_s / total:.0%}), rest of the model (trunk math) "
            f"{fmt.duration(self.trunk_math_s)} ({self.trunk_math_s / total:.0%})" + _CLOCK.get(self.clock, ""),
            f"read {fmt.size(self.bytes_read)} of experts from the drives in {self.reads:,} reads ({io}); "
            f"{self.cache_hit_rate:.0%} of expert lookups found in memory (expert cache limit "
            f"{fmt.size(self.cache_bytes)})",
            _checks(self),
        ]
        if self.guessed:
            wasted = self.guessed - self.guess_used - self.guess_cancelled
            lines.append(f"read ahead on a guess of the next layer's routing: {self.guessed:,} experts, "
                         f"{self.guess_used / self.guessed:.0%} of them asked for; {self.guess_cancelled:,} cancelled "
                         f"before reading, {wasted:,} read for nothing")
        elif self.guess_note:
            lines.append(self.guess_note + " (--no-guess-next stops guessing)")
        if verbose:
            lines.append(f"prefill: chunks of {self.prefill_chunk} tokens, read amplification "
                         f"{self.prefill_read_amplification:.2f} (bytes read / bytes of the distinct experts)")
            lines.append(f"math on {self.device}: " + (", ".join(self.kernels) if self.kernels
                                                       else "plain torch path (float32 reference or no fast path)"))
        run_s = max(total, 1e-9)
        for label, d in self.per_drive.items():
            rated = f", rated {fmt.gbps(d['rated_gbps'])}" if d.get("rated_gbps") else ""
            busy = d.get("active_s", 0.0)
            rate = (f"{fmt.gbps(d['gbps_busy'])} while reading (busy {busy / run_s:.0%} of the run)"
                    if busy > 0 else "idle")
            lines.append(f"  drive {label}: {d['reads']:,} reads, {fmt.size(d['bytes'])}, {rate}{rated}"
                         + (f", {d['errors']} failed reads" if d.get("errors") else ""))
        return "\n".join(lines)

    def line(self) -> str:
        """One line for a chat turn: speed, first token, bytes read, cache."""
        from deltafin import fmt

        return (f"[{len(self.tokens)} tokens, {self.decode_tok_s:.2f} tok/s, first token {fmt.duration(self.ttft_s)}, "
                f"{fmt.size(self.bytes_read)} read, {self.cache_hit_rate:.0%} from memory; /stats for more]")


def _checks(st: RunStats) -> str:
    """Where the reads' checksums were computed, and the time they took there."""
    from deltafin import fmt

    if st.checks == "off":
        return "reads not checked (--no-verify-reads)"
    host = f"{fmt.duration(st.check_s)} on the host (summed over the reader threads)"
    if st.checks == "gpu":
        return f"reads checked on the GPU: {fmt.duration(st.gpu_check_s)} of GPU time; " + host
    later = f"; {st.checked_later:,} of them mapped files checked while the math read them" if st.checked_later else ""
    return "reads checked on the host: " + host + later
