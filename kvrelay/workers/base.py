"""What prefill and decode workers share: a reader thread, a compute loop, an emitter thread.

A request's path through a worker:
  reader thread: XREADGROUP (or a claim of a dead consumer's entries) -> decode/validate
      (bad -> DLQ) -> admit (owner; after a claim, read the tokens already emitted) ->
      `admissions` queue
  compute loop: cancel/deadline check -> engine.add_request -> engine.step() ... ->
      each RequestOutput becomes an Outgoing write (token chunk, hand-off, final chunk)
  emitter thread: one step script per batch of writes, fenced per worker; cancels and feed
      changes come back with every step (the consumer's control list). A fenced step (this
      consumer went silent past a lease and its entries were claimed) makes the worker rejoin
      as a new consumer: every request it held is dropped (the claimants resume them).
The reader, emitter and heartbeat are per pipeline shard (`workers.lane.ShardLane`): a worker
serves every shard (or those of `serve_shards`) with one compute loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import redis

from kvrelay.core import record as rec
from kvrelay.core.enums import FinishReason, RequestStatus, Stage
from kvrelay.core.keys import Keys
from kvrelay.core.messages import DecodeTask, PrefillTask, Task, TokenChunk
from kvrelay.core.published_model import PublishedModel
from kvrelay.core.record import RequestRecord
from kvrelay.core.redis_client import sync_redis, worker_options
from kvrelay.core.worker_record import WorkerRecord
from kvrelay.pipeline.queue.output import DEADLINE_PASSED
from kvrelay.pipeline.queue.shard_count import check_shard_count_sync
from kvrelay.pipeline.queue.streams import Streams
from kvrelay.workers.config import WorkerConfig
from kvrelay.workers.emitter import Emitter, Heartbeat, Inflight, Outgoing, OutgoingKind
from kvrelay.workers.engine.config import RequestOutput
from kvrelay.workers.engine_api import EngineAPI
from kvrelay.workers.lane import ShardLane
from kvrelay.workers.lora_control import LoraControl, published_loras
from kvrelay.workers.metrics import WorkerMetrics
from kvrelay.workers.publication import ModelPublication
from kvrelay.workers.reader import Admission
from kvrelay.workers.slot import dead_predecessors

logger = logging.getLogger(__name__)


def process_age() -> float | None:
    """Seconds since this process started (the interpreter's start, imports included), from
    /proc; None where there is none."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat.rsplit(")", 1)[1].split()[19])  # starttime: clock ticks after boot
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return round(now - started / os.sysconf("SC_CLK_TCK"), 2)


@dataclass(slots=True)
class Active:
    """A request the engine is working on (compute thread only)."""

    task: Task
    entry_id: str
    next_index: int  # output index of the next token to emit
    started: float
    generation: int = 0  # the consumer generation that admitted it (its writes carry it)
    shard: int = 0  # the pipeline shard it came from (its writes go back there)
    first_index: int = 0  # next_index when this worker admitted it (above: progress here)


class Worker:
    """Base of PrefillWorker and DecodeWorker; subclasses say which stream and how to finish."""

    role: ClassVar[Stage]
    message: ClassVar[type[PrefillTask] | type[DecodeTask]]
    handoff_after: ClassVar[int | None] = None

    def __init__(
        self,
        config: WorkerConfig,
        engine: EngineAPI,
        client: redis.Redis | None = None,
        store_node: str = "",
        metrics: WorkerMetrics | None = None,
        started: float | None = None,
    ):
        """`started`: time.monotonic() when this process began to serve (a standby: when it
        took the name's slot), for `startup_s`; None: the process's start."""
        self.config = config
        self.store_node = store_node
        self.engine = engine
        # the work streams of this worker's model pipeline ("" the unnamed one)
        self.keys = Keys(config.key_prefix, shards=config.shards, pipeline=config.pipeline)
        self.name = config.worker_name(self.role)
        self.r = client or sync_redis(
            config.redis_url,
            health_check_interval=10,
            **worker_options(config.redis_socket_timeout_s, config.redis_keepalive_s),
        )
        self.admissions: queue.Queue[Admission] = queue.Queue()
        self.cancels: queue.Queue[str] = queue.Queue()
        self.active: dict[str, Active] = {}
        # Suspects (a holder died running them since their last progress) run alone: one at a
        # time, beside nothing that has not made progress here, and admissions wait behind
        # them in order. So a poison entry kills no innocent that would be struck with it, and
        # a suspect is exposed to churn for its own run only (docs/reliability.md).
        self._waiting: deque[Admission] = deque()
        self._alone: tuple[str, int] | None = None  # the suspect running alone, its next_index
        # the name the API serves the model under (--served-model-name), else the model's own
        model_name = (config.served_names or (engine.model_name,))[0]
        self.metrics = metrics or WorkerMetrics(model_name, engine)
        self.stop_event = threading.Event()
        # this process holds the name's slot on the host (`workers.slot`; `kvrelay worker` takes
        # it before building the worker): earlier processes of the name here are all gone
        self.slot_held = False
        # set once the worker's groups exist and its heartbeat announced it (start())
        self.ready = threading.Event()
        self.page_size = engine.config.page_size
        publication = ModelPublication.from_dir(
            model_name,
            engine.loaded.dir,
            PublishedModel(
                fingerprint=engine.fingerprint,
                page_size=self.page_size,
                max_model_len=engine.max_model_len,
                vocab_size=engine.vocab_size,
                pipeline=config.pipeline or None,  # where producers queue its requests
                aliases=config.served_names[1:] or None,
                loras=published_loras(engine.loras),
            ),
            config.generation_override,
            config.chat_template_text(),
            own_name=engine.model_name,
        )
        info = WorkerRecord(
            model=model_name,
            fingerprint=engine.fingerprint,
            max_num_seqs=config.engine.max_num_seqs,
            kernel_isa=engine.kernel_isa,
            # the KV pool's dtype ("float32", "bfloat16", "float16")
            kv_dtype=str(engine.kv_dtype).removeprefix("torch."),
            attention=engine.attention_precision,  # fp32 or bf16 (AMX tiles), resolved
            # speculative decoding, resolved: off, ngram or draft
            speculation=str(engine.speculation),
            # the engine is ready (a restart's cost, in status)
            startup_s=process_age() if started is None else time.monotonic() - started,
        )
        self._tokens = 0
        self._rate = (time.monotonic(), 0, 0.0)
        # one lane per shard served, all under one consumer name at first; the first lane
        # publishes the model (the models hash is every shard's)
        consumer = self.new_consumer()
        self.lanes: dict[int, ShardLane] = {}
        for shard in config.shard_list():
            first = not self.lanes
            lane = ShardLane(self, shard, consumer, info, publication if first else None)
            self.lanes[shard] = lane
        self._first = next(iter(self.lanes.values()))
        # run-time LoRA adapter commands (applied beside the compute loop)
        self.lora_control = LoraControl(
            self.r, self.keys.global_keys, self.name, engine.loras, publication, self.stop_event
        )
        # the compute loop's generation per shard (a rejoin there starts a new one)
        self._generation = {k: lane.streams.generation for k, lane in self.lanes.items()}

    def new_consumer(self) -> str:
        return f"{self.name}.{int(time.time() * 1000) % 10**9}"

    def held(self) -> int:
        """Entries this worker holds, on every shard."""
        return sum(len(lane.inflight) for lane in self.lanes.values())

    # the first shard served (shard 0 by default): what a one-shard worker had
    @property
    def streams(self) -> Streams:
        return self._first.streams

    @property
    def emitter(self) -> Emitter:
        return self._first.emitter

    @property
    def inflight(self) -> Inflight:
        return self._first.inflight

    @property
    def heartbeat(self) -> Heartbeat:
        return self._first.heartbeat

    @property
    def consumer(self) -> str:
        return self._first.consumer

    @property
    def stream(self) -> str:
        return self._first.stream

    @property
    def group(self) -> str:
        return self.role

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Create groups, announce the worker, start the IO threads (retries until Redis is up)."""
        while not self.stop_event.is_set():
            try:
                check_shard_count_sync(self.r, self.keys)  # refuse another shard count
                for lane in self.lanes.values():
                    lane.ensure_groups()
                    # before the first beat overwrites the name's record
                    lane.dead = dead_predecessors(
                        self.r, lane.keys, self.name, lane.consumer, self.slot_held
                    )
                    if lane.dead:
                        logger.info(
                            "%s worker %s: taking over %s at once (their process is gone)",
                            self.role, self.name, ", ".join(lane.dead),
                        )  # fmt: skip
                    lane.heartbeat.beat()
                self.lora_control.poll()  # the adapters its peers were given at run time
                break
            except redis.ConnectionError as exc:
                logger.warning("redis unavailable (%s); retrying", exc)
                time.sleep(0.5)
        for lane in self.lanes.values():
            lane.heartbeat.start()
            lane.emitter.thread.start()
            lane.reader.start()
        self.lora_control.start()
        logger.info(
            "%s worker %s ready (consumer %s, shards %s)",
            self.role,
            self.name,
            self.consumer,
            ",".join(map(str, self.lanes)),
        )
        self.ready.set()

    def run(self) -> None:
        """The compute loop; returns after stop() once in-flight work is done or released."""
        self.start()
        grace_end: float | None = None
        while True:
            if self.stop_event.is_set() and grace_end is None:
                grace_end = time.monotonic() + self.config.stop_grace_s
            if grace_end is not None and (not self.active or time.monotonic() > grace_end):
                break
            try:
                self._iteration()
            except Exception as exc:  # an engine bug must not take the worker down with it
                logger.exception("compute loop failed")
                self._release_all(f"engine error: {exc!r}")
        self._shutdown()

    def _iteration(self) -> None:
        """Apply control messages, then one engine step (or wait briefly for work)."""
        self._control()
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                self._on_output(out)
            self.metrics.count_engine(self.engine.stats)
        else:
            with contextlib.suppress(queue.Empty):
                self._admit(self.admissions.get(timeout=0.05))

    def stop(self) -> None:
        self.stop_event.set()

    def _shutdown(self) -> None:
        for lane in self.lanes.values():
            lane.reader.join(5)
        for rid in list(self.active):
            self.engine.abort_request(rid, FinishReason.ABORT)
        self.active.clear()
        for lane in self.lanes.values():
            lane.emitter.close()
            # make what is left claimable at once instead of after a lease
            with contextlib.suppress(redis.RedisError):
                held = [(eid, rid) for rid, eid in lane.inflight.snapshot().items()]
                lane.streams.release(lane.stream, lane.group, held)
            lane.heartbeat.stop()
        logger.info("%s worker %s stopped", self.role, self.name)

    # ---- compute loop ------------------------------------------------------------------------
    def _control(self) -> None:
        """Apply admissions, cancels, lost entries and deadlines (compute thread)."""
        for shard, lane in self.lanes.items():
            self._follow_generation(shard, lane.streams.generation)
        while True:
            try:
                self._admit(self.admissions.get_nowait())
            except queue.Empty:
                break
        self._start_waiting()
        for q, reason in (
            (self.cancels, FinishReason.CANCELLED),
            *((lane.emitter.lost, None) for lane in self.lanes.values()),
        ):
            while True:
                try:
                    rid = q.get_nowait()
                except queue.Empty:
                    break
                self._abort(rid, reason)
        now = time.time()
        for rid, act in list(self.active.items()):
            if act.task.deadline is not None and now > act.task.deadline:
                self._abort(rid, FinishReason.TIMEOUT)
        for adm in list(self._waiting):
            if adm.task.deadline is not None and now > adm.task.deadline:
                self._waiting.remove(adm)
                self._start(adm)  # ends it as a timeout

    def _follow_generation(self, shard: int, generation: int) -> None:
        """After a rejoin on `shard`, drop (no final chunk) what its older consumer held."""
        if generation > self._generation[shard]:
            self._generation[shard] = generation
            for rid, act in list(self.active.items()):
                if act.shard == shard:
                    self._abort(rid, None)

    def _emitter(self, shard: int) -> Emitter:
        return self.lanes[shard].emitter

    def _admit(self, adm: Admission) -> None:
        if adm.suspect or self._waiting or self._alone is not None:
            self._waiting.append(adm)
            self._start_waiting()
        else:
            self._start(adm)

    def _start_waiting(self) -> None:
        """Start what waits, in order, up to a suspect that cannot run alone yet."""
        if self._alone is not None:
            rid, index = self._alone
            act = self.active.get(rid)
            if act is not None and act.next_index == index:
                return  # still running alone, no progress yet
            self._alone = None
        while self._waiting:
            adm = self._waiting[0]
            if adm.suspect and adm.generation >= self._generation[adm.shard]:
                if any(a.next_index == a.first_index for a in self.active.values()):
                    return  # beside requests that may still be struck with it: wait
                self._waiting.popleft()
                self._ran(adm)
                self._start(adm)
                act = self.active.get(adm.task.request_id)
                if act is not None:
                    self._alone = (adm.task.request_id, act.next_index)
                    return
            else:
                self._start(self._waiting.popleft())

    def _ran(self, adm: Admission) -> None:
        """Record that this holder runs the suspect now: its death counts as a strike."""
        try:
            self.lanes[adm.shard].streams.ran(adm.task.request_id, adm.entry_id, adm.delivery)
        except redis.RedisError as exc:  # unrecorded, a death while it runs is not counted
            logger.warning("request %s: running it alone unrecorded (%s)", adm.task.request_id, exc)
        logger.info(
            "request %s: a suspect (delivery %d), running alone", adm.task.request_id, adm.delivery
        )

    def _start(self, adm: Admission) -> None:
        task, rid = adm.task, adm.task.request_id
        if adm.generation < self._generation[adm.shard]:
            return  # admitted by a consumer since fenced: its claimant has it
        if self.lanes[adm.shard].inflight.get(rid) != adm.entry_id:
            return  # dropped before it started (a repair found the server lost its delivery)
        self._follow_generation(adm.shard, adm.generation)
        first = len(adm.emitted)
        act = Active(task, adm.entry_id, first, time.time(), adm.generation, adm.shard, first)
        late = task.deadline is not None and time.time() > task.deadline
        if adm.cancelled or late:
            # past its deadline it is a timeout even when the ingress, giving up at the
            # deadline, also set the cancel flag: the record says what the client was told
            self._finish(act, FinishReason.TIMEOUT if late else FinishReason.CANCELLED, 0)
            return
        try:
            self.engine.add_request(
                rid,
                task.prompt_token_ids,
                task.sampling,
                output_token_ids=adm.emitted,
                cache_salt=task.cache_salt,
                retention=task.retention,
                priority=task.priority,
                tenant=task.tenant,
                weight=task.weight,
                lora=task.lora,
                handoff_after=self.handoff_after,
                emitted_text_len=adm.emitted_text_len if task.detokenize else None,
                sampling_checked=True,  # validated when the entry was decoded
            )
        except Exception as exc:  # InvalidRequestError and anything else input can provoke
            self.lanes[adm.shard].inflight.remove(rid, adm.entry_id)
            self._emitter(adm.shard).put(
                Outgoing(
                    OutgoingKind.DEAD_LETTER,
                    rid,
                    adm.entry_id,
                    payload=task.encode(),
                    reason=f"rejected by the engine: {exc}",
                    generation=adm.generation,
                )
            )
            self.metrics.dead_letters.inc()
            return
        self.active[rid] = act
        self.metrics.admitted(task, len(adm.emitted))

    def _abort(self, rid: str, reason: FinishReason | None) -> None:
        waiting = next((a for a in self._waiting if a.task.request_id == rid), None)
        if waiting is not None:  # not in the engine yet
            self._waiting.remove(waiting)
            if reason is not None:  # cancel/timeout: end it as if admitted now
                self._start(replace(waiting, cancelled=reason == FinishReason.CANCELLED))
            return
        act = self.active.pop(rid, None)
        if act is None:
            return
        late = act.task.deadline is not None and time.time() > act.task.deadline
        if reason == FinishReason.CANCELLED and late:
            # the ingress sets the cancel flag when it gives up at the deadline: as in _admit,
            # a timeout, which is what the client was told
            reason = FinishReason.TIMEOUT
        out = self.engine.abort_request(rid, reason or FinishReason.ABORT)
        if reason is not None:  # cancel/timeout: tell the client; lost entries belong elsewhere
            self._finish(act, reason, out.num_cached_tokens if out else 0)

    def _finish(self, act: Active, reason: FinishReason, cached: int) -> None:
        # A deadline ending is the system's, not a finish: the record says failed with the
        # reason, as the SSE error event, the 504 body and the client's Completion.error do.
        timeout = reason == FinishReason.TIMEOUT
        chunk = TokenChunk(
            index=act.next_index,
            finish_reason=reason,
            usage=self._usage(act, act.next_index, cached),
            error=DEADLINE_PASSED if timeout else None,
        )
        status = (
            RequestStatus.CANCELLED
            if reason == FinishReason.CANCELLED
            else RequestStatus.FAILED
            if timeout
            else None
        )
        self._emit(act, chunk, done=True, status=status)

    def _usage(self, act: Active, completion: int, cached: int) -> dict[str, int]:
        return {
            "prompt_tokens": len(act.task.prompt_token_ids),
            "completion_tokens": completion,
            "cached_tokens": cached,
        }

    def _emit(
        self,
        act: Active,
        chunk: TokenChunk,
        done: bool,
        status: RequestStatus | None = None,
        record: RequestRecord | None = None,
    ) -> None:
        """Write `chunk` (and with the final one, the record's ending fields and `record`'s)."""
        fields: rec.Encoded = {}
        if done:
            ending = RequestRecord(
                status=status or RequestStatus.FINISHED,
                stage=self.role,
                owner=self.name,
                finish_reason=chunk.finish_reason or "",
                error=chunk.error or None,
                cached_tokens=chunk.usage.get("cached_tokens", 0) if chunk.usage else None,
                # the usage the client gets, as the step script counts it (lua/usage.lua)
                prompt_tokens=chunk.usage.get("prompt_tokens") if chunk.usage else None,
            )
            fields = {**ending.changes(), **(record.changes() if record else {})}
        self._emitter(act.shard).put(
            Outgoing(
                OutgoingKind.EMIT,
                act.task.request_id,
                act.entry_id,
                chunk=chunk,
                req_fields=fields,
                done=done,
                generation=act.generation,
            )
        )

    def _release_all(self, reason: str) -> None:
        """Give every active entry back (claimable at once) after an engine failure.

        Not the DLQ: the failure may be the store or the machine, not the requests. Each entry
        is claimed again; one that fails every worker before making progress runs out of
        strikes and is dead-lettered by the reader (see workers.reader.receive)."""
        for rid, act in list(self.active.items()):
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid, FinishReason.ABORT)
            self.active.pop(rid)
            logger.warning("request %s: released after %s", rid, reason)
            self._emitter(act.shard).put(
                Outgoing(
                    OutgoingKind.RELEASE,
                    rid,
                    act.entry_id,
                    reason=reason,
                    generation=act.generation,
                )
            )

    def _on_output(self, out: RequestOutput) -> None:
        raise NotImplementedError

    def _chunk(self, act: Active, out: RequestOutput) -> TokenChunk:
        """The TokenChunk for one RequestOutput (advances the request's emit index)."""
        chunk = TokenChunk(
            index=act.next_index,
            token_ids=list(out.new_token_ids),
            text=out.text_delta if act.task.detokenize else "",
            finish_reason=out.finish_reason if out.finished else None,
            logprobs=_logprobs(out.new_logprobs, out.new_token_ids, act.task.sampling.logprobs),
            prompt_logprobs=out.prompt_logprobs,
            stop_reason=out.stop_reason if out.finished else None,
            error=out.error if out.finished else None,
        )
        act.next_index += len(out.new_token_ids)
        self._tokens += len(out.new_token_ids)
        self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.new_token_ids:
            self.metrics.generation_steps.inc()
        return chunk

    def stats(self, record: WorkerRecord) -> WorkerRecord:
        """The heartbeat with running/waiting counts, a smoothed tokens/s and the metrics
        port."""
        t0, n0, rate = self._rate
        now = time.monotonic()
        if now - t0 >= 1.0:
            rate = (self._tokens - n0) / (now - t0)
            self._rate = (now, self._tokens, rate)
        self.metrics.set_load(len(self.active), self.admissions.qsize())
        return replace(
            record,
            load=self.held(),  # every shard's entries, whichever shard's hash this is
            running=len(self.active),
            waiting=self.admissions.qsize(),
            tokens_per_s=rate,
            metrics_port=self.metrics.port or None,
        )


def speculation_record(metrics: dict[str, Any]) -> RequestRecord:
    """The request record's speculation fields from a finished RequestOutput's metrics (none
    set when the engine does not report them)."""
    if "num_draft_tokens" not in metrics:
        return RequestRecord()
    return RequestRecord(
        draft_tokens=int(metrics["num_draft_tokens"] or 0),
        accepted_tokens=int(metrics.get("num_accepted_tokens") or 0),
    )


def _logprobs(
    lps: list[dict[int, float]] | None, tokens: list[int], top_n: int | None
) -> list[dict[str, Any]] | None:
    if lps is None:
        return None
    out = []
    for tok, lp in zip(tokens, lps, strict=True):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[: top_n or 0]
        out.append({"logprob": lp.get(tok), "top": [[t, v] for t, v in top]})
    return out
