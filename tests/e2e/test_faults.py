"""Crash recovery under supervisord: a decode worker SIGKILLed mid-request is resumed by another
worker with exactly the tokens of an uninterrupted run, and every process comes back by itself."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.e2e.stack import MODEL, Stack

MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
SAMPLING = {"max_tokens": 40, "temperature": 0.8, "seed": 1234}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("run"), prefill=1, decode=2)
    s.up()
    yield s
    s.down()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=180)


def stream_text(client, request_id: str, on_token=None) -> tuple[str, str | None]:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
        **SAMPLING,
    )
    text, reason, n = "", None, 0
    for event in stream:
        if event.choices:
            text += event.choices[0].delta.content or ""
            reason = event.choices[0].finish_reason or reason
            n += 1
            if on_token:
                on_token(n)
    return text, reason


def test_sigkill_decode_worker_mid_request_same_tokens(stack, client):
    ref_text, ref_reason = stream_text(client, "fault-ref")
    ref_tokens = stack.out_tokens("fault-ref")
    assert len(ref_tokens) == SAMPLING["max_tokens"] and ref_reason == "length"

    killed: dict[str, int] = {}

    def kill_owner(n: int) -> None:
        if n == 5 and not killed:
            owner = stack.redis.hget(stack.keys.request("fault-victim"), "owner").decode()
            assert owner.startswith("decode-")
            killed[owner] = stack.kill(owner)

    text, reason = stream_text(client, "fault-victim", on_token=kill_owner)
    assert killed, "the request finished before a decode worker could be killed"
    assert stack.out_tokens("fault-victim") == ref_tokens  # no gap, no duplicate, same tokens
    assert (text, reason) == (ref_text, ref_reason)
    [(program, pid)] = killed.items()
    stack.wait_restarted(program, pid)


def _serves(client, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            resp = client.completions.create(
                model=MODEL, prompt="One, two,", max_tokens=3, temperature=0
            )
            return resp.choices[0].text
        except openai.OpenAIError as exc:  # restarting components answer 5xx or refuse
            last = exc
            time.sleep(0.5)
    raise AssertionError(f"not serving after {timeout}s: {last!r}")


@pytest.mark.parametrize("program", ["ingress", "store", "prefill-0", "decode-0", "valkey"])
def test_killed_process_is_restarted_and_serving_resumes(stack, client, program):
    expected = _serves(client)
    old = stack.kill(program)
    stack.wait_restarted(program, old)
    assert _serves(client) == expected


def test_request_in_flight_survives_valkey_restart(stack, client):
    ref_text, _ = stream_text(client, "fault-vk-ref")
    results: list[tuple[str, str | None]] = []
    errors: list[Exception] = []

    def victim() -> None:
        try:
            results.append(stream_text(client, "fault-vk"))
        except openai.APIError as exc:
            errors.append(exc)

    thread = threading.Thread(target=victim)
    thread.start()
    time.sleep(1.0)
    stack.wait_restarted("valkey", stack.kill("valkey"))
    thread.join(180)
    # the ingress waits the restart out: the open stream goes on, nothing is cut or repeated
    assert not errors, f"{errors!r}{stack.logs()}"
    assert results == [(ref_text, "length")]
    assert stack.out_tokens("fault-vk") == stack.out_tokens("fault-vk-ref")
    # reattaching by request id after the end gives the same text again
    deadline = time.monotonic() + 60
    while True:  # a 5xx right after the restart is retried, as clients do
        try:
            text, reason = stream_text(client, "fault-vk")
            break
        except openai.APIError:
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.5)
    assert (text, reason) == (ref_text, "length")
