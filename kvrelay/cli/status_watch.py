"""`kvrelay status --watch`: a live terminal view (rich) refreshed every `--interval` seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvrelay.cli.status_data import (
    several_models,
    worker_attention,
    worker_compute,
    worker_record,
    worker_speculation,
    worker_startup,
)

logger = logging.getLogger(__name__)

TIER_NAMES = {"device": "device (worker pools)", "host": "host (DRAM arena)", "disk": "disk"}


def _num(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0%}"


def worker_state(w: dict[str, Any]) -> str:
    """ok, draining (finishing what it holds) or drained (draining and holding nothing)."""
    record = worker_record(w)
    if not record.draining:
        return "ok"
    return "drained" if not record.load and not record.running else "draining"


def workers_table(workers: list[dict[str, Any]]) -> Table:
    t = Table(title="Workers", title_justify="left", expand=False)
    left = ("NAME", "STAGE", "STATE", "KERNELS", "KV", "ATTN", "SPEC")
    for col in ("NAME", "STAGE", "STATE", "BATCH", "WAITING", "KV USE", "TOK/S", "BEAT",
                "START", "KERNELS", "KV", "ATTN", "SPEC"):  # fmt: skip
        t.add_column(col, justify="left" if col in left else "right")
    for w in workers:
        record = worker_record(w)
        batch = record.running if record.running is not None else record.load
        usage = (w.get("metrics") or {}).get("kv_cache_usage_perc")
        t.add_row(
            record.name or "?",
            str(record.role) or "?",
            worker_state(w),
            _num(batch),
            _num(record.waiting),
            _pct(usage),
            _num(record.tokens_per_s, "{:.1f}"),
            f"{w['age_s']:.1f}s ago",
            worker_startup(w),
            *worker_compute(w),
            worker_attention(w),
            worker_speculation(w),
        )
    if not workers:
        t.add_row("(no live workers)", *[""] * 12)
    return t


def streams_table(streams: list[dict[str, Any]]) -> Table:
    t = Table(title="Streams", title_justify="left")
    for col in ("STAGE", "LENGTH", "LAG", "PENDING", "CONSUMERS"):
        t.add_column(col, justify="left" if col == "STAGE" else "right")
    sharded = any(s.get("shard") for s in streams)  # several shards: say whose stream it is
    for s in streams:
        stage = s.get("stage", s["stream"])
        if s.get("pipeline"):  # another model's pipeline: say whose stream it is
            stage = f"{stage} [{s['pipeline']}]"
        t.add_row(
            f"{stage} (shard {s['shard']})" if sharded else stage,
            str(s["length"]),
            _num(s["lag"]),
            str(s["pending"]),
            str(s["consumers"]),
        )
    return t


def models_table(models: list[dict[str, Any]]) -> Table:
    t = Table(title="Models", title_justify="left")
    for col in ("MODEL", "PIPELINE", "PREFILL", "DECODE", "WAITING", "PENDING"):
        t.add_column(col, justify="left" if col in ("MODEL", "PIPELINE") else "right")
    for m in models:
        t.add_row(
            m["model"] or "?",
            m["pipeline"] or "-",
            str(len(m["prefill_workers"])),
            str(len(m["decode_workers"])),
            str(m["prefill_waiting"] + m["decode_waiting"]),
            str(m["prefill_pending"] + m["decode_pending"]),
        )
    return t


def tiers_table(tiers: list[dict[str, Any]], store: dict[str, Any] | None) -> Table:
    t = Table(title="KV cache", title_justify="left")
    for col in ("TIER", "PAGES", "USAGE", "HITS", "HIT RATE"):
        t.add_column(col, justify="left" if col == "TIER" else "right")
    for tier in tiers:
        pages = tier["pages"]
        if pages is not None and tier["capacity"]:
            pages = f"{pages}/{tier['capacity']}"
        t.add_row(
            TIER_NAMES.get(tier["tier"], tier["tier"]),
            _num(pages),
            _pct(tier["usage"]),
            f"{int(tier['hits'])}/{int(tier['lookups'])}",
            _pct(tier["hit_rate"]),
        )
    if store is None:
        t.caption = "no store node (give --run-dir)"
    elif "error" in store:
        t.caption = f"store unavailable: {store['error']}"
    else:
        t.caption = f"store {store.get('node_id', '?')}; device hits are prompt tokens"
    return t


def render(data: dict[str, Any], where: str, interval: float, error: str | None = None) -> Group:
    """The whole screen for one snapshot (and the error of the last refresh, if it failed)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(data["time"]))
    head = Text(f"kvrelay status  {where}  {stamp}  every {interval:g}s (Ctrl-C to quit)")
    head.stylize("bold")
    inflight = data["requests_in_flight"]
    n = data["dlq"]
    dlq = "dead-letter stream is empty" if not n else f"{n} entr{'y' if n == 1 else 'ies'}"
    summary = Text(
        f"DLQ: {dlq}   requests in flight: {inflight}   tokens/s: {data['tokens_per_s']:.1f}"
    )
    parts: list[Any] = [head, summary]
    if error:
        parts.append(Text(f"refresh failed: {error} (showing the last snapshot)", style="red"))
    parts.append(workers_table(data["workers"]))
    if several_models(data):
        parts.append(models_table(data["models"]))
    parts += [
        streams_table(data["streams"]),
        tiers_table(data["tiers"], data["store"]),
        Text(f"topology: {data['topology']['summary']}"),
    ]
    return Group(*parts)


def watch(
    collect: Callable[[], dict[str, Any]],
    where: str,
    interval: float,
    console: Console | None = None,
) -> int:
    """Redraw `collect()` every `interval` s until Ctrl-C (exit 0); a failed refresh is shown,
    not fatal (the first one is: there is nothing to show yet)."""
    console = console or Console()
    try:
        data = collect()
        with Live(render(data, where, interval), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                error = None
                try:
                    data = collect()
                except Exception as exc:  # Redis restarting: keep watching, say so
                    error = " ".join(str(exc).split()) or type(exc).__name__
                live.update(render(data, where, interval, error), refresh=True)
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends: a success
        return 0
