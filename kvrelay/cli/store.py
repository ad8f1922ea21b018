"""`kvrelay store` (run this host's store node) and `kvrelay kv` (inspect it). Light imports."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
from typing import Any

from kvrelay.core.config import config_file_help

logger = logging.getLogger(__name__)

# (field, help): flag names, types and defaults come from StoreConfig; every flag is also
# KVRELAY_STORE_<FIELD> (and --redis-url/--key-prefix the shared KVRELAY_REDIS_URL/KEY_PREFIX).
_HELP: list[tuple[str, ...]] = [
    ("node_id", "this node's id (unique per host)"),
    ("run_dir", "directory of the local socket (kvstore.sock)"),
    ("redis_url", "Redis/Valkey URL for the page directory (none: no remote fetches)"),
    ("key_prefix", "Redis key prefix"),
    ("shards", "pipeline shards, the same for every process (or the shared KVRELAY_SHARDS)"),
    ("arena_bytes", "size of the shared-memory arena"),
    ("disk_dir", "directory of the disk tier (none: no disk tier)"),
    ("disk_bytes", "disk tier size cap"),
    ("page_bytes", "payload bytes of one page (or give --model)"),
    ("model", "model whose pages this node stores (sets page bytes and fingerprint)"),
    ("dtype", "page dtype with --model (the workers' --kv-cache-dtype; auto: CPU workers')"),
    ("model_dtype", "workers' compute dtype with --model when not the page dtype (fingerprint)"),
    ("page_size", "tokens per page with --model"),
    ("quantization", "workers' weight quantization with --model (fingerprint)"),
    (
        "attention_precision",
        "workers' --attention-precision with --model (fingerprint; auto: CPU workers')",
    ),
    ("fingerprint", "accept only pages of this model fingerprint (none: any)"),
    ("listen_host", "address of the remote-transfer listeners"),
    ("advertise_host", "address peers dial (none: the listen host)"),
    ("tcp_port", "TCP transfer port (0 = any, -1 = off)"),
    ("ucx_port", "UCX transfer port (0 = any, -1 = off)"),
    ("transport", "remote fetch transport: auto, ucx or tcp"),
    ("secret", "shared secret of the store nodes (HMAC challenge)"),
    ("transfer_timeout_s", "bound on one remote transfer in seconds"),
    ("peer_retry_s", "seconds a peer whose transfer failed is skipped (0: never)"),
    ("metrics_port", "serve Prometheus metrics on this port (none: off)"),
    ("keep_arena", "keep the arena file on stop for a fast restart"),
    ("max_retention_s", "longest a session's pages are retained (a request's TTL is cut to it)"),
    ("prefetch", "queued requests' pages brought up ahead: off, local (disk) or remote (peers)"),
]


def store_flags() -> list[tuple[str, str, Any, str]]:
    """(flag, field, type, help) of `kvrelay store`, generated from StoreConfig."""
    from kvrelay.core.config import setting_flags
    from kvrelay.kvstore.config import StoreConfig

    return setting_flags(StoreConfig, "store", _HELP)


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    for flag, dest, kind, help_text in store_flags():
        p.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    p.add_argument("--config", default=None, metavar="FILE", help=config_file_help("store")["help"])


def build_config(args: argparse.Namespace):
    """StoreConfig from defaults, KVRELAY_STORE_* and flags; resolves --model to a page size."""
    from dataclasses import replace

    from kvrelay.cli.errors import CommandError
    from kvrelay.core.config import from_env, read_config_file
    from kvrelay.kvstore.config import SECTION, StoreConfig

    overrides: dict[str, Any] = {
        dest: getattr(args, dest, None) for _f, dest, _k, _h in store_flags()
    }
    file_values = read_config_file(getattr(args, "config", None), SECTION)
    cfg = from_env(StoreConfig, SECTION, file_values=file_values, **overrides)
    if cfg.model is not None:
        from kvrelay.core.modelref import (
            config_head_dim,
            converted_dir,
            read_config,
            read_model_info,
            resolve_model,
        )
        from kvrelay.workers.model.loader import resolve_attention_precision

        try:
            model_dtype, kv_dtype = page_dtypes(cfg.dtype, cfg.model_dtype)
            directory = converted_dir(resolve_model(cfg.model))
            attention = resolve_attention_precision(
                cfg.attention_precision,
                kv_dtype,
                model_dtype,
                "cpu",
                cfg.page_size,
                config_head_dim(read_config(directory)),
                None if _kernels_load() else False,
            )
            info = read_model_info(
                directory, model_dtype, cfg.quantization, kv_dtype=kv_dtype, attention=attention
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        page_bytes = info.page_bytes(kv_dtype, cfg.page_size)
        if cfg.page_bytes not in (None, page_bytes):
            raise CommandError(
                f"--page-bytes {cfg.page_bytes} contradicts --model "
                f"{cfg.model} ({page_bytes}-byte pages)"
            )
        cfg = replace(cfg, page_bytes=page_bytes, fingerprint=cfg.fingerprint or info.fingerprint)
    if cfg.page_bytes is None:
        raise CommandError("give --page-bytes or --model (or KVRELAY_STORE_PAGE_BYTES)")
    return cfg


def page_dtypes(dtype: str, model_dtype: str | None) -> tuple[str, str]:
    """(workers' compute dtype, page dtype) for --dtype/--model-dtype. `auto` resolves as the
    workers' own --kv-cache-dtype auto does for an fp32 model on this host's CPU
    (loader.resolve_kv_dtype_name: bfloat16 when the C++ kernels load, else float32)."""
    from kvrelay.core.modelref import normalize_dtype, normalize_kv_cache_dtype

    if normalize_kv_cache_dtype(dtype) != "auto":
        return normalize_dtype(model_dtype or dtype), normalize_dtype(dtype)
    model_dtype = normalize_dtype(model_dtype or "float32")
    from kvrelay.workers.model.loader import resolve_kv_dtype_name

    return model_dtype, resolve_kv_dtype_name("auto", model_dtype, "cpu", _kernels_load())


def _kernels_load() -> bool:
    """Whether the C++ CPU kernels load on this host (as a CPU worker's would)."""
    try:
        from kvrelay.kernels.cpu_build import load
    except ImportError:  # no torch on this host: no CPU worker here either
        return False
    return load() is not None


def run_store(args: argparse.Namespace) -> int:
    from kvrelay.kvstore.server import StoreNode

    cfg = build_config(args)  # a bad flag or KVRELAY_STORE_* value: one line, exit 2
    node = StoreNode(cfg, cfg.page_bytes)
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    signal.signal(signal.SIGINT, lambda *_: node.stop())
    try:
        node.start()
    except OSError as exc:  # a run dir it cannot create, an arena it cannot map, a port in use
        from kvrelay.cli.errors import EXIT_FAILURE, CommandError

        with contextlib.suppress(Exception):  # what did start must not keep the process up
            node.close()
        where = f": {exc.filename}" if exc.filename else ""
        raise CommandError(
            f"cannot start the store node ({exc.strerror or exc}{where})", EXIT_FAILURE
        ) from None
    try:
        node.serve_forever()
    finally:
        node.close()
    return 0


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["stats", "ls", "get", "evict"], help="what to do")
    p.add_argument("key", nargs="?", help="page key (hex) for `get`")
    p.add_argument(
        "--run-dir", default=None, help="the store node's run dir, or a `kvrelay up` run dir"
    )
    p.add_argument("--limit", type=int, default=100, help="keys per tier for `ls`")
    p.add_argument(
        "--tier",
        default="host",
        choices=["host", "all"],
        help="`evict`: demote the arena to disk (host) or drop everything (all)",
    )
    p.add_argument("--timeout-s", type=float, default=5.0, help="wait this long for the node")
    p.add_argument("--json", action="store_true", help="print JSON")


def store_run_dir(run_dir: str | None) -> str:
    """The store node's run dir: a stack's (`<run_dir>/stack.json`), else `run_dir` itself."""
    from pathlib import Path

    from kvrelay.cli.up.launch import STATE_NAME, read_state
    from kvrelay.kvstore.client import default_run_dir

    if run_dir is None:
        return default_run_dir()
    state_file = Path(run_dir) / STATE_NAME
    if not state_file.is_file():
        return run_dir
    try:
        store_dir = read_state(run_dir).get("store_run_dir")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"cannot read {state_file}: {exc}") from None
    return store_dir or run_dir


def _page_key(args: argparse.Namespace) -> bytes | None:
    """The page key of `get` (required there, refused elsewhere); ValueError says why."""
    from kvrelay.core.page_keys import KEY_BYTES

    if args.action != "get":
        if args.key:  # stats/ls/evict work on whole tiers; never ignore a key silently
            hint = " (it works on a whole tier: --tier host|all)" if args.action == "evict" else ""
            raise ValueError(f"kv {args.action} takes no page key, got {args.key!r}{hint}")
        return None
    if not args.key:
        raise ValueError("give a page key (hex), as `kvrelay kv ls` prints it")
    try:
        key = bytes.fromhex(args.key)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(
            f"not a page key: {args.key!r} ({2 * KEY_BYTES} hex digits, as `kvrelay kv ls` "
            "prints them)"
        )
    return key


def run_kv(args: argparse.Namespace) -> int:
    from kvrelay.cli.errors import EXIT_FAILURE, EXIT_NOT_FOUND, CommandError
    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.errors import StoreError

    if args.limit < 1 or args.timeout_s <= 0:
        raise CommandError("--limit must be at least 1 and --timeout-s above 0")
    try:
        key = _page_key(args)
        run_dir = store_run_dir(args.run_dir)
    except ValueError as exc:  # bad usage: one line, exit 2 (an unreachable node is 1)
        raise CommandError(str(exc)) from None
    client = StoreClient(run_dir, timeout_s=args.timeout_s)
    counts: dict[str, int] = {}
    try:
        if args.action == "stats":
            out = client.stats()
        elif args.action == "ls":
            out = client.ls(args.limit)
            # the listing stops at --limit: the node's page counts say how many there are
            counts = client.stats().get("pages", {}) if not args.json else {}
        elif args.action == "evict":
            out = {"evicted": client.evict(args.tier), "tier": args.tier}
        else:
            assert key is not None  # _page_key: `get` has one
            page = _get(client, key, args.key)
            if page is None:
                raise CommandError(f"no page {args.key} in the store at {run_dir}", EXIT_NOT_FOUND)
            out = page
    except StoreError as exc:
        raise CommandError(f"store node at {run_dir}: {exc}", EXIT_FAILURE) from None
    finally:
        client.close()
    if args.json:
        print(json.dumps(out, indent=2))
    elif args.action == "ls":
        print(ls_text(out, counts), end="")
    else:
        _print_human(args.action, out)
    return 0


def ls_text(listing: dict[str, list[str]], counts: dict[str, int]) -> str:
    """`kv ls` for people: each tier's page count (the node's, not the listing's length) and
    its listed keys, saying when the listing stopped short of it (`--limit`)."""
    lines = []
    for tier, keys in listing.items():
        count = max(counts.get(tier, 0), len(keys))  # a page put between the two calls
        note = ""
        if count > len(keys):
            note = f" (the {len(keys)} least recently used listed; --limit {count} lists all)"
        lines.append(f"{tier}: {count} page{'s' * (count != 1)}{note}")
        lines += [f"  {key}" for key in keys]
    return "".join(line + "\n" for line in lines)


def _get(client, key: bytes, key_hex: str) -> dict | None:
    """The header of one page in the arena (verified), None when the store has no such page."""
    from kvrelay.kvstore.errors import StoreError
    from kvrelay.kvstore.messages import Get, Release, Reply, SlotsReply
    from kvrelay.kvstore.page import unpack_header, verify_page

    reply = client.request(Get(keys=[key], remote=False), SlotsReply)
    if not reply.slots:
        return None
    out: dict = {"key": key_hex, "found": True}
    try:
        page = client.map_arena(reply.gen).slot(reply.slots[0])
        h = unpack_header(page)
        out.update(
            fingerprint=h.fingerprint,
            dtype=h.dtype,
            shape=list(h.shape),
            num_tokens=h.num_tokens,
            payload_bytes=h.payload_bytes,
            checksum=f"{h.checksum:08x}",
        )
        try:
            verify_page(page, key)
            out["verified"] = True
        except StoreError as exc:
            out["verified"] = False
            out["error"] = str(exc)
    finally:
        client.request(Release(slots=reply.slots), Reply)
    return out


def _print_human(action: str, out: dict) -> None:
    if action == "stats":
        from kvrelay.cli.admin import store_cache_lines, store_line

        print("\n".join([store_line(out), *store_cache_lines(out)]))
    elif action == "evict":
        print(f"evicted {out['evicted']} pages ({out['tier']})")
    else:
        width = max(map(len, out))
        for name, value in out.items():
            print(f"{name:<{width}}  {value}")
