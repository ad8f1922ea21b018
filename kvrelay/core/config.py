"""Settings for the per-component frozen config dataclasses, read one way for every command.

Precedence: override (CLI flag) > `KVRELAY_<SECTION>_<FIELD>` > a fallback variable of it > a
deprecated spelling of it > the shared `KVRELAY_<FIELD>` (redis_url, key_prefix, api_keys) > the
config file > the default.

Every `KVRELAY_*` variable is read here (`from_env`, `setting`), never with `os.environ` beside
it (tests/core/test_env_reads.py): each component's settings start with the one Redis section
(`RedisSettings`), and the process-wide ones are `CacheSettings` here and the kernels'
`KernelSettings` (kernels/cpu_build.py). A `nested` field holds another settings dataclass
(the worker's `engine: EngineConfig`) whose settings are spelled as the parent's own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from kvrelay.core.errors import KvrelayError
from kvrelay.core.sentinel_url import is_sentinel_url, sentinel_url_problem

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVRELAY_"
# Fields that mean the same to every component, each with one shared variable.
SHARED_ENV = {
    "redis_url": "KVRELAY_REDIS_URL",
    "key_prefix": "KVRELAY_KEY_PREFIX",
    "api_keys": "KVRELAY_API_KEYS",
    "shards": "KVRELAY_SHARDS",
}
# Settings printed as *** by `kvrelay config show`.
SECRET_FIELDS = frozenset({"secret", "api_keys"})
# Settings holding JSON text: a config file may give a table, kept as its JSON text.
JSON_TEXT_FIELDS = frozenset({"override_generation_config"})
REDIS_SCHEMES = ("redis", "rediss", "unix")
# The defaults every component shares, stated once (tests/core/test_env_reads.py).
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_KEY_PREFIX = "kvrelay:"
DEFAULT_CACHE_DIR = "~/.cache/kvrelay"
_warned: set[str] = set()
_UNSET: Any = object()
NESTED = "kvrelay_nested"  # field metadata key of a nested section (`nested`)


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """The Redis section every component's settings start with (`WorkerConfig`,
    `IngressConfig` inherit it; `StoreConfig` has its own optional URL): the server and the key
    prefix, `KVRELAY_<SECTION>_<FIELD>` else the shared `KVRELAY_REDIS_URL`/`KVRELAY_KEY_PREFIX`.
    The server's cluster mode is probed, not configured (`kvrelay.core.redis_client`)."""

    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_KEY_PREFIX
    # pipeline shards (`kvrelay.core.keys`): the same number for every process of a stack
    shards: int = 1


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """Process-wide: `KVRELAY_CACHE_DIR` holds prepared models, built kernels and model files."""

    cache_dir: str = DEFAULT_CACHE_DIR

    @property
    def path(self) -> Path:
        return Path(self.cache_dir or DEFAULT_CACHE_DIR).expanduser()  # empty: the default


def cache_root() -> Path:
    """`$KVRELAY_CACHE_DIR`, default `~/.cache/kvrelay`."""
    return from_env(CacheSettings).path


class ConfigError(KvrelayError, ValueError):
    """A configuration value (flag, environment variable or config file) is invalid."""


MAX_SHARDS = 16  # as kvrelay.core.keys.MAX_SHARDS (keys imports this module)


def check_shards(shards: int) -> int:
    """`shards` when it is a pipeline shard count (1-16), else ConfigError."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ConfigError(f"shards must be 1-{MAX_SHARDS}, got {shards}")
    return shards


class FileValues(dict):
    """The settings of a config file (`read_config_file`), knowing the file they came from."""

    def __init__(self, values: dict[str, Any], path: str):
        super().__init__(values)
        self.path = path


def redact_url(url: str) -> str:
    """The URL without its password."""
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)


def redis_url_problem(url: str) -> str | None:
    """What makes `url` unusable as a Redis URL, or None: a scheme redis-py knows (redis,
    rediss, unix), a port of 1-65535 and a database number (path `/N` or `?db=N`); or a
    `redis+sentinel://` URL (`core.sentinel_url`)."""
    if is_sentinel_url(url):
        return sentinel_url_problem(url)
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES or not url.startswith(parts.scheme + "://"):
        return (
            "not a Redis URL (redis://[:PASSWORD@]HOST[:PORT][/DB], rediss://... or unix:///PATH)"
        )
    db = parse_qs(parts.query).get("db", [None])[-1]
    if parts.scheme == "unix":
        if not parts.path:
            return "a unix:// URL needs a socket path (unix:///run/valkey.sock)"
    else:
        try:
            port = parts.port
        except ValueError:  # not a number, or past 65535
            port = -1
        if port is not None and not 1 <= port <= 65535:
            return f"the port must be 1-65535, got {parts.netloc.rpartition(':')[2]!r}"
        if db is None and parts.path.strip("/"):
            db = parts.path.strip("/")
    if db is not None and not db.isdigit():
        return f"the database must be a number, got {db!r}"
    return None


def check_redis_url(url: str, source: str) -> str:
    """`url` if redis-py can use it; else ConfigError naming `source` (flag, variable, file)."""
    problem = redis_url_problem(url)
    if problem is not None:
        raise ConfigError(f"invalid Redis URL {redact_url(url)!r} for {source}: {problem}")
    return url


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
    environ: Mapping[str, str] | None = None,
    *,
    file_values: dict[str, Any] | None = None,
    deprecated: tuple[str, ...] = (),
    env_names: dict[str, str] | None = None,
    fallbacks: dict[str, str] | None = None,
    **overrides,
) -> T:
    """Build config `cls` from defaults, a config file, `KVRELAY_*` variables, then overrides.

    Overrides whose value is None are ignored so CLI flags can default to None ("not given").
    `deprecated` lists old sections whose `KVRELAY_<OLD>_<FIELD>` still work, with one warning;
    `env_names` renames a field's variable (field -> full name); `fallbacks` names another
    component's variable a field takes when its own is not set (field -> full name).
    Settings are spelled as `settings_of(cls)` lists them (a nested section's flat); an
    override may also give a nested section whole (`engine=EngineConfig(...)`), the other
    sources' values then replacing its fields.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    table = settings_of(cls)
    values: dict[str, Any] = {}  # setting (flat name) -> value
    whole: dict[str, Any] = {}  # a nested section given whole as an override
    sources: dict[str, str] = {}  # setting -> where its value came from, for error messages
    path = getattr(file_values, "path", "")
    in_file = f" {path}" if path else ""
    for key, value in (file_values or {}).items():
        if key not in table:
            raise ConfigError(
                f"unknown setting {key!r} in the config file{in_file} for {cls.__name__}"
            )
        sources[key] = f"{key} in {path or 'the config file'}"
        values[key] = _file_value(value, table[key].annotation, key, sources[key])
    for name, s in table.items():
        raw_name = _variable(env, section, name, deprecated, env_names, fallbacks)
        if raw_name is not None:
            values[name] = _convert(env[raw_name], s.annotation, raw_name)
            sources[name] = raw_name
    nested = {f.name for f in dataclasses.fields(cls) if NESTED in f.metadata}
    for key, value in overrides.items():
        if value is not None:
            if key in nested:
                whole[key] = value
                continue
            if key not in table:
                raise ConfigError(f"unknown setting {key!r} for {cls.__name__}")
            values[key] = value
            sources[key] = "--" + key.replace("_", "-")
    if isinstance(values.get("redis_url"), str):
        check_redis_url(values["redis_url"], sources["redis_url"])
    return _build(cls, table, values, whole)


def _build(cls: type[T], table: dict[str, Setting], values: dict[str, Any], whole: dict) -> T:
    """`cls` from setting values, each nested section from its default (or the one given
    whole) with its settings replaced."""
    own: dict[str, Any] = {}
    inner: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        s = table[name]
        if s.section is None:
            own[s.field] = value
        else:
            inner.setdefault(s.section, {})[s.field] = value
    for f in dataclasses.fields(cls):
        if NESTED in f.metadata and (f.name in whole or f.name in inner):
            base = whole.get(f.name) or _nested_default(f)
            own[f.name] = dataclasses.replace(base, **inner.get(f.name, {}))
    return cls(**own)


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of a settings dataclass, as variables, flags and config files spell it."""

    name: str  # the spelling: KVRELAY_<SECTION>_<NAME>, --name, `name = ` in a config file
    field: str  # the dataclass field holding it
    section: str | None  # the nested section's field holding `field`; None: the class's own
    annotation: Any
    default: Any


def nested(factory: Callable[[], Any], names: dict[str, str] | None = None) -> Any:
    """A field holding another settings dataclass (a worker's `engine: EngineConfig`): its
    settings are spelled as the parent's own (variables, flags, config file keys, `kvrelay
    config show`), `names` renaming some (its field -> the parent's spelling); the default is
    `factory()`."""
    return dataclasses.field(default_factory=factory, metadata={NESTED: dict(names or {})})


def _nested_default(f: dataclasses.Field) -> Any:
    """The default of a `nested` field (its factory's value)."""
    return typing.cast(Callable[[], Any], f.default_factory)()


def settings_of(cls: type) -> dict[str, Setting]:
    """The settings of `cls` by spelling, in field order, nested sections' spliced in."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Setting] = {}
    for f in dataclasses.fields(cls):
        if NESTED in f.metadata:
            inner = _nested_default(f)
            inner_hints = typing.get_type_hints(type(inner))
            for g in dataclasses.fields(inner):
                name = f.metadata[NESTED].get(g.name, g.name)
                default = getattr(inner, g.name)
                out[name] = Setting(name, g.name, f.name, inner_hints[g.name], default)
        else:
            default = None if f.default is dataclasses.MISSING else f.default
            out[f.name] = Setting(f.name, f.name, None, hints[f.name], default)
    return out


def setting_values(config: Any) -> dict[str, Any]:
    """The settings of a settings dataclass instance by spelling (nested sections flat)."""
    out = {}
    for name, s in settings_of(type(config)).items():
        holder = config if s.section is None else getattr(config, s.section)
        out[name] = getattr(holder, s.field)
    return out


def setting(
    cls: type[DataclassInstance],
    field: str,
    section: str = "",
    environ: Mapping[str, str] | None = None,
    *,
    default: Any = _UNSET,
    **options: Any,
) -> Any:
    """One setting of `cls` as `from_env` reads it (its variable, a fallback, a deprecated or
    the shared spelling), without reading or checking the others; unset: `default` if given,
    else the field's default. `options`: from_env's `deprecated`, `env_names`, `fallbacks`."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    s = settings_of(cls)[field]
    raw_name = _variable(
        env,
        section,
        field,
        options.get("deprecated", ()),
        options.get("env_names"),
        options.get("fallbacks"),
    )
    if raw_name is not None:
        return _convert(env[raw_name], s.annotation, raw_name)
    return s.default if default is _UNSET else default


def _variable(
    env: Mapping[str, str],
    section: str,
    field: str,
    deprecated: tuple[str, ...],
    env_names: dict[str, str] | None,
    fallbacks: dict[str, str] | None,
) -> str | None:
    """The variable a field's value comes from, or None: its own, a fallback, a deprecated
    spelling, the shared one."""
    name = (env_names or {}).get(field) or env_name(section, field)
    old_names = [env_name(old, field) for old in deprecated]
    fallback = (fallbacks or {}).get(field)
    raw_name = _first_set(env, name, old_names, fallback)
    if raw_name is None and section and field in SHARED_ENV and SHARED_ENV[field] in env:
        raw_name = SHARED_ENV[field]
    return raw_name


def _first_set(
    env: Mapping[str, str], name: str, old_names: list[str], fallback: str | None = None
) -> str | None:
    """`name` if set, else `fallback` if set, else the first old spelling that is set (warning
    once per spelling)."""
    if name in env:
        return name
    if fallback is not None and fallback in env:
        return fallback
    for old in old_names:
        if old in env:
            if old not in _warned:
                _warned.add(old)
                logger.warning("%s is deprecated: use %s (same meaning)", old, name)
            return old
    return None


_EXPECTED = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _file_value(value: Any, annotation: Any, key: str, where: str) -> Any:
    """A TOML value for a field of type `annotation`, checked: TOML values have types, so a
    string where a number belongs is an error, not a spelling. An optional field takes "none";
    a JSON-text field a table (kept as JSON text). ConfigError names the key and the file."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kind = args[0] if optional else annotation
    if key in JSON_TEXT_FIELDS and isinstance(value, dict):
        return json.dumps(value, default=str)  # a TOML date: a string the parse names
    if optional and isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
        return None
    origin = typing.get_origin(kind)
    if origin in (tuple, list):
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value) if origin is tuple else list(value)
        expected = "a list of strings"
    elif kind is bool:
        if isinstance(value, bool):
            return value
        expected = _EXPECTED[bool]
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 2e9 bytes
            return int(value)
        expected = _EXPECTED[int]
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        expected = _EXPECTED[float]
    elif kind is str:
        if isinstance(value, str):
            return value
        expected = _EXPECTED[str]
    else:
        return value
    if optional:
        expected += ' or "none"'
    raise ConfigError(f"invalid value {_toml(value)} for {where}: want {expected}")


def _toml(value: Any) -> str:
    """A value as the config file wrote it (true, not True)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # dates and times
        return str(value)


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
    # a table is a component's section, unless it is the table form of a JSON-text setting
    shared = {k: v for k, v in data.items() if not isinstance(v, dict) or k in JSON_TEXT_FIELDS}
    own = data.get(section.lower(), {})
    if not isinstance(own, dict):
        raise ConfigError(f"--config: [{section.lower()}] in {path} must be a table")
    return FileValues({**shared, **own}, str(path))


def redacted(config: Any) -> dict[str, Any]:
    """The settings of a config dataclass as a dict (nested sections flat, as variables spell
    them), secrets shown as ***."""
    out = {}
    for name, value in setting_values(config).items():
        if name in SECRET_FIELDS and value:
            value = "***"
        elif name.endswith("url") and isinstance(value, str):
            value = redact_url(value)
        out[name] = list(value) if isinstance(value, tuple) else value
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
    """(flag, setting, type, help) for each `(setting, help[, flag])`: name, type and default
    from the setting (`settings_of`), help ending with its default and variable; flags default
    to None ("not given")."""
    settings = settings_of(cls)
    out = []
    for field, help_text, *flag in table:
        var = (env_names or {}).get(field) or env_name(section, field)
        default = settings[field].default
        shown = "none" if default is None else str(default).lower()  # True -> true
        kind = _flag_type(settings[field].annotation, var)
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
