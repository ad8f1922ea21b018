"""Usage accounting: the tokens and requests counted per API key, tenant and model.

The step script that ends a request (`lua/step.lua`, mode 'd', through the `lua/usage.lua`
prelude) counts it, in the same fenced call that writes its end: a refused (fenced) or repeated
step counts nothing, so a resumed, retried or migrated request counts once. Per shard, one
hash per hour (`Keys.usage(start)`, expiring `USAGE_TTL_S` after its last count) and one that
never expires (`Keys.usage_total`, what the ingress's /metrics exports). A hash field is
`<metric> <account>`: a `UsageField` and the request's account, the JSON array [API key name,
tenant, model asked] the ingress writes into its record (`record.ACCOUNT`).
docs/operations.md "Usage accounting".
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PERIOD_S = 3600  # one hash per hour
USAGE_TTL_S = 90 * 86400  # an hour's hash expires this long after its last count


class UsageField(enum.StrEnum):
    """What a usage hash counts (the metric part of its fields). A request that a worker ended
    as failed (its deadline passed, an engine error: its client got no usage) is counted under
    the `failed_` ones instead."""

    REQUESTS = "requests"
    PROMPT_TOKENS = "prompt_tokens"
    CACHED_TOKENS = "cached_tokens"
    COMPLETION_TOKENS = "completion_tokens"
    FAILED_REQUESTS = "failed_requests"
    FAILED_PROMPT_TOKENS = "failed_prompt_tokens"
    FAILED_CACHED_TOKENS = "failed_cached_tokens"
    FAILED_COMPLETION_TOKENS = "failed_completion_tokens"


class Dimension(enum.StrEnum):
    """What usage can be grouped by (`kvrelay usage --by`)."""

    KEY = "key"
    TENANT = "tenant"
    MODEL = "model"


def account(key: str, tenant: str, model: str) -> str:
    """A request's account, as its record holds it: JSON [key name, tenant, model]."""
    return json.dumps([key, tenant, model], separators=(",", ":"), ensure_ascii=False)


def parse_account(text: str) -> tuple[str, str, str] | None:
    """(key, tenant, model) of an account; None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, str) for v in value):
        return None
    return value[0], value[1], value[2]


def period_start(at: float) -> int:
    """The start (unix seconds) of the hour `at` falls in: the usage hash that counts it."""
    return int(at) - int(at) % PERIOD_S


@dataclass(slots=True)
class Usage:
    """The counts of one account (key, tenant, model), or of a group of accounts."""

    key: str = ""
    tenant: str = ""
    model: str = ""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UsageField, 0))

    def get(self, name: UsageField) -> int:
        return self.counts.get(name, 0)

    def add(self, other: Usage) -> None:
        for name, value in other.counts.items():
            self.counts[name] = self.counts.get(name, 0) + value

    def public(self) -> dict[str, Any]:
        """A JSON object: key, tenant, model, then every count."""
        out: dict[str, Any] = {"key": self.key, "tenant": self.tenant, "model": self.model}
        out.update({str(name): self.get(name) for name in UsageField})
        return out


def parse_hash(raw: Mapping[Any, Any]) -> dict[tuple[str, str, str], Usage]:
    """An HGETALL of a usage hash as account -> Usage; fields that do not parse are left out."""
    out: dict[tuple[str, str, str], Usage] = {}
    for name, value in raw.items():
        text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        metric, _, rest = text.partition(" ")
        dims = parse_account(rest)
        if dims is None or metric not in UsageField._value2member_map_:
            continue
        try:
            count = int(value)
        except ValueError:
            continue
        usage = out.setdefault(dims, Usage(*dims))
        usage.counts[metric] = usage.counts.get(metric, 0) + count
    return out


def merge(
    parts: Iterable[Mapping[tuple[str, str, str], Usage]],
) -> dict[tuple[str, str, str], Usage]:
    """Several hashes' counts (shards, hours) summed per account."""
    out: dict[tuple[str, str, str], Usage] = {}
    for part in parts:
        for dims, usage in part.items():
            out.setdefault(dims, Usage(*dims)).add(usage)
    return out


def group(usages: Iterable[Usage], by: Iterable[Dimension]) -> list[Usage]:
    """The counts summed per value of the `by` dimensions (the others ""), sorted by them."""
    names = set(by)
    out: dict[tuple[str, str, str], Usage] = {}
    for u in usages:
        dims = (
            u.key if Dimension.KEY in names else "",
            u.tenant if Dimension.TENANT in names else "",
            u.model if Dimension.MODEL in names else "",
        )
        out.setdefault(dims, Usage(*dims)).add(u)
    return [out[dims] for dims in sorted(out)]
