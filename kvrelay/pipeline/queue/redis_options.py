"""Redis clients for a URL (a plain server or a Redis/Valkey Cluster) and their pool options.

A URL names one server; when that server runs in cluster mode (`INFO cluster` says
`cluster_enabled:1`, asked once per URL per process) `sync_redis` / `async_redis` return
redis-py's cluster clients, which learn the slot map from it and send each command to the node
serving its keys; else today's plain clients. Probing instead of a URL option keeps every URL
kvrelay takes valid for both (`--redis-url redis://any-node:6379` of an existing cluster just
works); `cluster=True/False` skips the probe. A server that does not answer the probe counts as
plain and is asked again by the next client (its plain client then fails as it always did).

After a Redis restart every pooled connection is dead; without a health check the next command
on each one fails ("Connection closed by server") and the ingress would answer 503 to a request
it could have queued. Idle connections are pinged before use and a failed command is retried
on a fresh connection. A command that times out is not retried: a hung Redis (stopped, not
dead) would otherwise hold each HTTP request for several timeouts instead of one.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisClusterException

from kvrelay.core.config import redact_url

logger = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0
_cluster_urls: dict[str, bool] = {}  # url -> cluster mode, for the urls that answered


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


def is_cluster(url: str) -> bool:
    """Whether the server at `url` runs in cluster mode (INFO cluster), once per URL."""
    known = _cluster_urls.get(url)
    if known is not None:
        return known
    probe = redis.Redis.from_url(
        url, socket_timeout=PROBE_TIMEOUT_S, socket_connect_timeout=PROBE_TIMEOUT_S
    )
    try:
        enabled = str(probe.info("cluster").get("cluster_enabled", 0)) == "1"
    except redis.RedisError as exc:
        logger.warning("cannot tell whether %s is a cluster (%s): plain", redact_url(url), exc)
        return False
    finally:
        probe.close()
    _cluster_urls[url] = enabled
    return enabled


def sync_redis(
    url: str, cluster: bool | None = None, **options: Any
) -> redis.Redis | redis.cluster.RedisCluster:
    """A sync client for `url`: a RedisCluster when it is a cluster node, else a Redis; the
    `options` (socket_timeout, health_check_interval, ...) go to every connection.

    The sync cluster client reads the slot map at once; when it cannot, redis-py raises
    RedisClusterException, not a RedisError: it is raised as a ConnectionError here, so callers
    that handle an unreachable Redis handle an unreachable cluster too."""
    if cluster if cluster is not None else is_cluster(url):
        options.setdefault("socket_timeout", None)  # the cluster client's default is 5 s
        try:
            return redis.cluster.RedisCluster.from_url(url, **options)
        except RedisClusterException as exc:
            raise ConnectionError(f"Redis Cluster at {redact_url(url)}: {exc}") from exc
    return redis.Redis.from_url(url, **options)


def async_redis(
    url: str,
    max_connections: int,
    pool_timeout_s: float | None = None,
    options: dict[str, Any] | None = None,
    cluster: bool | None = None,
) -> aioredis.Redis | aiocluster.RedisCluster:
    """An asyncio client whose pool waits for a free connection (up to `pool_timeout_s`;
    None: as long as it takes) instead of failing: redis-py's default pool raises "Too many
    connections" past 100, and every open request holds one for its blocking output read.

    On a cluster: redis-py's asyncio RedisCluster with `max_connections` per node; it has no
    waiting pool, so past them a command raises MaxConnectionsError (`pool_timeout_s` unused).
    """
    options = dict(options or RESILIENT)
    if cluster if cluster is not None else is_cluster(url):
        # no timeout unless given, as for the plain pool (blocking reads bound their own wait)
        options.setdefault("socket_timeout", None)
        options.setdefault("socket_connect_timeout", None)
        return aiocluster.RedisCluster.from_url(url, max_connections=max_connections, **options)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, **options
    )
    return aioredis.Redis.from_pool(pool)
