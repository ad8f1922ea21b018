"""One pipeline shard as a worker serves it: its own `Streams` (consumer, fence, control list,
lease), reader thread, emitter thread and heartbeat, feeding the worker's one compute loop.

A Redis Cluster cannot read the streams of several slots in one call nor run a script across
them, so everything a worker does on a shard stays on that shard: a thread per shard blocks on
its XREADGROUP, each engine step makes one step call per shard, and a fenced consumer on one
shard drops only what the worker holds there and rejoins that shard as a new consumer.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol, cast

import redis

from kvrelay.core.enums import Stage
from kvrelay.core.keys import Keys
from kvrelay.core.messages import DecodeTask, PrefillTask
from kvrelay.core.worker_record import WorkerRecord
from kvrelay.pipeline.queue.streams import Streams
from kvrelay.workers.config import WorkerConfig
from kvrelay.workers.emitter import Emitter, Heartbeat, Inflight
from kvrelay.workers.engine_api import EngineAPI
from kvrelay.workers.metrics import WorkerMetrics
from kvrelay.workers.publication import ModelPublication
from kvrelay.workers.reader import Admission, read_loop

logger = logging.getLogger(__name__)


class LaneHost(Protocol):
    """What a lane uses of its worker (`workers.base.Worker`)."""

    config: WorkerConfig
    keys: Keys  # every shard's (`Keys.at`)
    r: redis.Redis | redis.RedisCluster
    name: str
    engine: EngineAPI
    metrics: WorkerMetrics
    admissions: queue.Queue[Admission]  # to the compute loop
    cancels: queue.Queue[str]
    stop_event: threading.Event

    @property
    def role(self) -> Stage: ...

    @property
    def message(self) -> type[PrefillTask] | type[DecodeTask]: ...

    def new_consumer(self) -> str: ...

    def held(self) -> int: ...  # entries held on every shard

    def stats(self, record: WorkerRecord) -> WorkerRecord: ...  # the heartbeat's load


class ShardLane:
    """A worker's IO on one shard (a `ReaderHost` for its reader thread)."""

    def __init__(
        self,
        worker: LaneHost,
        shard: int,
        consumer: str,
        info: WorkerRecord,
        publication: ModelPublication | None,
    ):
        self.worker, self.shard = worker, shard
        config = worker.config
        self.keys: Keys = worker.keys.at(shard)
        # A RedisCluster serves the same commands; Streams is typed for a plain client.
        self.streams = Streams(
            cast(redis.Redis, worker.r),
            self.keys,
            consumer,
            out_ttl_s=config.out_ttl_s,
            req_ttl_s=config.req_ttl_s,
        )
        self.inflight = Inflight()
        # the consumers of earlier processes of this worker's name, known gone: claimed at
        # once, not after a lease (`workers.slot.dead_predecessors`, set by `Worker.start`)
        self.dead: list[str] = []
        self.emitter = Emitter(
            self.streams,
            self.stream,
            self.group,
            self.inflight,
            next_stream=self.keys.decode_stream,
            cancels=worker.cancels,
            check_s=config.cancel_poll_s,
            interval_s=config.stream_interval_ms / 1000,
            on_fenced=self.rejoin,
        )
        self.heartbeat = Heartbeat(
            self.streams,
            worker.name,
            worker.role,
            self.stream,
            self.group,
            self.inflight,
            config.heartbeat_s,
            config.heartbeat_ttl_s,
            info,
            publication,  # the models hash is every shard's: one lane publishes it
            stats=worker.stats,
            on_fenced=self.rejoin,
            on_new_server=self.emitter.request_repair,
        )
        self.reader = threading.Thread(
            target=read_loop, args=(self,), name=f"reader-{shard}", daemon=True
        )

    # what the reader thread uses (workers.reader.ReaderHost) ----------------------------------
    @property
    def config(self) -> WorkerConfig:
        return self.worker.config

    @property
    def role(self) -> Stage:
        return self.worker.role

    @property
    def message(self) -> type[PrefillTask] | type[DecodeTask]:
        return self.worker.message

    @property
    def name(self) -> str:
        return self.worker.name

    @property
    def stream(self) -> str:
        return self.keys.prefill_stream if self.role == Stage.PREFILL else self.keys.decode_stream

    @property
    def group(self) -> str:
        return self.worker.role

    @property
    def r(self) -> redis.Redis | redis.RedisCluster:
        return self.worker.r

    @property
    def engine(self) -> EngineAPI:
        return self.worker.engine

    @property
    def metrics(self) -> WorkerMetrics:
        return self.worker.metrics

    @property
    def admissions(self) -> queue.Queue[Admission]:
        return self.worker.admissions

    @property
    def stop_event(self) -> threading.Event:
        return self.worker.stop_event

    def room(self) -> int:
        """Sequences the worker may still take, on every shard together."""
        return self.config.engine.max_num_seqs - self.worker.held()

    # ---------------------------------------------------------------------------------------
    @property
    def consumer(self) -> str:
        return self.streams.consumer

    def ensure_groups(self) -> None:
        for stream, group in (
            (self.keys.prefill_stream, Stage.PREFILL),
            (self.keys.decode_stream, Stage.DECODE),
        ):
            self.streams.ensure_group(stream, group)

    def rejoin(self, fenced: str) -> None:
        """`fenced` (this shard's consumer) was fenced: come back on this shard as a new
        consumer holding nothing here (IO threads). The compute loop drops the requests of the
        shard's old generation; the other shards are not touched."""
        with self.streams.lock:  # no read or admission under the old name straddles this
            if self.streams.consumer != fenced:
                return  # rejoined already
            # emptied before the name changes: a step under the new name carries nothing of
            # the old one's (one under the old name is refused: it is fenced)
            held = self.inflight.clear()
            self.emitter.drop_all()
            consumer = self.worker.new_consumer()
            if consumer == fenced:
                consumer += ".1"
            self.streams.rejoin(fenced, consumer)
        logger.warning(
            "%s worker %s: consumer %s was fenced on shard %d; %d requests dropped, rejoined as %s",
            self.role,
            self.name,
            fenced,
            self.shard,
            len(held),
            consumer,
        )
        try:
            self.heartbeat.beat()  # registers the new consumer before its first step
        except redis.RedisError as exc:
            logger.warning("heartbeat after rejoining failed: %s", exc)
