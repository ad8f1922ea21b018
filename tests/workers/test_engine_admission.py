"""Admission never blocks the step: a store fetch stuck on a black-holed peer delays only its own
request (recomputed once the engine gives up on it), while the running batch keeps decoding.

Real components: a store node (thread) with its page directory in a real Valkey, a peer
registered in that directory whose TCP address accepts connections and never answers, the
real StoreClient/StoreConnector, and the real model."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
import redis
import torch

from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import page_keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine import kv_cache_manager
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

PAGE = 16
PREFIX = "admtest:"
LOGGER = kv_cache_manager.__name__


@pytest.fixture
def store(tmp_path, loaded_model, valkey):
    """(run_dir, spec) of a store node whose peer lookups go through the Valkey directory."""
    from kvrelay.kvstore.config import StoreConfig
    from kvrelay.kvstore.page import PageSpec
    from kvrelay.kvstore.server import StoreNode, arena_path

    c = loaded_model.config
    spec = PageSpec(loaded_model.fingerprint, "float32", c.num_layers, PAGE, c.num_kv_heads,
                    c.head_dim)  # fmt: skip
    config = StoreConfig(node_id=f"adm{os.getpid()}", run_dir=str(tmp_path / "run"),
                         arena_bytes=48 * spec.slot_bytes, page_bytes=spec.page_bytes,
                         tcp_port=0, ucx_port=-1, transport="tcp", redis_url=valkey.url,
                         key_prefix=PREFIX, transfer_timeout_s=3.0)  # fmt: skip
    node = StoreNode(config, spec.page_bytes)
    node.start()
    thread = threading.Thread(target=node.serve_forever, daemon=True)
    thread.start()
    yield config.run_dir, spec
    node.stop()
    thread.join(timeout=10)
    node.close()
    arena_path(config).unlink(missing_ok=True)


def _connector(run_dir: str, spec):
    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.connector import StoreConnector

    return StoreConnector(StoreClient(run_dir, spec, timeout_s=10.0))


def test_slow_store_fetch_delays_only_its_own_request(loaded_model, store, valkey, caplog):
    run_dir, spec = store
    g = torch.Generator().manual_seed(5)
    prompt_a = torch.randint(100, 40000, (20,), generator=g).tolist()
    prompt_b = torch.randint(100, 40000, (70,), generator=g).tolist()
    prompt_c = torch.randint(100, 40000, (40,), generator=g).tolist()
    sp = SamplingParams(max_tokens=24, temperature=0.7, seed=4, ignore_eos=True)
    # fp32 pages: the store's PageSpec and the directory's page keys use the fp32 fingerprint
    refs = Engine(EngineConfig(num_blocks=32, kv_cache_dtype="fp32"), loaded=loaded_model).generate(
        [prompt_a, prompt_b, prompt_c], [sp] * 3, ["a", "b", "c"]
    )
    # A peer "holding" B's prompt pages: it accepts TCP connections and never answers.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    r = redis.Redis.from_url(valkey.url)
    keys = Keys(PREFIX)
    r.hset(keys.store_node("blackhole"), mapping={"tcp": f"127.0.0.1:{hole.getsockname()[1]}"})
    b_keys = page_keys(prompt_b[:-1], PAGE, loaded_model.fingerprint)
    assert len(b_keys) == 4
    for key in b_keys:
        r.hset(keys.pages, key.hex(), "blackhole")

    config = EngineConfig(num_blocks=32, max_num_seqs=4, kv_cache_dtype="fp32")
    engine = Engine(config, loaded=loaded_model)
    conns = [_connector(run_dir, spec) for _ in range(3)]  # saves, two loader threads
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            _run(engine, conns, [prompt_a, prompt_b, prompt_c], sp, refs, caplog)
    finally:
        for conn in conns:
            conn.client.close()  # open zmq sockets would hold up the interpreter's exit
        hole.close()
        r.close()


def _run(engine, conns, prompts, sp, refs, caplog) -> None:
    engine.set_kv_connector(conns[0], conns[1:])
    engine.kv.fetch_timeout_s = 1.5  # give up before the node's 3 s transfer bound
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    engine.add_request("a", prompts[0], sp)
    while not got["a"]:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    engine.add_request("b", prompts[1], sp)
    engine.add_request("c", prompts[2], sp)  # behind B, nothing in the store
    a_before, given_up, first_step = len(got["a"]), None, {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            first_step.setdefault(out.request_id, step)
            if out.request_id == "b" and given_up is None:
                given_up = [r.getMessage() for r in caplog.records if r.name == LOGGER]
                a_during = len(got["a"]) - a_before
                assert out.num_cached_tokens == 0  # nothing came from the store: recomputed
    # B was held back by its own fetch until the engine gave up on it (past 1.5 s on its
    # clock), while A kept decoding: a fetch awaited inside a step would admit B in the step
    # that started it, so A would have one token in that time (and B its first at once),
    # however slow the machine.
    assert given_up == ["store fetch for request b took over 1.5s; recomputing"]
    assert a_during >= 2
    assert first_step["c"] <= first_step["b"]  # C, queued behind B, did not wait for B's fetch
    assert [got[k] for k in "abc"] == [ref.output_token_ids for ref in refs]
    # the abandoned load's blocks come back once the node's transfer bound has passed
    deadline = time.monotonic() + 10
    while engine.pool.num_free_blocks < engine.num_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
        engine.kv.start_admission()
    assert engine.pool.num_free_blocks == engine.num_blocks
    assert engine.kv.num_store_errors == 0  # a miss after a timeout, not an error
