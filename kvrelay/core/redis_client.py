"""Which redis-py client a URL wants: a plain server's, or a Redis/Valkey Cluster's.

A URL names one server; when that server runs in cluster mode (`INFO cluster` says
`cluster_enabled:1`, asked once per URL per process) the factories return redis-py's cluster
clients, which learn the slot map from that node and send each command to the node serving its
keys; else today's plain clients. Probing instead of a URL option keeps every URL kvrelay takes
valid for both (`--redis-url redis://any-node:6379` of an existing cluster just works);
`cluster=True/False` skips the probe. A server that does not answer the probe counts as plain
and is asked again by the next client (its plain client then fails as it always did).

A `redis+sentinel://` URL (`kvrelay.core.sentinel_url`) gives a client of the primary the
Sentinels name, on redis-py's Sentinel pool: every new connection asks the Sentinels where the
primary is, so after a failover the next connection reaches the promoted replica, and a
READONLY reply (a demoted primary) is raised as a ConnectionError, which callers retry like a
lost connection. Such a URL is never a cluster (no probe).

Here in core, not beside the asyncio pools of `pipeline/queue/redis_options.py`, because the
store's directory (kvstore), the workers and the CLI connect too, and kvstore and pipeline may
not import each other.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import redis
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, RedisClusterException
from redis.retry import Retry

from kvrelay.core.config import redact_url
from kvrelay.core.sentinel_url import is_sentinel_url, parse_sentinel_url

logger = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0
SENTINEL_TIMEOUT_S = 1.0  # one question to one Sentinel: a dead one is skipped after this
_cluster_urls: dict[str, bool] = {}  # url -> cluster mode, for the urls that answered


def is_cluster(url: str) -> bool:
    """Whether the server at `url` runs in cluster mode (INFO cluster), once per URL."""
    if is_sentinel_url(url):
        return False
    known = _cluster_urls.get(url)
    if known is not None:
        return known
    probe = redis.Redis.from_url(
        url,
        socket_timeout=PROBE_TIMEOUT_S,
        socket_connect_timeout=PROBE_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),  # one try: a silent server costs one timeout, not several
    )
    try:
        enabled = str(probe.info("cluster").get("cluster_enabled", 0)) == "1"
    except redis.RedisError as exc:
        # INFO, not WARNING: `kvrelay up` polls before its Valkey listens (it knows the mode)
        logger.info("cannot tell whether %s is a cluster (%s): plain", redact_url(url), exc)
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
    that handle an unreachable Redis handle an unreachable cluster too.

    A `redis+sentinel://` URL gives the primary's client on a Sentinel pool (`cluster` unused).
    """
    if is_sentinel_url(url):
        return sentinel_master(url, **options)
    if cluster if cluster is not None else is_cluster(url):
        options.setdefault("socket_timeout", None)  # the cluster client's default is 5 s
        try:
            return redis.cluster.RedisCluster.from_url(url, **options)
        except RedisClusterException as exc:
            raise ConnectionError(f"Redis Cluster at {redact_url(url)}: {exc}") from exc
    return redis.Redis.from_url(url, **options)


def worker_options(socket_timeout_s: float, keepalive_idle_s: int) -> dict[str, Any]:
    """Connection options of a worker's sync client: every call bounded by `socket_timeout_s`
    (connects too), and TCP keepalive probes after `keepalive_idle_s` idle seconds, one a
    second, 3 unanswered ones ending the connection. A partitioned worker's call then fails
    in seconds instead of waiting out TCP's retransmissions, and its caller retries."""
    keepalive: dict[int, int] = {}
    for name, value in (("TCP_KEEPIDLE", keepalive_idle_s), ("TCP_KEEPINTVL", 1)):
        if hasattr(socket, name):  # (Linux; other systems keep their defaults)
            keepalive[getattr(socket, name)] = value
    if hasattr(socket, "TCP_KEEPCNT"):
        keepalive[socket.TCP_KEEPCNT] = 3
    return {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive,
    }


def sentinel_options() -> dict[str, Any]:
    """Connection options for the Sentinels themselves: short timeouts and no retry, so a dead
    Sentinel costs one refused connect (or one timeout) before the next one is asked."""
    return {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }


def master_options(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """(Sentinel addresses, master name, the data connections' db and credentials) of a
    `redis+sentinel://` URL."""
    parsed = parse_sentinel_url(url)
    auth = {"db": parsed.db, "username": parsed.username, "password": parsed.password}
    return list(parsed.sentinels), parsed.master, auth


def sentinel_master(url: str, **options: Any) -> redis.Redis:
    """A sync client of the primary that the Sentinels of `url` name, following failovers."""
    sentinels, master, auth = master_options(url)
    manager = redis.sentinel.Sentinel(sentinels, sentinel_kwargs=sentinel_options())
    return manager.master_for(master, **auth, **options)
