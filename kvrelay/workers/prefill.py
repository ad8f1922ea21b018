"""Prefill worker: computes prompts and hands requests to the decode stream.

A request's path: stream:prefill entry -> reader thread (validate; bad -> DLQ) -> engine with
`handoff_after=1` (prefix pages from the device cache or the store are reused; new full pages
are put in the store as they are computed) -> first token sampled -> emitter thread runs the
fenced step script: emit token 0, XADD the DecodeTask to stream:decode, XACK.
A request that finishes on its first token (max_tokens=1, eos) gets its final chunk instead.
"""

from __future__ import annotations

import logging

from kvrelay.core.enums import RequestStatus, Stage
from kvrelay.core.messages import DecodeTask, PrefillTask
from kvrelay.core.record import RequestRecord
from kvrelay.workers.base import Worker
from kvrelay.workers.emitter import Outgoing, OutgoingKind
from kvrelay.workers.engine.config import RequestOutput

logger = logging.getLogger(__name__)


class PrefillWorker(Worker):
    role = Stage.PREFILL
    message = PrefillTask
    handoff_after = 1

    def _on_output(self, out: RequestOutput) -> None:
        act = self.active.get(out.request_id)
        if act is None:
            return
        task = act.task
        cached = out.num_cached_tokens
        chunk = self._chunk(act, out)
        if not (out.handoff or out.finished):
            self._emit(act, chunk, done=False)  # not expected with handoff_after=1
            return
        del self.active[out.request_id]
        self.metrics.finished(len(task.prompt_token_ids), cached)
        if out.finished:
            chunk.usage = self._usage(act, act.next_index, cached)
            self._emit(act, chunk, done=True)
            return
        nxt = DecodeTask(
            request_id=task.request_id,
            model=task.model,
            prompt_token_ids=task.prompt_token_ids,
            output_token_ids=list(out.output_token_ids),
            sampling=task.sampling,
            cache_salt=task.cache_salt,
            retention=task.retention,
            priority=task.priority,
            tenant=task.tenant,
            weight=task.weight,
            lora=task.lora,
            arrival_time=task.arrival_time,
            deadline=task.deadline,
            num_cached_tokens=cached,
            num_stored_pages=len(task.prompt_token_ids) // self.page_size,
            prefilled=True,
            detokenize=task.detokenize,
        )
        fields = RequestRecord(
            status=RequestStatus.DECODING,
            stage=Stage.DECODE,
            owner="",
            prompt_tokens=len(task.prompt_token_ids),
            cached_tokens=cached,
        ).changes()
        self._emitter(act.shard).put(
            Outgoing(
                OutgoingKind.HANDOFF,
                task.request_id,
                act.entry_id,
                chunk=chunk,
                payload=nxt.encode(),
                req_fields=fields,
                done=True,
                generation=act.generation,
            )
        )
        logger.debug(
            "request %s: handed off after %d cached of %d prompt tokens",
            task.request_id,
            cached,
            len(task.prompt_token_ids),
        )
