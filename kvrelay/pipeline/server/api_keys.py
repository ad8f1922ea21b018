"""API keys and what each one is allowed: its tenant, fair-share weight, priorities and quotas.

Keys come from `--api-key` (repeatable; each its own tenant, defaults for everything else) and
from a keys file (`--api-keys-file`, TOML), one `[[key]]` table per key:

    [[key]]
    name = "alice"              # label in usage, metrics and logs (unique)
    key = "sk-alice-..."        # or key_env = "ALICE_KEY" (read from the environment)
    tenant = "acme"             # fair shares and usage are per tenant (default: the name)
    weight = 2.0                # tenant's share against other tenants' (default 1)
    priority = 5                # a request's priority when it gives none (default 0)
    priority_range = [0, 10]    # the values it may ask for (lower first; default: any)
    rpm = 600                   # requests per minute (0: no limit)
    tpm = 100000                # tokens per minute: prompt + max_tokens asked (0: no limit)
    max_concurrent = 16         # requests open at once (0: no limit)

A tenant's weight is the largest of its keys'. Without any key there is no authentication and
every request belongs to one anonymous tenant ("").
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.core.config import ConfigError
from kvrelay.core.messages import PRIORITY_BOUND

MAX_WEIGHT = 1e6
_FIELDS = {
    "name",
    "key",
    "key_env",
    "tenant",
    "weight",
    "priority",
    "priority_range",
    "rpm",
    "tpm",
    "max_concurrent",
}


def key_id_of(key: str) -> str:
    """The short id a request records of the key that submitted it (never the key itself)."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """One API key's identity and limits."""

    name: str
    key: str = field(repr=False)
    tenant: str
    weight: float = 1.0
    priority: int = 0
    min_priority: int = -PRIORITY_BOUND
    max_priority: int = PRIORITY_BOUND
    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0

    @property
    def key_id(self) -> str:
        return key_id_of(self.key) if self.key else ""

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)


ANONYMOUS = KeyPolicy(name="", key="", tenant="")


def _int(table: dict[str, Any], name: str, where: str, low: int, high: int, default: int) -> int:
    value = table.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{where}: {name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _policy(table: Any, index: int, environ: dict[str, str]) -> KeyPolicy:
    where = f"keys file: key #{index + 1}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: name must be a non-empty string")
    where = f"keys file: key {name!r}"
    if ("key" in table) == ("key_env" in table):
        raise ConfigError(f"{where}: give exactly one of key and key_env")
    if "key_env" in table:
        env = table["key_env"]
        key = environ.get(env, "") if isinstance(env, str) else ""
        if not key:
            raise ConfigError(f"{where}: environment variable {env!r} is not set")
    else:
        key = table["key"]
    if not isinstance(key, str) or not key.strip() or key != key.strip():
        raise ConfigError(f"{where}: key must be a non-empty string without spaces at its ends")
    tenant = table.get("tenant", name)
    if not isinstance(tenant, str) or not tenant.strip():
        raise ConfigError(f"{where}: tenant must be a non-empty string")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ConfigError(f"{where}: weight must be a number")
    if not 0 < weight <= MAX_WEIGHT:
        raise ConfigError(f"{where}: weight must be > 0 and <= {MAX_WEIGHT:g}")
    low, high = -PRIORITY_BOUND, PRIORITY_BOUND
    if "priority_range" in table:
        bounds = table["priority_range"]
        if (
            not isinstance(bounds, list)
            or len(bounds) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
            or not -PRIORITY_BOUND <= bounds[0] <= bounds[1] <= PRIORITY_BOUND
        ):
            raise ConfigError(f"{where}: priority_range must be [low, high] integers, low <= high")
        low, high = bounds
    priority = _int(table, "priority", where, low, high, min(max(0, low), high))
    return KeyPolicy(
        name=name,
        key=key,
        tenant=tenant,
        weight=float(weight),
        priority=priority,
        min_priority=low,
        max_priority=high,
        rpm=_int(table, "rpm", where, 0, 1 << 40, 0),
        tpm=_int(table, "tpm", where, 0, 1 << 50, 0),
        max_concurrent=_int(table, "max_concurrent", where, 0, 1 << 30, 0),
    )


def read_keys_file(path: str, environ: dict[str, str] | None = None) -> tuple[KeyPolicy, ...]:
    """The policies of a keys file (ConfigError naming what is wrong)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"keys file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"keys file {path}: not TOML: {exc}") from None
    unknown = sorted(set(data) - {"key"})
    if unknown:
        raise ConfigError(f"keys file {path}: unknown table(s) {', '.join(unknown)}")
    tables = data.get("key", [])
    if not isinstance(tables, list):
        raise ConfigError(f"keys file {path}: write each key as a [[key]] table")
    env = os.environ if environ is None else environ
    return tuple(_policy(t, i, dict(env)) for i, t in enumerate(tables))


class ApiKeys:
    """The keys an ingress accepts, each with its policy."""

    def __init__(self, keys: tuple[str, ...] = (), policies: tuple[KeyPolicy, ...] = ()):
        plain = tuple(
            KeyPolicy(name=f"key-{key_id_of(k)[:8]}", key=k, tenant=key_id_of(k)) for k in keys
        )
        self.policies = plain + policies
        seen_keys: set[str] = set()
        seen_names: set[str] = set()
        for p in self.policies:
            if p.key in seen_keys:
                raise ConfigError(f"API key of {p.name!r} is given twice")
            if p.name in seen_names:
                raise ConfigError(f"two API keys are named {p.name!r}")
            seen_keys.add(p.key)
            seen_names.add(p.name)
        weights: dict[str, float] = {}
        for p in self.policies:
            weights[p.tenant] = max(weights.get(p.tenant, 0.0), p.weight)
        self.tenant_weights = weights
        self._encoded = [(p.key.encode(), p) for p in self.policies]

    @classmethod
    def load(cls, keys: tuple[str, ...], keys_file: str | None) -> ApiKeys:
        return cls(keys, read_keys_file(keys_file) if keys_file else ())

    @property
    def required(self) -> bool:
        return bool(self.policies)

    def match(self, presented: str) -> KeyPolicy | None:
        """The policy of `presented`; every key is compared (the time taken does not reveal
        which prefix matched)."""
        token = presented.encode()
        found = None
        for key, policy in self._encoded:
            if secrets.compare_digest(token, key):
                found = policy
        return found

    def weight(self, policy: KeyPolicy) -> float:
        return self.tenant_weights.get(policy.tenant, policy.weight)
