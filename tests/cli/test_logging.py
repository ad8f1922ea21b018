"""What a `kvrelay` command logs on stderr: its own lines at the chosen level (INFO for the
services, WARNING for the other commands), other libraries' only from WARNING."""

from __future__ import annotations

import re
import subprocess
import sys

from kvrelay.core.keys import MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask
from kvrelay.pipeline.queue.streams import Streams

POLICY = """
import logging, sys
from kvrelay.cli.main import configure_logging
configure_logging(sys.argv[1])
for name in ("matplotlib.font_manager", "httpx", "asyncio", "urllib3.connectionpool",
             "kvrelay.bench.sweep", "kvrelay.workers.base"):
    logging.getLogger(name).debug("debug of %s", name)
    logging.getLogger(name).info("info of %s", name)
    logging.getLogger(name).warning("warning of %s", name)
"""
STAMP = re.compile(r"^\S+ \S+ ")  # "2026-11-23 18:41:47,123 "


def logged(level: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", POLICY, level], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
    return [STAMP.sub("", line) for line in done.stderr.splitlines()]


def test_other_libraries_log_warnings_only_whatever_the_level():
    assert logged("INFO") == [
        "WARNING matplotlib.font_manager: warning of matplotlib.font_manager",
        "WARNING httpx: warning of httpx",
        "WARNING asyncio: warning of asyncio",
        "WARNING urllib3.connectionpool: warning of urllib3.connectionpool",
        "INFO kvrelay.bench.sweep: info of kvrelay.bench.sweep",
        "WARNING kvrelay.bench.sweep: warning of kvrelay.bench.sweep",
        "INFO kvrelay.workers.base: info of kvrelay.workers.base",
        "WARNING kvrelay.workers.base: warning of kvrelay.workers.base",
    ]
    debug = logged("DEBUG")  # kvrelay's debug lines, never a library's
    assert [line for line in debug if line.startswith("DEBUG")] == [
        "DEBUG kvrelay.bench.sweep: debug of kvrelay.bench.sweep",
        "DEBUG kvrelay.workers.base: debug of kvrelay.workers.base",
    ]
    assert len(logged("ERROR")) == 0


def test_dlq_replay_force_prints_its_result_and_no_log_line(r, valkey_session):
    # before: stderr also had `... INFO kvrelay.pipeline.queue.dlq: replayed DLQ entry ...`
    keys = Keys("lg:")
    s = Streams(r, keys, "w1")
    s.ensure_group(keys.prefill_stream, PREFILL_GROUP)
    task = PrefillTask(request_id="p1", prompt_token_ids=[1, 2], sampling={})
    r.xadd(keys.prefill_stream, {MESSAGE_FIELD: task.encode()})
    [entry] = s.read(keys.prefill_stream, PREFILL_GROUP, 1, None)
    reason = "delivered 6 times, 5 times its holder died running it without progress (limit 5)"
    dlq_id = s.dead_letter(keys.prefill_stream, PREFILL_GROUP, entry.entry_id, entry.payload,
                           reason, "p1")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "dlq", "replay", dlq_id, "--force",
         "--redis-url", valkey_session.url, "--key-prefix", "lg:"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    new_id = r.xrevrange(keys.prefill_stream, count=1)[0][0].decode()
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"replayed {dlq_id} (request p1) to {keys.prefill_stream} as {new_id}; it had failed: "
        f"{reason}\n",
        f"kvrelay dlq: warning: replaying poison entry {dlq_id} (--force): {reason}\n",
    )
