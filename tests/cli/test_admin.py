"""Admin CLI on a real Valkey: status, requests show/cancel, dlq ls/show/replay/purge, drain."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import redis

from kvrelay.cli.admin import connect
from kvrelay.cli.main import build_parser, main
from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask, TokenChunk, frame
from kvrelay.core.worker_record import WorkerRecord
from kvrelay.pipeline.queue import admin as queue_admin
from kvrelay.pipeline.queue.progress import Progress, new_progress, tail_entry
from kvrelay.pipeline.queue.streams import Streams
from kvrelay.workers.emitter import Heartbeat, Inflight
from tests.conftest import free_port

KEYS = Keys("adm:")
TIMEOUTS = ("socket_timeout", "socket_connect_timeout")


def cli(capsys, valkey, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--redis-url", valkey.url, "--key-prefix", "adm:"])
    out, err = capsys.readouterr()
    return code, out, err


def seed(r) -> Streams:
    s = Streams(r, KEYS, "w1")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    s.ensure_group(KEYS.decode_stream, DECODE_GROUP)
    for i in range(3):
        task = PrefillTask(request_id=f"q{i}", prompt_token_ids=[1, 2], sampling={})
        r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    s.read(KEYS.prefill_stream, PREFILL_GROUP, 2, None)
    r.hset(
        KEYS.worker("decode-0"),
        mapping={"name": "decode-0", "role": "decode", "pid": 7, "updated": time.time(), "load": 2,
                 "draining": 1, "tokens_per_s": "3.5", "metrics_port": "", "model": "m",
                 "kernel_isa": "avx512", "kv_dtype": "bfloat16", "attention": "bf16",
                 "speculation": "ngram", "startup_s": "7.94"},
    )  # fmt: skip
    r.expire(KEYS.worker("decode-0"), 30)
    r.hset(KEYS.request("q0"), mapping={"status": "decoding", "prompt_tokens": 2})
    r.hset(KEYS.request("q1"), mapping={"status": "finished"})
    # q0 runs: its two tokens are in its owner's tail hash, none in out:{id} yet
    tail = TokenChunk(0, [5, 6], text="hi").encode()
    r.hset(KEYS.progress, "q0", Progress(emitted=2, owner="decode-0.1/1-0").encode())
    r.hset(KEYS.tail("decode-0.1"), 1, tail_entry([("q0", tail)]))
    return s


def test_status_json(r, valkey_session, capsys):
    seed(r)
    ttl_before = r.ttl(KEYS.worker("decode-0"))
    code, out, _ = cli(capsys, valkey_session, "status", "--json")
    ttl_after = r.ttl(KEYS.worker("decode-0"))
    assert code == 0
    data = json.loads(out)
    [worker] = data["workers"]
    assert (worker["name"], worker["pid"], worker["load"], worker["draining"]) == (
        "decode-0",
        7,
        2,
        1,
    )
    assert (worker["tokens_per_s"], worker["metrics_port"], worker["model"]) == (3.5, None, "m")
    # the heartbeat's time as written, and the TTL Valkey gave the hash while `status` ran
    assert worker["updated"] == float(r.hget(KEYS.worker("decode-0"), "updated"))
    assert ttl_after <= worker["ttl_s"] <= ttl_before
    prefill, decode = data["streams"]
    assert (prefill["length"], prefill["pending"], prefill["lag"], prefill["consumers"]) == (
        3,
        2,
        1,
        1,
    )
    assert (decode["length"], decode["pending"]) == (0, 0)
    assert data["dlq"] == 0 and data["requests_in_flight"] == 1
    assert data["requests"] == {"decoding": 1, "finished": 1}
    # added keys: stage per stream, scraped counters (none: no metrics port), tiers, rate
    assert [s["stage"] for s in data["streams"]] == ["prefill", "decode"]
    assert worker["metrics"] is None and data["tokens_per_s"] == 3.5
    assert data["tiers"] == [{"tier": "device", "pages": None, "capacity": None, "usage": None,
                              "hits": 0, "lookups": 0, "hit_rate": None}]  # fmt: skip
    code, out, _ = cli(capsys, valkey_session, "status")
    assert code == 0 and "DLQ entries: 0" in out and out.count("tokens/s: 3.5\n") == 1
    header, row = out.splitlines()[:2]
    assert header.endswith("AGE   START  KERNELS  KV    ATTN  SPEC   STATE")
    assert row.startswith(f"{'decode-0':<24}{'decode':<9}{7:>8}{2:>6}{'3.5':>8}")
    assert row.endswith("s    7.9s  avx512   bf16  bf16  ngram  draining")
    # a worker that reports neither (GPU, torch path, older version): "-"
    r.hset(KEYS.worker("prefill-0"), mapping={"name": "prefill-0", "pid": "", "updated": 0})
    code, out, _ = cli(capsys, valkey_session, "status")
    assert code == 0 and out.splitlines()[2].startswith(f"{'prefill-0':<24}{'?':<9}{'':>22}")
    assert out.splitlines()[2].endswith("s       -  -        -     -     -      ok")


def test_status_counts_a_request_of_several_choices_once_as_its_choices_combine(
    r, valkey_session, capsys
):
    # issue 46: an idle stack showed "in flight: 12, queued: 12" from the parents' stored
    # status (they keep the `queued` they were written with; workers write only the choices)
    for parent in ("p", "b"):
        r.hset(KEYS.request(parent), mapping={"status": "queued", "num_choices": 2})
        for k in range(2):
            r.hset(KEYS.request(f"{parent}.{k}"), mapping={
                "status": "finished", "finish_reason": "stop", "parent": parent})  # fmt: skip
    r.hset(KEYS.request("solo"), mapping={"status": "finished"})
    data = json.loads(cli(capsys, valkey_session, "status", "--json")[1])
    assert (data["requests"], data["requests_in_flight"]) == ({"finished": 3}, 0)
    code, out, _ = cli(capsys, valkey_session, "status")
    assert code == 0 and "requests in flight: 0 " in out
    # one choice of b still decoding: b is decoding, as GET /v1/requests/b says
    r.hset(KEYS.request("b.1"), mapping={"status": "decoding", "finish_reason": ""})
    data = json.loads(cli(capsys, valkey_session, "status", "--json")[1])
    assert (data["requests"], data["requests_in_flight"]) == ({"finished": 2, "decoding": 1}, 1)


def test_requests_show_and_cancel(r, valkey_session, capsys):
    seed(r)
    code, out, _ = cli(capsys, valkey_session, "requests", "show", "q0", "--json")
    data = json.loads(out)
    assert (data["status"], data["output_tokens"], data["output_text"]) == ("decoding", 2, "hi")
    assert data["prompt_tokens"] == 2  # a number, not "2"
    assert (data["completion_tokens"], data["emitted"]) == (2, 2)  # live, from the progress
    assert data["finished"] is False and data["cancel_requested"] is False
    assert cli(capsys, valkey_session, "requests", "cancel", "q0")[0] == 0
    assert Progress.parse(r.hget(KEYS.progress, "q0")).cancelled
    data = json.loads(cli(capsys, valkey_session, "requests", "show", "q0", "--json")[1])
    assert data["cancel_requested"] is True
    # issue 46: once it ended cancelled (its progress, and the flag, gone) it still says so,
    # and a deadline's end (failed, timeout) too; an ordinary end does not
    r.hdel(KEYS.progress, "q0")
    for status, reason, asked in (
        ("cancelled", "cancelled", True),
        ("failed", "timeout", True),
        ("finished", "stop", False),
    ):
        r.hset(KEYS.request("q0"), mapping={"status": status, "finish_reason": reason})
        data = json.loads(cli(capsys, valkey_session, "requests", "show", "q0", "--json")[1])
        assert (data["status"], data["cancel_requested"]) == (status, asked)
    code, _, err = cli(capsys, valkey_session, "requests", "cancel", "nope")
    assert (code, err) == (3, "kvrelay requests: error: no request 'nope'\n")


def test_requests_show_and_cancel_of_a_request_of_several_choices(r, valkey_session, capsys):
    # the parent record as the ingress stores it (its status stays queued) and two choices
    r.hset(KEYS.request("p"), mapping={"status": "queued", "model": "m", "prompt_tokens": 3,
                                       "completion_tokens": 0, "num_choices": 2})  # fmt: skip
    r.hset(KEYS.request("p.0"), mapping={"status": "finished", "completion_tokens": 2,
                                         "emitted": 2, "finish_reason": "stop"})  # fmt: skip
    r.hset(KEYS.request("p.1"), mapping={"status": "prefilling", "prompt_tokens": 3})
    r.hset(KEYS.progress, "p.1", new_progress())
    r.xadd(KEYS.out("p.0"), {MESSAGE_FIELD: frame(TokenChunk(0, [5, 6], text="hi").encode())})
    code, out, _ = cli(capsys, valkey_session, "requests", "show", "p")
    assert code == 0 and "status             prefilling\n" in out
    code, out, _ = cli(capsys, valkey_session, "requests", "show", "p", "--json")
    data = json.loads(out)
    assert (data["status"], data["completion_tokens"], data["emitted"]) == ("prefilling", 2, 2)
    assert (data["prompt_tokens"], data["num_choices"], data["finish_reason"]) == (3, 2, None)
    assert [(c["id"], c["status"], c["finish_reason"]) for c in data["choices"]] == [
        ("p.0", "finished", "stop"), ("p.1", "prefilling", None)]  # fmt: skip
    assert (data["output_tokens"], data["output_text"], data["finished"]) == (2, None, False)
    code, out, _ = cli(capsys, valkey_session, "requests", "cancel", "p", "--json")
    assert json.loads(out) == {
        "request_id": "p",
        "cancelled": True,
        "status": "prefilling",
        "finish_reason": None,
    }
    # only the running choice has progress to flag
    assert _flags(r, ("p", "p.0", "p.1")) == [None, None, True]
    # one failed, one cancelled (its progress gone with its end): failed wins; nothing is left
    r.hset(KEYS.request("p.0"), mapping={"status": "failed", "error": "boom"})
    r.hset(KEYS.request("p.1"), mapping={"status": "cancelled", "finish_reason": "cancelled"})
    r.hdel(KEYS.progress, "p.1")
    code, out, _ = cli(capsys, valkey_session, "requests", "show", "p", "--json")
    data = json.loads(out)
    assert (data["status"], data["error"], data["finish_reason"]) == ("failed", "boom", "stop")
    assert data["cancel_requested"] is True  # p.1 ended cancelled (issue 46)
    code, out, _ = cli(capsys, valkey_session, "requests", "cancel", "p")
    ended = "request p already ended (status failed, finish_reason stop); not cancelled\n"
    assert (code, out) == (0, ended)
    assert _flags(r, ("p", "p.0", "p.1")) == [None, None, None]


def _flags(r, ids) -> list[bool | None]:
    """Each request's cancel flag; None for one without progress."""
    return [(p.cancelled if (p := Progress.parse(r.hget(KEYS.progress, i))) else None) for i in ids]


def test_dlq_ls_show_replay_purge(r, valkey_session, capsys):
    s = seed(r)
    entries = s.read(KEYS.prefill_stream, PREFILL_GROUP, 5, None)
    [entry] = entries  # q2
    s.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, entry.entry_id, entry.payload, "boom", "q2")
    code, out, _ = cli(capsys, valkey_session, "dlq", "ls", "--json")
    [row] = json.loads(out)
    assert (row["reason"], row["request_id"]) == ("boom", "q2")
    code, out, _ = cli(capsys, valkey_session, "dlq", "show", row["dlq_id"], "--json")
    shown = json.loads(out)
    assert shown["task"]["request_id"] == "q2" and shown["task"]["prompt_token_ids"] == [1, 2]
    assert r.xlen(KEYS.out("q2")) == 1  # the error chunk
    code, out, _ = cli(capsys, valkey_session, "dlq", "replay", row["dlq_id"])
    assert code == 0 and out.startswith(f"replayed {row['dlq_id']} (request q2) to ")
    assert out.endswith("; it had failed: boom\n")
    assert r.xlen(KEYS.dlq) == 0 and not r.exists(KEYS.out("q2"))
    assert r.hget(KEYS.request("q2"), "status") == b"queued"
    # a fresh progress: nothing emitted, no owner, no cancel, no reader yet; the record's TTL
    assert r.hget(KEYS.progress, "q2") == new_progress()
    [ttl] = r.execute_command("HTTL", KEYS.progress, "FIELDS", 1, "q2")
    assert 86390 < ttl <= 86400  # the record has none: the submit scripts' default
    [replayed] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 5, None)
    assert PrefillTask.decode(replayed.payload).request_id == "q2"
    r.xadd(KEYS.dlq, {MESSAGE_FIELD: b"x", "reason": "r"})
    assert cli(capsys, valkey_session, "dlq", "purge")[0] == 2
    code, out, _ = cli(capsys, valkey_session, "dlq", "purge", "--yes")
    assert out.strip() == "purged 1 entry" and r.xlen(KEYS.dlq) == 0


def test_drain_waits_for_the_heartbeat_to_acknowledge(r, valkey_session, capsys):
    seed(r)
    streams = Streams(redis.Redis.from_url(valkey_session.url), KEYS, "decode-9.1")
    hb = Heartbeat(streams, "decode-9", "decode", KEYS.decode_stream, DECODE_GROUP, Inflight(),
                   0.3, 5, WorkerRecord(), None)  # fmt: skip
    hb.beat()
    hb.start()
    try:
        code, out, err = cli(capsys, valkey_session, "drain", "decode-9")
        assert (code, out, err) == (0, "decode-9: draining\n", "")
        assert hb.draining is True  # the reader stops taking entries from now on
        assert r.hget(KEYS.worker("decode-9"), "draining") == b"1"
        code, out, err = cli(capsys, valkey_session, "drain", "decode-9", "--undo")
        assert (code, out, err) == (0, "decode-9: taking work again\n", "")
        assert hb.draining is False
    finally:
        hb.stop()
        streams.r.close()


def test_drain_without_acknowledgement(r, valkey_session, capsys, fake_clock):
    seed(r)  # decode-0's hash has no heartbeat behind it
    fake_clock.install(queue_admin)  # the wait's clock moves only as it polls
    code, out, err = cli(capsys, valkey_session, "drain", "decode-0", "--undo", "--wait-s", "0.3")
    assert (code, out) == (1, "")
    assert err == (
        "kvrelay drain: error: decode-0 did not acknowledge within 0.3s (the flag is set; it "
        "applies at the worker's next heartbeat)\n"
    )
    # it polled the heartbeat hash all through --wait-s, then gave up at the first look past it
    assert fake_clock.slept == [0.05] * 6
    assert r.hget(KEYS.worker("decode-0"), "drain") == b"0"
    code, out, _ = cli(capsys, valkey_session, "drain", "decode-0", "--wait-s", "0")
    assert (code, out) == (0, "decode-0: draining\n")
    assert r.hget(KEYS.worker("decode-0"), "drain") == b"1"
    code, _, err = cli(capsys, valkey_session, "drain", "ghost")
    assert (code, err) == (3, "kvrelay drain: error: no live worker 'ghost'\n")


def test_store_line_shows_every_tier_even_before_lookups():
    from kvrelay.cli.admin import store_line

    stats = {
        "node_id": "n0",
        "pages": {"host": 3, "host_slots": 8, "disk": 1, "disk_capacity": 100},
        "counters": {"hits": {"host": 3.0}, "misses": {"host": 1.0, "disk": 1.0}},
    }
    assert store_line(stats) == (
        "store n0: host 3/8 pages, disk 1/100 pages, host hit rate 75% (3/4), "
        "disk hit rate 0% (0/1), remote hit rate - (0/0)"
    )
    assert store_line({"error": "no node"}) == "store: unavailable (no node)"


def test_dlq_refuses_bad_ids_and_entries_without_payload(r, valkey_session, capsys):
    s = seed(r)
    for action in ("show", "replay"):
        code, out, err = cli(capsys, valkey_session, "dlq", action, "nope")
        assert (code, out) == (2, "")
        assert err == "kvrelay dlq: error: not a DLQ entry id: 'nope' (like 1712345678901-0)\n"
    code, _, err = cli(capsys, valkey_session, "dlq", "replay")
    assert (code, err) == (2, "kvrelay dlq: error: give an entry id (or --all)\n")
    code, _, err = cli(capsys, valkey_session, "dlq", "show", "1-0")
    assert (code, err) == (3, "kvrelay dlq: error: no entry 1-0\n")
    [good] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 5, None)  # q2
    r.xadd(KEYS.prefill_stream, {"x": b"no m field"})
    [bad] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 5, None)
    assert bad.payload is None
    bad_id = s.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, bad.entry_id, None, "no payload")
    good_id = s.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, good.entry_id, good.payload, "x")
    code, out, err = cli(capsys, valkey_session, "dlq", "replay", bad_id)
    assert (code, out) == (1, "")
    assert err == (
        f"kvrelay dlq: error: DLQ entry {bad_id} has no payload to replay (purge it instead)\n"
    )
    code, out, err = cli(capsys, valkey_session, "dlq", "replay", "--all")
    assert out == (
        f"replayed {good_id} (request q2) to {KEYS.prefill_stream} as {out.split()[-5][:-1]}; "
        "it had failed: x\n"
    )
    assert code == 0 and out.count("\n") == 1
    assert err == (
        "kvrelay dlq: warning: skipped 1 entry that cannot be replayed (no payload, or "
        f"poison/invalid without --force; see `kvrelay dlq show`): {bad_id}\n"
    )
    assert [eid.decode() for eid, _ in r.xrange(KEYS.dlq)] == [bad_id]


def test_status_errors_are_one_line(r, valkey_session, capsys, tmp_path):
    code, out, err = cli(capsys, valkey_session, "status", "--run-dir", str(tmp_path / "none"))
    assert (code, out) == (2, "")
    assert err == (
        f"kvrelay status: error: no kvrelay stack in {tmp_path / 'none'} "
        f"({tmp_path / 'none' / 'stack.json'} is missing)\n"
    )
    port = free_port()  # a stack after `kvrelay down`: stack.json names a Redis that is gone
    url = f"redis://127.0.0.1:{port}/0"
    (tmp_path / "stack.json").write_text(json.dumps({"redis_url": url, "key_prefix": "adm:"}))
    code = main(["status", "--run-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err == (
        f"kvrelay status: error: Redis at {url} is not reachable (Error 111 connecting to "
        f"127.0.0.1:{port}. Connection refused.); is the stack running?\n"
    )
    seed(r)
    url = valkey_session.url
    (tmp_path / "stack.json").write_text(json.dumps({"redis_url": url, "key_prefix": "adm:"}))
    assert main(["status", "--run-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workers"][0]["name"] == "decode-0"


def test_status_on_a_stopped_valkey_times_out_quickly(valkey, capsys):
    argv = ["status", "--redis-url", valkey.url, "--timeout-s", "0.5"]
    client, _, _ = connect(build_parser().parse_args(argv))  # the client `status` reads with
    timeouts = {k: client.connection_pool.connection_kwargs[k] for k in TIMEOUTS}
    client.close()
    assert timeouts == {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
    valkey.proc.send_signal(signal.SIGSTOP)
    try:
        code = main(argv)
    finally:
        valkey.proc.send_signal(signal.SIGCONT)
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    # the read timed out (that 0.5 s bound fired), rather than failing or retrying otherwise
    assert err == (
        f"kvrelay status: error: Redis at {valkey.url} did not answer in time (Timeout reading "
        "from socket); is it overloaded or stopped?\n"
    )


def test_status_into_a_closed_pipe_is_quiet(r, valkey_session):
    seed(r)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.cli.main", "status", "--redis-url",
         valkey_session.url, "--key-prefix", "adm:"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first line (like `| head -0`)
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == b""
    proc.stderr.close()


def test_consumers_of_dead_workers_are_pruned(r, valkey_session, capsys):
    seed(r)  # consumer w1 (of no live worker) holds q0 and q1
    stream = KEYS.prefill_stream
    for name in ("old.1", "old.2", "live.3"):  # a worker restarted twice, then its current self
        Streams(r, KEYS, name).read(stream, PREFILL_GROUP, 1, None)  # q2 goes to old.1
    r.hset(KEYS.worker("prefill-0"), mapping={"name": "prefill-0", "consumer": "live.3"})
    time.sleep(0.15)
    pruner = Streams(r, KEYS, "me.4")
    assert pruner.live_consumers() == {"live.3"}
    # old.2 owns nothing and no live worker names it; old.1 and w1 still hold entries
    assert pruner.prune_consumers(stream, PREFILL_GROUP, dead_idle_ms=100) == 1
    names = [c["name"].decode() for c in r.xinfo_consumers(stream, PREFILL_GROUP)]
    assert names == ["live.3", "old.1", "w1"]
    # they never beat: the pruning adopted them (beat 0), so the next claim takes their entries;
    # then they go too
    assert len(pruner.claim(stream, PREFILL_GROUP, 10_000, 10)) == 3
    time.sleep(0.15)
    assert pruner.prune_consumers(stream, PREFILL_GROUP, dead_idle_ms=100) == 2
    code, out, _ = cli(capsys, valkey_session, "status", "--json")
    assert json.loads(out)["streams"][0]["consumers"] == 2  # live.3 and me.4
    assert pruner.prune_consumers(stream, PREFILL_GROUP, idle_ms=100) == 1  # idle even if live
    assert [c["name"] for c in r.xinfo_consumers(stream, PREFILL_GROUP)] == [b"me.4"]


def test_store_cache_lines_show_sessions_prefetches_and_evictions_by_reason():
    from kvrelay.cli.admin import store_cache_lines

    stats = {
        "page_bytes": 368640,
        "pages": {"sessions": 2, "retained_host": 10, "retained_disk": 3},
        "counters": {
            "prefetch_pages": {"disk": 12.0},
            "prefetch_hits": {"": 9.0},
            "evictions": {"host/capacity": 40.0, "host/expired": 5.0, "disk/retained": 1.0},
        },
    }
    assert store_cache_lines(stats) == [
        "sessions: 2 retaining host 10 pages (3.7 MB), disk 3 pages (1.1 MB)",
        "prefetched pages: 12 from disk; read 9, evicted unread 0",
        "evictions: disk retained 1, host capacity 40, host expired 5",
    ]
    assert store_cache_lines({}) == [
        "sessions: 0 retaining host 0 pages (0.0 MB), disk 0 pages (0.0 MB)",
        "prefetched pages: none; read 0, evicted unread 0",
        "evictions: none",
    ]
