"""One `models` hash entry as a typed record: what a worker publishes about its model.

The hash maps a model name to this record's JSON (`encode`); workers write it each heartbeat
(`kvrelay.workers.publication`), the ingress and producer clients read it
(`kvrelay.pipeline.queue.cluster`, `kvrelay.pipeline.model_registry`). Every reader and writer
goes through `PublishedModel`: each field's name and type are declared once, here.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from kvrelay.core.sampling import GenerationDefaults, InvalidSamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublishedModel:
    """A typed `models` entry; a field that is absent or not of its type is None.

    `files` is the digest of the model's tokenizer files (the hash `model-files:{digest}`);
    `generation_defaults` the model's own defaults under the worker's override (None: none
    published, the files' own stand in); `published` the unix time of the last heartbeat
    that wrote it (None: a worker from before the stamp); `pipeline` the model pipeline whose
    streams its workers read (`kvrelay.core.keys`; None: the unnamed one); `aliases` the
    other names the model is served under (`--served-model-name`: requests naming one are the
    model's, answered under the entry's name); `loras` its LoRA adapters (`--lora-modules`,
    or loaded at run time): adapter name -> its identity in page keys
    (`core.page_keys.lora_fingerprint`); a request naming one is the model's with it.
    """

    fingerprint: str | None = None
    page_size: int | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    files: str | None = None
    generation_defaults: GenerationDefaults | None = None
    published: float | None = None
    pipeline: str | None = None
    aliases: tuple[str, ...] | None = None
    loras: dict[str, str] | None = None

    @classmethod
    def decode(cls, raw: str | bytes, name: str = "") -> PublishedModel | None:
        """From the entry's JSON; None when it is no JSON object. Never raises on a value: a
        malformed one is None (a bad `generation_defaults` is logged)."""
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        defaults = None
        if isinstance(raw_defaults := data.get("generation_defaults"), dict):
            try:
                defaults = GenerationDefaults.parse(raw_defaults, strict=False)
            except InvalidSamplingParams as exc:
                logger.warning("model %s: ignoring published defaults: %s", name or "?", exc)
        return cls(
            fingerprint=_text(data, "fingerprint"),
            page_size=_count(data, "page_size"),
            max_model_len=_count(data, "max_model_len"),
            vocab_size=_count(data, "vocab_size"),
            files=_text(data, "files"),
            generation_defaults=defaults,
            published=_time(data, "published"),
            pipeline=_text(data, "pipeline"),
            aliases=_names(data, "aliases"),
            loras=_text_map(data, "loras"),
        )

    def encode(self) -> str:
        """The entry's JSON: the fields that are set, in declaration order."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, GenerationDefaults):
                value = value.to_dict()
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return json.dumps(out)

    def stamped(self, now: float) -> PublishedModel:
        """This entry as a heartbeat at `now` writes it (milliseconds)."""
        return replace(self, published=round(now, 3))

    def stale(self, now: float, ttl_s: float) -> bool:
        """Stamped more than `ttl_s` before `now` (an unstamped entry never is)."""
        return self.published is not None and now - self.published > ttl_s


def _text(data: dict[str, Any], name: str) -> str | None:
    value = data.get(name)
    return value if isinstance(value, str) and value else None


def _names(data: dict[str, Any], name: str) -> tuple[str, ...] | None:
    value = data.get(name)
    if not isinstance(value, list):
        return None
    return tuple(v for v in value if isinstance(v, str) and v) or None


def _text_map(data: dict[str, Any], name: str) -> dict[str, str] | None:
    value = data.get(name)
    if not isinstance(value, dict):
        return None
    return {k: v for k, v in value.items() if isinstance(v, str) and k and v} or None


def _count(data: dict[str, Any], name: str) -> int | None:
    value = data.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _time(data: dict[str, Any], name: str) -> float | None:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


# the JSON keys (tests/core/test_state_literals.py: spelled only in this module)
FIELDS = frozenset(f.name for f in fields(PublishedModel))
