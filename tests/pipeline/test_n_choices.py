"""Several choices per request (n, best_of, a list of prompts) with a fake worker: the child
tasks the ingress queues, the exact bodies and streamed chunk order, the parent record, cancel,
limits and backpressure."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrelay.cli.main import main as cli_main
from kvrelay.core.messages import TokenChunk
from kvrelay.core.sampling import SamplingParams, choice_seed, derive_seed
from kvrelay.pipeline.client.producer import AsyncClient
from kvrelay.pipeline.openai.tool_calls import call_id
from tests.pipeline.ingress_support import MODEL, Taken, http, parse_sse
from tests.pipeline.queue_sim import cancel_flags, clear_cancel

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}


async def take_all(role, count: int) -> dict[str, Taken]:
    """The tasks of `count` choices, by request id."""
    taken = [await role.take() for _ in range(count)]
    return {t.task.request_id: t for t in taken}


async def answer(role, taken: Taken, pieces, reason="stop", logprobs=None, cached=0) -> None:
    """One chunk per (token id, text), the last final, then the task acked."""
    rid, prompt = taken.task.request_id, len(taken.task.prompt_token_ids)
    for i, (tid, text) in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk = TokenChunk(
            index=i,
            token_ids=[tid],
            text=text,
            finish_reason=reason if last else None,
            usage=usage(prompt, len(pieces), cached) if last else None,
            logprobs=[{"logprob": logprobs[i], "top": []}] if logprobs else None,
        )
        await role.emit(rid, chunk)
    await role.finish(taken)


async def test_n2_completion_queues_two_seeded_choices_and_sums_usage(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "prompt": [1, 2, 3], "n": 2, "temperature": 0.7, "seed": 5}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "n2"})
        )
        tasks = await take_all(role, 2)
        assert sorted(tasks) == ["n2.0", "n2.1"]
        for k in (0, 1):
            task = tasks[f"n2.{k}"].task
            assert (task.prompt_token_ids, task.sampling.temperature) == ([1, 2, 3], 0.7)
            assert task.sampling.seed == choice_seed(SamplingParams(seed=5), "n2", k)
        assert tasks["n2.0"].task.sampling.seed == 5  # choice 0 is what n=1 gives
        assert tasks["n2.1"].task.sampling.seed == 2014649224381430719
        await answer(role, tasks["n2.1"], [(10, "c"), (11, "d"), (12, "e")], "length")
        await answer(role, tasks["n2.0"], [(20, "a"), (21, "b")], cached=2)
        resp = await post
        assert resp.status_code == 200, resp.text
        got = resp.json()
        assert got.pop("created") > 0
        assert got == {
            "id": "n2",
            "object": "text_completion",
            "model": MODEL,
            "choices": [
                {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"},
                {"index": 1, "text": "cde", "logprobs": None, "finish_reason": "length"},
            ],
            "usage": {
                "prompt_tokens": 3,  # the prompt once
                "completion_tokens": 5,
                "total_tokens": 8,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        }
        state = (await client.get("/v1/requests/n2")).json()
        assert (state["status"], state["completion_tokens"], state["prompt_tokens"]) == (
            "finished", 0, 3)  # fmt: skip
        assert [(c["id"], c["status"]) for c in state["choices"]] == [
            ("n2.0", "finished"), ("n2.1", "finished")]  # fmt: skip
        # posted again with the same id: reattached to the finished choices, same body
        again = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "n2"})
        assert again.json()["choices"] == got["choices"]
        assert again.json()["usage"] == got["usage"]
        # the same id with another n is another request
        other = {**body, "n": 3}
        clash = await client.post("/v1/completions", json=other, headers={"X-Request-Id": "n2"})
        assert clash.status_code == 409


async def test_n2_chat_stream_interleaves_choices_by_index(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {
        "model": MODEL,
        "messages": HI,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "s2"})
        )
        tasks = await take_all(role, 2)
        first, second = tasks["s2.0"], tasks["s2.1"]
        prompt = len(first.task.prompt_token_ids)
        assert second.task.prompt_token_ids == first.task.prompt_token_ids
        # with no seed given, choice 0 has the seed n=1 derives from the request id
        assert first.task.sampling.seed == derive_seed("s2")
        order = [
            ("s2.1", TokenChunk(0, [10], "x")),
            ("s2.0", TokenChunk(0, [20], "Hel")),
            ("s2.0", TokenChunk(1, [21], "lo", finish_reason="stop", usage=usage(prompt, 2))),
            ("s2.1", TokenChunk(1, [11], "y", finish_reason="length", usage=usage(prompt, 2))),
        ]
        for rid, chunk in order:
            await role.emit(rid, chunk)
            await asyncio.sleep(0.3)  # each event out before the next chunk exists
        resp = await post
        # reattached: every choice again from the start (Last-Event-ID means nothing here)
        replay = await client.get("/v1/requests/s2/stream", headers={"Last-Event-ID": "0"})
        assert sorted(parse_sse(replay.content)) == sorted(parse_sse(resp.content))
    assert resp.status_code == 200
    events = parse_sse(resp.content)
    assert all(event_id is None for event_id, _ in events)  # indices are per choice
    datas = [json.loads(d) for _, d in events[:-1]]
    assert events[-1][1] == "[DONE]"
    assert {(d["id"], d["object"]) for d in datas} == {("s2", "chat.completion.chunk")}
    seen = [
        [(c["index"], c["delta"], c["finish_reason"]) for c in d["choices"]] for d in datas[:-1]
    ]
    assert seen == [
        [(0, {"role": "assistant", "content": ""}, None)],
        [(1, {"role": "assistant", "content": ""}, None)],
        [(1, {"content": "x"}, None)],
        [(0, {"content": "Hel"}, None)],
        [(0, {"content": "lo"}, "stop")],
        [(1, {"content": "y"}, "length")],
    ]
    assert datas[-1]["choices"] == []
    assert datas[-1]["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "total_tokens": prompt + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_prompt_list_fans_out_prompt_major(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "prompt": [[1, 2], [3, 4, 5]], "n": 2, "max_tokens": 4}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "pl"})
        )
        tasks = await take_all(role, 4)
        prompts = {rid: t.task.prompt_token_ids for rid, t in tasks.items()}
        assert prompts == {"pl.0": [1, 2], "pl.1": [1, 2], "pl.2": [3, 4, 5], "pl.3": [3, 4, 5]}
        seeds = {rid: t.task.sampling.seed for rid, t in tasks.items()}
        assert seeds["pl.0"] == seeds["pl.2"] == derive_seed("pl")  # choice k of each prompt
        assert seeds["pl.1"] == seeds["pl.3"] == choice_seed(SamplingParams(), "pl", 1)
        for i, rid in enumerate(["pl.3", "pl.0", "pl.2", "pl.1"]):
            await answer(role, tasks[rid], [(30 + i, rid[-1])])
        resp = await post
    got = resp.json()
    assert [(c["index"], c["text"]) for c in got["choices"]] == [
        (0, "0"), (1, "1"), (2, "2"), (3, "3")]  # fmt: skip
    assert got["usage"] == {
        "prompt_tokens": 5,  # each prompt once
        "completion_tokens": 4,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_prompt_list_of_texts_streams_with_echo(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "prompt": ["Hi", "Bye"], "echo": True, "stream": True}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "pe"})
        )
        tasks = await take_all(role, 2)
        assert tasks["pe.0"].task.prompt_token_ids == smollm_tokenizer.encode("Hi")
        assert tasks["pe.1"].task.prompt_token_ids == smollm_tokenizer.encode("Bye")
        await answer(role, tasks["pe.1"], [(5, "!")])
        await asyncio.sleep(0.3)
        await answer(role, tasks["pe.0"], [(6, "?")])
        resp = await post
    datas = [json.loads(d) for _, d in parse_sse(resp.content)[:-1]]
    assert [(c["index"], c["text"], c["finish_reason"]) for d in datas for c in d["choices"]] == [
        (1, "Bye!", "stop"),
        (0, "Hi?", "stop"),
    ]


async def test_best_of_returns_the_highest_cumulative_logprobs(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "prompt": [7, 8], "n": 2, "best_of": 3, "seed": 1}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "bo"})
        )
        tasks = await take_all(role, 3)
        # the ranking needs the chosen tokens' logprobs, asked for even though not returned
        assert [tasks[f"bo.{k}"].task.sampling.logprobs for k in range(3)] == [0, 0, 0]
        await answer(role, tasks["bo.0"], [(1, "a"), (2, "b")], logprobs=[-1.0, -1.5])  # -2.5
        await answer(role, tasks["bo.1"], [(3, "c")], logprobs=[-0.5])  # -0.5: best
        await answer(role, tasks["bo.2"], [(4, "d"), (5, "e")], logprobs=[-0.25, -1.0])  # -1.25
        resp = await post
        replay = await client.get("/v1/requests/bo/stream")  # the best are known at the end
        assert (replay.status_code, replay.json()["error"]["code"]) == (400, "unsupported_value")
        again = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "bo"})
        assert again.json()["choices"] == resp.json()["choices"]
    got = resp.json()
    assert got["choices"] == [
        {"index": 0, "text": "c", "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "text": "de", "logprobs": None, "finish_reason": "stop"},
    ]
    # of every candidate generated (as OpenAI bills best_of, and the usage counters count)
    assert got["usage"]["completion_tokens"] == 5


async def test_cancel_cancels_every_choice(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    ing = app.state.ingress
    body = {"model": MODEL, "messages": HI, "n": 3}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "cx"})
        )
        tasks = await take_all(role, 3)
        state = (await client.get("/v1/requests/cx")).json()
        assert state["status"] == "decoding"  # WorkerRole marks what it takes as decoding
        resp = await client.delete("/v1/requests/cx")
        assert resp.json() == {
            "id": "cx",
            "object": "request.cancel",
            "cancelled": True,
            "status": "decoding",
        }
        flags = await cancel_flags(ing.redis, ing.keys, [f"cx.{k}" for k in range(3)])
        assert flags == [True, True, True]
        for rid, taken in tasks.items():  # what workers do on the flag
            await role.emit(rid, TokenChunk(0, [], finish_reason="cancelled"))
            await role.finish(taken, "cancelled")
        got = (await post).json()
        assert [c["finish_reason"] for c in got["choices"]] == ["cancelled"] * 3
        state = (await client.get("/v1/requests/cx")).json()
        # the flag lived in the choices' progress, which ended with them: their end tells
        assert (state["status"], state["cancel_requested"]) == ("cancelled", True)
        resp = await client.delete("/v1/requests/cx")
        assert resp.json()["cancelled"] is False


async def test_limits_refuse_with_400_and_queue_nothing(harness):
    factory, worker = harness
    app = factory(max_choices=4)
    role = await worker(app)
    cases = [
        ({"n": 5}, "n", "n must be at most 4, got 5"),
        ({"n": 1, "best_of": 5}, "best_of", "best_of must be at most 4, got 5"),
        (
            {"prompt": ["a", "b", "c"], "n": 2},
            "prompt",
            "the request asks for 6 choices (3 prompts x 2); at most 4 are allowed",
        ),
        ({"n": 2, "best_of": 3, "stream": True}, "best_of", None),
    ]
    async with http(app) as client:
        for extra, param, message in cases:
            body = {"model": MODEL, "prompt": "x", **extra}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == param
            if message:
                assert err["message"] == message
        long_id = "x" * 127  # "x...x.1" would pass 128 characters
        resp = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "n": 2},
            headers={"X-Request-Id": long_id},
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "invalid_request_id"
    assert await role.r.xlen(app.state.ingress.keys.decode_stream) == 0


async def test_choices_count_against_max_inflight(harness):
    factory, worker = harness
    app = factory(max_inflight=2)
    role = await worker(app)
    body = {"model": MODEL, "prompt": [1], "n": 3}  # more than the bound: an idle ingress
    async with http(app) as client:  # takes it all the same
        post = asyncio.create_task(client.post("/v1/completions", json=body))
        tasks = await take_all(role, 3)
        assert app.state.ingress.backpressure.inflight == 3
        refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1]})
        assert refused.status_code == 429
        for taken in tasks.values():
            await answer(role, taken, [(1, "a")])
        assert (await post).status_code == 200
    assert app.state.ingress.backpressure.inflight == 0


async def test_deadline_ends_every_choice(harness):
    factory, worker = harness
    app = factory(request_timeout_s=1.0)
    role = await worker(app)
    ing = app.state.ingress
    body = {"model": MODEL, "prompt": [1, 2], "n": 2}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "dl"})
        )
        tasks = await take_all(role, 2)
        assert tasks["dl.0"].task.deadline == tasks["dl.1"].task.deadline  # one deadline
        await role.emit("dl.1", TokenChunk(0, [5], "a"))  # one choice under way, then silence
        resp = await post
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "request_timeout"
        flags = await cancel_flags(ing.redis, ing.keys, [f"dl.{k}" for k in range(2)])
        assert flags == [True, True]
        # streaming: the error event, then [DONE]
        stream = await client.post("/v1/completions", json={**body, "stream": True})
        tail = [d for _, d in parse_sse(stream.content)[-2:]]
        assert json.loads(tail[0])["error"]["code"] == "request_timeout"
        assert tail[1] == "[DONE]"


# ---- tools: each choice's calls parsed on their own -------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def call(request_id: str, arguments: str) -> dict:
    """A choice's first call to f, its id derived from the choice's own id."""
    function = {"name": "f", "arguments": arguments}
    return {"id": call_id(request_id, 0), "type": "function", "function": function}


async def test_n3_chat_with_tools_parses_each_choice(harness):
    factory, worker = harness
    app = factory(tool_call_parser="hermes")
    role = await worker(app)
    body = {"model": MODEL, "messages": HI, "n": 3, "tools": [TOOL], "tool_choice": "auto"}
    texts = {
        "tt.0": '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
        "tt.1": 'Sure.<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>',
        "tt.2": "No.",
    }
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "tt"})
        )
        tasks = await take_all(role, 3)
        for rid in ("tt.2", "tt.0", "tt.1"):
            await answer(role, tasks[rid], [(5, texts[rid])])
        resp = await post
        assert resp.status_code == 200, resp.text
        again = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "tt"})
    got = resp.json()
    assert got["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": [
                call("tt.0", '{"a": 1}')]},
            "logprobs": None,
            "finish_reason": "tool_calls",
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "Sure.", "tool_calls": [
                call("tt.1", '{"a": 2}')]},
            "logprobs": None,
            "finish_reason": "tool_calls",
        },
        {
            "index": 2,
            "message": {"role": "assistant", "content": "No."},
            "logprobs": None,
            "finish_reason": "stop",
        },
    ]  # fmt: skip
    assert call_id("tt.0", 0) != call_id("tt.1", 0)
    assert again.json()["choices"] == got["choices"]  # reattached: the same ids


async def test_n2_chat_stream_with_tools_sends_each_choices_deltas(harness):
    factory, worker = harness
    app = factory(tool_call_parser="hermes")
    role = await worker(app)
    body = {"model": MODEL, "messages": HI, "n": 2, "tools": [TOOL], "stream": True}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "ts"})
        )
        tasks = await take_all(role, 2)
        order = [
            ("ts.1", TokenChunk(0, [10], "Hm.")),
            ("ts.0", TokenChunk(0, [20], '<tool_call>{"name": "f", "arguments": ')),
            ("ts.0", TokenChunk(1, [21], '{"a": 1}}</tool_call>', finish_reason="stop")),
            ("ts.1", TokenChunk(1, [11], " No.", finish_reason="length")),
        ]
        for rid, chunk in order:
            await role.emit(rid, chunk)
            await asyncio.sleep(0.3)  # each event out before the next chunk exists
        for taken in tasks.values():
            await role.finish(taken)
        resp = await post
        replay = await client.get("/v1/requests/ts/stream")
        # reattached: every choice again (interleaved as read), with the same call ids
        assert sorted(parse_sse(replay.content)) == sorted(parse_sse(resp.content))
    events = parse_sse(resp.content)
    assert events[-1][1] == "[DONE]"
    seen = [
        [(c["index"], c["delta"], c["finish_reason"]) for c in json.loads(d)["choices"]]
        for _, d in events[:-1]
    ]
    head = {"index": 0, "id": call_id("ts.0", 0), "type": "function"}
    assert seen == [
        [(0, {"role": "assistant", "content": ""}, None)],
        [(1, {"role": "assistant", "content": ""}, None)],
        [(1, {"content": "Hm."}, None)],
        [(0, {"tool_calls": [{**head, "function": {"name": "f", "arguments": ""}}]}, None)],
        # the chunk's last delta carries its finish reason
        [(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}, "tool_calls")],
        [(1, {"content": " No."}, "length")],
    ]


async def test_n2_chat_forced_named_call_ends_each_choice_with_stop(harness):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    named = {"type": "function", "function": {"name": "f"}}
    body = {"model": MODEL, "messages": HI, "n": 2, "tools": [TOOL], "tool_choice": named}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "tn"})
        )
        tasks = await take_all(role, 2)
        await answer(role, tasks["tn.0"], [(5, '{"a": 1}')])
        await answer(role, tasks["tn.1"], [(6, '{"a": 2}')])
        resp = await post
    assert [
        (c["index"], c["message"], c["finish_reason"]) for c in resp.json()["choices"]
    ] == [
        (0, {"role": "assistant", "content": None, "tool_calls": [call("tn.0", '{"a": 1}')]},
         "stop"),
        (1, {"role": "assistant", "content": None, "tool_calls": [call("tn.1", '{"a": 2}')]},
         "stop"),
    ]  # fmt: skip


# ---- prompt logprobs: each prompt's, shown in each of its choices ---------------------------


def prompt_entries(ids: list[int], base: float) -> list[dict]:
    """A worker's prompt logprobs of `ids` (chunk 0): none for the first token."""
    out: list[dict] = [{"token_id": ids[0], "logprob": None, "rank": None, "top": []}]
    for k, tid in enumerate(ids[1:], start=1):
        out.append({"token_id": tid, "logprob": base - k, "rank": 2, "top": [[7, -0.5]]})
    return out


async def emit_with_prompt(role, taken: Taken, entries: list[dict], tid: int, text: str) -> None:
    """One token, its chunk 0 carrying the prompt logprobs, then the task acked."""
    prompt = len(taken.task.prompt_token_ids)
    chunk = TokenChunk(
        0,
        [tid],
        text,
        finish_reason="stop",
        usage=usage(prompt, 1),
        logprobs=[{"logprob": -0.25, "top": [[tid, -0.25]]}],
        prompt_logprobs=entries,
    )
    await role.emit(taken.task.request_id, chunk)
    await role.finish(taken)


async def test_completions_prompt_list_n2_echo_logprobs_and_prompt_logprobs(
    harness, smollm_tokenizer
):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    tok = smollm_tokenizer

    def text(tid: int) -> str:
        return tok.decode([tid], skip_special_tokens=False)

    prompts = [tok.encode("The sky is"), tok.encode("Grass")]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "echo": True, "logprobs": 1,
            "prompt_logprobs": 1}  # fmt: skip
    entries = [prompt_entries(prompts[0], -1.0), prompt_entries(prompts[1], -3.0)]
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "pp"})
        )
        tasks = await take_all(role, 4)
        assert [tasks[f"pp.{k}"].task.sampling.prompt_logprobs for k in range(4)] == [1] * 4
        for k in (3, 1, 0, 2):  # every choice computes its prompt's (the same values)
            await emit_with_prompt(role, tasks[f"pp.{k}"], entries[k // 2], 100 + k, f"{k}")
        resp = await post
        assert resp.status_code == 200, resp.text
        again = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "pp"})
    choices = resp.json()["choices"]
    assert again.json()["choices"] == choices
    for k, choice in enumerate(choices):
        ids = prompts[k // 2]
        prompt_text = "".join(text(t) for t in ids)
        assert choice["index"] == k
        assert choice["text"] == prompt_text + f"{k}"
        offsets = [len("".join(text(t) for t in ids[:i])) for i in range(len(ids) + 1)]
        base = -1.0 if k < 2 else -3.0
        assert choice["logprobs"] == {
            "tokens": [*(text(t) for t in ids), text(100 + k)],
            "token_logprobs": [None, *(base - i for i in range(1, len(ids))), -0.25],
            "top_logprobs": [None, *({text(7): -0.5} for _ in ids[1:]), {text(100 + k): -0.25}],
            "text_offset": offsets,
        }
        assert choice["prompt_logprobs"] == [
            None,
            *(
                {
                    str(t): {"logprob": base - i, "rank": 2, "decoded_token": text(t)},
                    "7": {"logprob": -0.5, "rank": 1, "decoded_token": text(7)},
                }
                for i, t in enumerate(ids[1:], start=1)
            ),
        ]
        assert choice["finish_reason"] == "stop"
    # both choices of a prompt show that prompt's values
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert choices[2]["prompt_logprobs"] != choices[0]["prompt_logprobs"]


async def test_completions_n2_stream_echo_logprobs_start_with_the_prompt(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    tok = smollm_tokenizer
    ids = tok.encode("Hi there")
    body = {"model": MODEL, "prompt": ids, "n": 2, "echo": True, "logprobs": 0, "stream": True}
    entries = prompt_entries(ids, -1.0)
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "pe2"})
        )
        tasks = await take_all(role, 2)
        assert [t.task.sampling.prompt_logprobs for t in tasks.values()] == [0, 0]
        await emit_with_prompt(role, tasks["pe2.1"], entries, 30, "!")
        await asyncio.sleep(0.3)
        await emit_with_prompt(role, tasks["pe2.0"], entries, 31, "?")
        resp = await post
    datas = [json.loads(d) for _, d in parse_sse(resp.content)[:-1]]
    prompt_lps = [None, *(-1.0 - i for i in range(1, len(ids)))]
    assert [
        (c["index"], c["text"], c["logprobs"]["token_logprobs"], c["finish_reason"])
        for d in datas
        for c in d["choices"]
    ] == [
        (1, "Hi there!", [*prompt_lps, -0.25], "stop"),
        (0, "Hi there?", [*prompt_lps, -0.25], "stop"),
    ]


async def test_chat_n2_prompt_logprobs_are_the_prompts_at_the_top(harness, smollm_tokenizer):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    body = {"model": MODEL, "messages": HI, "n": 2, "prompt_logprobs": 0}
    async with http(app) as client:
        post = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "cp"})
        )
        tasks = await take_all(role, 2)
        ids = tasks["cp.0"].task.prompt_token_ids
        entries = prompt_entries(ids, -1.0)
        await emit_with_prompt(role, tasks["cp.1"], entries, 40, "b")
        await emit_with_prompt(role, tasks["cp.0"], entries, 41, "a")
        resp = await post
    got = resp.json()
    assert [c["message"]["content"] for c in got["choices"]] == ["a", "b"]
    assert all("prompt_logprobs" not in c for c in got["choices"])

    def text(tid: int) -> str:
        return smollm_tokenizer.decode([tid], skip_special_tokens=False)

    assert got["prompt_logprobs"] == [
        None,
        *(
            {
                str(t): {"logprob": -1.0 - i, "rank": 2, "decoded_token": text(t)},
                "7": {"logprob": -0.5, "rank": 1, "decoded_token": text(7)},
            }
            for i, t in enumerate(ids[1:], start=1)
        ),
    ]


def kvrelay_cli(ing, capsys, *argv: str) -> dict:
    """`kvrelay ... --json` against the app's Valkey and key prefix, its JSON output."""
    code = cli_main([*argv, "--json", "--redis-url", ing.config.redis_url,
                     "--key-prefix", ing.keys.prefix])  # fmt: skip
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    return json.loads(out)


async def test_parent_status_is_combined_for_client_and_cli_and_cancel_stops_all(
    harness, smollm_tokenizer, capsys
):
    factory, worker = harness
    app = factory()
    role = await worker(app)
    ing = app.state.ingress
    body = {"model": MODEL, "prompt": [1, 2, 3], "n": 2, "max_tokens": 4}
    producer = AsyncClient(
        ing.config.redis_url, key_prefix=ing.keys.prefix, tokenizers={MODEL: smollm_tokenizer}
    )
    async with http(app) as client, producer:
        post = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "st"})
        )
        tasks = await take_all(role, 2)
        await answer(role, tasks["st.0"], [(20, "a"), (21, "b")])
        await role.emit("st.1", TokenChunk(0, [30], text="c"))
        # what the workers record of their progress
        await role.r.hset(ing.keys.request("st.0"), mapping={
            "completion_tokens": 2, "emitted": 2, "finish_reason": "stop"})  # fmt: skip
        await role.r.hset(ing.keys.request("st.1"), mapping={
            "completion_tokens": 1, "emitted": 1})  # fmt: skip
        assert await ing.redis.hget(ing.keys.request("st"), "status") == b"queued"  # as stored

        state = (await client.get("/v1/requests/st")).json()
        assert (state["status"], state["completion_tokens"], state["emitted"]) == (
            "decoding", 3, 3)  # fmt: skip
        assert (state["prompt_tokens"], state["finish_reason"], state["error"]) == (3, None, None)
        assert [(c["id"], c["status"], c["completion_tokens"]) for c in state["choices"]] == [
            ("st.0", "finished", 2), ("st.1", "decoding", 1)]  # fmt: skip
        status = await producer.status("st")
        assert status == {
            k: v for k, v in state.items() if k not in ("id", "object", "cancel_requested")
        }
        shown = kvrelay_cli(ing, capsys, "requests", "show", "st")
        assert (shown["status"], shown["completion_tokens"], shown["emitted"]) == (
            "decoding", 3, 3)  # fmt: skip
        assert shown["choices"] == state["choices"]
        output = (shown["output_tokens"], shown["output_chunks"], shown["output_text"])
        assert output == (3, 3, None)
        assert (shown["finished"], shown["cancel_requested"]) == (False, False)

        cancelled = kvrelay_cli(ing, capsys, "requests", "cancel", "st")
        assert cancelled == {
            "request_id": "st",
            "cancelled": True,
            "status": "decoding",
            "finish_reason": None,
        }
        # the parent has no progress of its own, and st.0's ended with it
        flags = ["st", "st.0", "st.1"]
        assert await cancel_flags(ing.redis, ing.keys, flags) == [None, None, True]
        await clear_cancel(ing.redis, ing.keys, flags)
        await producer.cancel("st")  # the client's cancel flags every choice too
        assert await cancel_flags(ing.redis, ing.keys, flags) == [None, None, True]

        await role.emit("st.1", TokenChunk(1, [], finish_reason="cancelled"))  # what workers do
        await role.finish(tasks["st.1"], "cancelled")
        got = (await post).json()
        assert [c["finish_reason"] for c in got["choices"]] == ["stop", "cancelled"]
        state = (await client.get("/v1/requests/st")).json()
        # the flag lived in the choices' progress, which ended with them: their end tells
        assert (state["status"], state["cancel_requested"]) == ("cancelled", True)
        assert await producer.status("st") == {
            k: v for k, v in state.items() if k not in ("id", "object", "cancel_requested")
        }
        shown = kvrelay_cli(ing, capsys, "requests", "show", "st")
        assert (shown["status"], shown["finished"], shown["cancel_requested"]) == (
            "cancelled", True, True)  # fmt: skip
        assert kvrelay_cli(ing, capsys, "requests", "cancel", "st") == {
            "request_id": "st",
            "cancelled": False,
            "status": "cancelled",
            "finish_reason": "stop",
        }
        assert await producer.status("nope") is None
