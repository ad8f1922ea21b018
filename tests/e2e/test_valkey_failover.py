"""`kvrelay up --valkey-replicas 2`: a primary, 2 replicas and 3 Sentinels under supervisord.
The primary SIGKILLed mid-stream: a replica is promoted, every process follows it (workers,
ingress), the stream ends with the text of an undisturbed run, a new request is served (the
other replica follows the new primary: its submission is replicated), and the old primary comes
back as a replica of the new one. With the replicas stopped, a submission is refused (503
not_replicated) instead of being acknowledged unreplicated, and a retry with the same id is
answered, the request run once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial

import httpx
import pytest
import redis

from kvrelay.cli.up.sentinel_status import current_primary, node_role
from kvrelay.cli.up.valkey_sentinel import sentinel_ports
from tests.e2e.chat_stream import LIGHTHOUSE, openai_client, stream_killing
from tests.e2e.chat_stream import stream_text as chat_stream_text
from tests.e2e.stack import MODEL, Stack

SAMPLING = {"max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("run"), prefill=0, decode=1, extra=["--valkey-replicas", "2"])
    s.up()
    yield s
    s.down()


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)


stream_text = partial(chat_stream_text, sampling=SAMPLING)


def wait_for(ok, what: str, stack: Stack, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what}{stack.logs()}"
        time.sleep(0.2)


NODES = ("valkey", "valkey-replica-1", "valkey-replica-2")


def test_the_stack_runs_a_primary_two_replicas_and_three_sentinels(stack):
    state = stack.state
    assert state["redis_url"].startswith("redis+sentinel://127.0.0.1:")
    assert state["redis_url"].endswith("/kvrelay/0")
    ports = sentinel_ports(state)
    assert sorted(ports) == [*NODES, "valkey-sentinel-0", "valkey-sentinel-1", "valkey-sentinel-2"]
    assert current_primary(state) == "valkey"
    assert [node_role(ports[n]) for n in NODES] == ["master", "slave", "slave"]
    # `kvrelay status` reaches the primary through the Sentinels and shows the roles
    cmd = [sys.executable, "-m", "kvrelay.cli.main", "status", "--run-dir", str(stack.run_dir)]
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)["replication"]
    assert [(n["name"], n["role"], n.get("link")) for n in view["nodes"]] == [
        ("valkey", "master", None),
        ("valkey-replica-1", "slave", "up"),
        ("valkey-replica-2", "slave", "up"),
    ]
    assert [s["primary"] for s in view["sentinels"]] == ["valkey"] * 3
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "valkey-sentinel-2" in text.stdout and "names valkey primary" in text.stdout


def test_primary_sigkilled_mid_stream_the_stream_completes_identically(stack, client):
    ref_text, ref_reason = stream_text(client, "fo-ref")
    assert ref_reason == "length"
    old = current_primary(stack.state)
    results, errors, killed = stream_killing(stream_text, client, stack, "fo-victim", old)
    assert killed, "the stream ended before its 8th token"
    assert not errors, f"{errors!r}{stack.logs()}"
    assert results == [(ref_text, "length")]
    new = current_primary(stack.state)
    assert new in NODES[1:] and old == "valkey"
    # a new request after the failover completes, with the same text
    assert stream_text(client, "fo-after") == (ref_text, "length")
    # the old primary, restarted by supervisord, is turned into a replica of the new one
    ports = sentinel_ports(stack.state)
    wait_for(lambda: node_role(ports[old]) == "slave", f"{old} a replica", stack, 90)
    assert node_role(ports[new]) == "master"


def test_a_submission_no_replica_holds_is_refused_and_a_retry_queues_it(stack):
    primary = current_primary(stack.state)
    replicas = [n for n in NODES if n != primary]
    ports = sentinel_ports(stack.state)
    for replica in replicas:
        wait_for(lambda r=replica: node_role(ports[r]) == "slave", "a replica", stack, 90)
    body = {"model": MODEL, "messages": LIGHTHOUSE, "max_tokens": 4, "temperature": 0}
    headers = {"X-Request-Id": "fo-unreplicated"}
    pids = [stack.pids()[r] for r in replicas]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        refused = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers,
                             timeout=60)  # fmt: skip
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "not_replicated")
    assert "Retry with the same X-Request-Id" in error["message"]
    # the same id again: the request queued on the primary is found and answered, once
    again = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["completion_tokens"] == 4
    assert len(stack.out_tokens("fo-unreplicated")) == 4


def stream_events(stack: Stack, request_id: str, on_token) -> tuple[list[tuple[int, int]], str]:
    """(SSE `id:` and token count of each event, text) of a streamed greedy request; logprobs
    give one entry per token, so the tokens each event covers are known."""
    body = {"model": MODEL, "messages": LIGHTHOUSE, "stream": True, "logprobs": True,
            "ignore_eos": True, **SAMPLING}  # fmt: skip
    events, text, event_id, n = [], "", None, 0
    headers = {"X-Request-Id": request_id}
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=180) as resp:  # fmt: skip
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("id:"):
                event_id = int(line[3:])
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                data = json.loads(line[5:])
                assert "error" not in data, data
                choice = data["choices"][0]
                count = len((choice.get("logprobs") or {}).get("content") or [])
                if count:
                    events.append((event_id, count))
                    text += choice["delta"].get("content") or ""
                    n += count
                    on_token(n)
    return events, text


def test_steps_only_the_lost_primary_held_are_neither_repeated_nor_skipped(stack, client):
    """The replicas stopped (SIGSTOP) and their links closed while the worker emits steps:
    those steps reach the primary and the client, not the replicas. Then the primary dies, the
    replicas go on and one is promoted without them. The worker's next step is refused as
    behind (the promoted copy's fence holds an older step number) and the worker writes again
    what the server lacks; the client keeps the tokens it had and gets the next ones, and
    out:{id} is whole."""
    ref_text, _ = stream_text(client, "lost-ref")
    primary = current_primary(stack.state)
    replicas = [n for n in NODES if n != primary]
    ports = sentinel_ports(stack.state)
    for replica in replicas:
        wait_for(lambda r=replica: node_role(ports[r]) == "slave", "a replica", stack, 90)
    pids = [stack.pids()[r] for r in replicas]
    seen: dict[str, int] = {}

    def fault(n: int) -> None:
        if n >= 4 and "stopped" not in seen:
            seen["stopped"] = n
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            # and their links closed: a stopped replica's socket would still take in the
            # primary's writes (the kernel buffers them) and apply them once resumed
            link = redis.Redis(port=ports[primary])
            link.client_kill_filter(_type="replica")  # (one mid-resync may have none now)
            link.close()
        elif n >= seen.get("stopped", 99) + 6 and "killed" not in seen:
            seen["killed"] = n
            stack.kill(primary)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    try:
        events, text = stream_events(stack, "lost-victim", fault)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    # tokens stopped-to-killed went to the client from the primary alone
    assert seen["killed"] - seen["stopped"] >= 6
    new = current_primary(stack.state)
    assert new in replicas
    # each event starts where the previous one ended: no token twice, none skipped
    starts = [sum(count for _, count in events[:i]) for i in range(len(events))]
    assert [event_id for event_id, _ in events] == starts
    assert sum(count for _, count in events) == SAMPLING["max_tokens"]
    assert text == ref_text
    assert stack.out_tokens("lost-victim") == stack.out_tokens("lost-ref")
