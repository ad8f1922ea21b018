"""Conditional disaggregation: send a request to stream:prefill or straight to stream:decode.

A prompt whose uncached tail is short costs a decode worker little to compute itself, while a
hand-off through a prefill worker costs a stream hop and a page transfer; so in `auto` mode
prompts with at most `threshold` uncached tokens (cached = leading pages found in the Redis
page directory) skip the prefill stage, and so does everything when no prefill worker is alive.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.core.enums import Stage
from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import page_keys
from kvrelay.pipeline.model_registry import ModelEntry
from kvrelay.pipeline.queue.cluster import ClusterState
from kvrelay.pipeline.queue.redis_options import AsyncRedis

logger = logging.getLogger(__name__)

PREFILL, DECODE = Stage.PREFILL, Stage.DECODE


class RouteMode(enum.StrEnum):
    """How the ingress picks a request's first stream (`--mode`)."""

    AUTO = "auto"  # decode for short or cached prompts (or no prefill worker), else prefill
    DISAGGREGATED = "disaggregated"  # always prefill first
    COLOCATED = "colocated"  # always decode (decode workers compute the prompt too)


@dataclass(slots=True)
class Route:
    """Where a request goes and how much of its prompt was found cached when routing."""

    stage: Stage
    cached_pages: int = 0
    cached_tokens: int = 0
    reason: str = ""


ROUTE_THRESHOLD = 64  # auto: at most this many uncached prompt tokens -> decode


class Router:
    """Decides the first stream of each request (mode: auto | disaggregated | colocated)."""

    def __init__(
        self,
        redis: AsyncRedis,
        keys: Keys,
        mode: RouteMode | str = RouteMode.AUTO,
        threshold: int = ROUTE_THRESHOLD,
        cluster: ClusterState | None = None,
    ):
        self.redis, self.keys = redis, keys
        self.mode, self.threshold, self.cluster = mode, threshold, cluster

    async def cached_pages(self, model: ModelEntry, prompt_ids: Sequence[int], salt: str) -> int:
        """Leading full pages of the prompt that the page directory knows."""
        if not model.fingerprint or len(prompt_ids) < model.page_size:
            return 0
        # The engine always computes the last prompt token, so a page ending on it never helps.
        keys = page_keys(prompt_ids[:-1], model.page_size, model.fingerprint, salt)
        if not keys:
            return 0
        hexes = [key.hex() for key in keys]
        known = [False] * len(hexes)
        for pages, positions in self.keys.page_groups(hexes).items():
            found = await self.redis.hmget(pages, [hexes[i] for i in positions])
            for i, value in zip(positions, found, strict=True):
                known[i] = bool(value)
        hits = 0
        while hits < len(known) and known[hits]:
            hits += 1
        return hits

    async def route(self, model: ModelEntry, prompt_ids: Sequence[int], salt: str = "") -> Route:
        if self.mode == RouteMode.COLOCATED:
            return Route(DECODE, reason="colocated")
        if self.mode == RouteMode.DISAGGREGATED:
            return Route(PREFILL, reason="disaggregated")
        if len(prompt_ids) <= self.threshold:
            return Route(DECODE, reason="short prompt")
        if self.cluster is not None:
            # Decode workers compute any prompt themselves: with no live prefill worker a long
            # prompt goes to them, also while no worker at all is live (starting, restarting);
            # on stream:prefill it would wait for a prefill worker that may never come.
            roles = await self.cluster.roles(model.worker_model)
            if not roles.get(PREFILL, 0):
                return Route(DECODE, reason="no prefill worker")
        pages = await self.cached_pages(model, prompt_ids, salt)
        cached = pages * model.page_size
        if len(prompt_ids) - cached <= self.threshold:
            return Route(DECODE, pages, cached, reason="cached prefix")
        return Route(PREFILL, pages, cached, reason="long uncached prompt")
