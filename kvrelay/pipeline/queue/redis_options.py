"""The asyncio Redis client of the ingress and the producer, and its pool options.

`async_redis` gives redis-py's asyncio RedisCluster when the URL is a cluster node
(`kvrelay.core.redis_client.is_cluster`, which also has the sync factory), else a plain client
on a waiting pool.

After a Redis restart every pooled connection is dead: the next command on each one fails
("Connection closed by server"), and the ingress would answer 503 to a request it could have
queued. A command that fails to connect or finds its connection closed is retried on a fresh
connection (with backoff), so a dead pooled connection costs one failed write, not a request.
Idle connections are not pinged before use (redis-py's health check): that PING was a second
command for most requests (~2 per request at 32 streams) and bought nothing the retry does not.
A `redis+sentinel://` URL gives a client on a waiting Sentinel pool (`BlockingSentinelPool`):
each new connection asks the Sentinels for the primary, so the retry above reaches a promoted
replica after a failover, and a demoted primary's READONLY reply counts as a lost connection.

A command that times out is not retried: a hung Redis (stopped, not dead) would otherwise hold
each HTTP request for several timeouts instead of one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeAlias

import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    SlotNotCoveredError,
    TryAgainError,
)

from kvrelay.core.errors import KvrelayError
from kvrelay.core.redis_client import SENTINEL_TIMEOUT_S, is_cluster, master_options
from kvrelay.core.sentinel_url import is_sentinel_url


def resilient(
    socket_timeout_s: float | None = None, connect_timeout_s: float | None = None
) -> dict[str, Any]:
    """Pool options (fresh objects per pool); timeouts bound every read and connect."""
    options: dict[str, Any] = {
        "health_check_interval": 0,  # no PING before use: the retry covers dead connections
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


class ClusterUnavailable(KvrelayError, ConnectionError):
    """A cluster node could not serve a command now (it is down or restarting): a redis
    ConnectionError, which callers wait out like any lost connection."""


def _raised_in_redis(exc: BaseException) -> bool:
    """Whether `exc` was raised inside redis-py itself (its innermost frame is there)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("redis.")


class ResilientCluster(aiocluster.RedisCluster):
    """redis-py's asyncio RedisCluster whose failures while a node is down or restarting are
    all ConnectionErrors (`ClusterUnavailable`), which callers wait out: CLUSTERDOWN and
    TRYAGAIN replies, a slot no node covers for the moment, and an AttributeError or TypeError
    raised inside redis-py's own connection code when a node's connections are torn down under
    a command (seen with nodes killed: `'NoneType' object has no attribute 'writelines'`).
    None of these ran the command."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with cluster_failures_unavailable():
            return await super().execute_command(*args, **kwargs)

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> aiocluster.ClusterPipeline:
        """A pipeline whose `execute` fails as `execute_command` does (its commands do not
        go through it: a node torn down under a pipeline raised redis-py's AttributeError)."""
        pipe = super().pipeline(transaction, shard_hint)
        return ResilientClusterPipeline(pipe.cluster_client, transaction)  # type: ignore[abstract]


class ResilientClusterPipeline(aiocluster.ClusterPipeline):
    """`ResilientCluster`'s pipeline: the same failures raised as `ClusterUnavailable`."""

    __slots__ = ()

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        with cluster_failures_unavailable():
            return await super().execute(raise_on_error, allow_redirections)


@contextmanager
def cluster_failures_unavailable() -> Iterator[None]:
    """`ResilientCluster`'s failures while a node is down or restarting raised as
    `ClusterUnavailable` (for what does not go through its execute_command: pub/sub)."""
    try:
        yield
    except (ClusterDownError, TryAgainError, SlotNotCoveredError) as exc:
        raise ClusterUnavailable(str(exc)) from exc
    except (AttributeError, TypeError) as exc:
        if not _raised_in_redis(exc):
            raise
        raise ClusterUnavailable(f"cluster connection lost ({exc})") from exc


# the asyncio client `async_redis` makes: a plain one or a cluster one, used alike
AsyncRedis: TypeAlias = aioredis.Redis | aiocluster.RedisCluster


def async_redis(
    url: str,
    max_connections: int,
    pool_timeout_s: float | None = None,
    options: dict[str, Any] | None = None,
    cluster: bool | None = None,
) -> AsyncRedis:
    """An asyncio client whose pool waits for a free connection (up to `pool_timeout_s`;
    None: as long as it takes) instead of failing: redis-py's default pool raises "Too many
    connections" past 100, and every open request holds one for its blocking output read.

    On a cluster: redis-py's asyncio RedisCluster with `max_connections` per node; it has no
    waiting pool, so past them a command raises MaxConnectionsError (`pool_timeout_s` unused).
    """
    options = dict(options or RESILIENT)
    if is_sentinel_url(url):
        return sentinel_master(url, max_connections, pool_timeout_s, options)
    if cluster if cluster is not None else is_cluster(url):
        # no timeout unless given, as for the plain pool (blocking reads bound their own wait)
        options.setdefault("socket_timeout", None)
        options.setdefault("socket_connect_timeout", None)
        return ResilientCluster.from_url(url, max_connections=max_connections, **options)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, **options
    )
    return aioredis.Redis.from_pool(pool)


class BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """redis-py's asyncio Sentinel pool (connections to the primary the Sentinels name) that
    waits for a free connection as `BlockingConnectionPool` does."""


def sentinel_master(
    url: str, max_connections: int, pool_timeout_s: float | None, options: dict[str, Any]
) -> aioredis.Redis:
    """An asyncio client of the primary that the Sentinels of `url` name, following failovers."""
    sentinels, master, auth = master_options(url)
    asked = {  # the Sentinels: short timeouts, no retry (a dead one: ask the next)
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }
    manager = aiosentinel.Sentinel(sentinels, sentinel_kwargs=asked)
    return manager.master_for(
        master,
        connection_pool_class=BlockingSentinelPool,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        **auth,
        **options,
    )


def replicated(client: Any) -> bool:
    """Whether `client` is on a Sentinel pool (a replicated Valkey: submissions WAIT). A
    cluster client's answer needs the cluster's topology: `cluster_has_replicas`."""
    return isinstance(getattr(client, "connection_pool", None), aiosentinel.SentinelConnectionPool)


def is_cluster_client(client: Any) -> bool:
    """Whether `client` is redis-py's asyncio RedisCluster (`async_redis` on a cluster URL)."""
    return isinstance(client, aiocluster.RedisCluster)


async def cluster_has_replicas(client: aiocluster.RedisCluster) -> bool:
    """Whether any node of the cluster is a replica. CLUSTER NODES lists a failed or stopped
    replica too (CLUSTER SLOTS, and redis-py's slot map, leave it out): a cluster whose
    replicas are all down still counts as replicated, so its submissions keep waiting for
    one (a 503 not_replicated) instead of being acknowledged unreplicated."""
    with cluster_failures_unavailable():
        nodes = await client.cluster_nodes()
    flags = (str(node.get("flags", "")).split(",") for node in nodes.values())
    return any("slave" in f or "replica" in f for f in flags)


async def wait_on_slot_primary(
    client: aiocluster.RedisCluster,
    key: str,
    commands: list[tuple[Any, ...]],
    numreplicas: int,
    timeout_ms: int,
) -> list[Any]:
    """The replies of `commands` (all on `key`'s hash slot) and then of `WAIT numreplicas
    timeout_ms`, sent together on ONE connection of the primary that serves `key`'s slot.

    WAIT counts the replicas holding the calling connection's last write, so it must follow a
    write on the same connection of the same node. redis-py's cluster client cannot do that
    by itself: it sends WAIT to its default node (a random primary); `target_nodes=` pins the
    node but each `execute_command` takes any free connection of that node; and a
    ClusterPipeline re-routes its commands when it retries (the `target_nodes` it popped on
    the first try are gone, so WAIT goes to the default node) or follows a MOVED on its own.
    Here the commands go through the node's `execute_pipeline`, which holds one connection
    for all of them, without retries or redirections. A reply that is an error (a MOVED: the
    slot map changed, a failover) has the client refresh its slot map and raises
    `ClusterUnavailable`, as does a lost connection (a ConnectionError): the caller retries.
    """
    with cluster_failures_unavailable():
        await client.initialize()  # no-op once initialized (the slot map is needed here)
        node = client.get_node_from_key(key)
        if node is None:
            raise ClusterUnavailable(f"no node serves the slot of {key!r}")
        queued = [*commands, ("WAIT", numreplicas, timeout_ms)]
        sent = [aiocluster.PipelineCommand(i, *args) for i, args in enumerate(queued)]
        failed: Exception | None = None
        try:
            await node.execute_pipeline(sent)
        except ConnectionError as exc:  # sending failed (a reply lost is a command's result)
            failed = exc
    failed = failed or next((c.result for c in sent if isinstance(c.result, Exception)), None)
    if failed is None:
        return [c.result for c in sent]
    if not isinstance(failed, _MOVED_OR_LOST):
        raise failed  # the commands' own error, or a timeout (not retried: see above)
    # a keyed read through the client follows a MOVED and updates its slot map
    with cluster_failures_unavailable():
        await client.exists(key)
    raise ClusterUnavailable(f"{node.name} did not run WAIT's commands: {failed}") from failed


# replies that say the node is not (or no longer) the slot's primary, or its connection was
# lost: the caller retries (a timeout is not among them: a hung node is not waited out twice)
_MOVED_OR_LOST = (
    MovedError,
    AskError,
    TryAgainError,
    ClusterDownError,
    SlotNotCoveredError,
    ConnectionError,
)
