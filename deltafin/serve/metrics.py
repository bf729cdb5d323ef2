"""``/metrics`` through ``prometheus_client``: engine, queue, prompt-cache and HTTP figures read at scrape time,
plus request-latency and time-to-first-token histograms. One registry per app, so several can live in one
process (tests)."""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds: a tiny model answers in milliseconds, Kimi K3 from SSDs takes about a minute to its first token
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, value=value)


def _counter(
    name: str,
    help_: str,
    value: float | None = None,
    labels: list[str] | None = None,
    samples: list[tuple[list[str], float]] = (),
) -> CounterMetricFamily:
    """``name`` ends in _total, as exposed (prometheus_client adds the suffix back)."""
    c = CounterMetricFamily(name.removesuffix("_total"), help_, value=value, labels=labels)
    for lab, v in samples:
        c.add_metric(lab, v)
    return c


class EngineCollector:
    """Reads the worker's, decoder's, expert source's and prompt cache's counters at each scrape."""

    def __init__(self, worker, http: Counter):
        self.worker, self.http = worker, http

    def collect(self):
        w = self.worker
        eng, c, dc = w.engine, w.counters, w.decoder.counters
        src = eng.source.stats
        yield _gauge(
            "deltafin_generated_tokens_per_second",
            "tokens generated per second over the last 10 s",
            w.tokens_per_s(),
        )
        yield _counter("deltafin_generated_tokens_total", "tokens generated", dc.generated_tokens)
        yield _counter("deltafin_prompt_tokens_total", "prompt tokens prefilled", dc.prompt_tokens)
        yield _counter(
            "deltafin_prompt_cached_tokens_total",
            "prompt tokens restored from the prompt cache instead of prefilled",
            dc.cached_tokens,
        )
        yield _counter("deltafin_decode_steps_total", "batched decode steps", dc.steps)
        yield _gauge("deltafin_queue_length", "sequences waiting to be admitted", w.queued)
        yield _gauge("deltafin_sequences_in_flight", "sequences being decoded", w.in_flight)
        yield _gauge("deltafin_peak_batch", "most sequences decoded together in one step", c.peak_batch)
        yield _counter(
            "deltafin_sequences_total",
            "sequences by outcome",
            labels=["outcome"],
            samples=[
                (["ok"], c.requests_ok),
                (["failed"], c.requests_failed),
                (["cancelled"], c.requests_cancelled),
            ],
        )
        yield _counter(
            "deltafin_http_requests_total",
            "HTTP responses by path and status",
            labels=["path", "status"],
            samples=[([p, str(s)], n) for (p, s), n in sorted(self.http.items())],
        )
        drives = eng.source.per_drive()
        for key, name, help_ in (
            ("bytes", "deltafin_expert_bytes_read_total", "routed-expert bytes read, per drive"),
            ("reads", "deltafin_expert_reads_total", "routed-expert reads, per drive"),
            ("errors", "deltafin_expert_read_errors_total", "failed reads, per drive"),
        ):
            yield _counter(
                name, help_, labels=["drive"], samples=[([lb], d[key]) for lb, d in drives.items()]
            )
        yield _gauge(
            "deltafin_expert_cache_hit_rate", "expert cache hits / lookups since start", src.hit_rate
        )
        yield _counter(
            "deltafin_expert_cache_lookups_total",
            "expert cache lookups by result",
            labels=["result"],
            samples=[(["hit"], src.hits), (["miss"], src.misses)],
        )
        yield _counter(
            "deltafin_io_wait_seconds_total", "time the engine waited on expert reads", src.io_wait_s
        )
        yield from self._prompt_cache()

    def _prompt_cache(self):
        pc = self.worker.prompt_cache
        if pc is None:
            return
        k = pc.counters
        yield _counter(
            "deltafin_prompt_cache_lookups_total",
            "prompt cache lookups by result",
            labels=["result"],
            samples=[(["hit"], k.hits), (["miss"], k.lookups - k.hits)],
        )
        yield _gauge(
            "deltafin_prompt_cache_bytes", "bytes of sequence state held by the prompt cache", pc.used
        )
        yield _gauge("deltafin_prompt_cache_budget_bytes", "the prompt cache's byte budget", pc.budget)
        yield _gauge("deltafin_prompt_cache_entries", "sequence states held by the prompt cache", len(pc))
        yield _counter(
            "deltafin_prompt_cache_evictions_total", "states evicted to stay within the budget", k.evicted
        )


class Metrics:
    """The app's registry: the engine collector and the two request histograms."""

    def __init__(self, worker, http: Counter):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(worker, http))
        self.latency = Histogram(
            "deltafin_request_duration_seconds",
            "HTTP request latency, until the last byte",
            ["path"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "deltafin_time_to_first_token_seconds",
            "time from a generation request's arrival to its first token",
            ["kind"],
            buckets=BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
