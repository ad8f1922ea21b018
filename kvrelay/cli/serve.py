"""`kvrelay serve`: run the OpenAI-compatible HTTP ingress under uvicorn.

Flags mirror IngressConfig; unset flags fall back to `KVRELAY_INGRESS_*` (and the shared
`KVRELAY_REDIS_URL`, `KVRELAY_KEY_PREFIX`, `KVRELAY_API_KEYS`), then to the defaults.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from kvrelay.core.config import config_file_help, setting_flags
from kvrelay.pipeline.server.config import MODES, SECTION, IngressConfig

logger = logging.getLogger(__name__)

# (field, help[, flag]): names, types and defaults come from IngressConfig
# (KVRELAY_INGRESS_*); `kvrelay up` passes the limits on from this same table.
_HELP = [
    ("redis_url", "Redis/Valkey URL (or the shared KVRELAY_REDIS_URL)"),
    ("key_prefix", "prefix of every Redis key (or the shared KVRELAY_KEY_PREFIX)"),
    ("shards", "pipeline shards, the same for every process (or the shared KVRELAY_SHARDS)"),
    ("host", "address to listen on"),
    ("port", "port to listen on"),
    ("max_body_bytes", "largest request body in bytes"),
    (
        "body_timeout_s",
        "408 when a request body sends nothing for this many seconds",
        "--body-timeout",
    ),
    ("max_prompt_tokens", "longest prompt accepted"),
    ("max_tokens_limit", "largest max_tokens"),
    (
        "route_threshold",
        "auto mode: prompts with at most this many uncached tokens go straight to decode",
    ),
    ("max_waiting", "429 when this many entries wait in the streams"),
    ("max_inflight", "429 beyond this many open requests"),
    ("max_choices", "most choices one request may ask for (n, best_of, prompts x n)"),
    ("retry_after_s", "Retry-After seconds on a 429", "--retry-after"),
    ("request_timeout_s", "request deadline in seconds", "--request-timeout"),
    (
        "disconnect_grace_s",
        "seconds a disconnected client may reconnect (Last-Event-ID) before "
        "its request is cancelled; 0 cancels at once",
        "--disconnect-grace",
    ),
    (
        "override_generation_config",
        "JSON object of defaults for the sampling fields a request leaves out, over the "
        """model's own: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens """
        """(e.g. '{"temperature": 0.5}')""",
    ),
    (
        "tool_call_parser",
        "how tool_choice auto finds tool calls in the answer: auto (from the model's chat "
        "template), hermes (<tool_call> blocks) or none (tool_choice auto refused)",
    ),
]
# (flag, config field, type, help)
SERVE_FLAGS: list[tuple[str, str, type, str]] = setting_flags(IngressConfig, SECTION, _HELP)


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
        choices=MODES,
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
    parser.add_argument(
        "--config", default=None, metavar="FILE", help=config_file_help("ingress")["help"]
    )


def config_from_args(args: argparse.Namespace):
    """IngressConfig from flags over the environment."""
    from kvrelay.pipeline.server.config import load_config

    overrides = {dest: getattr(args, dest, None) for _f, dest, _k, _h in SERVE_FLAGS}
    overrides["mode"] = args.mode
    overrides["models"] = tuple(args.models) if args.models else None
    overrides["api_keys"] = tuple(args.api_keys) if args.api_keys else None
    return load_config(config_file=getattr(args, "config", None), **overrides)


def check_listen(host: str, port: int) -> None:
    """Refuse (one line, exit 2) an address uvicorn could not listen on, before it starts: it
    would print a traceback (port out of range) or its own error lines."""
    from kvrelay.cli.errors import CommandError
    from kvrelay.cli.up.launch import check_port_free

    if not 0 <= port <= 65535:
        raise CommandError(f"port must be 0-65535 (0: any free port), got {port}")
    check_port_free(host, port)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvrelay.pipeline.server.app import create_app

    config = config_from_args(args)  # a ConfigError is one line, exit 2 (kvrelay.cli.main)
    check_listen(config.host, config.port)
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
        log_level=str(getattr(args, "log_level", None) or "info").lower(),  # its own lines
        timeout_graceful_shutdown=10,
    )
    return 0
