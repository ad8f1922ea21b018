"""`kvrelay up` end to end with the official openai client: chat and completions (streaming and
not) token-identical to `kvrelay generate`, 32 concurrent streams, multi-turn page reuse, bad
requests, poison stream entries, admin status and worker metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvrelay.core.keys import MESSAGE_FIELD
from tests.e2e.stack import MODEL, Stack, generate_reference

MAX_TOKENS = 12
CHATS = [
    [{"role": "user", "content": "Name three fruits."}],
    [{"role": "user", "content": "What is the capital of Italy?"}],
]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("run"), prefill=1, decode=1)
    s.up()
    yield s
    s.down()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(stack, tmp_path_factory):
    reqs = [{"id": f"chat{i}", "messages": m} for i, m in enumerate(CHATS)]
    reqs.append({"id": "cmpl", "prompt": PROMPT})
    weights = stack.state["quantization"]  # `up` picks them for the host (fp16 on x86 CPUs)
    attention = stack.state["attention_precision"]  # and the attention (bf16 on AMX hosts)
    return generate_reference(tmp_path_factory.mktemp("gen"), reqs, MAX_TOKENS, weights, attention)


def test_non_streaming_matches_generate(stack, client, reference):
    for i, messages in enumerate(CHATS):
        rid = f"e2e-chat-{i}"
        resp = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_headers={"X-Request-Id": rid},
        )
        ref = reference[f"chat{i}"]
        assert stack.out_tokens(rid) == ref["token_ids"]
        assert resp.choices[0].message.content == ref["text"]
        assert resp.choices[0].finish_reason == ref["finish_reason"]
        assert resp.usage.completion_tokens == ref["completion_tokens"]
        assert resp.usage.prompt_tokens == ref["prompt_tokens"]
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Request-Id": "e2e-cmpl"},
    )
    assert stack.out_tokens("e2e-cmpl") == reference["cmpl"]["token_ids"]
    assert resp.choices[0].text == reference["cmpl"]["text"]


def test_streaming_matches_generate(stack, client, reference):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHATS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "e2e-schat"},
    )
    events = list(stream)
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == reference["chat0"]["text"]
    assert events[-1].usage.completion_tokens == reference["chat0"]["completion_tokens"]
    assert stack.out_tokens("e2e-schat") == reference["chat0"]["token_ids"]
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(e.choices[0].text for e in stream if e.choices) == reference["cmpl"]["text"]


def test_32_concurrent_streams_complete(stack, client):
    def one(i: int) -> tuple[str, str | None]:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {i % 7 + 2}."}],
            max_tokens=6,
            temperature=0.7,
            seed=i,
            stream=True,
        )
        text, reason = "", None
        for event in stream:
            if event.choices:
                text += event.choices[0].delta.content or ""
                reason = event.choices[0].finish_reason or reason
        return text, reason

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(reason in ("stop", "length") for _, reason in results), results
    assert sum(1 for text, _ in results if text) == 32


def test_second_turn_reuses_pages_written_by_decode(stack, client):
    first = [{"role": "user", "content": "Describe a sunny beach in a few sentences."}]
    resp1 = client.chat.completions.create(
        model=MODEL, messages=first, max_tokens=48, temperature=0
    )
    answer = resp1.choices[0].message.content
    prompt1 = resp1.usage.prompt_tokens
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now describe it at night."},
    ]
    resp2 = client.chat.completions.create(
        model=MODEL, messages=second, max_tokens=4, temperature=0
    )
    cached = resp2.usage.prompt_tokens_details.cached_tokens
    # more than the first prompt's full pages: the rest are answer pages the decode worker saved
    assert cached > prompt1 // 16 * 16, (cached, prompt1, resp2.usage)
    assert cached % 16 == 0 and cached < resp2.usage.prompt_tokens


def test_bad_requests_get_openai_errors(stack, client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=CHATS[0], max_tokens=2)
    assert exc.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=-1)
    body = exc.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["param"] == "max_tokens"
    resp = httpx.post(
        stack.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400 and "message" in resp.json()["error"]


def test_poison_entries_dead_lettered_and_serving_continues(stack, client):
    before = stack.redis.xlen(stack.keys.dlq)
    stack.redis.xadd(stack.keys.prefill_stream, {MESSAGE_FIELD: b"\x81\xa1v\xa1x"})
    stack.redis.xadd(stack.keys.prefill_stream, {b"junk": b"1"})
    deadline = time.monotonic() + 30
    while stack.redis.xlen(stack.keys.dlq) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    reasons = [f[b"reason"].decode() for _, f in stack.redis.xrange(stack.keys.dlq)][before:]
    assert reasons[0].startswith("invalid prefill task:") and "version" in reasons[0]
    assert reasons[1] == "entry has no 'm' field"
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert resp.choices[0].text


def test_admin_status_and_worker_metrics(stack, client):
    long = "Describe the sea, the sky and the mountains in one long sentence."  # > 1 KV page
    client.completions.create(model=MODEL, prompt=long * 2, max_tokens=2, temperature=0)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvrelay.cli.main",
            "status",
            "--json",
            "--run-dir",
            str(stack.run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    workers = {w["name"]: w for w in status["workers"]}
    assert set(workers) == {"prefill-0", "decode-0"}
    assert [s["pending"] for s in status["streams"]] == [0, 0] * stack.shards
    assert status["store"]["pages"]["host"] > 0
    # both workers hold the pages `up` resolved (auto: bf16 with the C++ kernels) and the store
    # took them (host pages above): one dtype across the stack
    kv = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[stack.state["kv_cache_dtype"]]
    assert {w["kv_dtype"] for w in workers.values()} == {kv}
    human = subprocess.run([sys.executable, "-m", "kvrelay.cli.main", "status",
                            "--run-dir", str(stack.run_dir)], capture_output=True, text=True,
                           timeout=60).stdout  # fmt: skip
    assert "decode-0" in human and "store node0: host " in human
    assert status["topology"]["summary"].startswith(
        "1 prefill + 1 decode live (disaggregated); kvrelay up: 1 prefill + 1 decode workers, "
    )  # given explicitly: this stack tests the prefill -> decode hand-off
    assert status["topology"]["summary"].endswith("(given: --prefill 1 --decode 1)")
    # the last line, or followed by the cluster's node table on a sharded stack
    assert f"topology: {status['topology']['summary']}" in human.splitlines()
    port = workers["decode-0"]["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'kvrelay:generation_tokens_total{model_name="smollm2-135m-instruct"}' in text
    assert "kvrelay:kv_store_pages_total" in text


def test_bench_command_reports_latencies(stack):
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli.main", "bench", "--url",
                           stack.url, "--num-requests", "4", "--concurrency", "2",
                           "--max-tokens", "4", "--json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (summary,) = json.loads(done.stdout)["summaries"]
    assert (summary["num_requests"], summary["num_errors"], summary["point"]) == (4, 0, 2)
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p50"] > 0
    assert summary["output_throughput"] > 0
