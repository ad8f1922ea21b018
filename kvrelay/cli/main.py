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
import re
import sys
from typing import NoReturn


class CommandError(Exception):
    """A failure reported as one line `kvrelay <cmd>: [error: ]message` on stderr."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


# Exit codes of the CLI contract (docs/operations.md, "Exit codes").
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
EXIT_UNAVAILABLE = EXIT_FAILURE  # Redis or the store node down or not answering

# Commands whose errors follow the contract: one line `kvrelay <cmd>: error: <message>`, usage
# errors included. The others keep `kvrelay <cmd>: <message>` until their tests move too.
CONTRACT_COMMANDS = frozenset({"status", "requests", "dlq", "drain", "kv"})


class CommandParser(argparse.ArgumentParser):
    """A command's parser; with `one_line` its usage errors are one line (exit 2)."""

    one_line = False

    def error(self, message: str) -> NoReturn:
        if not self.one_line:
            super().error(message)
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
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        cmd.one_line = name in CONTRACT_COMMANDS
        hook(cmd)
        runner = getattr(module, f"run_{name}", None) or module.run
        cmd.set_defaults(_run=runner)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    except CommandError as exc:
        _fail(args, str(exc))
        return exc.exit_code
    except Exception as exc:
        message = _redis_unavailable(args, exc)
        if message is None:
            raise
        _fail(args, message)
        return EXIT_UNAVAILABLE


def _fail(args: argparse.Namespace, message: str) -> None:
    tag = "error: " if args.command in CONTRACT_COMMANDS else ""
    print(f"kvrelay {args.command}: {tag}{' '.join(message.split())}", file=sys.stderr)


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


def redact_url(url: str) -> str:
    """The URL without its password."""
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)


if __name__ == "__main__":
    # run the imported module's main: commands raise *its* CommandError, not __main__'s
    from kvrelay.cli.main import main as _main

    sys.exit(_main())
