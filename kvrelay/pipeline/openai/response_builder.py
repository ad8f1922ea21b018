"""The Responses API's answer: the `response` object and its typed SSE events, from TokenChunks.

Without tools, one output item, an assistant message with one `output_text` part. A stream is

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per chunk with text),
    response.output_text.done, response.content_part.done, response.output_item.done,
    then response.completed | response.incomplete | response.failed

each as `event: <type>` and `data: <json>` lines with a `sequence_number` counted from 0. The
numbers depend only on the chunks in out:{id}, so a client that reattaches sees the same ones.

With tools, the text goes through chat's ToolCallStream (tool_calls.py) and each run of text
between calls is a message item, each call a `function_call` item (`id` "fc_" + the hash of
its `call_id`), in the order the model wrote them. An item is opened when its first piece
arrives (output_item.added, then for a message content_part.added) and closed when the next
one opens or the answer ends (message: output_text.done, content_part.done; call:
function_call_arguments.done; then output_item.done); a call's arguments stream as
response.function_call_arguments.delta events. A chunk's events carry its `id:` on the last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.enums import FinishReason
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.openai.completion_format import dumps, usage_counts
from kvrelay.pipeline.openai.tool_calls import ToolCallStream
from kvrelay.pipeline.queue.output import Completion

RESPONSE_PREFIX, REQUEST_PREFIX = "resp_", "resp-"

# finish reason -> response status (an error or a deadline: "failed")
_STATUS: dict[str, str] = {
    FinishReason.STOP: "completed",
    FinishReason.LENGTH: "incomplete",
    FinishReason.CANCELLED: "cancelled",
}
FINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.failed",
    "failed": "response.failed",
}


def response_id(request_id: str) -> str:
    """`resp_<x>` for the request `resp-<x>` (a response's request ids all start `resp-`)."""
    return RESPONSE_PREFIX + request_id.removeprefix(REQUEST_PREFIX)


def request_id_of(resp_id: str) -> str:
    """The request id behind a response id (the inverse of response_id)."""
    return REQUEST_PREFIX + resp_id.removeprefix(RESPONSE_PREFIX)


def usage_object(usage: dict[str, int] | None, prompt_tokens: int, output_tokens: int) -> dict:
    """The Responses usage (usage_counts: the worker's counts win when it sent them)."""
    prompt, output, cached = usage_counts(usage, prompt_tokens, output_tokens)
    return {
        "input_tokens": prompt,
        # cache_write_tokens: explicit prompt caching, which this server does not have
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


@dataclass(slots=True)
class ResponseBuilder:
    """Builds one response's object and events; `sequence` counts the events made so far."""

    request_id: str
    model: str
    created_at: int
    prompt_tokens: int
    repeated: dict[str, Any]  # the request values the object repeats (ResponsesCall.repeated)
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool = True
    tool_calls: ToolCallStream | None = None  # a call with tools: finds the answer's calls
    sequence: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)  # with tools: the output so far
    _open: bool = False  # with tools: the last item is still being written
    _fed: bool = False  # with tools: the chunks were fed one by one (a stream)
    _finished: bool = False  # with tools: the parser was told the text ended
    _pending: list[dict[str, Any]] = field(default_factory=list)  # events made by final()

    @property
    def id(self) -> str:
        return response_id(self.request_id)

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix(RESPONSE_PREFIX)

    def response(
        self,
        status: str = "in_progress",
        text: str | None = None,
        usage: dict | None = None,
        incomplete: str | None = None,
        error: dict | None = None,
        output: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The `response` object; `text` None: no output yet (`output`: the items, given)."""
        if output is None:
            output = [] if text is None else [self.message(text, _item_status(status))]
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": self.repeated.get("instructions"),
            "max_output_tokens": self.repeated.get("max_output_tokens"),
            "max_tool_calls": None,
            "metadata": self.repeated.get("metadata") or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.repeated.get("parallel_tool_calls", True),
            "previous_response_id": self.previous_response_id,
            "prompt_cache_key": self.repeated.get("prompt_cache_key"),
            "prompt_cache_retention": self.repeated.get("prompt_cache_retention"),
            "reasoning": None,
            "safety_identifier": self.repeated.get("safety_identifier"),
            "service_tier": self.repeated.get("service_tier"),
            "store": self.store,
            "temperature": self.temperature,
            "text": self.repeated.get("text") or {"format": {"type": "text"}},
            "tool_choice": self.repeated.get("tool_choice", "auto"),
            "tools": self.repeated.get("tools") or [],
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": self.repeated.get("user"),
        }
        return body

    def message(self, text: str, status: str = "completed", index: int = 0) -> dict[str, Any]:
        """An output item: an assistant message (`index`: its place in the output)."""
        return {
            "id": self.message_id + (f"_{index}" if index else ""),
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [self.part(text)],
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def final(self, result: Completion) -> dict[str, Any]:
        """The finished response object (also the non-streaming body)."""
        reason = result.finish_reason or FinishReason.STOP
        status = _STATUS.get(reason, "failed")
        error = None
        if status == "failed":
            error = {"code": "server_error", "message": result.error or f"generation {reason}"}
        usage = usage_object(result.usage, self.prompt_tokens, len(result.token_ids))
        incomplete = "max_output_tokens" if reason == FinishReason.LENGTH else None
        if self.tool_calls is None:
            return self.response(status, result.text, usage, incomplete, error)
        if not self._fed:
            self._apply(self.tool_calls.feed(result.text))  # the whole text: no events sent
        if not self._finished:
            self._finished = True
            self._pending += self._apply(self.tool_calls.finish())
        output = [dict(item) for item in self.items] or [self.message("")]
        output[-1]["status"] = _item_status(status) if self._open or not self.items else "completed"
        return self.response(status, None, usage, incomplete, error, output=output)

    # streaming --------------------------------------------------------------------------
    def event(self, body: dict[str, Any], event_id: int | None = None) -> bytes:
        """One SSE event (`event:` line = its type), numbered with the next sequence number."""
        body["sequence_number"] = self.sequence
        self.sequence += 1
        head = f"id: {event_id}\n" if event_id is not None else ""
        return f"{head}event: {body['type']}\ndata: {dumps(body)}\n\n".encode()

    def opening(self) -> list[bytes]:
        """The events before the first token: created, in_progress, the item and its part
        (with tools, an item opens when its first piece arrives)."""
        start = self.response()
        if self.tool_calls is not None:
            return [
                self.event({"type": "response.created", "response": start}),
                self.event({"type": "response.in_progress", "response": start}),
            ]
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        item = {**self.message("", "in_progress"), "content": []}
        return [
            self.event({"type": "response.created", "response": start}),
            self.event({"type": "response.in_progress", "response": start}),
            self.event({"type": "response.output_item.added", "output_index": 0, "item": item}),
            self.event({"type": "response.content_part.added", **where, "part": self.part("")}),
        ]

    def delta(self, chunk: TokenChunk) -> bytes | None:
        """The delta event of one chunk (None: it has no text); `id:` its first token's index
        (with tools: the chunk's events, the last with the `id:`)."""
        if self.tool_calls is not None:
            return self._tool_events(chunk)
        if not chunk.text:
            return None
        body = {
            "type": "response.output_text.delta",
            "item_id": self.message_id,
            "output_index": 0,
            "content_index": 0,
            "delta": chunk.text,
            "logprobs": [],
        }
        return self.event(body, chunk.index)

    def closing(self, final: dict[str, Any]) -> list[bytes]:
        """The events after the last token, ending with the final response object."""
        if self.tool_calls is not None:
            bodies = self._pending
            if not self.items:  # no text and no call: an empty message, as without tools
                bodies += self._open_message()
            bodies += self._close(final["output"][-1]["status"])
            bodies.append({"type": FINAL_EVENT[final["status"]], "response": final})
            return [self.event(body) for body in bodies]
        message = final["output"][0]
        text = message["content"][0]["text"]
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self.event(
                {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
            ),
            self.event({"type": "response.content_part.done", **where, "part": self.part(text)}),
            self.event({"type": "response.output_item.done", "output_index": 0, "item": message}),
            self.event({"type": FINAL_EVENT[final["status"]], "response": final}),
        ]

    # with tools -------------------------------------------------------------------------
    def _tool_events(self, chunk: TokenChunk) -> bytes | None:
        assert self.tool_calls is not None
        self._fed = True
        bodies = self._apply(self.tool_calls.feed(chunk.text))
        if chunk.finished and chunk.finish_reason != FinishReason.ERROR and not self._finished:
            self._finished = True
            bodies += self._apply(self.tool_calls.finish())
        if not bodies:
            return None
        last = chunk.index if chunk.token_ids else None
        return b"".join(
            self.event(body, last if i == len(bodies) - 1 else None)
            for i, body in enumerate(bodies)
        )

    def _apply(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat deltas (content, a call's head, its arguments) into items and event bodies."""
        bodies: list[dict[str, Any]] = []
        for delta in deltas:
            if "content" in delta:
                if not self._open or self.items[-1]["type"] != "message":
                    bodies += self._close() + self._open_message()
                where = self._where()
                self.items[-1]["content"][0]["text"] += delta["content"]
                text = {"delta": delta["content"], "logprobs": []}
                bodies.append({"type": "response.output_text.delta", **where, **text})
                continue
            call = delta["tool_calls"][0]
            if "id" in call:
                bodies += self._close()
                item = {
                    "type": "function_call",
                    "id": "fc_" + call["id"].removeprefix("call_"),
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": "",
                    "status": "in_progress",
                }
                self.items.append(item)
                self._open = True
                index = len(self.items) - 1
                bodies.append(
                    {"type": "response.output_item.added", "output_index": index, "item": {**item}}
                )
            arguments = call["function"].get("arguments") or ""
            if arguments:
                self.items[-1]["arguments"] += arguments
                where = self._where()
                del where["content_index"]
                bodies.append(
                    {"type": "response.function_call_arguments.delta", **where, "delta": arguments}
                )
        return bodies

    def _where(self) -> dict[str, Any]:
        index = len(self.items) - 1
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    def _open_message(self) -> list[dict[str, Any]]:
        index = len(self.items)
        item = self.message("", "in_progress", index)
        self.items.append(item)
        self._open = True
        where = self._where()
        return [
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": {**item, "content": []},
            },
            {"type": "response.content_part.added", **where, "part": self.part("")},
        ]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The events that end the last item (none when it has ended)."""
        if not self._open:
            return []
        self._open = False
        item = self.items[-1]
        item["status"] = status
        where = self._where()
        done = {"type": "response.output_item.done", "output_index": where["output_index"]}
        if item["type"] == "message":
            part = item["content"][0]
            text = {"text": part["text"], "logprobs": []}
            return [
                {"type": "response.output_text.done", **where, **text},
                {"type": "response.content_part.done", **where, "part": {**part}},
                {**done, "item": {**item, "content": [{**part}]}},
            ]
        del where["content_index"]
        arguments = {"arguments": item["arguments"]}
        return [
            {"type": "response.function_call_arguments.done", **where, **arguments},
            {**done, "item": {**item}},
        ]

    def error_event(self, message: str, code: str | None, param: str | None = None) -> bytes:
        """An `error` event: the stream cannot go on (the queue is lost, the output expired)."""
        return self.event({"type": "error", "code": code, "message": message, "param": param})


def _item_status(status: str) -> str:
    return {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")
