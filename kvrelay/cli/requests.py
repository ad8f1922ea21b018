"""`kvrelay requests show|cancel` and `kvrelay dlq ls|show|replay|purge`."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from kvrelay.cli.admin import connect, connection_args, print_json
from kvrelay.cli.errors import EXIT_FAILURE, EXIT_NOT_FOUND, CommandError

# a full stream entry id as `kvrelay dlq ls` prints it (`@<shard>` when there are several)
ENTRY_ID = re.compile(r"\d+-\d+(@\d+)?")


def _null_if_empty(data: dict[str, Any], names: Any) -> dict[str, Any]:
    """`data` with the fields in `names` that Redis held empty ("") as None: absent is null."""
    return {k: None if v == "" and k in names else v for k, v in data.items()}


def dlq_fields(entry: dict[str, Any]) -> dict[str, Any]:
    """A dict of DLQ results as JSON has them: empty fields null."""
    return {k: None if v == "" else v for k, v in entry.items()}


def add_requests_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show", "cancel"])
    p.add_argument("request_id")
    connection_args(p)


def _show(data: dict[str, Any], as_json: bool) -> None:
    """JSON, or one `name  value` line per field."""
    if as_json:
        print_json(data)
        return
    width = max(len(k) for k in data)
    for name, value in data.items():
        shown = "-" if value is None or value == "" else value
        if isinstance(value, dict | list):
            shown = json.dumps(value)
        print(f"{name:<{width}}  {shown}")


def run_requests(args: argparse.Namespace) -> int:
    from kvrelay.pipeline.queue import admin

    rid = args.request_id
    if not admin.valid_request_id(rid):
        raise CommandError(f"invalid request id {rid!r} (1-128 characters of A-Za-z0-9._:-)")
    r, keys, _ = connect(args)
    if args.action == "show":
        from kvrelay.core.record import FIELDS

        data = admin.show_request(r, keys, rid)
        if data is None:
            raise CommandError(f"no request {rid!r}", EXIT_NOT_FOUND)
        _show(_null_if_empty(data, FIELDS), args.json)
        return 0
    result = admin.cancel_request(r, keys, rid)
    if result is None:
        raise CommandError(f"no request {rid!r}", EXIT_NOT_FOUND)
    if args.json:
        print_json(result)
    elif result["cancelled"]:
        print(f"cancel requested for {rid} (status {result['status'] or 'unknown'})")
    else:  # idempotent, like DELETE /v1/requests/{id}: nothing is left to stop
        reason = f", finish_reason {result['finish_reason']}" if result["finish_reason"] else ""
        print(f"request {rid} already ended (status {result['status']}{reason}); not cancelled")
    return 0


def add_dlq_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["ls", "show", "replay", "purge"])
    p.add_argument("dlq_id", nargs="?", help="DLQ entry id (show, replay); replay --all for all")
    p.add_argument("--all", action="store_true", help="replay every entry")
    p.add_argument("--force", action="store_true", help="replay poison or invalid entries too")
    p.add_argument("--limit", type=int, default=100, help="entries to list")
    p.add_argument("--yes", action="store_true", help="purge without asking")
    connection_args(p)


def run_dlq(args: argparse.Namespace) -> int:
    from kvrelay.pipeline.queue import dlq as admin_dlq

    if args.limit < 1:
        raise CommandError(f"--limit must be at least 1, got {args.limit}")
    if args.action in ("ls", "purge") and args.dlq_id is not None:
        raise CommandError(f"dlq {args.action} takes no entry id, got {args.dlq_id!r}")
    if args.all and (args.action != "replay" or args.dlq_id is not None):
        raise CommandError("--all goes with `dlq replay` and no entry id")
    if args.action in ("show", "replay") and not args.all:
        if args.dlq_id is None:
            extra = " (or --all)" if args.action == "replay" else ""
            raise CommandError(f"give an entry id{extra}")
        if not ENTRY_ID.fullmatch(args.dlq_id):
            raise CommandError(f"not a DLQ entry id: {args.dlq_id!r} (like 1712345678901-0)")
    if args.action == "purge" and not args.yes:
        raise CommandError("dlq purge deletes every entry: add --yes")
    r, keys, _ = connect(args)
    if args.action == "ls":
        rows = admin_dlq.entries(r, keys, args.limit)
        if args.json:
            print_json([row.public() for row in rows])
        elif not rows:
            print("dead-letter stream is empty")
        for row in [] if args.json else rows:
            print(f"{row.dlq_id:<22}{row.request_id or '-':<28}{row.reason}")
        return 0
    if args.action == "purge":
        n = admin_dlq.purge(r, keys)
        if args.json:
            print_json({"purged": n})
        else:
            print(f"purged {n} {'entry' if n == 1 else 'entries'}")
        return 0
    if args.action == "show":
        try:
            entry = admin_dlq.entry(r, keys, args.dlq_id)
        except admin_dlq.AmbiguousEntry as exc:
            raise CommandError(str(exc)) from None
        if entry is None:
            raise CommandError(f"no entry {args.dlq_id}", EXIT_NOT_FOUND)
        _show(dlq_fields(entry), args.json)
        return 0
    if args.all:
        return _replay(r, keys, [row.dlq_id for row in admin_dlq.entries(r, keys, 100000)], args)
    return _replay(r, keys, [args.dlq_id], args)


def _replay(r, keys, ids: list[str], args: argparse.Namespace) -> int:
    from kvrelay.pipeline.queue import dlq as admin_dlq

    done, skipped = [], []
    for dlq_id in ids:
        try:
            replayed = admin_dlq.replay(r, keys, dlq_id, force=args.force)
        except admin_dlq.AmbiguousEntry as exc:
            raise CommandError(str(exc)) from None
        except (admin_dlq.NotReplayable, admin_dlq.ReplayRefused) as exc:
            if not args.all:
                raise CommandError(str(exc), EXIT_FAILURE) from None
            skipped.append(dlq_id)
            continue
        if replayed is None:
            raise CommandError(f"no entry {dlq_id}", EXIT_NOT_FOUND)
        done.append(dlq_fields(replayed.to_dict()))
        if replayed.forced:  # say so on stderr too: it may take a worker down again
            print(
                f"kvrelay dlq: warning: replaying {replayed.kind} entry {dlq_id} (--force): "
                f"{replayed.reason}",
                file=sys.stderr,
            )
        if not args.json:
            print(
                f"replayed {dlq_id} (request {replayed.request_id or '?'}) to {replayed.stream} "
                f"as {replayed.new_id}; it had failed: {replayed.reason}"
            )
    if args.json:
        print_json({"replayed": done, "skipped": skipped})
    if skipped:  # they stay in the DLQ for `dlq show` / `dlq purge`
        what = "entry" if len(skipped) == 1 else "entries"
        print(
            f"kvrelay dlq: warning: skipped {len(skipped)} {what} that cannot be replayed "
            f"(no payload, or poison/invalid without --force; see `kvrelay dlq show`): "
            f"{' '.join(skipped)}",
            file=sys.stderr,
        )
    if args.all and not ids and not args.json:
        print("dead-letter stream is empty")
    return 0
