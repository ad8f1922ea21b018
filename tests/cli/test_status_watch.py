"""`kvrelay status --watch` rendered in a real pseudo-terminal against a real Valkey, a real store
node and a worker's real /metrics endpoint; SIGINT (Ctrl-C) ends it with exit code 0."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from types import SimpleNamespace

import pytest
import redis

from kvrelay.cli.status_data import RateSampler, parse_metrics
from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask
from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.config import StoreConfig
from kvrelay.kvstore.server import arena_path
from kvrelay.pipeline.queue.streams import Streams
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.metrics import WorkerMetrics
from tests.kvstore.conftest import SMALL, RunningNode, keys_for, payload

KEYS = Keys("watch:")
ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][A-Z0-9])")


def test_rate_sampler_is_exact():
    s = RateSampler()
    assert s.rate("w", 100.0, 10.0) is None  # first sample: no rate yet
    assert s.rate("w", 150.0, 10.5) == 100.0
    assert s.rate("w", 150.0, 11.0) == 0.0
    assert s.rate("w", 20.0, 12.0) is None  # counter went back: the worker restarted
    assert s.rate("w", 50.0, 13.0) == 30.0
    text = 'a_total{x="1"} 2.0\na_total{x="2"} 3.5\n# HELP b\nb 7\nc 1\n'
    text += 'kvrelay:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0\n'
    assert parse_metrics(text, {"a_total": "a", "b": "b"}) == {"a": 5.5, "b": 7.0, "num_blocks": 64}


@pytest.fixture
def stack(valkey_session, tmp_path):
    """Valkey seeded with two workers, a lagging stream and a DLQ entry; a store node holding 3
    pages (3 hits, 1 miss); a worker /metrics endpoint (pool 2/8 used, 16 of 32 tokens hit)."""
    r = redis.Redis.from_url(valkey_session.url)
    r.flushdb()
    run_dir = str(tmp_path / "store")
    config = StoreConfig(node_id="w0", run_dir=run_dir, arena_bytes=64 << 10,
                         page_bytes=SMALL.page_bytes, tcp_port=-1, ucx_port=-1)  # fmt: skip
    node = RunningNode(config)
    pool = BlockPool(8)
    pool.allocate(2)
    metrics = WorkerMetrics("m", SimpleNamespace(pool=pool))
    try:
        with StoreClient(run_dir, SMALL) as client:
            client.put(keys_for(3), [payload(SMALL, i) for i in range(3)])
            assert len(client.get(keys_for(4))) == 3
            slots = client.stats()["pages"]["host_slots"]
        metrics.finished(32, 16)
        metrics.generation_tokens.inc(100)
        port = metrics.serve(0)
        s = Streams(r, KEYS, "c1")
        s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
        for i in range(3):
            task = PrefillTask(request_id=f"q{i}", prompt_token_ids=[1], sampling={})
            r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
        s.read(KEYS.prefill_stream, PREFILL_GROUP, 2, None)
        r.xadd(KEYS.dlq, {MESSAGE_FIELD: b"", "reason": "boom"})
        now = time.time()
        r.hset(KEYS.worker("decode-0"), mapping={
            "name": "decode-0", "role": "decode", "host": socket.gethostname(), "updated": now,
            "draining": 1, "load": 0, "running": 0, "waiting": 0, "tokens_per_s": "3.5",
            "metrics_port": port, "kernel_isa": "avx2", "kv_dtype": "bfloat16",
            "attention": "fp32", "speculation": "ngram", "startup_s": "2.46",
        })  # fmt: skip
        r.hset(KEYS.worker("prefill-0"), mapping={
            "name": "prefill-0", "role": "prefill", "updated": now, "draining": 0,
            "load": 3, "running": 2, "waiting": 1, "tokens_per_s": "1.5", "metrics_port": "",
        })  # fmt: skip
        state = {"redis_url": valkey_session.url, "key_prefix": "watch:", "store_run_dir": run_dir}
        (tmp_path / "stack.json").write_text(json.dumps(state))
        yield SimpleNamespace(run_dir=str(tmp_path), slots=slots, r=r)
    finally:
        metrics.close()
        node.stop()
        arena_path(config).unlink(missing_ok=True)
        r.close()


def _read_until(fd: int, proc: subprocess.Popen, wanted, timeout_s: float) -> str:
    """Terminal output (escape codes removed) until `wanted(text)` holds; fails on timeout."""
    raw = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                raw += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
        text = ANSI.sub("", raw.decode(errors="replace"))
        if wanted(text):
            return text
        assert proc.poll() is None, f"exited {proc.returncode}: {text[-2000:]}"
    raise AssertionError(f"not rendered in {timeout_s}s: {ANSI.sub('', raw.decode())[-3000:]}")


def _exit_code(fd: int, proc: subprocess.Popen, timeout_s: float) -> int | None:
    """Wait for `proc` to exit while reading its terminal: a child blocked writing to a full
    terminal (frames keep coming until Ctrl-C is handled) would never exit otherwise."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _row(*cells: str) -> re.Pattern:
    return re.compile(r"\s*│\s*".join(re.escape(c) for c in cells))


def test_watch_renders_in_a_terminal_and_ctrl_c_exits_0(stack):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 150, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="150", LINES="60")
    env.pop("NO_COLOR", None)
    cmd = [sys.executable, "-m", "kvrelay.cli.main", "status", "--watch", "--interval",
           "0.3", "--run-dir", stack.run_dir]  # fmt: skip
    # Ctrl-C must reach the watch even when this test runs in a background job (which starts
    # with SIGINT ignored, and a child inherits that: Python then installs no handler)
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env,
                            preexec_fn=_default_sigint)  # fmt: skip
    os.close(slave)
    try:
        first = [
            "Workers", "Streams", "KV cache", "DLQ: 1 entry", "requests in flight: 0",
            "tokens/s: 5.0", "store w0; device hits are prompt tokens",
        ]  # fmt: skip
        rows = [
            _row("decode-0", "decode", "drained", "0", "0", "25%", "3.5"),
            _row("prefill-0", "prefill", "ok", "2", "1", "-", "1.5"),
            # START, KERNELS, KV, ATTN, SPEC
            re.compile(
                r"decode-0.*s ago\s*│\s*2\.5s\s*│\s*avx2\s*│\s*bf16\s*│\s*fp32\s*│\s*ngram\s*│"
            ),
            re.compile(r"prefill-0.*s ago\s*│\s*-\s*│\s*-\s*│\s*-\s*│\s*-\s*│\s*-\s*│"),
            _row("prefill", "3", "1", "2", "1"),  # stage, length, lag, pending, consumers
            _row("decode", "0", "-", "0", "0"),
            _row("device (worker pools)", "2/8", "25%", "16/32", "50%"),
            _row("host (DRAM arena)", f"3/{stack.slots}", f"{3 / stack.slots:.0%}", "3/4", "75%"),
            _row("disk", "0", "-", "0/0", "-"),
        ]

        def first_frame(text: str) -> bool:
            return all(s in text for s in first) and all(p.search(text) for p in rows)

        _read_until(master, proc, first_frame, 30)
        # later refreshes sample decode-0's counter (flat: 0 tok/s) instead of its heartbeat
        sampled = _row("decode-0", "decode", "drained", "0", "0", "25%", "0.0")
        _read_until(master, proc, lambda t: "tokens/s: 1.5" in t and sampled.search(t), 10)
        stack.r.xadd(KEYS.dlq, {MESSAGE_FIELD: b"", "reason": "again"})
        _read_until(master, proc, lambda t: "DLQ: 2 entries" in t, 10)
        proc.send_signal(signal.SIGINT)
        assert _exit_code(master, proc, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_a_failed_refresh_is_shown_and_the_watch_goes_on():
    import io

    from rich.console import Console

    from kvrelay.cli.status_watch import watch

    snapshot = {
        "time": 0.0, "workers": [], "streams": [], "dlq": 0, "requests_in_flight": 0,
        "tokens_per_s": 0.0, "tiers": [], "store": None, "topology": {"summary": "none"},
    }  # fmt: skip
    calls = []

    def collect():
        calls.append(len(calls))
        if len(calls) == 2:
            raise redis.ConnectionError("Connection refused")
        if len(calls) == 4:
            raise KeyboardInterrupt  # Ctrl-C while fetching
        return snapshot

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    assert watch(collect, "redis://x", 0.01, console) == 0
    text = ANSI.sub("", out.getvalue())
    assert len(calls) == 4
    assert "refresh failed: Connection refused (showing the last snapshot)" in text
    assert "DLQ: dead-letter stream is empty" in text and "(no live workers)" in text
    assert "no store node (give --run-dir)" in text
