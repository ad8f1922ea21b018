"""What the endpoint and reply modules need of the ingress: narrow Protocols that `Ingress`
(app.py) satisfies structurally.

The handlers (routes.py, responses_routes.py, info.py, tokenization.py) and the replies
(output.py, choices_output.py, response_output.py) hold the Ingress, yet annotate it with these
Protocols, so none of them imports app.py, which imports them: no import cycle, not even one
hidden behind TYPE_CHECKING. Each Protocol lists exactly what its modules use; mypy checks
`Ingress` against them where app.py passes `self`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvrelay.core.keys import Keys
from kvrelay.pipeline.metrics import Metrics
from kvrelay.pipeline.model_registry import ModelEntry, ModelRegistry
from kvrelay.pipeline.queue.backpressure import Backpressure
from kvrelay.pipeline.queue.cluster import ClusterState
from kvrelay.pipeline.queue.feed import OutputFeed, OutputFeeds
from kvrelay.pipeline.queue.quota import Quotas
from kvrelay.pipeline.queue.redis_options import AsyncRedis
from kvrelay.pipeline.queue.submit import Producer
from kvrelay.pipeline.server.config import IngressConfig


class ModelHost(Protocol):
    """The configuration and the served models (tokenization.py)."""

    @property
    def config(self) -> IngressConfig: ...

    @property
    def registry(self) -> ModelRegistry: ...


class RecordHost(Protocol):
    """Redis and its keys: the request records (attach.py, choices.py)."""

    @property
    def redis(self) -> AsyncRedis: ...

    @property
    def keys(self) -> Keys: ...


class InfoHost(ModelHost, Protocol):
    """What the informational endpoints read (info.py): Redis, the cluster, the metrics."""

    @property
    def redis(self) -> AsyncRedis: ...

    @property
    def keys(self) -> Keys: ...  # the usage counters /metrics exports (usage_metrics.py)

    @property
    def cluster(self) -> ClusterState: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def started(self) -> int: ...


class OutputHost(Protocol):
    """What a reply needs (output.py's Delivery and its jobs): the output feed, the queue time
    metric and the cancel paths."""

    @property
    def feed(self) -> OutputFeed | OutputFeeds: ...

    def observe_queue_time(self, request_id: str, model: str) -> None: ...

    async def try_cancel(self, request_id: str) -> None: ...

    async def client_gone(
        self, request_id: str, attach_seq: int = 0, on_cancel: Callable[[], None] | None = None
    ) -> None: ...


class RequestHost(ModelHost, RecordHost, OutputHost, Protocol):
    """What the generation endpoints use (routes.py, responses_routes.py, attach.py,
    choices.py): admission, submission, the request records and attaching to them."""

    @property
    def cluster(self) -> ClusterState: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def producer(self) -> Producer: ...

    @property
    def backpressure(self) -> Backpressure: ...

    @property
    def quotas(self) -> Quotas: ...

    def token_text(self, entry: ModelEntry) -> Callable[[int], str]: ...

    async def cancel(self, request_id: str) -> None: ...

    async def reattached(self, request_id: str) -> int: ...
