"""Scheduler: token budget, chunked prefill, decode first, max_num_seqs, preemption (exact)."""

from __future__ import annotations

from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.engine.kv_cache_manager import KVCacheManager
from kvrelay.workers.engine.scheduler import Scheduler, SchedulerOutput
from kvrelay.workers.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int, max_seqs: int = 4, budget: int = 16) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), page_size=4, fingerprint="fp")
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget)


def seq(rid: str, n: int, first: int = 0) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), n, SamplingParams(), seed=0)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def finish_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after the forward: advance, commit, append sampled tokens."""
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.kv.commit(s.seq)
        if samples:
            s.seq.token_ids.append(token)


def test_chunked_prefill_then_decode_first():
    sched = make(num_blocks=32, budget=16)
    a, b = seq("a", 20), seq("b", 6, first=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 16)]  # budget spent on a's first chunk; b waits
    assert not out.scheduled[0].samples
    finish_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 4), ("b", 6)]
    assert [s.samples for s in out.scheduled] == [True, True]
    finish_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]  # both decoding
    assert a.block_table == [0, 1, 2, 3, 4, 7] and b.block_table == [5, 6]
    assert a.status is SequenceStatus.RUNNING and out.num_batched_tokens == 2


def test_max_num_seqs_and_budget_limit_admission():
    sched = make(num_blocks=64, max_seqs=2, budget=100)
    for i in range(3):
        sched.add(seq(f"r{i}", 5, first=10 * i))
    out = sched.schedule()
    assert plan(out) == [("r0", 5), ("r1", 5)]
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_preemption_by_recompute_keeps_tokens_and_requeues_first():
    # 4 blocks of 4 tokens = 16 slots; two sequences of 7 tokens grow until one must yield.
    sched = make(num_blocks=4, budget=64)
    a, b = seq("a", 7), seq("b", 7, first=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 7), ("b", 7)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    finish_step(sched, out)  # both now 8 tokens, 7 computed: the next token fits block 1/3
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]
    finish_step(sched, out)  # 9 tokens: both need a third block, none free
    out = sched.schedule()
    assert out.preempted == [b]
    assert plan(out) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.token_ids[-2:] == [7, 7]
    assert list(sched.waiting) == [b] and sched.num_preemptions == 1
    assert a.block_table == [0, 1, 3]  # b's keyless tail block (3) was handed out first
    finish_step(sched, out)
    # b's first full block (key of tokens 50..53) stays cached; it comes back once a finishes
    sched.remove(a)
    out = sched.schedule()
    assert plan(out) == [("b", 5)]  # 9 tokens, 4 served from the device prefix cache
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert b.block_table[0] == 2


def test_sequence_preempts_itself_when_alone_at_tail():
    sched = make(num_blocks=3, budget=64)
    a = seq("a", 4)
    b = seq("b", 4, first=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("a", 4), ("b", 4)]
    finish_step(sched, out)
    out = sched.schedule()
    # a needs block 2 (free): fine; b then needs one more and only itself can yield
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert sched.running == [a]
