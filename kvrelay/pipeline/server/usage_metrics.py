"""The usage counters as Prometheus series on the ingress's /metrics.

They are the step script's own (`core.usage`, every shard's total hash, read at each scrape),
not counts this process keeps where it delivers usage: those would count a reattached client's
usage again and miss what another ingress, the producer client or a client that went away
got, while the step script counts each request once, in the step that ends it. So every
ingress exports the same stack-wide values (`kvrelay:tenant_<field>_total{tenant,key,model}`,
one per `UsageField`): aggregate them with `max`, not `sum`, across ingresses. An unreachable
Valkey leaves them out of that scrape.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from kvrelay.core.keys import Keys
from kvrelay.core.usage import Usage, UsageField
from kvrelay.pipeline.queue.usage import read_total

logger = logging.getLogger(__name__)

PREFIX = "kvrelay:tenant_"
LABELS = ("tenant", "key", "model")
READ_TIMEOUT_S = 2.0  # a scrape does not wait longer for Valkey


class _Snapshot(Collector):
    """One scrape's counts as counter families."""

    def __init__(self, usages: list[Usage]):
        self.usages = usages

    def collect(self) -> Any:
        for name in UsageField:
            family = CounterMetricFamily(
                PREFIX + name,
                f"Usage counted when a worker ends a request ({name}), per tenant, API key "
                "and model (exactly once; the same on every ingress).",
                labels=LABELS,
            )
            for u in self.usages:
                family.add_metric([u.tenant, u.key, u.model], u.get(name))
            yield family


def exposition(usages: list[Usage]) -> bytes:
    """The text exposition of `usages` (nothing when there are none)."""
    if not usages:
        return b""
    registry = CollectorRegistry()
    registry.register(_Snapshot(sorted(usages, key=lambda u: (u.tenant, u.key, u.model))))
    return generate_latest(registry)


async def usage_exposition(redis: Any, keys: Keys) -> bytes:
    """Every shard's total counts, as text exposition; b"" when Valkey does not answer."""
    try:
        accounts = await asyncio.wait_for(read_total(redis, keys), READ_TIMEOUT_S)
    except (RedisError, TimeoutError) as exc:
        logger.warning("/metrics: usage counters left out: %s", exc)
        return b""
    return exposition(list(accounts.values()))
