"""Continuous-batching scheduler: token budget, chunked prefill, decode first, preemption.

A request's path: `waiting` (by priority, lower first; FCFS within one) -> admitted into
`running` once its prefix hits are attached and blocks for its first chunk are free -> one or
more steps computing prompt chunks -> decode steps (one token each, or the last token and a
draft to verify, engine/speculator.py) -> finished (blocks released). When the pool runs out,
the worst priority's newest running sequence is preempted by recompute: its blocks are released
(its full blocks stay in the prefix cache, so the recompute is mostly cache hits) and it goes
back to the front of its priority in `waiting` keeping every token it has produced.

Each step every running sequence is visited in priority, then admission order (the decodes
of older requests come first), each taking `min(remaining tokens, budget left)` plus as much of
its draft as the budget leaves (a draft is dropped rather than preempt anyone for its blocks);
waiting requests are admitted only with the budget and sequence slots left over, and not in a
step that had to preempt for blocks.
A waiting request whose prefix pages are still coming from the store keeps its place (and a
sequence slot) but does not hold up the requests behind it.

Priorities (the task's `priority`, lower first, as vLLM's `--scheduling-policy priority`):
`waiting` and `running` are kept in priority order (arrival, resp. admission, order within
one), so the decodes of better priorities come first, a preemption for blocks takes the worst
priority's newest sequence, and a waiting request of a better priority than the worst running
one takes that one's place when every sequence slot is taken (it is preempted by recompute:
its full blocks stay in the prefix cache, it comes back first among its priority).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvrelay.workers.engine.kv_cache_manager import KVCacheManager
from kvrelay.workers.engine.sequence import Sequence, SequenceStatus, crowded_tenant

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
        _insert(self.waiting, seq, after_equal=True)

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
        _insert(self.waiting, seq, after_equal=False)  # first among its priority
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
        displaced = self._displace(out)
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
        if len(out.preempted) == displaced:  # no preemption for blocks this step
            self._admit(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _displace(self, out: SchedulerOutput) -> int:
        """With every slot taken, preempt running sequences for waiting requests that are
        ready and have a better claim to a slot (`_victim`); each such request goes first
        among its priority (the admission after the running sequences takes it), before its
        victim. How many were preempted."""
        reserved: list[Sequence] = []
        while self.running and len(self.running) + len(reserved) >= self.max_num_seqs:
            found = None
            for head in self.waiting:
                if any(head is r for r in reserved) or not (
                    self.kv.ready(head) and head.grammar_ready
                ):
                    continue
                victim = self._victim(head, reserved)
                if victim is not None:
                    found = head, victim
                    break
            if found is None:
                break
            head, victim = found
            self._preempt(victim)
            out.preempted.append(victim)
            reserved.append(head)
        for head in reversed(reserved):  # first among their priority, in the order reserved
            self.waiting.remove(head)
            _insert(self.waiting, head, after_equal=False)
        return len(reserved)

    def _victim(self, head: Sequence, reserved: list[Sequence]) -> Sequence | None:
        """The running sequence `head` takes the slot of: the worst priority's newest when
        `head`'s priority is better; at the same priority, the newest of the tenant holding
        the most slots for its weight (`reserved` ones count as held), when that is more than
        `head`'s tenant would hold with one more (fair shares of slots); None when `head`
        waits its turn."""
        worst = self.running[-1]
        if head.priority < worst.priority:
            return worst
        if head.priority > worst.priority:
            return None
        same = [s for s in (*self.running, *reserved) if s.priority == head.priority]
        crowded, _slots, share = crowded_tenant((s.tenant, s.weight) for s in same)
        if crowded == head.tenant:
            return None
        mine = sum(1 for s in same if s.tenant == head.tenant)
        if share <= (mine + 1) / head.weight:
            return None
        return next(
            (
                s
                for s in reversed(self.running)
                if s.tenant == crowded and s.priority == head.priority
            ),
            None,
        )

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
            _insert(self.running, seq, after_equal=True)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n


def _insert(seqs: deque[Sequence] | list[Sequence], seq: Sequence, *, after_equal: bool) -> None:
    """Put `seq` in priority order: after (or before) those of its own priority."""
    for i, other in enumerate(seqs):
        if other.priority > seq.priority or (not after_equal and other.priority == seq.priority):
            seqs.insert(i, seq)
            return
    seqs.append(seq)
