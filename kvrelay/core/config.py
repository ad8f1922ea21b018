"""Settings for the per-component frozen config dataclasses, read one way for every command.

Precedence: override (CLI flag) > `KVRELAY_<SECTION>_<FIELD>` > a deprecated spelling of it >
the shared `KVRELAY_<FIELD>` (redis_url, key_prefix, api_keys) > the config file > the default.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
import types
import typing
from typing import Any, TypeVar

from kvrelay.core.errors import KvrelayError

T = TypeVar("T")

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVRELAY_"
# Fields that mean the same to every component, each with one shared variable.
SHARED_ENV = {
    "redis_url": "KVRELAY_REDIS_URL",
    "key_prefix": "KVRELAY_KEY_PREFIX",
    "api_keys": "KVRELAY_API_KEYS",
}
# Settings printed as *** by `kvrelay config show`.
SECRET_FIELDS = frozenset({"secret", "api_keys"})
_warned: set[str] = set()


class ConfigError(KvrelayError, ValueError):
    """A configuration value (flag or environment variable) is invalid."""


def _convert(raw: str, annotation: Any, name: str) -> Any:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        if raw.strip().lower() in ("", "none", "null"):
            return None
        return _convert(raw, args[0], name)
    try:
        if annotation is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if annotation is int:
            return int(raw)
        if annotation is float:
            return float(raw)
        if origin in (tuple, list):
            items = [s.strip() for s in raw.split(",") if s.strip()]
            return tuple(items) if origin is tuple else items
    except ValueError as exc:
        raise ConfigError(f"invalid value {raw!r} for {name}") from exc
    return raw


def env_name(section: str, field: str) -> str:
    """`KVRELAY_<SECTION>_<FIELD>`, or `KVRELAY_<FIELD>` for the empty section."""
    parts = [p for p in (section, field) if p]
    return ENV_PREFIX + "_".join(parts).upper()


def from_env(
    cls: type[T],
    section: str = "",
    environ: dict[str, str] | None = None,
    *,
    file_values: dict[str, Any] | None = None,
    deprecated: tuple[str, ...] = (),
    env_names: dict[str, str] | None = None,
    **overrides,
) -> T:
    """Build config `cls` from defaults, a config file, `KVRELAY_*` variables, then overrides.

    Overrides whose value is None are ignored so CLI flags can default to None ("not given").
    `deprecated` lists old sections whose `KVRELAY_<OLD>_<FIELD>` still work, with one warning;
    `env_names` renames a field's variable (field -> full name).
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in (file_values or {}).items():
        if key not in hints:
            raise ConfigError(f"unknown setting {key!r} in the config file for {cls.__name__}")
        values[key] = _file_value(value, hints[key], key)
    for f in dataclasses.fields(cls):
        name = (env_names or {}).get(f.name) or env_name(section, f.name)
        raw_name = _first_set(env, name, [env_name(old, f.name) for old in deprecated])
        if raw_name is None and section and f.name in SHARED_ENV and SHARED_ENV[f.name] in env:
            raw_name = SHARED_ENV[f.name]
        if raw_name is not None:
            values[f.name] = _convert(env[raw_name], hints[f.name], raw_name)
    for key, value in overrides.items():
        if value is not None:
            if key not in hints:
                raise ConfigError(f"unknown setting {key!r} for {cls.__name__}")
            values[key] = value
    return cls(**values)


def _first_set(env: dict[str, str], name: str, old_names: list[str]) -> str | None:
    """`name` if set, else the first old spelling that is set (warning once per spelling)."""
    if name in env:
        return name
    for old in old_names:
        if old in env:
            if old not in _warned:
                _warned.add(old)
                logger.warning("%s is deprecated: use %s (same meaning)", old, name)
            return old
    return None


def _file_value(value: Any, annotation: Any, name: str) -> Any:
    """A TOML value for a field: strings converted like variables, lists to tuples."""
    if isinstance(value, str):
        return _convert(value, annotation, name)
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    return value


def read_config_file(path: str | None, section: str) -> dict[str, Any]:
    """Top-level keys of TOML file `path` (shared) overlaid by its `[section]` table."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config: {path} is not valid TOML: {exc}") from None
    shared = {k: v for k, v in data.items() if not isinstance(v, dict)}
    own = data.get(section.lower(), {})
    if not isinstance(own, dict):
        raise ConfigError(f"--config: [{section.lower()}] in {path} must be a table")
    return {**shared, **own}


def redacted(config: Any) -> dict[str, Any]:
    """The settings of a config dataclass as a dict, secrets shown as ***."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in SECRET_FIELDS and value:
            value = "***"
        elif f.name.endswith("url") and isinstance(value, str):
            value = re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", value)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def config_file_help(section: str) -> dict[str, str]:
    """argparse help of a command's `--config FILE` flag."""
    return {
        "help": f"TOML settings: shared top-level keys and a [{section}] table (flags and "
        "environment variables win)"
    }


def setting_flags(
    cls: type, section: str, table: list[tuple[str, ...]], env_names: dict[str, str] | None = None
) -> list[tuple[str, str, Any, str]]:
    """(flag, field, type, help) for each `(field, help[, flag])`: name, type and default from
    the field, help ending with its default and variable; flags default to None ("not given")."""
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = []
    for field, help_text, *flag in table:
        var = (env_names or {}).get(field) or env_name(section, field)
        default = defaults[field]
        shown = "none" if default is None else str(default).lower()  # True -> true
        kind = _flag_type(hints[field], var)
        flag_name = flag[0] if flag else "--" + field.replace("_", "-")
        out.append((flag_name, field, kind, f"{help_text} (default {shown}; {var})"))
    return out


def _flag_type(annotation: Any, name: str) -> Any:
    """The argparse `type` for a field's annotation (Optional unwrapped, bools parsed)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    inner = args[0] if args else annotation
    if inner is bool:

        def parse_bool(raw: str) -> bool:
            return _convert(raw, bool, name)

        parse_bool.__name__ = "bool"  # argparse names the type in its error: "invalid bool value"
        return parse_bool
    return inner if inner in (int, float) else str
