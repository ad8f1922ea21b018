"""Local request handlers of the store node (one function per request type, see `messages`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.kvstore.errors import StoreError
from kvrelay.kvstore.messages import (
    Abort,
    Commit,
    CommitReply,
    Contains,
    CountReply,
    Demote,
    Evict,
    Get,
    Hello,
    HelloReply,
    Ls,
    LsReply,
    NodeRequest,
    Paged,
    Prefetch,
    Put,
    Release,
    Reply,
    Retain,
    SlotsReply,
    Stats,
    StatsReply,
)


@dataclass(slots=True)
class Later:
    """A reply that needs peers or Redis: the node runs `run()` on a pool thread."""

    run: Callable[[], Reply]


def _keys(node, req: Paged) -> list[bytes]:
    return req.check(node.store.fingerprint, node.page_bytes)


def op_hello(node, req: Hello) -> Reply:
    _keys(node, req)  # refuses a wrong fingerprint or page size up front
    return HelloReply(
        node_id=node.config.node_id,
        arena=str(node.arena.path),
        num_slots=node.arena.num_slots,
        page_bytes=node.page_bytes,
        fingerprint=node.store.fingerprint,
        remote=node.remote is not None,
        gen=node.arena_gen,
    )


def op_put(node, req: Put) -> Reply:
    return SlotsReply(slots=node.store.reserve(_keys(node, req)), gen=node.arena_gen)


def op_commit(node, req: Commit) -> Reply:
    keys, slots = _keys(node, req), req.slots
    if len(keys) != len(slots):
        raise StoreError("commit needs one slot per key")
    # Verify the payload CRC once, as the page enters the arena: a writer that published a
    # header before its copy finished (say an unsynchronised GPU copy) is caught here.
    return CommitReply(errors=node.store.commit(keys, slots, verify=True))


def op_abort(node, req: Abort) -> Reply:
    node.store.abort(_keys(node, req), req.slots)
    return Reply()


def op_get(node, req: Get) -> Reply | Later:
    keys = _keys(node, req)
    slots = node.store.acquire(keys)
    if len(slots) < len(keys) and req.remote and node.remote is not None:

        def fetch() -> Reply:
            got = list(slots)
            try:
                got += node.remote.fetch(keys[len(got) :])
                # Another worker's fetch (or put) of the same pages was under way: wait for it
                # and take what it brought instead of recomputing.
                timeout = node.config.transfer_timeout_s
                if len(got) < len(keys) and node.store.wait_written(keys[len(got)], timeout):
                    got += node.store.acquire(keys[len(got) :])
            except BaseException:
                node.store.release(got)  # nobody will get these slots to release them
                raise
            return SlotsReply(slots=got, gen=node.arena_gen)

        return Later(fetch)
    return SlotsReply(slots=slots, gen=node.arena_gen)


def op_release(node, req: Release) -> Reply:
    node.store.release(req.slots)
    return Reply()


def op_contains(node, req: Contains) -> Reply | Later:
    keys = _keys(node, req)
    n = node.store.contains_prefix(keys)
    if n < len(keys) and req.remote and node.remote is not None:

        def locate() -> Reply:
            more = 0
            with contextlib.suppress(Exception):  # Redis down: count only local pages
                more = node.remote.locate_prefix(keys[n:])
            return CountReply(n=n + more)

        return Later(locate)
    return CountReply(n=n)


def op_stats(node, req: Stats) -> Reply:
    return StatsReply(
        node_id=node.config.node_id,
        pages=node.store.counts(),
        page_bytes=node.page_bytes,
        counters=node.metrics.snapshot(),
        addresses={str(k): v for k, v in node.addresses.items()},
    )


def op_ls(node, req: Ls) -> Reply:
    return LsReply(tiers=node.store.ls(req.limit))


def op_evict(node, req: Evict) -> Reply:
    return CountReply(n=node.store.evict(req.tier))


def op_demote(node, req: Demote) -> Reply:
    return CountReply(n=node.store.demote(_keys(node, req)))


def op_retain(node, req: Retain) -> Reply:
    return CountReply(n=node.store.retain(req.session, _keys(node, req), req.ttl_s))


def op_prefetch(node, req: Prefetch) -> Reply | Later:
    keys = _keys(node, req)
    remote = req.remote and node.remote is not None
    return Later(lambda: CountReply(n=node.prefetch(keys, remote)))


HANDLERS: dict[type, Callable[[Any, Any], Reply | Later]] = {
    Hello: op_hello,
    Put: op_put,
    Commit: op_commit,
    Abort: op_abort,
    Get: op_get,
    Release: op_release,
    Contains: op_contains,
    Stats: op_stats,
    Ls: op_ls,
    Evict: op_evict,
    Demote: op_demote,
    Retain: op_retain,
    Prefetch: op_prefetch,
}


def handle_request(node, req: NodeRequest) -> Reply | Later:
    """Run one decoded request; raise StoreError for anything the caller got wrong."""
    return HANDLERS[type(req)](node, req)
