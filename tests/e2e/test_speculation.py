"""Speculative decoding through `kvrelay up` (prompt lookup is on by default): 100 requests,
chat and completions, streaming and not, greedy and seeded sampling, stop strings and
max_tokens at draft boundaries, token-identical to plain decoding (`kvrelay generate
--speculation off`); and a decode worker SIGKILLed while its drafts are being accepted hands
the request to the other worker with exactly the same tokens."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvrelay.bench.datasets import load
from tests.e2e.stack import MODEL, Stack, generate_reference
from tests.queue_state import emitted_chunks

NUM_REQUESTS = 100
OPENAI_FIELDS = ("temperature", "top_p", "seed", "stop", "max_tokens")
COPY = (
    "Copy this list exactly:\n"
    + "\n".join(
        f"{i}. the {w} of the old harbor town"
        for i, w in enumerate(
            [
                "lighthouse",
                "market",
                "bakery",
                "station",
                "bridge",
                "library",
                "school",
                "garden",
                "tower",
                "chapel",
                "mill",
                "museum",
            ],
            1,
        )
    )  # fmt: skip
)


def _request(i: int) -> dict:
    """Request i: a grounded task, a short chat or a text prompt, with varied sampling."""
    grounded = load("grounded", 0).session(i).messages
    short = load("short", 0).session(i).messages
    kind = i % 4
    if kind == 0:
        body: dict = {"messages": grounded}
    elif kind == 1:
        body = {"messages": [{"role": "user", "content": COPY}]}
    elif kind == 2:
        body = {"messages": short}
    else:
        body = {"prompt": COPY + "\n\n1. the lighthouse"}
    sampling = [
        {"temperature": 0},
        {"temperature": 0.8, "seed": i},
        {"temperature": 0.7, "top_p": 0.9, "seed": 100 + i},
        {"temperature": 0, "stop": ["\n\n", "garden"]},
        {"temperature": 1.0, "top_k": 30, "seed": 3 * i, "stop": ["."]},
    ][i % 5]
    max_tokens = [1, 2, 3, 7, 8, 13, 40, 64][i % 8]
    return {"id": f"spec-{i}", **body, **sampling, "max_tokens": max_tokens}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("spec"), prefill=1, decode=2)
    s.up()
    yield s
    s.down()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _send(client, req: dict, stream: bool) -> tuple[str, str | None]:
    extra = {k: v for k, v in req.items() if k in OPENAI_FIELDS}
    extra["extra_body"] = {k: v for k, v in req.items() if k in ("top_k", "ignore_eos")}
    extra["extra_headers"] = {"X-Request-Id": req["id"]}
    if "messages" in req:
        resp = client.chat.completions.create(
            model=MODEL, messages=req["messages"], stream=stream, **extra
        )
        if not stream:
            return resp.choices[0].message.content or "", resp.choices[0].finish_reason
        text, reason = "", None
        for event in resp:
            if event.choices:
                text += event.choices[0].delta.content or ""
                reason = event.choices[0].finish_reason or reason
        return text, reason
    resp = client.completions.create(model=MODEL, prompt=req["prompt"], stream=stream, **extra)
    if not stream:
        return resp.choices[0].text, resp.choices[0].finish_reason
    text, reason = "", None
    for event in resp:
        if event.choices:
            text += event.choices[0].text
            reason = event.choices[0].finish_reason or reason
    return text, reason


def test_100_requests_identical_to_plain_decoding(stack, client, tmp_path):
    reqs = [_request(i) for i in range(NUM_REQUESTS)]
    ref = generate_reference(
        tmp_path, reqs, 64, stack.state["quantization"], stack.state["attention_precision"]
    )
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _send(client, reqs[i], stream=i % 2 == 1), range(len(reqs))))
    for req, (text, reason) in zip(reqs, got, strict=True):
        r = ref[req["id"]]
        assert stack.out_tokens(req["id"]) == r["token_ids"], req
        assert (text, reason) == (r["text"], r["finish_reason"]), req
    accepted = [
        stack.redis.hget(stack.keys.of(r["id"]).request(r["id"]), "accepted_tokens") for r in reqs
    ]
    assert sum(int(a or 0) for a in accepted) > 100  # drafts were verified and accepted


def test_decode_worker_killed_mid_draft_resumes_identically(stack, client, tmp_path):
    reqs = [
        {"id": "kill-greedy", "messages": [{"role": "user", "content": COPY}], "temperature": 0},
        {
            "id": "kill-seeded",
            "prompt": COPY + "\n\n1. the lighthouse",
            "temperature": 0.8,
            "seed": 42,
        },  # fmt: skip
    ]
    for r in reqs:
        r.update(max_tokens=120, ignore_eos=True)
    ref = generate_reference(
        tmp_path, reqs, 120, stack.state["quantization"], stack.state["attention_precision"]
    )
    for req in reqs:
        killed: dict[str, int] = {}
        done = threading.Event()

        def watch(req=req, killed=killed, done=done) -> None:
            # kill the owner once it has emitted a multi-token chunk (a verified draft) and
            # at least 20 tokens, while the request is still running
            while not done.is_set():
                chunks = emitted_chunks(stack.redis, stack.keys, req["id"])
                n = sum(len(c.token_ids) for c in chunks)
                if n >= 20 and any(len(c.token_ids) > 1 for c in chunks):
                    owner = stack.redis.hget(
                        stack.keys.of(req["id"]).request(req["id"]), "owner"
                    ).decode()
                    if owner.startswith("decode-"):
                        killed[owner] = stack.kill(owner)
                        return
                done.wait(0.005)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        text, reason = _send(client, req, stream=True)
        done.set()
        t.join()
        assert killed, f"{req['id']} finished before its decode worker could be killed"
        assert stack.out_tokens(req["id"]) == ref[req["id"]]["token_ids"]
        assert (text, reason) == (ref[req["id"]]["text"], ref[req["id"]]["finish_reason"])
        [(program, pid)] = killed.items()
        stack.wait_restarted(program, pid)
