"""`kvrelay config show`: the effective settings of a component (secrets shown as ***).

With `--run-dir`, those of a `kvrelay up` stack's programs: each program's command line and
environment read back (a running program's from /proc: what it was started with, its
inherited environment included; else supervisord.conf's, whose items are all `up` gave it:
the environment `up` itself ran in is not recorded) and put through the same parsing and
settings loading the program does.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path
from typing import Any

COMPONENTS = ("ingress", "worker", "store")
# the `kvrelay` command of a program -> its component
COMMAND_COMPONENTS = {"serve": "ingress", "worker": "worker", "store": "store"}
CLI_MODULE = "kvrelay.cli.main"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print the effective settings")
    p.add_argument("--component", choices=COMPONENTS, default=None, help="one component (all)")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML settings file to apply")
    p.add_argument(
        "--run-dir",
        default=None,
        help="a `kvrelay up` run dir: the settings its programs were given, per program "
        "(a running one's from its process)",
    )


def run(args: argparse.Namespace) -> int:
    from kvrelay.cli.errors import CommandError

    if args.run_dir is not None:
        if args.config is not None:  # the stack's programs name their own
            raise CommandError("--config and --run-dir do not go together")
        print(json.dumps(stack_settings(args.run_dir, args.component), indent=2))
        return 0
    from kvrelay.core.config import redacted

    names = [args.component] if args.component else list(COMPONENTS)
    print(json.dumps({n: redacted(load_settings(n, [], args.config)) for n in names}, indent=2))
    return 0


def load_settings(
    component: str, argv: list[str], config_file: str | None, environ: dict[str, str] | None = None
) -> Any:
    """The settings `component` runs with given its command's arguments `argv` (after the
    command's name) and `environ` (None: this process's), as that command loads them."""
    from kvrelay.core.config import from_env, read_config_file

    parser = argparse.ArgumentParser(prog=f"kvrelay {component}", exit_on_error=False)
    if component == "ingress":
        from kvrelay.cli import serve
        from kvrelay.pipeline.server.config import load_config

        serve.add_arguments(parser)
        ns = _parse(parser, argv)
        overrides = {dest: getattr(ns, dest) for _f, dest, _k, _h in serve.SERVE_FLAGS}
        overrides["mode"] = ns.mode
        overrides["models"] = tuple(ns.models) if ns.models else None
        overrides["api_keys"] = tuple(ns.api_keys) if ns.api_keys else None
        return load_config(environ=environ, config_file=ns.config or config_file, **overrides)
    if component == "worker":
        from kvrelay.cli import worker
        from kvrelay.workers.config import load_worker_config

        if not argv:  # `config show` itself: the role is not a setting
            argv = ["decode"]
        worker.add_arguments(parser)
        ns = _parse(parser, argv)
        overrides = {dest: getattr(ns, dest) for _f, dest, _k, _h in worker.worker_flags()}
        return load_worker_config(
            environ=environ, config_file=ns.config or config_file, **overrides
        )
    from kvrelay.cli import store
    from kvrelay.kvstore.config import SECTION, StoreConfig

    store.add_store_arguments(parser)
    ns = _parse(parser, argv)
    overrides = {dest: getattr(ns, dest) for _f, dest, _k, _h in store.store_flags()}
    file_values = read_config_file(ns.config or config_file, SECTION)
    return from_env(StoreConfig, SECTION, environ=environ, file_values=file_values, **overrides)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    from kvrelay.core.config import ConfigError

    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:  # exit_on_error misses some errors
        raise ConfigError(f"cannot read the arguments {shlex.join(argv)!r}: {exc}") from None


def component_of(command: list[str]) -> tuple[str, list[str]] | None:
    """(component, its command's arguments) of a program's command line (`python -m
    kvrelay.cli.main serve ...` or `kvrelay serve ...`); None for another program (valkey)."""
    for i, part in enumerate(command):
        if part == CLI_MODULE or os.path.basename(part) == "kvrelay":
            rest = command[i + 1 :]
            if rest and rest[0] in COMMAND_COMPONENTS:
                return COMMAND_COMPONENTS[rest[0]], rest[1:]
            return None
    return None


def process_start(pid: int) -> tuple[list[str], dict[str, str]] | None:
    """(command line, environment) process `pid` was started with; None when unreadable."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, another user's, or no /proc
        return None
    pairs = (os.fsdecode(item).partition("=") for item in env if b"=" in item)
    return [os.fsdecode(a) for a in argv], {k: v for k, _, v in pairs}


def configured_programs(run_dir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Program name -> (command line, environment items) as supervisord.conf gives them."""
    import configparser

    from supervisor.datatypes import dict_of_key_value_pairs

    from kvrelay.cli.up.launch import CONFIG_NAME

    conf = configparser.RawConfigParser()
    if not conf.read(run_dir / CONFIG_NAME):
        raise FileNotFoundError(f"no {CONFIG_NAME} in {run_dir}")
    out = {}
    for section in conf.sections():
        if not section.startswith("program:"):
            continue
        # supervisord doubles '%' for its interpolation, and parses environment= this way
        command = shlex.split(conf.get(section, "command").replace("%%", "%"))
        env_items = conf.get(section, "environment", fallback="").replace("%%", "%")
        env = dict_of_key_value_pairs(env_items) if env_items else {}
        out[section.removeprefix("program:")] = (command, env)
    return out


def stack_settings(run_dir: str, component: str | None = None) -> dict[str, Any]:
    """Each kvrelay program of the stack in `run_dir` (of `component` only, when given):
    {component, source, settings}; `source` is `pid N` for a running program read from its
    process, else `supervisord.conf` (its items only, over the defaults)."""
    from kvrelay.cli.admin import stack_state
    from kvrelay.cli.errors import EXIT_USAGE, CommandError
    from kvrelay.cli.up.launch import Supervisor
    from kvrelay.core.config import ConfigError, redacted

    stack_state(run_dir)  # exit 2 with the reason when run_dir holds no stack
    try:
        programs = configured_programs(Path(run_dir))
    except (OSError, ValueError) as exc:
        message = f"cannot read the stack's supervisord config: {exc}"
        raise CommandError(message, EXIT_USAGE) from None
    running = Supervisor(run_dir).status()
    out: dict[str, Any] = {}
    for name, (command, env) in programs.items():
        source, environ = "supervisord.conf", env
        state, pid = running.get(name, ("", None))
        started = process_start(pid) if state == "RUNNING" and pid else None
        if started is not None:
            (command, environ), source = started, f"pid {pid}"
        found = component_of(command)
        if found is None or (component is not None and found[0] != component):
            continue
        try:
            settings = load_settings(found[0], found[1], None, environ)
        except ConfigError as exc:
            raise ConfigError(f"program {name}: {exc}") from None
        out[name] = {"component": found[0], "source": source, "settings": redacted(settings)}
    return out
