"""The embedded Valkey of `kvrelay up`: one plain node (`--shards 1`, the default), a local
cluster of N primaries (`--shards N`, with `--valkey-replicas R` R replica nodes per primary
and the cluster's own failover), or a primary with N replicas and 3 Sentinels
(`--valkey-replicas N`, `valkey_sentinel.py`), each a supervisord program.

A cluster's programs start first; every other program is written with autostart off and
started only once the slots are assigned and every node is ok (`start_cluster`), so no worker
ever meets a cluster that cannot serve its keys. Ports are kept from the run directory's
previous stack.json when they are free, so a restart finds its nodes where `nodes.conf` says.
"""

from __future__ import annotations

import argparse
import re
import shlex
import socket
import sys
import time
from pathlib import Path

from kvrelay.cli.errors import CommandError
from kvrelay.cli.up.launch import Program, Supervisor, check_port_free, read_state
from kvrelay.cli.up.valkey_cluster import (
    MAX_SHARDS,
    NODE_TIMEOUT_MS,
    NODES_CONF,
    STARTED,
    ClusterNode,
    form,
    make_nodes,
    valkey_command,
)
from kvrelay.cli.up.valkey_sentinel import replicated_valkey, sentinel_ports

SINGLE = "valkey"  # the program name of the one plain node
CLUSTER_DIR = "valkey-cluster"  # <run-dir>/valkey-cluster/node-<i>: each node's AOF, nodes.conf


def free_ports(count: int, avoid: set[int]) -> list[int]:
    """`count` distinct ports free now (the sockets stay open until all are picked)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] not in avoid:  # the ingress port is free until it starts
                ports.append(s.getsockname()[1])
    finally:
        for s in held:
            s.close()
    return ports


def _existing_nodes(run_dir: Path) -> tuple[int, int]:
    """(primaries, replicas per primary) of an earlier cluster that left a nodes.conf in this
    run directory (node-<i>, node-<i>-replica-<j>)."""
    primaries, replicas = 0, 0
    for conf in (run_dir / CLUSTER_DIR).glob(f"node-*/{NODES_CONF}"):
        found = re.fullmatch(r"node-\d+(?:-replica-(\d+))?", conf.parent.name)
        if found is None:
            continue
        if found.group(1) is None:
            primaries += 1
        else:
            replicas = max(replicas, int(found.group(1)) + 1)
    return primaries, replicas


def check_shards(args: argparse.Namespace, run_dir: Path) -> None:
    """Refuse (CommandError, exit 2) a shard count this run directory or these flags rule out."""
    shards = args.shards
    if not 1 <= shards <= MAX_SHARDS:
        raise CommandError(f"--shards must be 1-{MAX_SHARDS}, got {shards}")
    # with --redis-url, --shards is the pipeline shard count on that server (a cluster's node,
    # or one plain Valkey): no embedded node is started
    replicas = getattr(args, "valkey_replicas", 0)
    if args.redis_url is None:
        existing, had = _existing_nodes(run_dir)
        if existing and existing != shards:
            raise CommandError(
                f"{run_dir / CLUSTER_DIR} holds a {existing}-node Valkey cluster: pass "
                f"--shards {existing}, or remove that directory for a fresh one"
            )
        if existing and shards > 1 and had != replicas:
            raise CommandError(
                f"{run_dir / CLUSTER_DIR} holds a cluster with {had} replica(s) per primary: "
                f"pass --valkey-replicas {had}, or remove that directory for a fresh one"
            )
    if replicas and shards == 2:
        raise CommandError(
            "--valkey-replicas with --shards 2: a cluster promotes a replica only with the "
            "votes of most primaries, and one of two is not most: use --shards 3 or more"
        )
    if replicas and args.redis_url is not None:
        raise CommandError("--valkey-replicas starts an embedded Valkey: drop --redis-url")
    count = _node_count(args)
    if args.redis_port and args.redis_port + count - 1 > 65535:
        raise CommandError(f"--redis-port {args.redis_port} leaves no room for {count} nodes")


def _node_count(args: argparse.Namespace) -> int:
    """The data nodes a cluster stack runs on consecutive `--redis-port`s (1 plain node)."""
    if args.shards == 1:
        return 1
    return args.shards * (1 + getattr(args, "valkey_replicas", 0))


def check_ports_free(args: argparse.Namespace) -> None:
    """Refuse given embedded ports that clash with the ingress or another listener."""
    count = _node_count(args)
    ports = [args.redis_port + i for i in range(count)] if args.redis_port else []
    if args.port in ports:
        flag = "--redis-port" if args.shards == 1 else f"--redis-port + {ports.index(args.port)}"
        raise CommandError(f"--port and {flag} are both {args.port}")
    for port in ports:
        check_port_free("127.0.0.1", port)


def _previous_ports(run_dir: Path, count: int) -> tuple[list[int], list[int]] | None:
    """The (ports, bus ports) of this run directory's last cluster of `count` nodes (replicas
    included) when all are free again."""
    try:
        nodes = read_state(run_dir).get("cluster", {}).get("nodes", [])
    except (OSError, ValueError):
        return None
    if len(nodes) != count:
        return None
    ports = [n["port"] for n in nodes] + [n["bus_port"] for n in nodes]
    try:
        for port in ports:
            check_port_free("127.0.0.1", port)
    except CommandError:
        return None
    return ports[:count], ports[count:]


def restart_delay_s(node_timeout_ms: int) -> float:
    """How long a restarted node of a cluster with replicas waits: long enough for the cluster
    to fail it and promote its replica (twice the node timeout, plus a second)."""
    return 2 * node_timeout_ms / 1000 + 1


def delayed_command(cmd: list[str], data_dir: Path, delay_s: float) -> list[str]:
    """`sh -c`: on a restart (the marker exists) wait `delay_s`, then exec `cmd`. A SIGKILLed
    primary back within milliseconds would be failed by no node and keep its slots; after the
    wait its replica serves them and the node rejoins as a replica (its nodes.conf's epoch is
    older)."""
    mark = shlex.quote(str(data_dir / STARTED))
    script = f"if [ -e {mark} ]; then sleep {delay_s:g}; fi; : > {mark}; exec {shlex.join(cmd)}"
    return ["/bin/sh", "-c", script]


def embedded_valkey(args: argparse.Namespace, run_dir: Path) -> tuple[list[Program], str, dict]:
    """(programs, redis url, stack.json additions) of the embedded Valkey for `args`."""
    shards = args.shards
    replicas = getattr(args, "valkey_replicas", 0)
    if replicas and shards == 1:
        given = [args.redis_port] if args.redis_port else []
        count = replicas + 1 + 3 - len(given)  # the data nodes, then 3 Sentinels
        return replicated_valkey(args, run_dir, given + free_ports(count, {args.port, *given}))
    if shards == 1:
        port = args.redis_port or free_ports(1, {args.port})[0]
        (run_dir / SINGLE).mkdir(parents=True, exist_ok=True)
        cmd = valkey_command(port, run_dir / SINGLE)
        return [Program(SINGLE, cmd, priority=10)], f"redis://127.0.0.1:{port}/0", {"shards": 1}
    count = _node_count(args)
    previous = None if args.redis_port else _previous_ports(run_dir, count)
    if previous is not None:
        ports, bus_ports = previous
    else:
        given = [args.redis_port + i for i in range(count)] if args.redis_port else []
        picked = free_ports(2 * count - len(given), {args.port, *given})
        ports = given or picked[:count]
        bus_ports = picked[len(picked) - count :]
    # each primary holds one pipeline shard's keys (the workers and ingress run args.shards)
    nodes = make_nodes(run_dir / CLUSTER_DIR, ports, bus_ports, args.key_prefix, replicas)
    timeout_ms = getattr(args, "cluster_node_timeout_ms", NODE_TIMEOUT_MS) if replicas else None
    programs = []
    for node in nodes:
        data_dir = Path(node.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        cmd = valkey_command(node.port, node.data_dir, node.bus_port, timeout_ms)
        if timeout_ms is not None:
            (data_dir / STARTED).unlink(missing_ok=True)  # the first start does not wait
            cmd = delayed_command(cmd, data_dir, restart_delay_s(timeout_ms))
        programs.append(Program(node.name, cmd, priority=10))
    cluster: dict = {"nodes": [n.to_dict() for n in nodes]}
    if timeout_ms is not None:
        cluster.update(replicas=replicas, node_timeout_ms=timeout_ms)
    return programs, nodes[0].url, {"shards": shards, "cluster": cluster}


def valkey_ports(state: dict) -> dict[str, int]:
    """Program name -> port of every embedded Valkey of this stack ({} with --redis-url)."""
    nodes = (state.get("cluster") or {}).get("nodes")
    if nodes:
        return {n["name"]: int(n["port"]) for n in nodes}
    if state.get("sentinel"):
        return sentinel_ports(state)
    if SINGLE in state["programs"]:
        return {SINGLE: int(state["redis_url"].rsplit(":", 1)[1].split("/")[0])}
    return {}


def cluster_mode(state: dict) -> bool | None:
    """Whether this stack's Redis is a cluster, as stack.json knows it (None: --redis-url, ask
    the server), so its clients need not probe a Valkey that is still starting."""
    if (state.get("cluster") or {}).get("nodes"):
        return True
    return False if SINGLE in state.get("programs", ()) else None


def start_cluster(sup: Supervisor, state: dict, timeout_s: float) -> None:
    """For a cluster stack: once its nodes run, form the cluster, then start the rest."""
    nodes = [ClusterNode(**n) for n in (state.get("cluster") or {}).get("nodes", [])]
    if not nodes:
        return
    started = time.monotonic()
    sup.wait_running([n.name for n in nodes], timeout=timeout_s)
    assigned = form(nodes, timeout_s=max(1.0, timeout_s - (time.monotonic() - started)))
    how = "slots assigned" if assigned else "slots kept from nodes.conf"
    primaries = sum(1 for n in nodes if not n.replica_of)
    size = f"{len(nodes)} nodes"
    if primaries != len(nodes):
        size = f"{primaries} primaries, {len(nodes) - primaries} replicas"
    print(f"kvrelay up: valkey cluster ok: {size}, {how}", file=sys.stderr)
    sup.start_all()
