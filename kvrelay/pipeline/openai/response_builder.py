"""The Responses API's answer: the `response` object and its typed SSE events, from TokenChunks.

One output item, an assistant message with one `output_text` part. A stream is

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per chunk with text),
    response.output_text.done, response.content_part.done, response.output_item.done,
    then response.completed | response.incomplete | response.failed

each as `event: <type>` and `data: <json>` lines with a `sequence_number` counted from 0. The
numbers depend only on the chunks in out:{id}, so a client that reattaches sees the same ones.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from kvrelay.core.enums import FinishReason
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.queue.output import Completion

RESPONSE_PREFIX, REQUEST_PREFIX = "resp_", "resp-"

# finish reason -> response status (an error or a deadline: "failed")
_STATUS = {
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


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def usage_object(usage: dict[str, int] | None, prompt_tokens: int, output_tokens: int) -> dict:
    """The Responses usage (the worker's counts win when it sent them)."""
    u = usage or {}
    prompt = int(u.get("prompt_tokens", prompt_tokens))
    output = int(u.get("completion_tokens", output_tokens))
    return {
        "input_tokens": prompt,
        # cache_write_tokens: explicit prompt caching, which this server does not have
        "input_tokens_details": {
            "cached_tokens": int(u.get("cached_tokens", 0)),
            "cache_write_tokens": 0,
        },
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
    sequence: int = 0

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
    ) -> dict[str, Any]:
        """The `response` object; `text` None: no output yet."""
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
            "reasoning": None,
            "safety_identifier": self.repeated.get("safety_identifier"),
            "service_tier": self.repeated.get("service_tier"),
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": self.repeated.get("tool_choice", "auto"),
            "tools": [],
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": self.repeated.get("user"),
        }
        return body

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        """The output item: the assistant message."""
        return {
            "id": self.message_id,
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
        return self.response(status, result.text, usage, incomplete, error)

    # streaming --------------------------------------------------------------------------
    def event(self, body: dict[str, Any], event_id: int | None = None) -> bytes:
        """One SSE event (`event:` line = its type), numbered with the next sequence number."""
        body["sequence_number"] = self.sequence
        self.sequence += 1
        head = f"id: {event_id}\n" if event_id is not None else ""
        return f"{head}event: {body['type']}\ndata: {_dumps(body)}\n\n".encode()

    def opening(self) -> list[bytes]:
        """The events before the first token: created, in_progress, the item and its part."""
        start = self.response()
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        item = {**self.message("", "in_progress"), "content": []}
        return [
            self.event({"type": "response.created", "response": start}),
            self.event({"type": "response.in_progress", "response": start}),
            self.event({"type": "response.output_item.added", "output_index": 0, "item": item}),
            self.event({"type": "response.content_part.added", **where, "part": self.part("")}),
        ]

    def delta(self, chunk: TokenChunk) -> bytes | None:
        """The delta event of one chunk (None: it has no text); `id:` its first token's index."""
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

    def error_event(self, message: str, code: str | None, param: str | None = None) -> bytes:
        """An `error` event: the stream cannot go on (the queue is lost, the output expired)."""
        return self.event({"type": "error", "code": code, "message": message, "param": param})


def _item_status(status: str) -> str:
    return {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")
