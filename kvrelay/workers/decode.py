"""Decode worker: continuous batching of requests from the decode stream.

A request's path: stream:decode entry (or an entry claimed from a dead worker) -> reader thread
reads out:{id} to learn the tokens already emitted -> engine.add_request(output_token_ids=...)
fetches the pages covering them from the store into free blocks and recomputes only the tail
-> one forward per step for the whole batch -> each new token goes to the emitter thread, which
appends it to out:{id} with the fenced Lua emit -> the final chunk acks the entry and starts the
expiry of out:{id}. Full blocks are saved to the store as they fill (resume, later turns).
A DecodeTask with `prefilled=False` (ingress routed it straight here) is prefilled locally.
"""

from __future__ import annotations

import logging
from typing import cast

from kvrelay.core.enums import Stage
from kvrelay.core.messages import DecodeTask
from kvrelay.workers.base import Worker, speculation_record
from kvrelay.workers.engine.config import RequestOutput

logger = logging.getLogger(__name__)


class DecodeWorker(Worker):
    role = Stage.DECODE
    message = DecodeTask

    def _on_output(self, out: RequestOutput) -> None:
        act = self.active.get(out.request_id)
        if act is None:
            return
        task = cast(DecodeTask, act.task)  # a decode worker reads DecodeTasks (`message`)
        chunk = self._chunk(act, out)
        if out.finished:
            del self.active[out.request_id]
            cached = task.num_cached_tokens if task.prefilled else out.num_cached_tokens
            if not task.prefilled:
                self.metrics.finished(len(task.prompt_token_ids), cached)
            chunk.usage = self._usage(act, act.next_index, cached)
            self._emit(act, chunk, done=True, record=speculation_record(out.metrics))
            return
        self._emit(act, chunk, done=False)
