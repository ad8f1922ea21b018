"""`kvrelay config show`: the effective settings of a component (secrets shown as ***)."""

from __future__ import annotations

import argparse
import json

COMPONENTS = ("ingress", "worker", "store")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print the effective settings")
    p.add_argument("--component", choices=COMPONENTS, default=None, help="one component (all)")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML settings file to apply")


def run(args: argparse.Namespace) -> int:
    from kvrelay.core.config import from_env, read_config_file, redacted
    from kvrelay.kvstore.config import SECTION as STORE_SECTION
    from kvrelay.kvstore.config import StoreConfig
    from kvrelay.pipeline.server.config import load_config
    from kvrelay.workers.config import load_worker_config

    loaders = {
        "ingress": lambda: load_config(config_file=args.config),
        "worker": lambda: load_worker_config(config_file=args.config),
        "store": lambda: from_env(
            StoreConfig, STORE_SECTION, file_values=read_config_file(args.config, STORE_SECTION)
        ),
    }
    names = [args.component] if args.component else list(COMPONENTS)
    print(json.dumps({name: redacted(loaders[name]()) for name in names}, indent=2))
    return 0
