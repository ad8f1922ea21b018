"""One benchmark run against one server: a closed loop at fixed concurrency or an open loop of
Poisson arrivals, stopping after a number of requests or a duration.

A session (one conversation) is the unit of work: its requests go one after another, each
follow-up carrying the server's previous answer, after the session's think time (a user
reading, a tool running), whichever loop started the session. A conversation's id is the
load's seed and the session's index (or the session's own `conversation`, which doc-qa's asks of
one document share): the prompt_cache_key, cold cache_salt and sampling seed derive from it.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvrelay.bench.datasets import Dataset, Session
from kvrelay.bench.request import RequestOptions, RequestRecord, Target, request_body, send


@dataclass(slots=True)
class Load:
    """How one run sends requests: `concurrency` (closed loop) or `rate` (open loop, req/s)."""

    concurrency: int | None = None
    rate: float | None = None
    num_requests: int | None = None  # stop after this many requests ...
    duration_s: float | None = None  # ... or start no request after this many seconds
    seed: int = 0  # of the arrival times; it also names the run's conversations (`{seed}-{i}`)

    @property
    def point(self) -> float:
        return float(self.concurrency if self.concurrency is not None else self.rate or 0)


@dataclass(slots=True)
class RunResult:
    """The records of one run and its wall time (first request sent to last answer)."""

    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Arrival offsets (s) of a Poisson process: the first at 0, then exponential gaps."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        yield t
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)


@dataclass(slots=True)
class _Sessions:
    """Hands out sessions in order: a fixed list, or endless ones until the deadline."""

    dataset: Dataset
    fixed: list[Session] | None  # None: a duration run, sessions made on demand
    next_index: int = 0

    def take(self) -> tuple[int, Session] | None:
        i = self.next_index
        if self.fixed is not None and i >= len(self.fixed):
            return None
        self.next_index += 1
        return i, self.fixed[i] if self.fixed is not None else self.dataset.session(i)


async def _session(
    client: httpx.AsyncClient,
    target: Target,
    opts: RequestOptions,
    session: Session,
    conversation: str,
    base: RequestRecord,
    t0: float,
    deadline: float,
    out: list[RequestRecord],
    on_done: Callable[[RequestRecord], None],
) -> None:
    messages = list(session.messages)
    answer = ""
    for turn in range(session.num_requests):
        if turn and session.think_s and session.think_s[turn - 1] > 0:
            # the user reads the answer (or a tool runs) before the next turn
            await asyncio.sleep(
                min(session.think_s[turn - 1], max(0.0, deadline - time.monotonic()))
            )
        rec = RequestRecord(
            base.server,
            base.point,
            base.round,
            base.session,
            session.first_turn + turn,
            scheduled_s=base.scheduled_s,
        )
        if turn and time.monotonic() >= deadline:
            return  # a duration run starts no request after its end
        if turn:
            if out[-1].error is not None:
                rec.error = "not sent: an earlier turn of this conversation failed"
                out.append(rec)
                on_done(rec)
                continue
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": session.follow_ups[turn - 1]},
            ]
        body = request_body(
            target, opts, messages, session.prompt, session.max_tokens, conversation, rec.turn
        )
        answer = await send(client, target, body, rec, t0)
        out.append(rec)
        on_done(rec)


async def run_load(
    target: Target,
    dataset: Dataset,
    load: Load,
    opts: RequestOptions,
    round_: int,
    on_done: Callable[[RequestRecord], None],
    timeout_s: float = 600.0,
) -> RunResult:
    """Send the load's requests to `target`; failures become records, never exceptions."""
    fixed = dataset.sessions(load.num_requests) if load.num_requests else None
    sessions = _Sessions(dataset, fixed)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    per_session: list[list[RequestRecord]] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.monotonic()
        deadline = t0 + load.duration_s if load.duration_s else math.inf

        def start(
            index: int, session: Session, scheduled: float | None
        ) -> Coroutine[Any, Any, None]:
            base = RequestRecord(target.label, load.point, round_, index, 0, scheduled_s=scheduled)
            out: list[RequestRecord] = []
            per_session.append(out)
            conversation = f"{load.seed}-{session.conversation or index}"
            return _session(
                client, target, opts, session, conversation, base, t0, deadline, out, on_done
            )

        if load.concurrency is not None:

            async def user() -> None:
                while time.monotonic() < deadline and (item := sessions.take()) is not None:
                    await start(item[0], item[1], None)

            await asyncio.gather(*(user() for _ in range(load.concurrency)))
        else:
            tasks: list[asyncio.Task[None]] = []
            for at in poisson_arrivals(float(load.rate or 0), load.seed):
                if at >= (load.duration_s or math.inf) or time.monotonic() >= deadline:
                    break
                item = sessions.take()
                if item is None:
                    break
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(start(item[0], item[1], at)))
            await asyncio.gather(*tasks)
        duration = time.monotonic() - t0
    records = [r for out in per_session for r in out]
    return RunResult(records, duration)
