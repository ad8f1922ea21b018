"""A store node killed with a fetch in flight: the engine learns it from the node's socket, not
from `fetch_timeout_s`, recomputes, asks nothing of the node while it is down, and uses it again
once it is back.

Real components: `kvrelay store` in a child process (SIGKILLed, then started again as
supervisord would), its page directory in a real Valkey, a peer registered there whose TCP
address accepts connections and never answers (so a fetch stays in flight on a live node), the
real StoreClient/StoreConnector and the real model."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis
import torch

from kvrelay.core.keys import Keys
from kvrelay.core.page_keys import page_keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.kvstore import liveness
from kvrelay.kvstore.errors import StoreNodeDownError
from kvrelay.workers.engine import kv_cache_manager
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

PAGE = 16
PREFIX = "outage:"
FOREVER = 600.0  # every timeout of the test: none of them may be what ends the fetch
NODE_LOG = liveness.__name__
ENGINE_LOG = kv_cache_manager.__name__


class StoreProcess:
    """`kvrelay store` in a child process; `kill()` is SIGKILL, `start()` starts it again."""

    def __init__(self, run_dir: str, redis_url: str, spec):
        from kvrelay.kvstore.config import StoreConfig

        self.config = StoreConfig(node_id=f"outage{os.getpid()}", run_dir=run_dir)
        self.spec = spec
        self.redis_url = redis_url
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        from kvrelay.kvstore.client import StoreClient

        self.proc = subprocess.Popen([
            sys.executable, "-m", "kvrelay.cli.main", "--log-level", "WARNING", "store",
            "--node-id", self.config.node_id, "--run-dir", self.config.run_dir,
            "--redis-url", self.redis_url, "--key-prefix", PREFIX,
            "--arena-bytes", str(48 * self.spec.slot_bytes),
            "--page-bytes", str(self.spec.page_bytes), "--fingerprint", self.spec.fingerprint,
            "--tcp-port", "0", "--ucx-port", "-1", "--transport", "tcp",
            "--transfer-timeout-s", str(FOREVER),
        ])  # fmt: skip
        deadline = time.monotonic() + 60
        with StoreClient(self.config.run_dir, self.spec, timeout_s=0.5) as client:
            while True:
                try:
                    client.connect()
                    return
                except Exception:
                    assert self.proc.poll() is None, "store node exited"
                    assert time.monotonic() < deadline, "store node did not start"
                    time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        from kvrelay.kvstore.server import arena_path

        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        arena_path(self.config).unlink(missing_ok=True)


def _connectors(run_dir: str, spec, n: int) -> list:
    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.connector import StoreConnector

    return [StoreConnector(StoreClient(run_dir, spec, timeout_s=FOREVER)) for _ in range(n)]


def _run(engine: Engine, got: dict[str, list[int]], first: dict) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            first.setdefault(out.request_id, out)


def test_killed_store_is_given_up_on_at_once_skipped_while_down_and_used_once_back(
    loaded_model, valkey, tmp_path, caplog
):
    from kvrelay.kvstore.page import PageSpec

    c = loaded_model.config
    spec = PageSpec(loaded_model.fingerprint, "float32", c.num_layers, PAGE, c.num_kv_heads,
                    c.head_dim)  # fmt: skip
    g = torch.Generator().manual_seed(11)
    prompts = {k: torch.randint(100, 40000, (n,), generator=g).tolist()
               for k, n in (("b", 40), ("c", 24), ("d", 40))}  # fmt: skip
    sp = SamplingParams(max_tokens=4, temperature=0.7, seed=3, ignore_eos=True)
    config = EngineConfig(num_blocks=48, max_num_seqs=4, kv_cache_dtype="fp32")
    refs = Engine(config, loaded=loaded_model).generate(list(prompts.values()), sp, list(prompts))
    want = {k: ref.output_token_ids for k, ref in zip(prompts, refs, strict=True)}

    # A peer "holding" B's prompt pages: it accepts the node's connection and never answers,
    # so B's load stays in flight on a node that is alive (slow, not dead).
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    dialled = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        try:
            held.append(hole.accept()[0])
            dialled.set()
        except OSError:  # closed at the end
            pass

    threading.Thread(target=accept, daemon=True).start()
    r = redis.Redis.from_url(valkey.url)
    keys = Keys(PREFIX)
    r.hset(keys.store_node("blackhole"), mapping={"tcp": f"127.0.0.1:{hole.getsockname()[1]}"})
    for key in page_keys(prompts["b"][:-1], PAGE, loaded_model.fingerprint):
        r.hset(keys.pages, key.hex(), "blackhole")

    node = StoreProcess(str(tmp_path / "run"), valkey.url, spec)
    engine = Engine(config, loaded=loaded_model)
    conns = _connectors(node.config.run_dir, spec, 3)  # saves, two loader threads
    got: dict[str, list[int]] = {}
    first: dict = {}
    try:
        node.start()
        engine.set_kv_connector(conns[0], conns[1:])
        kv = engine.kv
        kv.fetch_timeout_s = FOREVER  # so a fetch given up on was not given up by its clock
        with caplog.at_level(logging.DEBUG, logger=ENGINE_LOG):
            # 1. B's load is in flight, on a live node: it waits, however long
            engine.add_request("b", prompts["b"], sp)
            deadline = time.monotonic() + 60
            while not dialled.is_set():
                assert time.monotonic() < deadline, "the node never dialled the peer"
                assert engine.step() == []
            stalled_until = time.monotonic() + 1.0
            while time.monotonic() < stalled_until:
                assert engine.step() == []  # B still waits for its fetch
            assert not kv.store_down() and kv.num_fetches_lost == 0
            # 2. SIGKILL the node: the fetch is given up on as soon as its socket closes
            killed_at = time.time()
            node.kill()
            _run(engine, got, first)
        lost = [rec for rec in caplog.records if rec.name == ENGINE_LOG and "lost" in rec.msg]
        assert [rec.getMessage() for rec in lost] == [
            "store node lost during request b's fetch; recomputing"
        ]
        gone = [rec for rec in caplog.records if rec.name == NODE_LOG and "went away" in rec.msg]
        print(f"\nkill -> node declared down {gone[0].created - killed_at:.3f}s, "
              f"-> fetch abandoned {lost[0].created - killed_at:.3f}s "
              f"(fetch_timeout_s {FOREVER:.0f}s)")  # fmt: skip
        assert (kv.num_fetches_lost, kv.num_fetch_timeouts, kv.num_store_errors) == (1, 0, 0)
        assert first["b"].num_cached_tokens == 0  # recomputed
        assert got["b"] == want["b"]

        # 3. While the node is down no admission asks it (no per-request wait), nothing is
        # saved to it, a direct call fails without waiting; the outage is one warning, not
        # one per request
        assert kv.store_down()
        engine.add_request("c", prompts["c"], sp)
        _run(engine, got, first)
        assert got["c"] == want["c"] and first["c"].num_cached_tokens == 0
        assert kv.num_store_skips == 1
        with pytest.raises(StoreNodeDownError, match="is down; 'contains' not sent"):
            conns[1].client.lookup(page_keys(prompts["c"], PAGE, loaded_model.fingerprint))
        node_logs = [rec.getMessage() for rec in caplog.records if rec.name == NODE_LOG]
        assert [m.split(" went away")[0] for m in node_logs if "went away" in m] == [
            f"store node at ipc://{node.config.socket_path}"
        ]

        # 4. Back (as supervisord restarts it): one warning, and the engine asks it and
        # saves to it again
        node.start()
        assert conns[1].liveness.wait_up(30)
        assert not kv.store_down()
        d_keys = page_keys(prompts["d"], PAGE, loaded_model.fingerprint)
        assert len(d_keys) == 2 and conns[1].lookup(d_keys) == 0
        engine.add_request("d", prompts["d"], sp)
        _run(engine, got, first)
        assert got["d"] == want["d"]
        assert (kv.num_fetches_lost, kv.num_fetch_timeouts, kv.num_store_skips) == (1, 0, 1)
        assert conns[1].lookup(d_keys) == 2  # D's pages, saved to the restarted node
        back = [rec.getMessage() for rec in caplog.records if rec.name == NODE_LOG]
        assert len([m for m in back if " is back after " in m]) == 1
        assert len([m for m in back if " went away" in m]) == 1
    finally:
        for conn in conns:
            conn.client.close()  # open zmq sockets would hold up the interpreter's exit
        node.close()
        hole.close()
        for s in held:
            s.close()
        r.close()
