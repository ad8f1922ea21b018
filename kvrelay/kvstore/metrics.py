"""Store node counters: kept as plain numbers (returned by `stats`) and mirrored to Prometheus."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

# StoreAdmin.counts entries about sessions (not page tiers)
SESSION_COUNTS = ("sessions", "retained_host", "retained_disk")

# counter name -> (help, label names)
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hits": ("page lookups served by a tier", ("tier",)),
    "misses": ("page lookups a tier could not serve", ("tier",)),
    "bytes": ("page bytes moved, by tier and transfer kind", ("tier", "kind")),
    "corrupt_pages": ("pages dropped because they failed verification", ("tier",)),
    "evictions": (
        "pages evicted from a tier (host: demoted or dropped; disk: dropped), by reason: "
        "capacity, demoted (behind a window), expired (session), retained (a live session's), "
        "operator",
        ("tier", "reason"),
    ),
    "prefetch_pages": ("pages a prefetch hint brought into the arena, by source", ("source",)),
    "prefetch_hits": ("prefetched pages a worker then read", ()),
    "prefetch_unused": ("prefetched pages evicted before any worker read them", ()),
    "puts": ("pages written (new keys only)", ("tier",)),
    "transfer_failures": ("remote fetches that failed or timed out", ("transport",)),
    "transfer_skips": (
        "remote fetches not tried: the peer was unreachable moments ago",
        ("node",),
    ),
}


def _child(counter, labels: tuple[str, ...]):
    """The series of `counter` for `labels` (the counter itself when it has none)."""
    return counter.labels(*labels) if labels else counter


@dataclass(slots=True)
class StoreMetrics:
    """Counters by (name, labels); `prometheus()` registers them in a fresh registry."""

    values: dict[tuple[str, tuple[str, ...]], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    # name -> a reader of counts kept elsewhere without a lock (the UCX loop's waits); they
    # are in the `stats` reply only, not in Prometheus
    sources: dict[str, Callable[[], dict[str, int]]] = field(default_factory=dict)
    _prom: dict | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)  # request + transfer threads

    def inc(self, name: str, *labels: str, value: float = 1) -> None:
        with self._lock:
            self.values[(name, labels)] += value
        if self._prom is not None:
            _child(self._prom[name], labels).inc(value)

    def get(self, name: str, *labels: str) -> float:
        return self.values.get((name, labels), 0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{name: {"label1/label2": value}} for the `stats` reply."""
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            items = sorted(self.values.items())
        for (name, labels), v in items:
            out.setdefault(name, {})["/".join(labels)] = v
        for name, read in self.sources.items():
            if counts := read():
                out[name] = {label: v for label, v in counts.items()}
        return out

    def hit_rates(self) -> dict[str, float]:
        """Lifetime hits / lookups by tier (tiers that saw a lookup)."""
        with self._lock:
            items = list(self.values.items())
        tally: dict[str, list[float]] = {}
        for (name, labels), v in items:
            if name in ("hits", "misses"):
                tally.setdefault(labels[0], [0.0, 0.0])[name == "misses"] += v
        return {tier: h / (h + m) for tier, (h, m) in sorted(tally.items()) if h + m}

    def prometheus(self, gauges, page_bytes: int = 0):
        """A CollectorRegistry with every counter plus `gauges()` (StoreAdmin.counts: pages by
        tier and capacities, sessions) as page, usage, session and hit-rate gauges."""
        from prometheus_client import CollectorRegistry, Counter
        from prometheus_client.core import GaugeMetricFamily

        registry = CollectorRegistry()
        self._prom = {
            name: Counter(f"kvrelay:store_{name}", help_, labels, registry=registry)
            for name, (help_, labels) in COUNTERS.items()
        }
        for (name, labels), v in self.values.items():
            _child(self._prom[name], labels).inc(v)

        metrics = self

        class _Pages:
            def collect(self):
                counts = gauges()
                g = GaugeMetricFamily("kvrelay:store_pages", "pages held, by tier", labels=["tier"])
                for tier, n in counts.items():
                    if tier not in SESSION_COUNTS:
                        g.add_metric([tier], n)
                yield g
                yield GaugeMetricFamily(
                    "kvrelay:store_sessions",
                    "sessions whose pages are retained (prompt_cache_key, user, a chain)",
                    value=counts.get("sessions", 0),
                )
                kept = GaugeMetricFamily(
                    "kvrelay:store_retained_bytes",
                    "bytes of the pages live sessions retain, by tier",
                    labels=["tier"],
                )
                for tier in ("host", "disk"):
                    kept.add_metric([tier], counts.get(f"retained_{tier}", 0) * page_bytes)
                yield kept
                # like vLLM's kv_cache_usage_perc (0-1), per store tier
                usage = GaugeMetricFamily(
                    "kvrelay:store_usage_perc",
                    "Store tier usage. 1 means 100 percent usage.",
                    labels=["tier"],
                )
                for tier, capacity in (("host", "host_slots"), ("disk", "disk_capacity")):
                    if counts.get(capacity):
                        usage.add_metric([tier], counts.get(tier, 0) / counts[capacity])
                yield usage
                rate = GaugeMetricFamily(
                    "kvrelay:store_hit_rate",
                    "Page lookup hits / lookups by tier, since start.",
                    labels=["tier"],
                )
                for tier, value in metrics.hit_rates().items():
                    rate.add_metric([tier], value)
                yield rate

        registry.register(_Pages())
        return registry
