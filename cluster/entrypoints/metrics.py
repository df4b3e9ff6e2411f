"""Prometheus metrics of a server, with vLLM's names where the meaning is the same.

Two sources, both exposed from the process that serves HTTP (one registry per AsyncEngine):
- the front door, measured where outputs arrive (AsyncEngine, for gRPC and HTTP alike): requests by
  finish reason, prompt and generation tokens, time to first token, inter-token latency, end-to-end
  latency, and queue time (the engine's own clock, carried by each final RequestOutput's `metrics`);
- the engine, read from `EngineLoop.stats()` (in the Ray driver actor under `serve`) when /metrics is
  scraped: requests running and waiting, KV-cache usage, preemptions, prefix-cache queries and hits,
  and deltaserve's own GDN state slots in use. Speculative decoding's counters are exported under
  vLLM's names when the engine speculates (`stats()["spec_decode"]`, EngineCore.speculative_stats():
  num_drafts, num_draft_tokens, num_accepted_tokens, and accepted tokens per draft position).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deltaserve.cluster.core.request import RequestOutput

disable_created_metrics()  # no `_created` series beside each counter (vLLM leaves them out too)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# stats()["spec_decode"] key -> vLLM's counter name (absent while the engine does not speculate)
SPEC_DECODE_COUNTERS = {
    "num_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
}


@dataclass
class RequestTimer:
    """One request's front-door timestamps (time.perf_counter)."""

    arrival: float
    last_token: float | None = None
    finished: bool = False


class ServingMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._values = {"model_name": model_name, "engine": "0"}
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(**self._values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(**self._values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success", "Count of finished requests.", (*LABELS, "finished_reason"), registry=r
        )
        self.request_success = {
            reason: success.labels(**self._values, finished_reason=reason) for reason in FINISH_REASONS
        }
        refused = Counter(
            "deltaserve:requests_refused",
            "Requests refused before they were queued, by reason (invalid, not_found, queue_full, unavailable).",
            (*LABELS, "reason"),
            registry=r,
        )
        self.refused = lambda reason: refused.labels(**self._values, reason=reason).inc()
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)  # fmt: skip
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS
        )
        self.engine = EngineCollector(self._values)
        r.register(self.engine)

    # ---- the front door --------------------------------------------------------------------------
    def start(self) -> RequestTimer:
        return RequestTimer(arrival=time.perf_counter())

    def on_output(self, timer: RequestTimer, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.delta_token_ids:
            if timer.last_token is None:
                self.ttft.observe(now - timer.arrival)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                self.itl.observe(now - timer.last_token)
            timer.last_token = now
            self.generation_tokens.inc(len(out.delta_token_ids))
        if out.finished:
            timer.finished = True
            self.request_success[out.outputs[0].finish_reason or "abort"].inc()
            self.e2e.observe(now - timer.arrival)
            queued = out.metrics.time_in_queue if out.metrics is not None else None
            if queued is not None:
                self.queue.observe(queued)

    def on_abandoned(self, timer: RequestTimer) -> None:
        """The client left before the end (the request was aborted)."""
        if not timer.finished:
            timer.finished = True
            self.request_success["abort"].inc()
            self.e2e.observe(time.perf_counter() - timer.arrival)

    # ---- the engine --------------------------------------------------------------------------------
    def update_engine(self, stats: dict | None) -> None:
        """The engine's latest stats (EngineLoop.stats()); None while it is down."""
        self.engine.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """The engine's gauges and cumulative counters from its last stats snapshot."""

    def __init__(self, values: dict[str, str]):
        self._values = values
        self.stats: dict | None = None

    def describe(self):
        return []  # families depend on the snapshot (spec decoding only once it reports)

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        labels, values = list(self._values), list(self._values.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats["running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats["waiting"])
        pages = stats["total_pages"]
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            1.0 - stats["free_pages"] / pages if pages else 0.0,
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats["preemptions"])
        used_slots = stats["total_slots"] - stats["free_slots"]
        yield gauge("deltaserve:gdn_state_slots_used", "GDN state slots held by running requests.", used_slots)
        yield gauge("deltaserve:gdn_state_slots_total", "GDN state slots the pool holds.", stats["total_slots"])
        yield counter("deltaserve:engine_passes", "Passes the engine ran.", stats["passes"])
        prefix = stats.get("prefix_cache") or {}
        if prefix.get("enabled"):
            yield counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                prefix["query_tokens"],
            )
            yield counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                prefix["hit_tokens"],
            )
            yield gauge(
                "deltaserve:prefix_cache_snapshots_held",
                "GDN state snapshots the prefix cache holds.",
                prefix["snapshots_held"],
            )
        spec = stats.get("spec_decode") or {}
        for key, value in spec.items():
            if key in SPEC_DECODE_COUNTERS:
                yield counter(*SPEC_DECODE_COUNTERS[key], value)
        if spec.get("accepted_per_position") is not None:
            family = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*labels, "position"],
            )
            for position, accepted in enumerate(spec["accepted_per_position"]):
                family.add_metric([*values, str(position)], accepted)
            yield family
