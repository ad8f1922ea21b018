"""One function per Redis command sequence, whichever client runs it: a command program is a
generator that yields `Call`s (a client method and its arguments; a `Batch` of them goes in one
pipeline) and is sent each reply; `run_sync` executes it on a redis-py client (the workers, the
admin CLI), `run_async` on an asyncio one (the ingress, the producer client). A sequence is
written once instead of as a sync and an async twin."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call:
    """One client call: `getattr(client, method)(*args, **kwargs)`."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Batch:
    """Calls sent together in one pipeline (not a transaction); the reply is their list."""

    calls: tuple[Call, ...]


# yields calls (or batches), is sent their replies, returns its result
Program = Generator[Call | Batch, Any, T]


def call(method: str, *args: Any, **kwargs: Any) -> Call:
    return Call(method, args, kwargs)


def batch(calls: list[Call]) -> Batch:
    return Batch(tuple(calls))


def run_sync(program: Program[T], client: Any) -> T:
    """Run `program` on a sync client; a call's error is raised here."""
    reply: Any = None
    try:
        while True:
            c = program.send(reply)
            if isinstance(c, Batch):
                with client.pipeline(transaction=False) as pipe:
                    for one in c.calls:
                        getattr(pipe, one.method)(*one.args, **one.kwargs)
                    reply = pipe.execute()
            else:
                reply = getattr(client, c.method)(*c.args, **c.kwargs)
    except StopIteration as done:
        return done.value


async def run_async(program: Program[T], client: Any) -> T:
    """Run `program` on an asyncio client; a call's error is raised here."""
    reply: Any = None
    try:
        while True:
            c = program.send(reply)
            if isinstance(c, Batch):
                async with client.pipeline(transaction=False) as pipe:
                    for one in c.calls:
                        getattr(pipe, one.method)(*one.args, **one.kwargs)
                    reply = await pipe.execute()
            else:
                reply = await getattr(client, c.method)(*c.args, **c.kwargs)
    except StopIteration as done:
        return done.value
