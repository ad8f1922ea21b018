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


def pseq(rid: str, n: int, priority: int, first: int = 0) -> Sequence:
    s = seq(rid, n, first)
    s.priority = priority
    return s


def test_waiting_is_served_by_priority_then_arrival():
    sched = make(num_blocks=64, max_seqs=2, budget=100)
    for rid, prio in (("low1", 5), ("high1", 0), ("low2", 5), ("high2", 0), ("mid", 2)):
        sched.add(pseq(rid, 4, prio, first=10 * len(rid)))
    assert [s.request_id for s in sched.waiting] == ["high1", "high2", "mid", "low1", "low2"]
    out = sched.schedule()
    assert plan(out) == [("high1", 4), ("high2", 4)]
    assert [s.request_id for s in sched.waiting] == ["mid", "low1", "low2"]


def test_better_priority_takes_the_worst_running_slot():
    sched = make(num_blocks=64, max_seqs=2, budget=100)
    a, b = pseq("a", 4, 10), pseq("b", 4, 10, first=20)
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())
    urgent = pseq("urgent", 4, 0, first=40)
    sched.add(urgent)
    out = sched.schedule()
    # b, the newest of the worst priority, yields its slot; urgent is admitted in this step
    assert out.preempted == [b]
    assert plan(out) == [("a", 1), ("urgent", 4)]
    assert sched.running == [urgent, a]  # decodes of better priorities first
    assert list(sched.waiting) == [b] and b.num_preemptions == 1
    # an equal priority never displaces anyone
    sched.add(pseq("peer", 4, 10, first=60))
    finish_step(sched, out)
    out = sched.schedule()
    assert out.preempted == [] and plan(out) == [("urgent", 1), ("a", 1)]
    assert [s.request_id for s in sched.waiting] == ["b", "peer"]  # b first among its own


def test_blocks_preemption_takes_the_worst_priority_first():
    sched = make(num_blocks=4, budget=64)
    low, high = pseq("low", 7, 3), pseq("high", 7, 1, first=50)
    sched.add(low)
    sched.add(high)
    out = sched.schedule()
    assert plan(out) == [("high", 7), ("low", 7)]  # better priority first in the batch
    finish_step(sched, out)
    finish_step(sched, sched.schedule())
    out = sched.schedule()  # both need a third block, none free: the low one yields
    assert out.preempted == [low] and plan(out) == [("high", 1)]


def tseq(rid: str, tenant: str, weight: float = 1.0, first: int = 0) -> Sequence:
    s = seq(rid, 4, first)
    s.tenant, s.weight = tenant, weight
    return s


def test_a_tenant_holding_every_slot_yields_one_to_another():
    sched = make(num_blocks=64, max_seqs=4, budget=100)
    for i in range(4):
        sched.add(tseq(f"a{i}", "A", first=10 * i))
    finish_step(sched, sched.schedule())
    sched.add(tseq("b0", "B", first=100))
    sched.add(tseq("b1", "B", first=110))
    out = sched.schedule()
    # A holds 4 slots, B would hold 1: A's newest yields; then 3 against 2: A's next yields
    assert [s.request_id for s in out.preempted] == ["a3", "a2"]
    assert plan(out) == [("a0", 1), ("a1", 1), ("b0", 4), ("b1", 4)]
    assert [s.request_id for s in sched.waiting] == ["a2", "a3"]
    # 2 against 2: the preempted A's wait their turn (no flapping)
    finish_step(sched, out)
    out = sched.schedule()
    assert out.preempted == [] and len(sched.running) == 4


def test_slots_are_shared_by_weight():
    sched = make(num_blocks=64, max_seqs=3, budget=100)
    for i in range(3):
        sched.add(tseq(f"a{i}", "A", first=10 * i))
    finish_step(sched, sched.schedule())
    for i in range(3):
        sched.add(tseq(f"b{i}", "B", weight=2.0, first=100 + 10 * i))
    sched.schedule()
    # B (weight 2) ends with 2 of the 3 slots: A's 1 is not more than B's 2 / 2 with one more
    assert sorted(s.request_id for s in sched.running) == ["a0", "b0", "b1"]
