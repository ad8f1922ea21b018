"""`kvrelay usage`: the tokens and requests counted per API key, tenant and model, summed over
every shard (`core.usage`; docs/operations.md "Usage accounting")."""

from __future__ import annotations

import argparse
import csv
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

from kvrelay.cli.admin import connect, connection_args, print_json
from kvrelay.cli.errors import EXIT_USAGE, CommandError
from kvrelay.core.usage import USAGE_TTL_S, Dimension, Usage, UsageField, group

_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
PERIODS = ("hour", "day")
# the table's count columns: heading, field
COLUMNS = (
    ("REQUESTS", UsageField.REQUESTS),
    ("PROMPT", UsageField.PROMPT_TOKENS),
    ("CACHED", UsageField.CACHED_TOKENS),
    ("COMPLETION", UsageField.COMPLETION_TOKENS),
    ("FAILED", UsageField.FAILED_REQUESTS),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    connection_args(p)
    p.add_argument(
        "--since",
        default=None,
        help="from this time: unix seconds, ISO 8601 (UTC unless it says), or an age such as "
        "90m, 6h, 2d (widened to whole hours: usage is kept per hour)",
    )
    p.add_argument("--until", default=None, help="up to this time (as --since; default now)")
    p.add_argument(
        "--period",
        choices=PERIODS,
        default=None,
        help="the current hour or UTC day (the default: day); not with --since/--until",
    )
    p.add_argument(
        "--by",
        action="append",
        choices=[str(d) for d in Dimension],
        default=None,
        help="group by this (repeatable; default: key, tenant and model)",
    )
    p.add_argument("--csv", action="store_true", help="print CSV")


def parse_time(text: str, now: float, flag: str) -> float:
    """Unix seconds from `text`: a number, an age (`90m`, `6h`, `2d`) or ISO 8601."""
    text = text.strip()
    if (ago := _AGO.fullmatch(text)) is not None:
        return now - float(ago.group(1)) * _UNIT_S[ago.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(
            f"{flag} {text!r}: give unix seconds, ISO 8601 or an age such as 6h", EXIT_USAGE
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def time_range(args: argparse.Namespace, now: float) -> tuple[float, float]:
    """[since, until) from --since/--until or --period (default: the current UTC day)."""
    if args.period and (args.since or args.until):
        raise CommandError("--period does not go with --since or --until", EXIT_USAGE)
    if args.since or args.until:
        until = parse_time(args.until, now, "--until") if args.until else now + 1
        # no --since: as far back as hours are kept
        since = parse_time(args.since, now, "--since") if args.since else until - USAGE_TTL_S
        if until <= since:
            raise CommandError("--until must be after --since", EXIT_USAGE)
        return since, until
    length = 3600 if args.period == "hour" else 86400
    return now - now % length, now + 1


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def row(u: Usage, by: list[Dimension]) -> dict[str, Any]:
    """A usage row as JSON/CSV shows it: the grouped dimensions, then every count."""
    public = u.public()
    return {**{str(d): public[d] for d in by}, **{str(f): u.get(f) for f in UsageField}}


def run(args: argparse.Namespace) -> int:
    from kvrelay.pipeline.queue.usage import hours, read_period

    if args.json and args.csv:
        raise CommandError("--json and --csv do not go together", EXIT_USAGE)
    by = [Dimension(d) for d in dict.fromkeys(args.by or list(Dimension))]
    now = time.time()
    since, until = time_range(args, now)
    r, keys, _ = connect(args)
    rows = group(read_period(r, keys, since, until).values(), by)
    total = Usage()
    for u in rows:
        total.add(u)
    starts = hours(since, until)
    # what the hour hashes read cover (the range widened to whole hours)
    covered = (_iso(starts[0]), _iso(min(starts[-1] + 3600, until))) if starts else ("", "")
    if args.json:
        print_json(
            {
                "since": covered[0],
                "until": covered[1],
                "by": [str(d) for d in by],
                "rows": [row(u, by) for u in rows],
                "total": {str(f): total.get(f) for f in UsageField},
            }
        )
    elif args.csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow([*(str(d) for d in by), *(str(f) for f in UsageField)])
        for u in rows:
            out.writerow(row(u, by).values())
    else:
        print(f"usage from {covered[0]} to {covered[1]} (UTC), {keys.shards} shard(s)")
        print(table(rows, total, by))
    return 0


def table(rows: list[Usage], total: Usage, by: list[Dimension]) -> str:
    """The rows and a total line as aligned columns (the key "" shows as `-`: no auth)."""
    heads = [str(d).upper() for d in by] + [h for h, _ in COLUMNS]
    lines = [
        [getattr(u, str(d)) or "-" for d in by] + [str(u.get(f)) for _, f in COLUMNS] for u in rows
    ]
    lines.append(["TOTAL", *[""] * (len(by) - 1), *(str(total.get(f)) for _, f in COLUMNS)])
    widths = [max(len(x) for x in column) for column in zip(heads, *lines, strict=True)]
    text = []
    for line in [heads, *lines]:
        cells = [
            cell.ljust(w) if i < len(by) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        text.append("  ".join(cells).rstrip())
    return "\n".join(text)
