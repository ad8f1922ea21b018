"""`kvrelay serve`: run the OpenAI-compatible HTTP ingress under uvicorn.

Flags mirror IngressConfig; unset flags fall back to `KVRELAY_INGRESS_*` (and the shared
`KVRELAY_REDIS_URL`, `KVRELAY_KEY_PREFIX`, `KVRELAY_API_KEYS`), then to the defaults.

`--reuse-port`: several ingresses share one address (`kvrelay up --ingresses N`). Each binds
its own socket with SO_REUSEPORT and the kernel spreads new connections over the listening
ones, so the clients of a killed ingress reconnect to a live one at the same address. The
socket listens only once the app has started (uvicorn calls listen() after its lifespan), so
a restarting ingress takes no connection it cannot serve yet.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
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
    (
        "cache_retention_s",
        "seconds a named session's pages (prompt_cache_key, user) are retained after a request",
    ),
    ("max_cache_retention_s", "longest prompt_cache_retention a request may ask for"),
    ("prefetch_hints", "publish a queued request's page keys so the store brings them up"),
    (
        "allow_runtime_lora_updating",
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (run-time LoRA adapters)",
    ),
    (
        "scheduling_policy",
        "fcfs (first come, first served; priorities refused) or priority (lower priority "
        "first, then tenants' weighted fair shares)",
    ),
    ("priority_age_s", "seconds after which a queued request goes before any priority"),
    (
        "api_keys_file",
        "TOML file of API keys, each with its tenant, weight, priorities and quotas "
        '(docs/api.md "Tenants")',
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
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="share the address with other ingresses (SO_REUSEPORT: the kernel spreads "
        "connections over them); `kvrelay up --ingresses N` sets it",
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


def bind_shared(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` with SO_REUSEPORT (and SO_REUSEADDR), not listening
    yet: other sockets bound the same way share the port, any other holder refuses it
    (CommandError, one line, exit 2)."""
    from kvrelay.cli.errors import CommandError
    from kvrelay.cli.up.launch import listen_address

    if not 0 <= port <= 65535:
        raise CommandError(f"port must be 0-65535 (0: any free port), got {port}")
    family, kind, proto, _name, addr = listen_address(host, port)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise CommandError(
                f"port {port} on {host} is in use by a listener that does not share it "
                "(SO_REUSEPORT)"
            ) from None
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from kvrelay.pipeline.server.app import create_app

    config = config_from_args(args)  # a ConfigError is one line, exit 2 (kvrelay.cli.main)
    shared = getattr(args, "reuse_port", False)
    # a port its sibling ingresses hold with SO_REUSEPORT is not taken: the real bind tells
    sock = bind_shared(config.host, config.port) if shared else None
    if sock is None:
        check_listen(config.host, config.port)
    logger.info(
        "ingress on http://%s:%d (%sredis %s, mode %s, models %s, api keys %s)",
        config.host,
        config.port,
        "port shared with other ingresses: SO_REUSEPORT; " if shared else "",
        config.redis_url,
        config.mode,
        ", ".join(config.models),
        "required" if config.api_keys else "off",
    )
    # uvicorn stops gracefully on SIGTERM and then re-raises it to the handler it found; without
    # this one the process dies by the signal (supervisord warns on every stop) instead of 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log_level = str(getattr(args, "log_level", None) or "info").lower()  # uvicorn's own lines
    if sock is None:
        uvicorn.run(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=log_level,
            timeout_graceful_shutdown=10,
        )
        return 0
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=log_level,
            timeout_graceful_shutdown=10,
        )
    )
    try:
        server.run(sockets=[sock])  # listen() once the app has started
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0 if server.started else STARTUP_FAILURE  # as uvicorn.run exits
