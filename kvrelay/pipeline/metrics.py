"""Prometheus metrics named like vLLM's (`kvrelay:` instead of `vllm:`), shared by all processes.

Each process builds one `Metrics` on its own registry, so tests and several apps in one process
never clash; `render()` gives the text exposition format for a /metrics endpoint.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

logger = logging.getLogger(__name__)

# No `*_created` series (a timestamp per labelled child: noise to a scraper), as vLLM does.
# Process-wide, so the workers' metrics (built on `Metrics`) export none either.
disable_created_metrics()

PREFIX = "kvrelay:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket edges follow vLLM's so dashboards built for it read these unchanged.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class Metrics:
    """The request metrics; every series carries a `model_name` label."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token in seconds.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens in seconds.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time from arrival until a worker started the request, in seconds.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt tokens per request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Generated tokens per request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running", "Requests producing tokens.", m, registry=r
        )
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting",
            "Requests waiting for their first token.",
            m,
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", m, registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", m, registry=r
        )
        # vLLM v1's prefix-cache series, in prompt tokens: queries = tokens looked up, hits =
        # tokens found cached; hit rate = rate(hits) / rate(queries). The gauge below is the
        # lifetime ratio, like vLLM v0's gpu_prefix_cache_hit_rate, for a quick look.
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries",
            "Prefix cache queries, in prompt tokens looked up.",
            m,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits",
            "Prefix cache hits, in prompt tokens found cached.",
            m,
            registry=r,
        )
        self.prefix_cache_hit_rate = Gauge(
            PREFIX + "prefix_cache_hit_rate",
            "Prefix cache hits / queries (tokens) since the process started.",
            m,
            registry=r,
        )
        self._cache_tally: dict[str, list[float]] = {}  # model -> [queries, hits]
        self.prefix_cache_hit_tokens = Counter(
            PREFIX + "prefix_cache_hit_tokens",
            "Prompt tokens served from the KV cache.",
            m,
            registry=r,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            m + ["finished_reason"],
            registry=r,
        )
        self.request_route = Counter(
            PREFIX + "request_route",
            "Requests by the stream they were sent to.",
            m + ["route"],
            registry=r,
        )
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected",
            "Completion requests answered with an error status (4xx, 5xx), by status.",
            ["status"],
            registry=r,
        )

    def count_prefix_cache(self, model: str, queries: int, hits: int) -> None:
        """Count one prompt's prefix-cache lookup (`queries` tokens, `hits` of them cached), in
        vLLM's series and in `prefix_cache_hit_tokens`."""
        self.prefix_cache_hit_tokens.labels(model).inc(hits)
        if queries <= 0:
            return
        self.prefix_cache_queries.labels(model).inc(queries)
        self.prefix_cache_hits.labels(model).inc(hits)
        tally = self._cache_tally.setdefault(model, [0.0, 0.0])
        tally[0] += queries
        tally[1] += hits
        self.prefix_cache_hit_rate.labels(model).set(tally[1] / tally[0])

    def render(self) -> bytes:
        """Text exposition of every metric in this registry."""
        return generate_latest(self.registry)


class RequestTimer:
    """Follows one request's tokens and records its latency metrics (waiting -> running -> done)."""

    __slots__ = ("metrics", "model", "arrival", "last_token", "first_token", "done", "finished")

    def __init__(self, metrics: Metrics, model: str, arrival: float):
        self.metrics, self.model, self.arrival = metrics, model, arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.done = False  # left the running/waiting gauges
        self.finished = False  # counted in request_success (at most once)
        metrics.num_requests_waiting.labels(model).inc()

    def tokens(self, count: int, now: float) -> None:
        """Record `count` tokens that arrived at `now` (monotonic seconds)."""
        if count <= 0 or self.done:
            return
        m = self.metrics
        if self.first_token is None:
            self.first_token = now
            m.time_to_first_token.labels(self.model).observe(now - self.arrival)
            m.num_requests_waiting.labels(self.model).dec()
            m.num_requests_running.labels(self.model).inc()
        elif self.last_token is not None:
            # a chunk of several tokens spreads its gap evenly over them
            gap = (now - self.last_token) / count
            for _ in range(count):
                m.inter_token_latency.labels(self.model).observe(gap)
        self.last_token = now
        m.generation_tokens.labels(self.model).inc(count)

    def finish(self, reason: str, usage: dict[str, int] | None, now: float) -> None:
        """Record the end of the request (once); `reason` is the finish reason or 'error'.

        Also after close(): a client that disconnected is counted 'cancelled' once its request
        is actually cancelled, which with a disconnect grace period happens later.
        """
        if self.finished:
            return
        self.finished = True
        self.close()
        m, model = self.metrics, self.model
        m.e2e_request_latency.labels(model).observe(now - self.arrival)
        m.request_success.labels(model, reason).inc()
        if usage:
            prompt = int(usage.get("prompt_tokens", 0))
            m.prompt_tokens.labels(model).inc(prompt)
            m.request_prompt_tokens.labels(model).observe(prompt)
            m.request_generation_tokens.labels(model).observe(
                int(usage.get("completion_tokens", 0))
            )
            m.count_prefix_cache(model, prompt, int(usage.get("cached_tokens", 0)))

    def close(self) -> None:
        """Leave the running/waiting gauges (also for requests the client abandoned)."""
        if self.done:
            return
        self.done = True
        gauge = (
            self.metrics.num_requests_waiting
            if self.first_token is None
            else (self.metrics.num_requests_running)
        )
        gauge.labels(self.model).dec()
