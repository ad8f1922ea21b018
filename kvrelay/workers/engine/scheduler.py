"""Continuous-batching scheduler: token budget, chunked prefill, decode first, preemption.

A request's path: `waiting` (FCFS deque) -> admitted into `running` once its prefix hits are
attached and blocks for its first chunk are free -> one or more steps computing prompt chunks
-> decode steps (one token each, or the last token and a draft to verify,
engine/speculator.py) -> finished (blocks released). When the pool runs out, the
newest running sequence is preempted by recompute: its blocks are released (its full blocks
stay in the prefix cache, so the recompute is mostly cache hits) and it goes back to the front
of `waiting` keeping every token it has produced.

Each step every running sequence is visited in admission order (the decodes of older requests
come first), each taking `min(remaining tokens, budget left)` plus as much of its draft as the
budget leaves (a draft is dropped rather than preempt anyone for its blocks); waiting requests
are admitted only with the budget and sequence slots left over, and not in a step that had to
preempt.
A waiting request whose prefix pages are still coming from the store keeps its place (and a
sequence slot) but does not hold up the requests behind it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvrelay.workers.engine.kv_cache_manager import KVCacheManager
from kvrelay.workers.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    # tokens whose K/V is computed this step (from num_computed_tokens), the draft included
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)  # verified after the sequence's last token

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token (so a token is sampled)."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    """Chooses each step's sequences and token counts within the budget and the block pool."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, aborted or handed off), retain its session's pages
        in the store and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.retain(seq)
        self.kv.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.store_checked = False  # its pages may be in the store by now
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.info(
            "request %s preempted (recompute); %d free blocks",
            seq.request_id,
            self.kv.pool.num_free_blocks,
        )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.start_admission()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = seq.draft[: budget - n]
            while not self.kv.allocate_slots(seq, n + len(draft)):
                if draft:  # a draft never preempts anyone: drop it first
                    draft = []
                    continue
                victim = self.running[-1]
                if id(victim) in scheduled_ids:  # never undo work already in this batch
                    victim = seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n + len(draft), draft))
                scheduled_ids.add(id(seq))
                budget -= n + len(draft)
                i += 1
                continue
            # `seq` itself was preempted: the list shifted, do not advance.
        if not out.preempted:
            self._admit(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        slots = self.max_num_seqs - len(self.running)
        i = 0
        while i < len(self.waiting) and budget > 0 and slots > 0:
            seq = self.waiting[i]
            slots -= 1
            # its store fetch is in flight, or its grammar compiling: admit the next one
            if not self.kv.ready(seq) or not seq.grammar_ready:
                i += 1
                continue
            self.kv.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate_slots(seq, n):
                self.kv.free(seq)  # its hits stay cached (free, keyed) for the next try
                break
            del self.waiting[i]
            seq.admitted = True
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
