"""The models a producer may send requests for, with their tokenizers and context limits.

Numbers published by workers in the Redis `models` hash win (their fingerprint depends on the
dtype they run in); until a worker publishes, the converted model directory supplies them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kvrelay.core.page_keys import DEFAULT_PAGE_SIZE
from kvrelay.pipeline.errors import RequestError, model_not_found
from kvrelay.pipeline.queue.cluster import ClusterState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelEntry:
    """What the producer needs to know about one served model."""

    name: str
    tokenizer: Any  # kvrelay.core.tokenizer.Tokenizer
    vocab_size: int
    max_model_len: int
    fingerprint: str | None  # None: cached pages cannot be looked up
    page_size: int = DEFAULT_PAGE_SIZE


@dataclass(slots=True)
class _Local:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    fingerprint: str | None


def _load_local(name: str) -> _Local:
    """Tokenizer and config numbers from the model's converted directory (torch-free)."""
    from kvrelay.core import modelref
    from kvrelay.core.tokenizer import Tokenizer

    try:
        ref = modelref.resolve_model(name)
    except modelref.ModelNotFoundError as exc:
        raise RequestError(str(exc), 404, param="model", code="model_not_found") from exc
    if not modelref.is_prepared(ref):
        raise RequestError(
            f"model {name!r} is not prepared yet: a worker converts it when it starts "
            "(or run `kvrelay generate` once)",
            503,
            type="service_unavailable",
            code="model_not_ready",
        )
    directory = modelref.converted_dir(ref)
    tokenizer = Tokenizer.from_dir(directory)
    cfg = modelref.read_config(directory)
    # Only a digest cached at conversion is used: hashing 500 MB of weights here would stall.
    digest = modelref.read_meta(directory).get("weights_digest")
    fingerprint = modelref.model_fingerprint(directory, "float32") if digest else None
    vocab = max(int(cfg.get("vocab_size", 0)), tokenizer.vocab_size)
    max_len = int(cfg.get("max_position_embeddings", 2048))
    return _Local(tokenizer, vocab, max_len, fingerprint)


class ModelRegistry:
    """Served model names -> ModelEntry, loading each tokenizer once."""

    def __init__(
        self,
        names: tuple[str, ...] | list[str],
        cluster: ClusterState | None = None,
        tokenizers: dict[str, Any] | None = None,
    ):
        self.names = list(names)
        self.cluster = cluster
        self._local: dict[str, _Local] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        for name, tok in (tokenizers or {}).items():
            self._local[name] = _Local(tok, tok.vocab_size, 0, None)

    async def served(self) -> list[str]:
        """Configured names plus any model a worker publishes."""
        published = list(await self.cluster.models()) if self.cluster else []
        return list(dict.fromkeys([*self.names, *published]))

    async def _published(self, name: str) -> dict[str, Any]:
        return (await self.cluster.models()).get(name, {}) if self.cluster else {}

    async def _local_for(self, name: str) -> _Local:
        local = self._local.get(name)
        if local is None:
            async with self._locks.setdefault(name, asyncio.Lock()):
                local = self._local.get(name)
                if local is None:
                    local = await asyncio.to_thread(_load_local, name)
                    self._local[name] = local
                    logger.info("loaded tokenizer for model %s", name)
        return local

    async def get(self, name: str) -> ModelEntry:
        """The entry for `name`; 404 for an unknown model, 503 while it is not prepared."""
        published = await self._published(name)
        if name not in self.names and not published:
            raise model_not_found(name, await self.served())
        local = await self._local_for(name)
        max_len = int(published.get("max_model_len") or local.max_model_len or 0)
        if max_len <= 0:
            max_len = 1 << 30  # an injected tokenizer without numbers: only flag limits apply
        return ModelEntry(
            name=name,
            tokenizer=local.tokenizer,
            vocab_size=int(published.get("vocab_size") or local.vocab_size),
            max_model_len=max_len,
            fingerprint=published.get("fingerprint") or local.fingerprint,
            page_size=int(published.get("page_size") or DEFAULT_PAGE_SIZE),
        )
