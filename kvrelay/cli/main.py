"""The `kvrelay` command line.

Each subcommand lives in a small module exposing `add_arguments(parser)` and `run(args) -> int`.
Those modules import only argparse-level code at top level and pull in heavy dependencies
(torch, the engine, the store) inside `run`, so `kvrelay --help` and the ingress stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

from kvrelay.cli.errors import (  # noqa: F401  (re-exported: commands import them from here)
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CommandError,
    redact_url,
)
from kvrelay.core.config import ConfigError
from kvrelay.core.errors import KvrelayError
from kvrelay.core.modelref import ModelNotFoundError


class CommandParser(argparse.ArgumentParser):
    """A command's parser: its usage errors are one line `<prog>: error: ...` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {line} (see `{self.prog} --help`)\n")


# (command, module, help). A module may define `add_subcommands(subparsers)` instead of
# `add_arguments` when the command has its own sub-commands (for example `worker prefill`).
COMMANDS: list[tuple[str, str, str]] = [
    ("up", "kvrelay.cli.up.command", "start the whole stack under supervisord"),
    ("down", "kvrelay.cli.up.command", "stop a stack started with `up --detach`"),
    ("serve", "kvrelay.cli.serve", "run the OpenAI-compatible HTTP ingress"),
    ("worker", "kvrelay.cli.worker", "run a prefill or decode worker"),
    ("store", "kvrelay.cli.store", "run this host's KV page store node"),
    ("status", "kvrelay.cli.admin", "workers, streams, lag, DLQ and store usage"),
    ("requests", "kvrelay.cli.requests", "show or cancel a request"),
    ("dlq", "kvrelay.cli.requests", "list, show, replay or purge dead-lettered entries"),
    ("drain", "kvrelay.cli.admin", "stop a worker from taking new work"),
    ("kv", "kvrelay.cli.store", "inspect the KV page store"),
    ("generate", "kvrelay.cli.generate", "generate text in-process (no Redis)"),
    ("bench", "kvrelay.cli.bench", "benchmark an OpenAI-compatible server"),
    ("config", "kvrelay.cli.config", "show the effective settings (flags aside)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kvrelay", description="Disaggregated LLM serving over Redis streams."
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True
    for name, module_name, help_text in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # command not built yet
        hook = getattr(module, f"add_{name}_arguments", None) or module.add_arguments
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        hook(cmd)
        runner = getattr(module, f"run_{name}", None) or module.run
        cmd.set_defaults(_run=runner, _parser=cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's parser, so the line reads `kvrelay <cmd>: error: ...`
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # surface a broken pipe here, not as a traceback at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`kvrelay status | head`): stop quietly, like other CLIs do;
        # stdout goes to /dev/null so the interpreter's final flush cannot complain again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by it
    except KvrelayError as exc:  # raised on purpose with a message that says what went wrong
        _fail(args, str(exc) or type(exc).__name__)
        return exit_code(exc)
    except Exception as exc:
        message = _redis_unavailable(args, exc)
        if message is None:
            raise
        _fail(args, message)
        return EXIT_UNAVAILABLE


def exit_code(exc: KvrelayError) -> int:
    """The one place a kvrelay error becomes an exit code: bad settings or model are usage (2)."""
    if isinstance(exc, CommandError):
        return exc.exit_code
    if isinstance(exc, ConfigError | ModelNotFoundError):
        return EXIT_USAGE
    return EXIT_FAILURE


def _fail(args: argparse.Namespace, message: str) -> None:
    print(f"kvrelay {args.command}: error: {' '.join(message.split())}", file=sys.stderr)


def _redis_unavailable(args: argparse.Namespace, exc: Exception) -> str | None:
    """A one-line message when `exc` says Redis is down or not answering, else None."""
    redis = sys.modules.get("redis")  # never imported: the error cannot come from redis
    if redis is None or not isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return None
    url = getattr(args, "redis_url", None)
    where = f"Redis at {redact_url(url)}" if url else "Redis"
    if isinstance(exc, redis.TimeoutError):
        return f"{where} did not answer in time ({exc}); is it overloaded or stopped?"
    return f"{where} is not reachable ({exc}); is the stack running?"


if __name__ == "__main__":
    sys.exit(main())
