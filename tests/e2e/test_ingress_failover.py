"""A killed ingress among several behind one address: its clients reconnect to the same URL (the
kernel hands the connection to a live ingress, SO_REUSEPORT), resume with Last-Event-ID and get
exactly the tokens an undisturbed run gives; a repeated X-Request-Id reattaches at any ingress.

The stack: `kvrelay up --ingresses 2` with one decode worker (prefilling locally). Six greedy
streams, each on its own connection, are spread by the kernel over the two ingresses; once
every stream has its first tokens, the ingress serving most of the unfinished ones (found from
each connection's server side in /proc) is SIGKILLed; supervisord restarts it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvrelay.cli.up.launch import listens
from kvrelay.cli.up.topology import ingress_programs
from tests.e2e.chaos_client import StreamResult, stream_chat
from tests.e2e.stack import MODEL, Stack

NUM_STREAMS = 6
MAX_TOKENS = 48
TOPICS = ["a lighthouse", "the moon", "a small dog", "rain in the city", "an old clock",
          "the ocean"]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("ingresses"), prefill=0, decode=1,
              extra=["--ingresses", "2"])  # fmt: skip
    s.up()
    yield s
    s.down()


def _body(i: int, salt: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a short story about {TOPICS[i]}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "cache_salt": salt,
    }


def _server_pid(port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of `pids` holds the server side of the loopback connection from `client_port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()  # sl local_address rem_address st ... inode
            local, remote = (int(a.rsplit(":", 1)[1], 16) for a in (f[1], f[2]))
            if f[3] == "01" and (local, remote) == (port, client_port):  # 01 = ESTABLISHED
                inodes.add(f"socket:[{f[9]}]")
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except OSError:
                continue
    return None


def _run(stack: Stack, salt: str, kill: bool) -> tuple[dict[int, StreamResult], dict]:
    """The streams, each on a connection of its own; with `kill`, once every stream has tokens
    SIGKILL the ingress serving most of the unfinished ones. Returns the results and what was
    killed (program, pid, the streams it was serving unfinished)."""
    results = {i: StreamResult(f"{salt}-{i}") for i in range(NUM_STREAMS)}
    killed: dict = {}

    def one(i: int) -> StreamResult:
        with httpx.Client() as client:
            body, rid = _body(i, salt), results[i].request_id
            return stream_chat(client, stack.url, body, rid, give_up_s=300, res=results[i])

    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(one, i) for i in range(NUM_STREAMS)]
        if kill:
            deadline = time.monotonic() + 180
            while not all(r.num_tokens or r.done for r in results.values()):
                assert time.monotonic() < deadline, "the streams did not start" + stack.logs()
                time.sleep(0.01)
            killed = _kill_busiest_ingress(stack, list(results.values()))
        for f in futures:
            f.result()
    return results, killed


def _kill_busiest_ingress(stack: Stack, streams: list[StreamResult]) -> dict:
    status = stack.sup.status()
    programs = {status[n][1]: n for n in ingress_programs(stack.state)}
    serving: dict[int, list[str]] = {pid: [] for pid in programs}
    for s in streams:
        if not s.done and s.client_ports:
            pid = _server_pid(stack.port, s.client_ports[-1], list(programs))
            if pid is not None:
                serving[pid].append(s.request_id)
    pid = max(serving, key=lambda p: len(serving[p]))
    os.kill(pid, signal.SIGKILL)
    return {"program": programs[pid], "pid": pid, "streams": serving[pid], "serving": serving}


def test_clients_of_a_killed_ingress_resume_at_another_with_identical_tokens(stack):
    assert ingress_programs(stack.state) == ["ingress", "ingress-1"]
    got, killed = _run(stack, "fault", kill=True)
    print(f"\nkilled {killed}")
    victims = killed["streams"]
    # the premise: the killed ingress was serving streams that had not ended
    assert victims, f"no unfinished stream on the killed ingress: {killed}"
    new_pid = stack.wait_restarted(killed["program"], killed["pid"])  # supervisord's restart
    ref, _ = _run(stack, "ref", kill=False)
    for i, g in got.items():
        r = ref[i]
        assert (r.error, r.index_errors, r.done) == (None, [], True), (i, r)
        assert (g.error, g.index_errors, g.done) == (None, [], True), (i, g)
        assert (g.text, g.finish_reason, g.num_tokens) == (r.text, r.finish_reason, r.num_tokens)
    # the streams the kill cut (one may have ended just before it) reconnected to the same URL
    # and resumed with Last-Event-ID; the others were not disturbed
    resumed = {g.request_id for g in got.values() if g.reattaches}
    assert resumed and resumed <= set(victims), (resumed, killed)
    # a repeated X-Request-Id submission reattaches at whichever ingress takes it: the whole
    # answer again, as first delivered
    for rid in victims:
        i = int(rid.rsplit("-", 1)[1])
        body = {**_body(i, "fault"), "logprobs": True}  # as streamed, minus the stream
        whole = httpx.post(f"{stack.url}/v1/chat/completions", json=body,
                           headers={"X-Request-Id": rid}, timeout=60)  # fmt: skip
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["message"]["content"] == got[i].text
    # the restarted ingress listens again on the shared address (once its app has started)
    deadline = time.monotonic() + 60
    while listens(new_pid, stack.port) is not True:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)
    assert stack.sup.status()[killed["program"]] == ("RUNNING", new_pid)
    # `kvrelay status` lists each ingress program
    status = [sys.executable, "-m", "kvrelay.cli.main", "status", "--run-dir", str(stack.run_dir)]
    done = subprocess.run([*status, "--json"], capture_output=True, text=True, timeout=60)
    text = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert (done.returncode, text.returncode) == (0, 0), done.stderr + text.stderr
    pids = {name: pid for name, (_state, pid) in stack.sup.status().items()}
    assert json.loads(done.stdout)["ingresses"] == [
        {"program": name, "state": "RUNNING", "pid": pids[name], "listening": True}
        for name in ("ingress", "ingress-1")
    ]
    assert text.stdout.splitlines()[-1] == (
        f"ingresses on port {stack.port} (shared): ingress running pid {pids['ingress']}, "
        f"ingress-1 running pid {pids['ingress-1']}"
    )
