"""The admin CLI contract on a real Valkey (and a real store node): `--json` everywhere, one-line
errors `kvrelay <cmd>: error: ...`, exit codes 0 ok, 1 failure, 2 bad usage, 3 not found."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvrelay.core.keys import DECODE_GROUP, MESSAGE_FIELD, PREFILL_GROUP, Keys
from kvrelay.core.messages import PrefillTask, TokenChunk, frame
from kvrelay.kvstore.config import StoreConfig
from kvrelay.kvstore.server import arena_path
from kvrelay.pipeline.queue.progress import Progress, new_progress
from kvrelay.pipeline.queue.streams import Streams
from tests.cli.in_process import run
from tests.conftest import free_port
from tests.kvstore.conftest import SMALL, RunningNode, keys_for, payload

KEYS = Keys("ctr:")
POISON = "delivered 6 times, 5 times its holder died running it without progress (limit 5)"


def cli(capsys, valkey, *argv: str) -> tuple[int, str, str]:
    return run(capsys, *argv, "--redis-url", valkey.url, "--key-prefix", "ctr:")


def dead_letter(r, request_id: str, reason: str) -> str:
    """Queue a prefill task, take it as a worker would, dead-letter it with `reason`."""
    s = Streams(r, KEYS, "w1")
    s.ensure_group(KEYS.prefill_stream, PREFILL_GROUP)
    task = PrefillTask(request_id=request_id, prompt_token_ids=[1, 2], sampling={})
    r.hset(KEYS.request(request_id), mapping={"status": "queued", "emitted": 0})
    r.xadd(KEYS.prefill_stream, {MESSAGE_FIELD: task.encode()})
    [entry] = s.read(KEYS.prefill_stream, PREFILL_GROUP, 1, None)
    return s.dead_letter(KEYS.prefill_stream, PREFILL_GROUP, entry.entry_id, entry.payload,
                         reason, request_id)  # fmt: skip


def test_kv_get_of_a_key_that_is_no_page_key_is_bad_usage(capsys, tmp_path):
    # before: `deadbeef` is hex, went to the store and came back as a failure (exit 1)
    code, out, err = run(capsys, "kv", "get", "deadbeef", "--run-dir", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (
        "kvrelay kv: error: not a page key: 'deadbeef' (32 hex digits, as `kvrelay kv ls` "
        "prints them)\n"
    )


def test_requests_show_of_an_invalid_id_is_bad_usage(r, valkey_session, capsys):
    for action in ("show", "cancel"):  # before: "no request 'bad id!'", exit 1
        code, out, err = cli(capsys, valkey_session, "requests", action, "bad id!")
        assert (code, out) == (2, "")
        assert err == (
            "kvrelay requests: error: invalid request id 'bad id!' (1-128 characters of "
            "A-Za-z0-9._:-)\n"
        )
    from kvrelay.pipeline.queue import (  # the admin's copy of the rule is the ingress's
        admin,
        submit,
    )

    for rid in ("a", "bad id!", "x" * 128, "x" * 129, "a.b_c:d-E9", "ü", "", "a/b"):
        assert admin.valid_request_id(rid) == submit.valid_request_id(rid), rid


def test_cancel_of_an_ended_request_says_so_and_sets_nothing(r, valkey_session, capsys):
    r.hset(KEYS.request("done1"), mapping={"status": "finished", "finish_reason": "stop"})
    code, out, err = cli(capsys, valkey_session, "requests", "cancel", "done1")
    # before: "cancel requested for done1", and cancel:{id} was set
    assert (code, out, err) == (
        0,
        "request done1 already ended (status finished, finish_reason stop); not cancelled\n",
        "",
    )
    assert not r.hexists(KEYS.progress, "done1")
    # no record left (expired), but the output stream ended: ended too
    last = frame(TokenChunk(0, [5], finish_reason="stop").encode())
    r.xadd(KEYS.out("gone1"), {MESSAGE_FIELD: last})
    code, out, _ = cli(capsys, valkey_session, "requests", "cancel", "gone1", "--json")
    assert (code, json.loads(out)) == (
        0,
        {"request_id": "gone1", "cancelled": False, "status": "finished", "finish_reason": None},
    )
    r.hset(KEYS.request("live1"), mapping={"status": "decoding"})
    r.hset(KEYS.progress, "live1", new_progress())
    code, out, _ = cli(capsys, valkey_session, "requests", "cancel", "live1", "--json")
    assert json.loads(out) == {
        "request_id": "live1", "cancelled": True, "status": "decoding", "finish_reason": None,
    }  # fmt: skip
    assert Progress.parse(r.hget(KEYS.progress, "live1")).cancelled
    code, out, _ = cli(capsys, valkey_session, "requests", "cancel", "live1")
    assert (code, out) == (0, "cancel requested for live1 (status decoding)\n")


def test_requests_show_gives_numbers_and_honours_json(r, valkey_session, capsys):
    ingress = {"api": "chat", "stream": True}
    r.hset(KEYS.request("q7"), mapping={
        "status": "finished", "prompt_tokens": "12", "completion_tokens": "3", "cached_tokens": "",
        "created": "1700000000.25", "emitted": "3", "ingress": json.dumps(ingress),
    })  # fmt: skip
    r.xadd(KEYS.out("q7"), {MESSAGE_FIELD: frame(TokenChunk(0, [4, 5, 6], "abc", "stop").encode())})
    r.xadd(KEYS.out("q7"), {MESSAGE_FIELD: b"junk"})  # counted, not a traceback
    code, out, _ = cli(capsys, valkey_session, "requests", "show", "q7", "--json")
    data = json.loads(out)
    # before: "12", "3", "" and "1700000000.25" (strings), ingress a string of JSON
    assert code == 0
    assert (data["prompt_tokens"], data["completion_tokens"], data["cached_tokens"]) == (
        12,
        3,
        None,
    )
    assert (data["created"], data["emitted"], data["ingress"]) == (1700000000.25, 3, ingress)
    assert (data["output_tokens"], data["output_text"], data["finished"]) == (3, "abc", True)
    assert data["output_bad_chunks"] == 1
    code, out, _ = cli(capsys, valkey_session, "requests", "show", "q7")
    fields = dict(line.split(None, 1) for line in out.splitlines())  # before: JSON always
    assert code == 0 and out.startswith("request_id ")
    assert (fields["request_id"], fields["status"], fields["prompt_tokens"]) == (
        "q7", "finished", "12")  # fmt: skip
    assert (fields["cached_tokens"], fields["ingress"]) == ("-", json.dumps(ingress))
    code, out, err = cli(capsys, valkey_session, "requests", "show", "nope")
    assert (code, out, err) == (3, "", "kvrelay requests: error: no request 'nope'\n")


def test_dlq_ls_of_an_empty_dlq_says_so(r, valkey_session, capsys):
    # before: nothing at all on stdout
    assert cli(capsys, valkey_session, "dlq", "ls") == (0, "dead-letter stream is empty\n", "")
    code, out, _ = cli(capsys, valkey_session, "dlq", "ls", "--json")
    assert (code, json.loads(out)) == (0, [])


def test_dlq_replay_refuses_poison_unless_forced(r, valkey_session, capsys):
    poison_id = dead_letter(r, "p1", POISON)
    other_id = dead_letter(r, "o1", "rejected by the engine: prompt too long")
    code, out, _ = cli(capsys, valkey_session, "dlq", "show", poison_id, "--json")
    assert json.loads(out)["kind"] == "poison"
    # before: replayed silently, to kill its next holders too
    code, out, err = cli(capsys, valkey_session, "dlq", "replay", poison_id)
    assert (code, out) == (1, "")
    assert err == (
        f"kvrelay dlq: error: DLQ entry {poison_id} was dead-lettered as poison (it killed or "
        f"wedged every worker that took it): {POISON}; replay it with --force\n"
    )
    code, out, err = cli(capsys, valkey_session, "dlq", "replay", "--all", "--json")
    report = json.loads(out)
    assert code == 0 and report["skipped"] == [poison_id]
    [done] = report["replayed"]
    assert (done["dlq_id"], done["request_id"], done["stream"]) == (
        other_id, "o1", KEYS.prefill_stream)  # fmt: skip
    assert (done["kind"], done["forced"]) == ("other", False)
    assert err.startswith("kvrelay dlq: warning: skipped 1 entry that cannot be replayed")
    code, out, err = cli(capsys, valkey_session, "dlq", "replay", poison_id, "--force")
    new_id = r.xrevrange(KEYS.prefill_stream, count=1)[0][0].decode()
    assert (code, out, err) == (
        0,
        f"replayed {poison_id} (request p1) to {KEYS.prefill_stream} as {new_id}; it had "
        f"failed: {POISON}\n",
        f"kvrelay dlq: warning: replaying poison entry {poison_id} (--force): {POISON}\n",
    )
    assert r.xlen(KEYS.dlq) == 0 and r.hget(KEYS.request("p1"), "status") == b"queued"


def test_dlq_replay_refuses_a_payload_that_is_no_task(r, valkey_session, capsys):
    s = Streams(r, KEYS, "w1")
    s.ensure_group(KEYS.decode_stream, DECODE_GROUP)
    r.xadd(KEYS.decode_stream, {MESSAGE_FIELD: b"\x81\xa1v\x63"})
    [entry] = s.read(KEYS.decode_stream, DECODE_GROUP, 1, None)
    bad = s.dead_letter(KEYS.decode_stream, DECODE_GROUP, entry.entry_id, entry.payload, "bad")
    code, out, err = cli(capsys, valkey_session, "dlq", "replay", bad)
    assert (code, out) == (1, "")
    assert err.startswith(f"kvrelay dlq: error: DLQ entry {bad} holds a payload that is not a ")


CONTRACT_ARGV = [
    ("status",),
    ("requests", "show", "q1"),
    ("requests", "cancel", "q1"),
    ("dlq", "ls"),
    ("dlq", "show", "1-0"),
    ("dlq", "replay", "1-0"),
    ("dlq", "replay", "--all"),
    ("dlq", "purge", "--yes"),
    ("drain", "w1", "--wait-s", "0"),
]


@pytest.mark.parametrize("argv", CONTRACT_ARGV, ids=" ".join)
def test_redis_down_is_exit_1_in_one_line(capsys, argv):
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, out, err = run(capsys, *argv, "--redis-url", url, "--json")
    assert (code, out) == (1, "")
    assert err.startswith(f"kvrelay {argv[0]}: error: Redis at {url} is not reachable (")
    assert err.count("\n") == 1


def test_every_admin_command_takes_json(r, valkey_session, capsys):
    r.hset(KEYS.request("q1"), mapping={"status": "decoding"})
    r.hset(KEYS.worker("w1"), mapping={"name": "w1", "updated": time.time()})
    outputs = {}
    for argv in CONTRACT_ARGV:
        code, out, err = cli(capsys, valkey_session, *argv, "--json")
        outputs[argv] = (code, json.loads(out) if code == 0 else None, err)
    assert outputs[("dlq", "show", "1-0")] == (3, None, "kvrelay dlq: error: no entry 1-0\n")
    assert outputs[("dlq", "replay", "1-0")] == (3, None, "kvrelay dlq: error: no entry 1-0\n")
    assert outputs[("dlq", "replay", "--all")] == (0, {"replayed": [], "skipped": []}, "")
    assert outputs[("dlq", "purge", "--yes")] == (0, {"purged": 0}, "")
    assert outputs[("drain", "w1", "--wait-s", "0")] == (
        0, {"worker": "w1", "draining": True, "acknowledged": None}, "")  # fmt: skip
    assert outputs[("requests", "show", "q1")][1]["status"] == "decoding"
    assert outputs[("status",)][1]["dlq"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("dlq", "bogus"), "argument action: invalid choice: 'bogus' (choose from 'ls', 'show', "
                           "'replay', 'purge')"),
        (("dlq", "ls", "1-0"), "dlq ls takes no entry id, got '1-0'"),
        (("dlq", "show", "--all"), "--all goes with `dlq replay` and no entry id"),
        (("dlq", "purge"), "dlq purge deletes every entry: add --yes"),
        (("dlq", "ls", "--limit", "0"), "--limit must be at least 1, got 0"),
        (("status", "--interval", "0"), "--interval must be 0.05-3600 s, got 0"),
        (("status", "--watch", "--json"), "--watch and --json do not go together (--json prints "
                                          "once)"),
        (("drain", "w1", "--wait-s", "-1"), "--wait-s must be >= 0, got -1"),
        (("requests", "show"), "the following arguments are required: request_id"),
    ],
)  # fmt: skip
def test_bad_usage_is_exit_2_in_one_line_before_connecting(capsys, argv, message):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens: usage is checked first
    code, out, err = run(capsys, *argv, "--redis-url", url)
    assert (code, out) == (2, "")
    suffix = f" (see `kvrelay {argv[0]} --help`)" if "argument" in message else ""
    assert err == f"kvrelay {argv[0]}: error: {message}{suffix}\n"


def test_kv_contract_on_a_real_store_node(capsys, tmp_path: Path):
    run_dir = str(tmp_path / "run")
    config = StoreConfig(node_id="c0", run_dir=run_dir, arena_bytes=64 << 10,
                         page_bytes=SMALL.page_bytes, tcp_port=-1, ucx_port=-1)  # fmt: skip
    node = RunningNode(config)
    try:
        from kvrelay.kvstore.client import StoreClient

        keys = keys_for(2)
        with StoreClient(run_dir, SMALL) as client:
            assert client.put(keys, [payload(SMALL, i) for i in range(2)]) == 2
        code, out, err = run(capsys, "kv", "get", "00" * 16, "--run-dir", run_dir)
        assert (code, out) == (3, "")  # before: exit 0 with {"found": false}
        assert err == f"kvrelay kv: error: no page {'00' * 16} in the store at {run_dir}\n"
        code, out, _ = run(capsys, "kv", "get", keys[1].hex(), "--run-dir", run_dir, "--json")
        page = json.loads(out)
        assert (code, page["found"], page["verified"], page["num_tokens"]) == (0, True, True, 4)
        code, out, _ = run(capsys, "kv", "ls", "--run-dir", run_dir)
        assert out == f"host: 2 pages\n  {keys[0].hex()}\n  {keys[1].hex()}\ndisk: 0 pages\n"
        # issue 46: the count is the node's, not the listing's (which stops at --limit)
        code, out, _ = run(capsys, "kv", "ls", "--run-dir", run_dir, "--limit", "1")
        assert (code, out) == (0, "host: 2 pages (the 1 least recently used listed; --limit 2 "
                                  f"lists all)\n  {keys[0].hex()}\ndisk: 0 pages\n")  # fmt: skip
        code, out, _ = run(capsys, "kv", "stats", "--run-dir", run_dir)
        assert out.startswith("store c0: host 2/")
        code, out, _ = run(capsys, "kv", "evict", "--run-dir", run_dir, "--json")
        assert (code, json.loads(out)) == (0, {"evicted": 2, "tier": "host"})
    finally:
        node.stop()
        arena_path(node.config).unlink(missing_ok=True)
    code, out, err = run(capsys, "kv", "stats", "--run-dir", run_dir, "--timeout-s", "0.2")
    assert (code, out) == (1, "")
    assert err.startswith(f"kvrelay kv: error: store node at {run_dir}: ") and err.count("\n") == 1


def _hint(cmd: str) -> str:
    return f" (see `kvrelay {cmd} --help`)"


# One usage error per command (exit 2, one line, before anything starts or connects).
EVERY_COMMAND_USAGE = [
    (("up", "--port", "0"), "argument --port: port must be 1-65535, got 0" + _hint("up")),
    (("down", "--timeout", "x"), "argument --timeout: invalid float value: 'x'" + _hint("down")),
    (("serve", "--port", "eighty"), "argument --port: invalid int value: 'eighty'"
                                    + _hint("serve")),
    (("serve", "--bogus"), "unrecognized arguments: --bogus" + _hint("serve")),
    (("worker", "decode", "--max-num-seqs", "x"), "argument --max-num-seqs: invalid int value: "
                                                  "'x'" + _hint("worker")),
    (("store", "--arena-bytes", "abc"), "argument --arena-bytes: invalid int value: 'abc'"
                                        + _hint("store")),
    (("generate",), "give a PROMPT or --batch-file (exactly one)"),
    (("bench", "--concurrency", "0"), "--concurrency must be > 0, got 0"),
    (("kv", "get", "xyz"), "not a page key: 'xyz' (32 hex digits, as `kvrelay kv ls` prints "
                           "them)"),
    (("status", "--interval", "0"), "--interval must be 0.05-3600 s, got 0"),
    (("requests", "show"), "the following arguments are required: request_id"
                           + _hint("requests")),
    (("dlq", "purge"), "dlq purge deletes every entry: add --yes"),
    (("drain",), "the following arguments are required: worker" + _hint("drain")),
    (("usage", "--period", "hour", "--since", "1h"), "--period does not go with --since or "
                                                     "--until"),
    (("config", "list"), "argument action: invalid choice: 'list' (choose from 'show')"
                         + _hint("config")),
]  # fmt: skip


def test_every_command_is_listed_for_its_usage_error():
    from kvrelay.cli.main import COMMANDS

    assert {argv[0] for argv, _ in EVERY_COMMAND_USAGE} == {name for name, _, _ in COMMANDS}


@pytest.mark.parametrize(("argv", "message"), EVERY_COMMAND_USAGE, ids=lambda v: " ".join(v)
                         if isinstance(v, tuple) else "")  # fmt: skip
def test_every_command_usage_error_is_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", f"kvrelay {argv[0]}: error: {message}\n")


def test_runtime_errors_are_one_line_with_their_exit_code(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("KVRELAY_INGRESS_MODE", "sideways")
    monkeypatch.setenv("KVRELAY_STORE_TRANSPORT", "carrier-pigeon")
    monkeypatch.setenv("KVRELAY_WORKER_LEASE_MS", "0")
    closed = free_port()
    none = tmp_path / "none"
    cases = [
        (("serve",), 2, "mode must be one of auto, disaggregated, colocated, got 'sideways'"),
        (("store", "--run-dir", str(tmp_path), "--page-bytes", "64"), 2,
         "transport must be auto, ucx or tcp, got 'carrier-pigeon'"),
        (("worker", "decode"), 2, "lease_ms must be at least 1"),
        (("generate", "hi", "--model", "no-such-model"), 2, "unknown model 'no-such-model': "),
        (("down", "--run-dir", str(none)), 2,
         f"no kvrelay stack in {none} ({none / 'stack.json'} is missing)"),
        (("up", "--detach", "--run-dir", str(tmp_path / "run"), "--port", str(free_port()),
          "--redis-url", f"redis://127.0.0.1:{closed}/0"), 1,
         f"Redis at redis://127.0.0.1:{closed}/0 is not reachable: "),
        (("bench", "--url", f"http://127.0.0.1:{closed}", "--num-requests", "1"), 1,
         f"cannot reach the server at http://127.0.0.1:{closed} ("),
        (("config", "show", "--component", "ingress"), 2,
         "mode must be one of auto, disaggregated, colocated, got 'sideways'"),
    ]  # fmt: skip
    for argv, exit_code, message in cases:
        code, out, err = run(capsys, *argv)
        assert (argv[0], code, out) == (argv[0], exit_code, "")
        assert err.startswith(f"kvrelay {argv[0]}: error: {message}"), err
        assert err.count("\n") == 1, err
