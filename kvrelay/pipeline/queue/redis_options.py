"""Connection options for the ingress's and producer's asyncio Redis pools.

After a Redis restart every pooled connection is dead; without a health check the next command
on each one fails ("Connection closed by server") and the ingress would answer 503 to a request
it could have queued. Idle connections are pinged before use and a failed command is retried
on a fresh connection. A command that times out is not retried: a hung Redis (stopped, not
dead) would otherwise hold each HTTP request for several timeouts instead of one.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError


def resilient(
    socket_timeout_s: float | None = None, connect_timeout_s: float | None = None
) -> dict[str, Any]:
    """Pool options (fresh objects per pool); timeouts bound every read and connect."""
    options: dict[str, Any] = {
        "health_check_interval": 2,
        "retry": Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 3, supported_errors=(ConnectionError,)
        ),
        "retry_on_error": [ConnectionError],
    }
    if socket_timeout_s is not None:
        options["socket_timeout"] = socket_timeout_s
    if connect_timeout_s is not None:
        options["socket_connect_timeout"] = connect_timeout_s
    return options


RESILIENT = resilient()  # no timeouts: callers that block on XREAD without a bound of their own


def async_redis(
    url: str,
    max_connections: int,
    pool_timeout_s: float | None = None,
    options: dict[str, Any] | None = None,
) -> aioredis.Redis:
    """An asyncio client whose pool waits for a free connection (up to `pool_timeout_s`;
    None: as long as it takes) instead of failing: redis-py's default pool raises "Too many
    connections" past 100, and every open request holds one for its blocking output read."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, **(options or RESILIENT)
    )
    return aioredis.Redis.from_pool(pool)
