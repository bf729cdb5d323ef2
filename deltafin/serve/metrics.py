"""``/metrics`` in the Prometheus text exposition format (version 0.0.4), written out by hand."""

from __future__ import annotations

from collections import Counter


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Lines:
    def __init__(self):
        self.out: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        self.out.append(f"# HELP {name} {help_}")
        self.out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(str(v))}"' for k, v in labels.items())
            self.out.append(f"{name}{{{lab}}} {value:g}" if lab else f"{name} {value:g}")

    def text(self) -> str:
        return "\n".join(self.out) + "\n"


def render(worker, http: Counter) -> str:
    """Engine, queue and HTTP figures. ``http`` counts responses by (path, status)."""
    eng, c, dc = worker.engine, worker.counters, worker.decoder.counters
    src = eng.source.stats
    m = Lines()
    m.metric("deltafin_generated_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
             [({}, worker.tokens_per_s())])
    m.metric("deltafin_generated_tokens_total", "counter", "tokens generated", [({}, dc.generated_tokens)])
    m.metric("deltafin_prompt_tokens_total", "counter", "prompt tokens prefilled", [({}, dc.prompt_tokens)])
    m.metric("deltafin_decode_steps_total", "counter", "batched decode steps", [({}, dc.steps)])
    m.metric("deltafin_queue_length", "gauge", "sequences waiting to be admitted", [({}, worker.queued)])
    m.metric("deltafin_sequences_in_flight", "gauge", "sequences being decoded", [({}, worker.in_flight)])
    m.metric("deltafin_peak_batch", "gauge", "most sequences decoded together in one step", [({}, c.peak_batch)])
    m.metric("deltafin_sequences_total", "counter", "sequences by outcome",
             [({"outcome": "ok"}, c.requests_ok), ({"outcome": "failed"}, c.requests_failed),
              ({"outcome": "cancelled"}, c.requests_cancelled)])
    m.metric("deltafin_http_requests_total", "counter", "HTTP responses by path and status",
             [({"path": p, "status": s}, n) for (p, s), n in sorted(http.items())])
    drives = eng.source.per_drive()
    m.metric("deltafin_expert_bytes_read_total", "counter", "routed-expert bytes read, per drive",
             [({"drive": label}, d["bytes"]) for label, d in drives.items()])
    m.metric("deltafin_expert_reads_total", "counter", "routed-expert reads, per drive",
             [({"drive": label}, d["reads"]) for label, d in drives.items()])
    m.metric("deltafin_expert_read_errors_total", "counter", "failed reads, per drive",
             [({"drive": label}, d["errors"]) for label, d in drives.items()])
    m.metric("deltafin_expert_cache_hit_rate", "gauge", "expert cache hits / lookups since start",
             [({}, src.hit_rate)])
    m.metric("deltafin_expert_cache_lookups_total", "counter", "expert cache lookups by result",
             [({"result": "hit"}, src.hits), ({"result": "miss"}, src.misses)])
    m.metric("deltafin_io_wait_seconds_total", "counter", "time the engine waited on expert reads",
             [({}, src.io_wait_s)])
    return m.text()
