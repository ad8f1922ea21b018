"""`kvrelay serve`: run the OpenAI-compatible HTTP ingress under uvicorn.

Flags mirror IngressConfig; unset flags fall back to `KVRELAY_INGRESS_*` (and the shared
`KVRELAY_REDIS_URL`, `KVRELAY_KEY_PREFIX`, `KVRELAY_API_KEYS`), then to the defaults.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

logger = logging.getLogger(__name__)

# (flag, config field, type, help)
SERVE_FLAGS: list[tuple[str, str, type, str]] = [
    ("--redis-url", "redis_url", str, "Redis/Valkey URL (default redis://127.0.0.1:6379/0)"),
    ("--key-prefix", "key_prefix", str, "prefix of every Redis key (default kvrelay:)"),
    ("--host", "host", str, "address to listen on (default 127.0.0.1)"),
    ("--port", "port", int, "port to listen on (default 8000)"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body (default 4 MiB)"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "longest prompt accepted (default 32768)"),
    ("--max-tokens-limit", "max_tokens_limit", int, "largest max_tokens (default 4096)"),
    (
        "--route-threshold",
        "route_threshold",
        int,
        "auto mode: prompts with at most this many uncached tokens go straight to decode (64)",
    ),
    ("--max-waiting", "max_waiting", int, "429 when this many entries wait in the streams (512)"),
    ("--max-inflight", "max_inflight", int, "429 beyond this many open requests (4096)"),
    ("--retry-after", "retry_after_s", int, "Retry-After seconds on a 429 (default 1)"),
    ("--request-timeout", "request_timeout_s", float, "request deadline in seconds (600)"),
    (
        "--disconnect-grace",
        "disconnect_grace_s",
        float,
        "seconds a disconnected client may reconnect (Last-Event-ID) before its request "
        "is cancelled; 0 cancels at once (default 10)",
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, dest, kind, help_text in SERVE_FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        default=None,
        help="served model name or path (repeatable; default smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--mode",
        choices=("auto", "disaggregated", "colocated"),
        default=None,
        help="routing: auto (conditional disaggregation, default), "
        "disaggregated (always prefill first), colocated (decode only)",
    )
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        help="accepted API key (repeatable); prefer KVRELAY_API_KEYS, which "
        "does not show in the process list",
    )


def config_from_args(args: argparse.Namespace):
    """IngressConfig from flags over the environment."""
    from kvrelay.pipeline.server.config import load_config

    overrides = {dest: getattr(args, dest, None) for _f, dest, _k, _h in SERVE_FLAGS}
    overrides["mode"] = args.mode
    overrides["models"] = tuple(args.models) if args.models else None
    overrides["api_keys"] = tuple(args.api_keys) if args.api_keys else None
    return load_config(**overrides)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvrelay.core.config import ConfigError
    from kvrelay.pipeline.server.app import create_app

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    logger.info(
        "ingress on http://%s:%d (redis %s, mode %s, models %s, api keys %s)",
        config.host,
        config.port,
        config.redis_url,
        config.mode,
        ", ".join(config.models),
        "required" if config.api_keys else "off",
    )
    # uvicorn stops gracefully on SIGTERM and then re-raises it to the handler it found; without
    # this one the process dies by the signal (supervisord warns on every stop) instead of 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=logging.getLevelName(logging.getLogger().level).lower(),
        timeout_graceful_shutdown=10,
    )
    return 0
