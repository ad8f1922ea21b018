"""`kvrelay status | requests | dlq | drain | bench`: look at and steer a running pipeline."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from kvrelay.pipeline.cli import CommandError

ENTRY_ID = re.compile(r"\d+-\d+")  # a full stream entry id, as `kvrelay dlq ls` prints it


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None, help="stack run dir (`kvrelay up`)")
    p.add_argument("--redis-url", default=None, help="Redis URL (env KVRELAY_REDIS_URL)")
    p.add_argument("--key-prefix", default=None, help="Redis key prefix (default kvrelay:)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--timeout-s", type=float, default=2.0, help="wait this long for Redis (default 2)"
    )


def stack_state(run_dir: str | None) -> dict[str, Any]:
    """`<run_dir>/stack.json` of `kvrelay up`; ./kvrelay-run when it holds one; else {}."""
    from kvrelay.pipeline.launch import STATE_NAME, read_state

    if run_dir is None:
        if not os.path.isfile(os.path.join("kvrelay-run", STATE_NAME)):
            return {}
        run_dir = "kvrelay-run"
    try:
        return read_state(run_dir)
    except FileNotFoundError as exc:  # read_state's message names the run dir and the file
        raise CommandError(str(exc), 2) from None
    except (OSError, ValueError) as exc:  # unreadable or not JSON
        raise CommandError(f"cannot read {run_dir}/{STATE_NAME}: {exc}", 2) from None


def _connect(args: argparse.Namespace):
    """(redis client, Keys, store run dir) from --run-dir, flags or the environment."""
    import redis

    from kvrelay.pipeline.keys import Keys

    state: dict[str, Any] = {}
    if args.run_dir or not args.redis_url:
        state = stack_state(args.run_dir)
    url = (
        args.redis_url
        or state.get("redis_url")
        or os.environ.get("KVRELAY_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    prefix = (
        args.key_prefix
        or state.get("key_prefix")
        or os.environ.get("KVRELAY_KEY_PREFIX", "kvrelay:")
    )
    store_dir = state.get("store_run_dir") or os.environ.get("KVRELAY_STORE_RUN_DIR")
    args.stack_state = state  # `status` shows the topology `kvrelay up` chose
    args.redis_url = url  # named by the one-line error of `kvrelay.pipeline.cli.main`
    timeout = max(0.1, args.timeout_s)
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    return client, Keys(prefix), store_dir


def topology_of(workers: list[dict[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    """Live worker counts by role, and what `kvrelay up` chose (when its stack.json is known)."""
    live = {role: sum(w.get("role") == role for w in workers) for role in ("prefill", "decode")}
    layout = "disaggregated" if live["prefill"] else "colocated"
    summary = f"{live['prefill']} prefill + {live['decode']} decode live ({layout}"
    summary += ")" if live["prefill"] else ": decode workers prefill locally)"
    chosen = state.get("topology") or {}
    if chosen.get("summary"):
        summary += f"; kvrelay up: {chosen['summary']}"
    return {**live, "layout": layout, "chosen": chosen or None, "summary": summary}


def _print(args: argparse.Namespace, data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    _connection_args(p)


NUMBER_COLUMNS = ("pid", "load", "tokens_per_s")  # None (field empty or missing) prints blank


def run_status(args: argparse.Namespace) -> int:
    from kvrelay.pipeline import admin

    r, keys, store_dir = _connect(args)
    data = admin.status(r, keys, store_dir)
    data["topology"] = topology_of(data["workers"], getattr(args, "stack_state", {}))
    if args.json:
        _print(args, data)
        return 0
    print(f"{'WORKER':<24}{'ROLE':<9}{'PID':>8}{'LOAD':>6}{'TOK/S':>8}{'AGE':>7}  STATE")
    for w in data["workers"]:
        state = "draining" if w.get("draining") else "ok"
        pid, load, rate = ("" if w.get(k) is None else str(w[k]) for k in NUMBER_COLUMNS)
        print(
            f"{w.get('name', '?'):<24}{w.get('role', '?'):<9}{pid:>8}"
            f"{load:>6}{rate:>8}{w['age_s']:>6.1f}s  {state}"
        )
    print(f"\n{'STREAM':<34}{'LENGTH':>8}{'PENDING':>9}{'LAG':>6}{'CONSUMERS':>11}")
    for s in data["streams"]:
        lag = "-" if s["lag"] is None else s["lag"]
        print(f"{s['stream']:<34}{s['length']:>8}{s['pending']:>9}{lag:>6}{s['consumers']:>11}")
    print(
        f"\nDLQ entries: {data['dlq']}   requests in flight: {data['requests_in_flight']}   "
        f"by status: {json.dumps(data['requests'])}"
    )
    if data["store"] is not None:
        print(_store_line(data["store"]))
    print(f"topology: {data['topology']['summary']}")
    return 0


TIERS = ("host", "disk", "remote")  # always listed, in this order


def _store_line(store: dict[str, Any]) -> str:
    """Tier usage and hit rates of the local store node in one line."""
    if "error" in store:
        return f"store: unavailable ({store['error']})"
    pages = store.get("pages", {})
    parts = [f"store {store.get('node_id', '?')}: host {pages.get('host', 0)}/"
             f"{pages.get('host_slots', '?')} pages, disk {pages.get('disk', 0)}/"
             f"{pages.get('disk_capacity', '?')} pages"]  # fmt: skip
    counters = store.get("counters", {})
    hits, misses = counters.get("hits", {}), counters.get("misses", {})
    for tier in [*TIERS, *sorted((set(hits) | set(misses)) - set(TIERS))]:
        h, m = hits.get(tier, 0), misses.get(tier, 0)
        rate = f"{h / (h + m):.0%}" if h + m else "-"  # "-": no lookups reached the tier yet
        parts.append(f"{tier} hit rate {rate} ({int(h)}/{int(h + m)})")
    return ", ".join(parts)


def add_requests_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show", "cancel"])
    p.add_argument("request_id")
    _connection_args(p)


def run_requests(args: argparse.Namespace) -> int:
    from kvrelay.pipeline import admin

    r, keys, _ = _connect(args)
    if args.action == "show":
        data = admin.show_request(r, keys, args.request_id)
        if data is None:
            print(f"kvrelay requests: no request {args.request_id!r}", file=sys.stderr)
            return 1
        _print(args, data)
        return 0
    if not admin.cancel_request(r, keys, args.request_id):
        print(f"kvrelay requests: no request {args.request_id!r}", file=sys.stderr)
        return 1
    print(f"cancel requested for {args.request_id}")
    return 0


def add_dlq_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["ls", "show", "replay", "purge"])
    p.add_argument("dlq_id", nargs="?", help="DLQ entry id (show, replay); replay --all for all")
    p.add_argument("--all", action="store_true", help="replay every entry")
    p.add_argument("--limit", type=int, default=100, help="entries to list")
    p.add_argument("--yes", action="store_true", help="purge without asking")
    _connection_args(p)


def run_dlq(args: argparse.Namespace) -> int:
    from kvrelay.pipeline import admin

    r, keys, _ = _connect(args)
    if args.action == "ls":
        rows = admin.dlq_entries(r, keys, args.limit)
        if args.json:
            _print(args, rows)
        for row in [] if args.json else rows:
            print(f"{row['dlq_id']:<22}{row.get('request_id') or '-':<28}{row.get('reason', '')}")
        return 0
    if args.action == "purge":
        if not args.yes:
            print("kvrelay dlq purge: add --yes to delete every entry", file=sys.stderr)
            return 2
        print(f"purged {admin.dlq_purge(r, keys)} entries")
        return 0
    if args.all and args.action == "replay":
        ids = [row["dlq_id"] for row in admin.dlq_entries(r, keys, 100000)]
    elif args.dlq_id is None:
        raise CommandError(f"give an entry id{' (or --all)' if args.action == 'replay' else ''}")
    elif not ENTRY_ID.fullmatch(args.dlq_id):
        raise CommandError(f"not a DLQ entry id: {args.dlq_id!r} (like 1712345678901-0)")
    else:
        ids = [args.dlq_id]
    if args.action == "show":
        entry = admin.dlq_entry(r, keys, ids[0])
        if entry is None:
            raise CommandError(f"no entry {ids[0]}", 1)
        _print(args, entry)
        return 0
    return _replay(r, keys, ids, args.all)


def _replay(r, keys, ids: list[str], replay_all: bool) -> int:
    from kvrelay.pipeline import admin

    skipped = []
    for dlq_id in ids:
        try:
            new_id = admin.dlq_replay(r, keys, dlq_id)
        except admin.NotReplayable as exc:
            if not replay_all:
                raise CommandError(str(exc), 1) from None
            skipped.append(dlq_id)
            continue
        if new_id is None:
            raise CommandError(f"no entry {dlq_id}", 1)
        print(f"replayed {dlq_id} as {new_id}")
    if skipped:  # they stay in the DLQ for `dlq show` / `dlq purge`
        what = "entry" if len(skipped) == 1 else "entries"
        print(f"kvrelay dlq replay: skipped {len(skipped)} {what} without a payload: "
              f"{' '.join(skipped)}", file=sys.stderr)  # fmt: skip
    return 0


def add_drain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("worker", help="worker name as `kvrelay status` shows it")
    p.add_argument("--undo", action="store_true", help="let the worker take work again")
    p.add_argument(
        "--wait-s",
        type=float,
        default=3.0,
        help="wait this long for the worker's heartbeat to acknowledge (default 3; 0 = no wait)",
    )
    _connection_args(p)


def run_drain(args: argparse.Namespace) -> int:
    from kvrelay.pipeline import admin

    r, keys, _ = _connect(args)
    if not admin.drain(r, keys, args.worker, undo=args.undo):
        raise CommandError(f"no live worker {args.worker!r}", 1)
    state = "taking work again" if args.undo else "draining"
    if args.wait_s > 0:
        ack = admin.wait_draining(r, keys, args.worker, not args.undo, args.wait_s)
        if ack is None:
            raise CommandError(f"{args.worker} stopped (its heartbeat is gone) while waiting", 1)
        if not ack:
            raise CommandError(
                f"{args.worker} did not acknowledge within {args.wait_s:g}s (the flag is set; "
                "it applies at the worker's next heartbeat)",
                1,
            )
    print(f"{args.worker}: {state}")
    return 0


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="ingress base URL")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=32, help="requests to send")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="Write a short story about a robot learning to paint.")


def run_bench(args: argparse.Namespace) -> int:
    from kvrelay.pipeline.loadgen import run_load, summarize

    prompts = [f"{args.prompt} (variant {i})" for i in range(args.requests)]
    results = run_load(args.url, args.model, prompts, args.max_tokens, args.concurrency)
    print(json.dumps(summarize(results, args.concurrency)))
    return 0
