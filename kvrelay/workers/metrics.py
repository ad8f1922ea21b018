"""Prometheus metrics of one worker process (names like vLLM's), served on its own port.

Request-level series come from `kvrelay.pipeline.metrics.Metrics`; a worker counts prefix-cache
queries/hits (tokens) there, and adds its KV pool usage (`kv_cache_usage_perc`, read from the
engine's block pool at scrape time), KV store traffic (`CountingConnector`) and dead letters.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from prometheus_client import Counter, Gauge

from kvrelay.core.messages import Task
from kvrelay.pipeline.metrics import PREFIX, Metrics
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.engine.config import EngineStats
from kvrelay.workers.engine_api import BlockPoolOwner

logger = logging.getLogger(__name__)


class WorkerMetrics:
    """All series of one worker; `serve(port)` exposes them over HTTP."""

    def __init__(self, model: str, engine: BlockPoolOwner | None = None):
        self.model = model
        self.base = Metrics()
        r = self.base.registry
        self.port: int | None = None
        self._server: Any = None
        self.prefix_cache_queries = self.base.prefix_cache_queries.labels(model)
        self.prefix_cache_hits = self.base.prefix_cache_hits.labels(model)
        # vLLM's name and meaning: the fraction of KV blocks in use (free = unreferenced,
        # cached blocks included, since any of them can be handed out)
        # (no series until track_engine: a worker without its engine reports nothing, not 0)
        self.kv_cache_usage = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            ["model_name"],
            registry=r,
        )
        self.store_bytes = Counter(
            PREFIX + "kv_store_bytes",
            "KV page bytes moved between this worker and the store.",
            ["model_name", "op"],
            registry=r,
        )
        self.store_pages = Counter(
            PREFIX + "kv_store_pages",
            "KV pages moved between this worker and the store.",
            ["model_name", "op"],
            registry=r,
        )
        self.dead_letters = self._counter(
            "dead_letters", "Stream entries this worker sent to the DLQ."
        )
        # Speculative decoding (vLLM's names): draft tokens verified, accepted, and drafts
        # verified (a request's step with a draft), from the engine's stats (count_engine).
        # generation_tokens / generation_steps is output tokens per request-step (1 without
        # speculation); num_accepted_tokens / num_draft_tokens the acceptance rate.
        self.spec_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified by speculative decoding."
        )
        self.spec_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted (each one an output token)."
        )
        self.spec_drafts = self._counter(
            "spec_decode_num_drafts", "Drafts verified: request-steps that checked a draft."
        )
        self.generation_steps = self._counter(
            "generation_steps",
            "Request-steps that produced output tokens (one per request per engine step); "
            "generation_tokens / generation_steps is tokens per step.",
        )
        self._engine_counts = (0, 0, 0)
        self.generation_tokens = self.base.generation_tokens.labels(model)
        self.prompt_tokens = self.base.prompt_tokens.labels(model)
        if engine is not None:
            self.track_engine(engine)

    def _counter(self, name: str, documentation: str) -> Any:
        """A counter of this worker's model (`PREFIX + name`, labelled by model_name)."""
        return Counter(
            PREFIX + name, documentation, ["model_name"], registry=self.base.registry
        ).labels(self.model)

    def track_engine(self, engine: BlockPoolOwner) -> None:
        """Report `engine`'s block pool usage in `kv_cache_usage_perc` (read at each scrape)
        and its size in `cache_config_info` (vLLM's info gauge: labels, value 1). Call once.
        Its `stats` (EngineStats) and `config.page_size`, where it has them, are read too."""
        self.kv_cache_usage.labels(self.model).set_function(lambda: kv_cache_usage(engine.pool))
        stats = getattr(engine, "stats", None)
        if stats is not None:  # count_engine counts from here (not what ran before)
            self._engine_counts = _spec_counts(stats)
        kv = getattr(engine, "kv", None)
        if kv is not None and hasattr(kv, "held_blocks"):
            held = Gauge(
                PREFIX + "kv_group_blocks",
                "KV blocks the running sequences hold per KV group (window 0: full attention; "
                "a sliding-window group's are bounded by its window).",
                ["model_name", "group", "window"],
                registry=self.base.registry,
            )
            for g, group in enumerate(kv.groups):
                held.labels(self.model, str(g), str(group.window)).set_function(
                    functools.partial(_held_blocks, kv, g)
                )
        if kv is not None and hasattr(kv, "num_fetches_lost"):
            self.base.registry.register(_StoreFetchOutcomes(self.model, kv))
            self.base.registry.register(_StoreFetchSpans(self.model, kv))
        page_size = getattr(getattr(engine, "config", None), "page_size", "")
        Gauge(
            PREFIX + "cache_config_info",
            "Information of the KV cache config.",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=self.base.registry,
        ).labels(self.model, str(page_size), str(engine.pool.num_blocks)).set(1)

    def count_engine(self, stats: EngineStats) -> None:
        """Add what the engine's speculation counters (EngineStats) gained since the last call."""
        now = _spec_counts(stats)
        before, self._engine_counts = self._engine_counts, now
        for counter, new, old in zip(
            (self.spec_draft_tokens, self.spec_accepted_tokens, self.spec_drafts),
            now,
            before,
            strict=True,
        ):
            if new > old:
                counter.inc(new - old)

    def admitted(self, task: Task, num_resumed: int) -> None:
        """Count the prompt of a newly admitted request."""
        self.prompt_tokens.inc(len(task.prompt_token_ids) + num_resumed)

    def finished(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a prompt's prefix-cache outcome (once per request, where it was prefilled)."""
        self.base.count_prefix_cache(self.model, prompt_tokens, cached_tokens)

    def set_load(self, running: int, waiting: int) -> None:
        self.base.num_requests_running.labels(self.model).set(running)
        self.base.num_requests_waiting.labels(self.model).set(waiting)

    def store_io(self, op: str, pages: int, nbytes: int) -> None:
        self.store_pages.labels(self.model, op).inc(pages)
        self.store_bytes.labels(self.model, op).inc(nbytes)

    def serve(self, port: int) -> int | None:
        """Start the /metrics HTTP server (port 0: any free port); returns the bound port."""
        if port < 0:
            return None
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr="0.0.0.0", registry=self.base.registry)
        self._server = server
        self.port = server.server_address[1]
        logger.info("metrics on port %d", self.port)
        return self.port

    def close(self) -> None:
        """Stop the /metrics HTTP server, if serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class CountingConnector:
    """Wraps a KVConnector to count pages and bytes moved (load/save) in the worker metrics."""

    def __init__(self, inner: Any, metrics: WorkerMetrics | None = None):
        self.inner = inner
        self.metrics = metrics

    def lookup(self, keys: list[bytes]) -> int:
        return self.inner.lookup(keys)

    def load(self, keys: list[bytes], block_ids: list[int], kv_pool: Any) -> int:
        n = self.inner.load(keys, block_ids, kv_pool)
        if self.metrics and n:
            self.metrics.store_io("load", n, n * _block_bytes(kv_pool))
        return n

    def save(self, keys: list[bytes], block_ids: list[int], kv_pool: Any) -> None:
        self.inner.save(keys, block_ids, kv_pool)
        if self.metrics and keys:
            self.metrics.store_io("save", len(keys), len(keys) * _block_bytes(kv_pool))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _spec_counts(stats: EngineStats) -> tuple[int, int, int]:
    return (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verifications)


def kv_cache_usage(pool: BlockPool) -> float:
    """Fraction of a BlockPool's blocks in use: 1 - free / total (vLLM's kv_cache_usage_perc)."""
    return 1.0 - pool.num_free_blocks / pool.num_blocks if pool.num_blocks else 0.0


class _StoreFetchOutcomes:
    """`kvrelay:kv_store_fetch_failures_total{model_name,reason}`, read from the KV cache
    manager's counters at each scrape: `lost` (the node went away during the fetch), `timeout`
    (abandoned after fetch_timeout_s: a slow node), `error` (the call failed), `skipped`
    (admissions that did not ask the store: its node was down). Each one's prefix was computed
    instead."""

    REASONS = (("lost", "num_fetches_lost"), ("timeout", "num_fetch_timeouts"),
               ("error", "num_store_errors"), ("skipped", "num_store_skips"))  # fmt: skip

    def __init__(self, model: str, kv: Any):
        self.model, self.kv = model, kv

    def describe(self) -> list:
        return []  # no checks against other collectors' names: the name is ours alone

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            PREFIX + "kv_store_fetch_failures",
            "Store lookups and fetches given up, by reason; their prefixes were computed.",
            labels=["model_name", "reason"],
        )
        for reason, attr in self.REASONS:
            family.add_metric([self.model, reason], float(getattr(self.kv, attr, 0)))
        yield family


class _StoreFetchSpans:
    """`kvrelay:kv_store_fetch_seconds{model_name,phase}`: the time of each store lookup and
    load in the KV loader's thread (read at each scrape; none while no store is connected)."""

    def __init__(self, model: str, kv: Any):
        self.model, self.kv = model, kv

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily

        from kvrelay.workers.engine.kv_loader import SPAN_BUCKETS

        loader = getattr(self.kv, "loader", None)
        family = HistogramMetricFamily(
            PREFIX + "kv_store_fetch_seconds",
            "Seconds of each store lookup and page load (a prefetched page loads from memory).",
            labels=["model_name", "phase"],
        )
        for phase, spans in loader.spans.items() if loader is not None else ():
            cumulative, running = [], 0
            for bound, n in zip(SPAN_BUCKETS, spans.buckets, strict=True):
                running += n
                cumulative.append((str(bound), running))
            cumulative.append(("+Inf", spans.count))
            family.add_metric([self.model, phase], cumulative, spans.seconds)
        yield family


def _held_blocks(kv: Any, group: int) -> float:
    return float(kv.held_blocks[group])


def _block_bytes(kv_pool: Any) -> int:
    return kv_pool[0].numel() * kv_pool.element_size()
