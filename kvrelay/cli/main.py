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
from collections.abc import Sequence
from typing import Any, NoReturn

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

# Commands that run until stopped log their lifecycle at INFO by default; the others print their
# results and log only warnings unless --log-level says otherwise.
SERVICE_COMMANDS = frozenset({"serve", "worker", "store"})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
    ("usage", "kvrelay.cli.usage", "tokens and requests counted per API key, tenant and model"),
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
    parser.add_argument("--version", action=VersionAction, help="print the version and exit")
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=None,
        help="kvrelay's logging level (default INFO for serve, worker and store, WARNING for the "
        "other commands); other libraries log warnings and errors only",
    )
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


def version() -> str:
    """kvrelay's version from the installed package's metadata (the source tree's otherwise)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kvrelay")
    except PackageNotFoundError:
        from kvrelay import __version__

        return __version__


class VersionAction(argparse.Action):
    """`--version`: `kvrelay <version>` on stdout, exit 0; the metadata is read only then."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> NoReturn:
        print(f"kvrelay {version()}")
        parser.exit()


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"want one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


class OwnLogs(logging.Filter):
    """kvrelay's records from the chosen level, other libraries' only from WARNING: their INFO
    lines (matplotlib's `generated new fontManager`, httpx's one per request) are not for
    kvrelay's users. uvicorn logs through handlers of its own, at the level `serve` gives it."""

    def __init__(self, level: int):
        super().__init__()
        self.level, self.others = level, max(level, logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == "kvrelay" or record.name.startswith(("kvrelay.", "__main__"))
        return record.levelno >= (self.level if own else self.others)


def configure_logging(level: str) -> None:
    """One stderr handler for the command's logs (left alone when logging is set up already,
    as basicConfig does: an embedding program's or pytest's handlers stay in charge)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(OwnLogs(logging.getLevelName(level)))
    root.addHandler(handler)
    root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's parser, so the line reads `kvrelay <cmd>: error: ...`
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.log_level is None:
        args.log_level = "INFO" if args.command in SERVICE_COMMANDS else "WARNING"
    configure_logging(args.log_level)
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
