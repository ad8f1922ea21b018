"""`kvrelay status | drain` and what every admin command shares (connection, output)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kvrelay.cli.errors import EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_USAGE, CommandError
from kvrelay.core.config import DEFAULT_KEY_PREFIX
from kvrelay.core.enums import Stage
from kvrelay.core.worker_record import WorkerRecord


def connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None, help="stack run dir (`kvrelay up`)")
    p.add_argument("--redis-url", default=None, help="Redis URL (env KVRELAY_REDIS_URL)")
    p.add_argument(
        "--key-prefix", default=None, help=f"Redis key prefix (default {DEFAULT_KEY_PREFIX})"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--timeout-s", type=float, default=2.0, help="wait this long for Redis (default 2)"
    )


def stack_state(run_dir: str | None) -> dict[str, Any]:
    """`<run_dir>/stack.json` of `kvrelay up`; ./kvrelay-run when it holds one; else {}."""
    from kvrelay.cli.up.launch import STATE_NAME, read_state

    if run_dir is None:
        if not os.path.isfile(os.path.join("kvrelay-run", STATE_NAME)):
            return {}
        run_dir = "kvrelay-run"
    try:
        return read_state(run_dir)
    except FileNotFoundError as exc:  # read_state's message names the run dir and the file
        raise CommandError(str(exc), EXIT_USAGE) from None
    except (OSError, ValueError) as exc:  # unreadable or not JSON
        raise CommandError(f"cannot read {run_dir}/{STATE_NAME}: {exc}", EXIT_USAGE) from None


def connect(args: argparse.Namespace):
    """(redis client, Keys, store run dir) from --run-dir, flags or the environment."""
    from kvrelay.cli.up.valkey import cluster_mode
    from kvrelay.core.config import RedisSettings, check_redis_url, env_name, setting
    from kvrelay.core.keys import Keys
    from kvrelay.core.redis_client import sync_redis
    from kvrelay.kvstore.config import SECTION as STORE_SECTION
    from kvrelay.kvstore.config import StoreConfig

    state: dict[str, Any] = {}
    if args.run_dir or not args.redis_url:
        state = stack_state(args.run_dir)
    if args.redis_url:
        url, source = args.redis_url, "--redis-url"
    elif state.get("redis_url"):
        url, source = state["redis_url"], f"{args.run_dir or 'kvrelay-run'}/stack.json"
    else:
        url = setting(RedisSettings, "redis_url")
        source = env_name("", "redis_url")
    check_redis_url(url, source)  # bad usage (exit 2), before anything is contacted
    prefix = args.key_prefix or state.get("key_prefix") or setting(RedisSettings, "key_prefix")
    # unset: no store (status shows none), not the store's default run dir
    store_dir = state.get("store_run_dir") or setting(
        StoreConfig, "run_dir", STORE_SECTION, default=None
    )
    args.stack_state = state  # `status` shows the topology `kvrelay up` chose
    args.redis_url = url  # named by the one-line error of `kvrelay.cli.main.main`
    timeout = max(0.1, args.timeout_s)
    # the mode stack.json knows, when the URL is its own (else the server is asked)
    mode = cluster_mode(state) if url == state.get("redis_url") else None
    client = sync_redis(url, mode, socket_timeout=timeout, socket_connect_timeout=timeout)
    return client, Keys(prefix, shards=_shards(client, prefix, state)), store_dir


def _shards(client: Any, prefix: str, state: dict[str, Any]) -> int:
    """The stack's shard count: what its processes recorded in Redis, else stack.json's, else
    KVRELAY_SHARDS (default 1)."""
    from redis.exceptions import RedisError

    from kvrelay.core.config import RedisSettings, setting
    from kvrelay.core.keys import Keys
    from kvrelay.pipeline.queue.shard_count import stored_shard_count

    try:
        stored = stored_shard_count(client, Keys(prefix))
    except RedisError:  # unreachable: the command's own call reports it
        stored = None
    return stored or int(state.get("shards") or setting(RedisSettings, "shards"))


def topology_of(workers: list[dict[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    """Live worker counts by role, and what `kvrelay up` chose (when its stack.json is known)."""
    roles = [w.role for w in map(WorkerRecord.decode, workers) if w is not None]
    live: dict[str, int] = {role: roles.count(role) for role in Stage}
    layout = "disaggregated" if live[Stage.PREFILL] else "colocated"
    summary = f"{live['prefill']} prefill + {live['decode']} decode live ({layout}"
    summary += ")" if live[Stage.PREFILL] else ": decode workers prefill locally)"
    chosen = state.get("topology") or {}
    if chosen.get("summary"):
        summary += f"; kvrelay up: {chosen['summary']}"
    return {**live, "layout": layout, "chosen": chosen or None, "summary": summary}


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    connection_args(p)
    p.add_argument("--watch", action="store_true", help="a live view, refreshed until Ctrl-C")
    p.add_argument(
        "--interval", type=float, default=1.0, help="--watch refresh period in s (default 1)"
    )


def run_status(args: argparse.Namespace) -> int:
    from redis import RedisError

    from kvrelay.cli import status_data
    from kvrelay.cli.up.ready import ingress_status
    from kvrelay.cli.up.sentinel_status import replication_lines, replication_status

    if not 0.05 <= args.interval <= 3600:
        raise CommandError(f"--interval must be 0.05-3600 s, got {args.interval:g}")
    if args.watch and args.json:
        raise CommandError("--watch and --json do not go together (--json prints once)")
    r, keys, store_dir = connect(args)
    state = getattr(args, "stack_state", {})
    sampler = status_data.RateSampler() if args.watch else None

    def snapshot() -> dict[str, Any]:
        data = status_data.collect(r, keys, store_dir, sampler)
        stores = status_data.model_stores(state)
        if stores:  # several models: each one's store node (`store` is the first's)
            data["stores"] = stores
        data["topology"] = topology_of(data["workers"], state)
        cluster = status_data.cluster_nodes(r, state)
        if cluster is not None:  # only a cluster's status has the key
            data["cluster"] = cluster
        replication = replication_status(state)
        if replication is not None:  # only a stack with --valkey-replicas has the key
            data["replication"] = replication
        standbys = status_data.standbys(r, keys)
        if standbys:  # only where a standby waits (`up --standby`) is the key there
            data["standbys"] = standbys
        ingresses = ingress_status(state)
        if ingresses:  # only a stack of several ingresses (`up --ingresses N`) has the key
            data["ingresses"] = ingresses
        return data

    if args.watch:
        from kvrelay.cli.errors import redact_url
        from kvrelay.cli.status_watch import watch

        return watch(snapshot, redact_url(args.redis_url), args.interval)
    try:
        data = snapshot()
    except RedisError:  # a cluster node down fails the Redis view: show which one first
        nodes = status_data.cluster_nodes(None, state)
        if nodes and not args.json:
            print("\n".join(cluster_lines(nodes)).lstrip("\n"))
        raise
    if args.json:  # a heartbeat field the worker left empty is null, like a missing one
        data["workers"] = [
            {k: None if v == "" else v for k, v in w.items()} for w in data["workers"]
        ]
        print_json(data)
        return 0
    print(
        f"{'WORKER':<24}{'ROLE':<9}{'PID':>8}{'LOAD':>6}{'TOK/S':>8}{'AGE':>7}{'START':>8}  "
        f"{'KERNELS':<9}{'KV':<6}{'ATTN':<6}{'SPEC':<7}STATE"
    )
    for w in data["workers"]:
        record = status_data.worker_record(w)
        shown = "draining" if record.draining else "ok"
        # None (field empty or missing) prints blank
        pid, load, rate = (
            "" if v is None else str(v) for v in (record.pid, record.load, record.tokens_per_s)
        )
        kernels, kv = status_data.worker_compute(w)
        attn = status_data.worker_attention(w)
        spec = status_data.worker_speculation(w)
        name, role = (str(v) if v else "?" for v in (record.name, record.role))
        start = status_data.worker_startup(w)
        print(
            f"{name:<24}{role:<9}{pid:>8}{load:>6}{rate:>8}{w['age_s']:>6.1f}s{start:>8}  "
            f"{kernels:<9}{kv:<6}{attn:<6}{spec:<7}{shown}"
        )
    if status_data.several_models(data):
        print(*model_lines(data["models"]), sep="\n")
    print(f"\n{'STREAM':<34}{'LENGTH':>8}{'PENDING':>9}{'LAG':>6}{'CONSUMERS':>11}")
    for s in data["streams"]:
        lag = "-" if s["lag"] is None else s["lag"]
        print(f"{s['stream']:<34}{s['length']:>8}{s['pending']:>9}{lag:>6}{s['consumers']:>11}")
    print(
        f"\nDLQ entries: {data['dlq']}   requests in flight: {data['requests_in_flight']}   "
        f"by status: {json.dumps(data['requests'])}   tokens/s: {data['tokens_per_s']:.1f}"
    )
    if data.get("stores"):
        for s in data["stores"]:
            print(f"{s['model']}: " + store_line(s["stats"] or {"error": "no run dir"}))
    elif data["store"] is not None:
        print(store_line(data["store"]))
    print(f"topology: {data['topology']['summary']}")
    if "replication" in data:
        print(*replication_lines(data["replication"]), sep="\n")
    if "standbys" in data:
        waiting = ", ".join(f"{s['name']} pid {s['pid']}" for s in data["standbys"])
        print(f"standbys (loaded, waiting to serve): {waiting}")
    if "ingresses" in data:
        ingresses = (
            f"{i['program']} {i['state'].lower()}"
            + (f" pid {i['pid']}" if i["pid"] else "")
            + ("" if i["listening"] or i["state"] != "RUNNING" else " (not listening yet)")
            for i in data["ingresses"]
        )
        print(f"ingresses on port {state['port']} (shared): {', '.join(ingresses)}")
    if "cluster" in data:
        print(*cluster_lines(data["cluster"]), sep="\n")
    return 0


def model_lines(models: list[dict[str, Any]]) -> list[str]:
    """Each model's fleet, one line each: pipeline, live workers and queue depth per stage."""
    lines = [
        f"\n{'MODEL':<32}{'PIPELINE':<20}{'PREFILL':>8}{'DECODE':>7}{'WAITING':>9}{'PENDING':>9}"
    ]
    for m in models:
        waiting = m["prefill_waiting"] + m["decode_waiting"]
        pending = m["prefill_pending"] + m["decode_pending"]
        shown = m["model"] or "?"
        if m.get("aliases"):  # --served-model-name's other names
            shown += f" ({', '.join(m['aliases'])})"
        lines.append(
            f"{shown:<32}{m['pipeline'] or '-':<20}{len(m['prefill_workers']):>8}"
            f"{len(m['decode_workers']):>7}{waiting:>9}{pending:>9}"
        )
    return lines


def cluster_lines(nodes: list[dict[str, Any]]) -> list[str]:
    """The Valkey cluster's nodes, one line each: port, slots served, keys, up or down."""
    lines = [f"\n{'VALKEY NODE':<24}{'PORT':>6}{'SLOTS':>7}{'KEYS':>8}  {'RANGES':<24}STATE"]
    for n in nodes:
        slots, count = ("-", "-") if not n["up"] else (n["slots"], n["keys"])
        ranges = ",".join(n.get("slot_ranges") or []) or "-"
        state = f"up ({n['cluster_state']})" if n["up"] else "down"
        lines.append(f"{n['name']:<24}{n['port']:>6}{slots:>7}{count:>8}  {ranges:<24}{state}")
    return lines


TIERS = ("host", "disk", "remote")  # always listed, in this order


def store_line(store: dict[str, Any]) -> str:
    """Tier usage and hit rates of the local store node in one line."""
    if "error" in store:
        return f"store: unavailable ({store['error']})"
    pages = store.get("pages", {})
    parts = [
        f"store {store.get('node_id', '?')}: host {pages.get('host', 0)}/"
        f"{pages.get('host_slots', '?')} pages, disk {pages.get('disk', 0)}/"
        f"{pages.get('disk_capacity', '?')} pages"
    ]
    counters = store.get("counters", {})
    hits, misses = counters.get("hits", {}), counters.get("misses", {})
    for tier in [*TIERS, *sorted((set(hits) | set(misses)) - set(TIERS))]:
        h, m = hits.get(tier, 0), misses.get(tier, 0)
        rate = f"{h / (h + m):.0%}" if h + m else "-"  # "-": no lookups reached the tier yet
        parts.append(f"{tier} hit rate {rate} ({int(h)}/{int(h + m)})")
    return ", ".join(parts)


def store_cache_lines(store: dict[str, Any]) -> list[str]:
    """What the store does for sessions: retained pages (bytes by tier), prefetches and their
    hits, evictions by tier and reason (`kvrelay kv stats`)."""
    pages, counters = store.get("pages", {}), store.get("counters", {})
    page_mb = store.get("page_bytes", 0) / 1e6
    kept = {tier: int(pages.get(f"retained_{tier}", 0)) for tier in ("host", "disk")}
    held = ", ".join(f"{tier} {n} pages ({n * page_mb:.1f} MB)" for tier, n in kept.items())
    prefetched = counters.get("prefetch_pages", {})
    sources = ", ".join(f"{n:.0f} from {source}" for source, n in sorted(prefetched.items()))
    hits = sum(counters.get("prefetch_hits", {}).values())
    unused = sum(counters.get("prefetch_unused", {}).values())
    evictions = counters.get("evictions", {})
    by_reason = ", ".join(
        f"{label.replace('/', ' ')} {n:.0f}" for label, n in sorted(evictions.items())
    )
    return [
        f"sessions: {pages.get('sessions', 0)} retaining {held}",
        f"prefetched pages: {sources or 'none'}; read {hits:.0f}, evicted unread {unused:.0f}",
        f"evictions: {by_reason or 'none'}",
    ]


def add_drain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("worker", help="worker name as `kvrelay status` shows it")
    p.add_argument("--undo", action="store_true", help="let the worker take work again")
    p.add_argument(
        "--wait-s",
        type=float,
        default=3.0,
        help="wait this long for the worker's heartbeat to acknowledge (default 3; 0 = no wait)",
    )
    connection_args(p)


def run_drain(args: argparse.Namespace) -> int:
    from kvrelay.pipeline.queue import admin

    if args.wait_s < 0:
        raise CommandError(f"--wait-s must be >= 0, got {args.wait_s:g}")
    r, keys, _ = connect(args)
    if not admin.drain(r, keys, args.worker, undo=args.undo):
        raise CommandError(f"no live worker {args.worker!r}", EXIT_NOT_FOUND)
    state = "taking work again" if args.undo else "draining"
    acknowledged = None
    if args.wait_s > 0:
        acknowledged = admin.wait_draining(r, keys, args.worker, not args.undo, args.wait_s)
        if acknowledged is None:
            raise CommandError(
                f"{args.worker} stopped (its heartbeat is gone) while waiting", EXIT_FAILURE
            )
        if not acknowledged:
            raise CommandError(
                f"{args.worker} did not acknowledge within {args.wait_s:g}s (the flag is set; "
                "it applies at the worker's next heartbeat)",
                EXIT_FAILURE,
            )
    if args.json:
        print_json({"worker": args.worker, "draining": not args.undo, "acknowledged": acknowledged})
    else:
        print(f"{args.worker}: {state}")
    return 0
