"""Merging a request's queued chunks into one write (the emitter's `coalesce`)."""

from __future__ import annotations

from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue.streams import StepWrite, WriteMode
from kvrelay.workers.emitter import Outgoing, OutgoingKind, coalesce


def emit(rid: str, chunk: TokenChunk, **kw) -> Outgoing:
    return Outgoing(OutgoingKind.EMIT, rid, f"e-{rid}", chunk, **kw)


def test_consecutive_chunks_of_a_request_become_one_chunk_and_others_keep_their_order():
    lp = [{"logprob": -0.5, "top": []}]
    items = [
        emit("a", TokenChunk(0, [1], text="x", logprobs=lp, prompt_logprobs=[{"token_id": 9}])),
        emit("b", TokenChunk(3, [7], text="p")),
        emit("a", TokenChunk(1, [2], text="y", logprobs=lp)),
        emit("b", TokenChunk(4, [8, 9], text="q")),
        emit("a", TokenChunk(2, [3], logprobs=lp, finish_reason="stop",
                             usage={"completion_tokens": 3}),
             done=True, req_fields={"status": "finished"}),
    ]  # fmt: skip
    out = coalesce(items)
    assert [(o.request_id, o.chunk) for o in out] == [
        (
            "a",
            TokenChunk(
                0,
                [1, 2, 3],
                text="xy",
                logprobs=lp + lp + lp,
                prompt_logprobs=[{"token_id": 9}],
                finish_reason="stop",
                usage={"completion_tokens": 3},
            ),
        ),
        ("b", TokenChunk(3, [7, 8, 9], text="pq")),
    ]
    assert out[0].done and out[0].req_fields == {"status": "finished"}
    assert not out[1].done


def test_chunks_that_must_stay_apart_are_not_merged():
    first = emit("a", TokenChunk(0, [1]))
    sent = emit("a", TokenChunk(0, [1]))
    sent.write = StepWrite("e-a", "a", TokenChunk(0, [1]), WriteMode.EMIT)  # already sent once
    cases = [
        [first, emit("a", TokenChunk(2, [3]))],  # not contiguous
        [emit("a", TokenChunk(0, [1]), done=True), emit("a", TokenChunk(1, [2]))],  # after end
        [emit("a", TokenChunk(0, [1]), req_fields={"s": 1}), emit("a", TokenChunk(1, [2]))],
        [first, emit("a", TokenChunk(1, [2], logprobs=[{"logprob": 0.0, "top": []}]))],
        [first, emit("a", TokenChunk(1, [2], prompt_logprobs=[{}]))],
        [sent, emit("a", TokenChunk(1, [2]))],  # a retried write stays the same write
        [emit("a", TokenChunk(0, [])), emit("a", TokenChunk(0, [2]))],  # a chunk with no tokens
        [first, emit("a", TokenChunk(1, [], finish_reason="cancelled"), done=True)],
        [first, Outgoing(OutgoingKind.HANDOFF, "a", "e-a", TokenChunk(1, [2]), done=True)],
        [first, Outgoing(OutgoingKind.EMIT, "a", "e-other", TokenChunk(1, [2]))],  # claimed back
        [first, Outgoing(OutgoingKind.EMIT, "a", "e-a", TokenChunk(1, [2]), generation=1)],
    ]
    for items in cases:
        assert coalesce(items) == items


def test_a_release_between_two_chunks_keeps_them_apart():
    items = [
        emit("a", TokenChunk(0, [1])),
        Outgoing(OutgoingKind.RELEASE, "b", "e-b"),
        emit("a", TokenChunk(1, [2])),
    ]
    assert coalesce(items) == items
