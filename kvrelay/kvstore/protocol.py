"""Local request handlers of the store node (one function per op, dispatched by `op`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.kvstore.errors import StoreError
from kvrelay.kvstore.remote import check_request


@dataclass(slots=True)
class Later:
    """A reply that needs peers or Redis: the node runs `run()` on a pool thread."""

    run: Callable[[], dict]


def _keys(node, req: dict) -> list[bytes]:
    return check_request(req, node.store.fingerprint, node.page_bytes)


def _slots(req: dict) -> list[int]:
    slots = req.get("slots", [])
    if not isinstance(slots, list) or not all(isinstance(s, int) for s in slots):
        raise StoreError("slots must be a list of slot numbers")
    return slots


def op_hello(node, req: dict) -> dict:
    _keys(node, req)  # refuses a wrong fingerprint or page size up front
    return {
        "node_id": node.config.node_id,
        "arena": str(node.arena.path),
        "num_slots": node.arena.num_slots,
        "page_bytes": node.page_bytes,
        "fingerprint": node.store.fingerprint,
        "remote": node.remote is not None,
        "gen": node.arena_gen,
    }


def op_put(node, req: dict) -> dict:
    return {"slots": node.store.reserve(_keys(node, req)), "gen": node.arena_gen}


def op_commit(node, req: dict) -> dict:
    keys, slots = _keys(node, req), _slots(req)
    if len(keys) != len(slots):
        raise StoreError("commit needs one slot per key")
    # Verify the payload CRC once, as the page enters the arena: a writer that published a
    # header before its copy finished (say an unsynchronised GPU copy) is caught here.
    return {"errors": node.store.commit(keys, slots, verify=True)}


def op_abort(node, req: dict) -> dict:
    keys, slots = _keys(node, req), _slots(req)
    node.store.abort(keys, slots)
    return {}


def op_get(node, req: dict) -> dict | Later:
    keys = _keys(node, req)
    slots = node.store.acquire(keys)
    if len(slots) < len(keys) and req.get("remote", True) and node.remote is not None:

        def fetch() -> dict:
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
            return {"slots": got, "gen": node.arena_gen}

        return Later(fetch)
    return {"slots": slots, "gen": node.arena_gen}


def op_release(node, req: dict) -> dict:
    node.store.release(_slots(req))
    return {}


def op_contains(node, req: dict) -> dict | Later:
    keys = _keys(node, req)
    n = node.store.contains_prefix(keys)
    if n < len(keys) and req.get("remote", True) and node.remote is not None:

        def locate() -> dict:
            more = 0
            with contextlib.suppress(Exception):  # Redis down: count only local pages
                more = node.remote.locate_prefix(keys[n:])
            return {"n": n + more}

        return Later(locate)
    return {"n": n}


def op_stats(node, req: dict) -> dict:
    return {
        "node_id": node.config.node_id,
        "pages": node.store.counts(),
        "page_bytes": node.page_bytes,
        "counters": node.metrics.snapshot(),
        "addresses": node.addresses,
    }


def op_ls(node, req: dict) -> dict:
    return node.store.ls(int(req.get("limit", 1000)))


def op_evict(node, req: dict) -> dict:
    return {"n": node.store.evict(str(req.get("tier", "host")))}


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


def handle_request(node, req: dict) -> dict | Later:
    """Dispatch one request; raise StoreError for anything the caller got wrong."""
    fn = OPS.get(req.get("op", ""))  # "" is no op
    if fn is None:
        raise StoreError(f"unknown op {req.get('op')!r}; known: {sorted(OPS)}")
    return fn(node, req)
