"""`kvrelay up` reports readiness progress as it changes, and passes its ingress limits through."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from kvrelay.cli.up.progress import LOADING, REMIND_S, WORKER_PHASES
from tests.conftest import free_port
from tests.e2e.stack import kvrelay_up

PROGRAMS = ["valkey", "store", "ingress", "decode-0"]
WAITING = re.compile(r"^kvrelay up: waiting: (.*) \((\d+) s\)$")
READY = re.compile(r"^kvrelay up: ready in \d+\.\d s: valkey, store, ingress, decode-0 up$")
SUPERVISOR_STATES = {"starting", "backoff", "stopped", "exited", "missing"}
# a worker's phases in the order it goes through them
WORKER_ORDER = [*SUPERVISOR_STATES, LOADING, *(phase for _text, phase in WORKER_PHASES), "up"]


def parse(line: str) -> tuple[dict[str, str], int]:
    """({program: what}, seconds) of one `waiting:` line."""
    match = WAITING.match(line)
    assert match, line
    parts = match.group(1).split(", ")
    names = [part.split(" ", 1)[0] for part in parts]
    assert names == PROGRAMS, line
    return {n: part.split(" ", 1)[1] for n, part in zip(names, parts, strict=True)}, int(
        match.group(2)
    )


def test_up_prints_progress_and_runs_the_ingress_with_its_limits(tmp_path: Path):
    port = free_port()
    limits = ["--max-waiting", "7", "--max-inflight", "9", "--max-body-bytes", "2000",
              "--request-timeout", "45", "--disconnect-grace", "3"]  # fmt: skip
    done = kvrelay_up(tmp_path, port, "--prefill", "0", "--arena-bytes", str(64 << 20),
                      "--kv-cache-bytes", str(96 << 20), "--timeout", "150", *limits)  # fmt: skip
    try:
        assert done.returncode == 0, done.stderr
        lines = done.stderr.splitlines()
        # a cold model cache converts first (`kvrelay: converting ...`), then `up` launches
        top = next(i for i, line in enumerate(lines) if line.startswith("kvrelay: topology: "))
        assert all(line.startswith("kvrelay: ") for line in lines[:top]), lines[:top]
        assert lines[top].startswith("kvrelay: topology: 1 decode worker, ")
        assert lines[top + 1].startswith("kvrelay: weights: ")
        assert READY.match(lines[-1]), lines[-1]
        steps = [parse(line) for line in lines[top + 2 : -1]]
        assert steps, done.stderr
        # the first line shows the worker not up yet: `up` waited for it
        assert steps[0][0]["decode-0"] != "up"
        for (before, t0), (after, t1) in zip(steps, steps[1:], strict=False):
            assert before != after or t1 - t0 >= REMIND_S - 1, (before, after)  # only on change
            assert t0 <= t1
        for name in PROGRAMS:
            seen = [step[name] for step, _t in steps]
            assert set(seen) <= set(WORKER_ORDER), seen
            if name == "decode-0":  # a worker only moves forward through its phases
                ranks = [WORKER_ORDER.index(what) for what in seen]
                assert ranks == sorted(ranks), seen
            if "up" in seen:  # once up, a program stays up (nothing restarted)
                assert set(seen[seen.index("up") :]) == {"up"}, seen

        # the ingress runs with the limits `up` was given, as `kvrelay serve` flags
        conf = (tmp_path / "supervisord.conf").read_text()
        command = next(line for line in conf.splitlines() if " serve " in line)
        assert command.endswith(
            f"serve --host 127.0.0.1 --port {port} --max-body-bytes 2000 --max-waiting 7 "
            "--max-inflight 9 --request-timeout 45.0 --disconnect-grace 3.0"
        ), command
        state = json.loads(done.stdout.strip().splitlines()[-1])
        assert (state["ready"], state["store_node"]) == (True, "node0")
        body = {"model": "smollm2-135m-instruct", "prompt": "x" * 2100, "max_tokens": 1}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 413
        assert resp.json()["error"]["message"] == "the request body is larger than 2000 bytes"
        small = dict(body, prompt="Hi", max_tokens=2, temperature=0)
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=small, timeout=60)
        assert resp.status_code == 200, resp.text
    finally:
        subprocess.run(
            [sys.executable, "-m", "kvrelay.cli.main", "down", "--run-dir", str(tmp_path)],
            capture_output=True,
            timeout=120,
        )


def test_up_refuses_limits_the_ingress_would_refuse(tmp_path: Path):
    done = kvrelay_up(tmp_path, free_port(), "--max-waiting", "0")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "kvrelay up: error: ingress: max_waiting must be at least 1\n"
    assert not (tmp_path / "supervisord.conf").exists()
