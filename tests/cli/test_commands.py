"""Smaller promises of the CLI: `--version`, what `down` and `dlq purge` say, and `generate
--batch-file` writing its results in input order with the model's sampling defaults."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from kvrelay.cli.up.launch import Program, Supervisor
from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, Keys
from kvrelay.pipeline.queue.streams import Streams
from tests.cli.in_process import run


def test_version_is_the_installed_package_version(capsys):
    # before: `kvrelay: error: unrecognized arguments: --version`, exit 2
    assert run(capsys, "--version") == (0, f"kvrelay {version('kvrelay')}\n", "")


def test_down_says_what_it_stopped(capsys, tmp_path: Path):
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    sup = Supervisor(tmp_path)
    sup.write([Program("a", sleep), Program("b", sleep)], nodaemon=False,
              state={"programs": ["a", "b"]})  # fmt: skip
    sup.start(detach=True)
    try:
        sup.wait_running(["a", "b"], timeout=30)
        pid = sup.pid()
        # before: nothing on stdout
        stopped = f"stopped the stack in {tmp_path.resolve()} (supervisord pid {pid}): a, b\n"
        assert run(capsys, "down", "--run-dir", str(tmp_path)) == (0, stopped, "")
        assert sup.pid() is None
    finally:
        sup.stop()
    assert run(capsys, "down", "--run-dir", str(tmp_path)) == (
        0, "", f"kvrelay down: nothing running in {tmp_path.resolve()}\n")  # fmt: skip


def test_dlq_purge_counts_in_words(r, valkey_session, capsys):
    keys = Keys("pg:")
    s = Streams(r, keys, "w1")
    s.ensure_group(keys.decode_stream, DECODE_GROUP)
    for n in (1, 2):
        for _ in range(n):
            r.xadd(keys.decode_stream, {MESSAGE_FIELD: b"x"})
            [entry] = s.read(keys.decode_stream, DECODE_GROUP, 1, None)
            s.dead_letter(keys.decode_stream, DECODE_GROUP, entry.entry_id, entry.payload, "bad")
        done = run(capsys, "dlq", "purge", "--yes", "--redis-url", valkey_session.url,
                   "--key-prefix", "pg:")  # fmt: skip
        # before: "purged 1 entries"
        assert done == (0, f"purged {n} {'entry' if n == 1 else 'entries'}\n", "")


def test_serve_refuses_an_address_it_cannot_listen_on_in_one_line(capsys):
    # before: an OverflowError traceback from asyncio (port 99999), uvicorn's own error lines
    refused = "kvrelay serve: error: port must be 0-65535 (0: any free port), got 99999\n"
    assert run(capsys, "serve", "--port", "99999") == (2, "", refused)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert run(capsys, "serve", "--port", str(port)) == (
            2, "", f"kvrelay serve: error: port {port} on 127.0.0.1 is in use\n")  # fmt: skip


def test_store_that_cannot_create_its_run_dir_fails_in_one_line(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a run dir under a file cannot be created
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "store", "--run-dir", str(blocker / "run"),
         "--page-bytes", "64"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # before: a NotADirectoryError traceback
    assert (done.returncode, done.stdout, done.stderr) == (
        1, "", f"kvrelay store: error: cannot start the store node (Not a directory: "
               f"{blocker / 'run'})\n")  # fmt: skip


ASK = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
BATCH = [
    {"id": "defaults", "messages": ASK, "seed": 7},  # the model's: temperature 0.2, top_p 0.9
    {"id": "given", "messages": ASK, "seed": 7, "temperature": 0.2, "top_p": 0.9},
    {"id": "openai", "messages": ASK, "seed": 7, "temperature": 1.0, "top_p": 1.0},
    {"id": "short", "messages": ASK, "max_tokens": 1},  # finishes first
]


@pytest.fixture(scope="module")
def batch_results(tmp_path_factory) -> list[dict]:
    """`kvrelay generate --batch-file --json` of BATCH: one result per printed line."""
    path = tmp_path_factory.mktemp("batch") / "batch.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in BATCH))
    env = {**os.environ, "KVRELAY_WORKER_KV_CACHE_BYTES": str(24 << 20)}
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "generate", "--batch-file", str(path),
         "--json", "--max-tokens", "12", "--num-threads", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_generate_batch_results_come_in_input_order(batch_results):
    # before: in completion order, "short" first
    assert [(r["id"], r["line"]) for r in batch_results] == [
        ("defaults", 1), ("given", 2), ("openai", 3), ("short", 4)]  # fmt: skip
    assert [len(r["token_ids"]) for r in batch_results][3] == 1


def test_generate_applies_the_models_sampling_defaults(batch_results):
    # the flags and the line's fields > the model's defaults > OpenAI's (temperature 1.0)
    by_id = {r["id"]: r["token_ids"] for r in batch_results}
    assert by_id["defaults"] == by_id["given"]  # before: sampled at temperature 1.0
    assert by_id["defaults"] != by_id["openai"]
    assert all(len(tokens) == 12 for tokens in (by_id["given"], by_id["openai"]))
