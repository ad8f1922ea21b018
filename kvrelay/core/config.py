"""Environment overrides for the per-component frozen config dataclasses (read in one place)."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

from kvrelay.core.errors import KvrelayError

T = TypeVar("T")

ENV_PREFIX = "KVRELAY_"


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
    cls: type[T], section: str = "", environ: dict[str, str] | None = None, **overrides
) -> T:
    """Build config `cls` from defaults, then `KVRELAY_<SECTION>_<FIELD>` variables, then overrides.

    Overrides whose value is None are ignored so CLI flags can default to None ("not given").
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        name = env_name(section, f.name)
        if name in env:
            values[f.name] = _convert(env[name], hints[f.name], name)
    for key, value in overrides.items():
        if value is not None:
            if key not in hints:
                raise ConfigError(f"unknown setting {key!r} for {cls.__name__}")
            values[key] = value
    return cls(**values)
