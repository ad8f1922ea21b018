"""prompt_logprobs (both endpoints) and echo with logprobs (completions) through the ingress and
real workers: a prefill worker handing chunk 0 to a decode worker (disaggregated), or a decode
worker prefilling locally (colocated). The values are the engine's own, bitwise."""

from __future__ import annotations

import contextlib
import json

import pytest

from kvrelay.core.keys import Keys
from kvrelay.core.messages import DecodeTask, MessageError
from kvrelay.core.sampling import SamplingParams
from kvrelay.pipeline.client.validate import parse_request, sampling_fields
from kvrelay.pipeline.openai.protocol import parse_chat, parse_completion
from kvrelay.pipeline.server.app import create_app
from kvrelay.pipeline.server.attach import request_digest
from tests.pipeline.ingress_support import MODEL, http, make_config, running_worker, unique_prefix

PREFIX = unique_prefix()
KEYS = Keys(PREFIX)
MESSAGES = [{"role": "user", "content": "Name a river."}]
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def loaded():
    from kvrelay.workers.model.loader import load_model

    return load_model(progress=False, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def workers(valkey_session, loaded):
    """One prefill and one decode worker on the same streams."""
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.prefill import PrefillWorker

    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(running_worker(valkey_session.url, PREFIX, name, role, loaded))
            for name, role in (("prefill-plp", PrefillWorker), ("decode-plp", DecodeWorker))
        ]


@pytest.fixture(params=["disaggregated", "colocated"])
async def ingress(request, valkey_session, smollm_tokenizer, workers):
    config = make_config(valkey_session.url, key_prefix=PREFIX, mode=request.param)
    app = create_app(config, tokenizers={MODEL: smollm_tokenizer})
    prefill = workers[0].engine.stats
    before = prefill.num_prompt_tokens_computed
    try:
        async with http(app) as client:
            yield client
    finally:
        await app.state.ingress.aclose()
    # disaggregated: the prefill worker computed the prompts; colocated: the decode worker
    computed = prefill.num_prompt_tokens_computed > before
    assert computed == (request.param == "disaggregated") or request.node.name.startswith(
        "test_refusals"
    )


def reference(loaded, prompt: list[int], n: int, logprobs: int | None = None):
    """The engine's own answer for `prompt`, alone on a fresh engine."""
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    engine = Engine(EngineConfig(kv_cache_bytes=32 << 20, num_threads=1), loaded=loaded)
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        prompt_logprobs=n,
        logprobs=logprobs,
    )
    return engine.generate([prompt], params)[0]


def text_of(tok, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def vllm_prompt_logprobs(tok, entries: list[dict]) -> list:
    """vLLM's shape: null, then {token id: {logprob, rank, decoded_token}} per prompt token."""
    out: list = [None]
    for e in entries[1:]:
        ranked = {str(e["token_id"]): (e["logprob"], e["rank"], e["token_id"])}
        for rank, (i, v) in enumerate(e["top"], start=1):
            ranked.setdefault(str(i), (v, rank, i))
        out.append(
            {
                k: {"logprob": lp, "rank": r, "decoded_token": text_of(tok, i)}
                for k, (lp, r, i) in ranked.items()
            }
        )
    return out


BASE = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.mark.anyio
async def test_completion_prompt_logprobs(ingress, loaded, smollm_tokenizer):
    prompt = loaded.tokenizer.encode("The longest river in Europe is")
    ref = reference(loaded, prompt, 2)
    resp = await ingress.post(
        "/v1/completions", json={**BASE, "prompt": prompt, "prompt_logprobs": 2}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    assert choice["prompt_logprobs"] == vllm_prompt_logprobs(smollm_tokenizer, ref.prompt_logprobs)
    assert len(choice["prompt_logprobs"]) == len(prompt) == body["usage"]["prompt_tokens"]
    assert all(len(d) in (2, 3) for d in choice["prompt_logprobs"][1:])  # the token + top 2
    assert choice["logprobs"] is None
    assert choice["text"] == smollm_tokenizer.decode(ref.new_token_ids)
    # the same request again: not served from the prefix cache, the same values
    again = await ingress.post(
        "/v1/completions", json={**BASE, "prompt": prompt, "prompt_logprobs": 2}
    )
    assert again.json()["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.anyio
async def test_completion_echo_with_logprobs(ingress, loaded, smollm_tokenizer):
    text = "The longest river in Europe is"
    prompt = loaded.tokenizer.encode(text)
    ref = reference(loaded, prompt, 1, logprobs=1)
    body = {**BASE, "prompt": text, "echo": True, "logprobs": 1}
    resp = await ingress.post("/v1/completions", json=body, headers={"X-Request-Id": "plp-echo"})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    output = smollm_tokenizer.decode(ref.new_token_ids)
    assert choice["text"] == text + output
    lp = choice["logprobs"]
    tokens = [*prompt, *ref.new_token_ids]
    assert lp["tokens"] == [text_of(smollm_tokenizer, t) for t in tokens]
    prompt_lps = [e["logprob"] for e in ref.prompt_logprobs]
    assert lp["token_logprobs"] == [
        *prompt_lps,
        *(d[t] for d, t in zip(ref.new_logprobs, ref.new_token_ids, strict=True)),
    ]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {
        text_of(smollm_tokenizer, i): v for i, v in ref.prompt_logprobs[1]["top"]
    }
    offsets = [0]
    for t in tokens[:-1]:
        offsets.append(offsets[-1] + len(text_of(smollm_tokenizer, t)))
    assert lp["text_offset"] == offsets
    # vLLM also gives them as the choice's prompt_logprobs
    assert choice["prompt_logprobs"] == vllm_prompt_logprobs(smollm_tokenizer, ref.prompt_logprobs)
    # a client reattaching to the finished request gets them again (from the stored chunk 0)
    again = await ingress.post("/v1/completions", json=body, headers={"X-Request-Id": "plp-echo"})
    assert again.json()["choices"][0] == choice
    # streamed: the first event carries the prompt and its logprobs
    resp = await ingress.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line[6:7] == "{"]
    first = events[0]["choices"][0]
    assert first["text"].startswith(text)
    n = len(prompt)
    assert first["logprobs"]["token_logprobs"][:n] == prompt_lps
    assert first["logprobs"]["text_offset"][: n + 1] == offsets[: n + 1]
    streamed = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


@pytest.mark.anyio
async def test_chat_prompt_logprobs(ingress, loaded, smollm_tokenizer):
    prompt = loaded.tokenizer.apply_chat_template(MESSAGES)
    ref = reference(loaded, prompt, 0)
    body = {**BASE, "messages": MESSAGES, "prompt_logprobs": 0}
    resp = await ingress.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["prompt_logprobs"] == vllm_prompt_logprobs(smollm_tokenizer, ref.prompt_logprobs)
    assert len(data["prompt_logprobs"]) == len(prompt)
    assert all(len(d) == 1 for d in data["prompt_logprobs"][1:])  # the prompt token alone
    assert "prompt_logprobs" not in data["choices"][0]
    assert data["choices"][0]["message"]["content"] == smollm_tokenizer.decode(ref.new_token_ids)


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_refusals(ingress, path):
    base = {**BASE, "prompt": "x"} if path == "/v1/completions" else {**BASE, "messages": MESSAGES}
    cases = [
        (
            {"prompt_logprobs": 1, "stream": True},
            "prompt_logprobs is not available when stream is true",
        ),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21"),
    ]
    for extra, message in cases:
        resp = await ingress.post(path, json={**base, **extra})
        assert resp.status_code == 400
        assert resp.json()["error"] | {"message": message} == resp.json()["error"]
        assert resp.json()["error"]["param"] == "prompt_logprobs"


def test_prompt_logprobs_travel_in_tasks_and_are_bounded():
    task = DecodeTask(
        request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(prompt_logprobs=4)
    )
    assert DecodeTask.decode(task.encode()).sampling.prompt_logprobs == 4
    bad = DecodeTask(
        request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(prompt_logprobs=21)
    )
    with pytest.raises(MessageError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        DecodeTask.decode(bad.encode())


def test_echo_with_logprobs_implies_prompt_logprobs_and_the_client_sends_them():
    echo = parse_completion({"model": "m", "prompt": "x", "echo": True, "logprobs": 3})
    assert echo.sampling.prompt_logprobs == 3
    both = parse_completion(
        {"model": "m", "prompt": "x", "echo": True, "logprobs": 3, "prompt_logprobs": 1}
    )
    assert both.sampling.prompt_logprobs == 1  # the field given wins (vLLM's)
    assert (
        parse_completion({"model": "m", "prompt": "x", "logprobs": 3}).sampling.prompt_logprobs
        is None
    )
    assert (
        parse_chat(
            {"model": "m", "messages": MESSAGES, "prompt_logprobs": 0}
        ).sampling.prompt_logprobs
        == 0
    )
    fields = sampling_fields(SamplingParams(prompt_logprobs=2))
    assert fields == {"prompt_logprobs": 2}
    assert parse_request({"model": "m", **fields}, "x", None, None).sampling.prompt_logprobs == 2


def test_prompt_logprobs_are_part_of_the_request_digest():
    body = {"model": "m", "prompt": "x"}
    digests = {
        request_digest(parse_completion({**body, **extra}))
        for extra in ({}, {"prompt_logprobs": 0}, {"prompt_logprobs": 1})
    }
    assert len(digests) == 3
