"""The chat and text completion bodies and SSE events (`ResponseFormatter`), built from
TokenChunks; the Responses API has its own (`response_builder.py`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.enums import FinishReason
from kvrelay.core.messages import TokenChunk
from kvrelay.pipeline.errors import error_body
from kvrelay.pipeline.openai.protocol import Api
from kvrelay.pipeline.openai.tool_calls import ToolCallStream
from kvrelay.pipeline.openai.tools import NAMED
from kvrelay.pipeline.queue.output import Completion

DONE = b"data: [DONE]\n\n"
# the finish reason of an answer that is tool calls; a forced named call ends with "stop",
# as OpenAI and vLLM answer it
TOOL_CALLS = "tool_calls"


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any, event_id: int | None = None) -> bytes:
    """One SSE event: optional `id:` line, one `data:` line, blank line."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {dumps(obj)}\n\n".encode()


def usage_counts(
    usage: dict[str, int] | None, prompt_tokens: int, completion_tokens: int
) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens: the worker's counts (a chunk's usage) win when it
    sent them, else the given counts and no cached tokens."""
    u = usage or {}
    return (
        int(u.get("prompt_tokens", prompt_tokens)),
        int(u.get("completion_tokens", completion_tokens)),
        int(u.get("cached_tokens", 0)),
    )


def usage_dict(usage: dict[str, int] | None, prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI usage with prompt_tokens_details.cached_tokens (usage_counts)."""
    prompt, completion, cached = usage_counts(usage, prompt_tokens, completion_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(slots=True)
class ResponseFormatter:
    """Formats one request's output the way OpenAI does for its endpoint."""

    api: Api | str
    request_id: str
    model: str
    created: int
    prompt_tokens: int
    logprobs: bool = False
    include_usage: bool = False
    token_text: Callable[[int], str] = str
    echo: str = ""  # completions with echo: the prompt text, sent before the first token's
    index: int = 0  # the choice this formats (n, best_of, a list of prompts: one formatter each)
    text_offset: int = 0
    completion_tokens: int = 0
    tool_calls: ToolCallStream | None = None  # chat with tools: the answer's calls
    _seen: list[int] = field(default_factory=list)

    @property
    def object_name(self) -> str:
        if self.api == Api.CHAT:
            return "chat.completion.chunk"
        return "text_completion"

    def _envelope(self, choices: list[dict]) -> dict:
        body = {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None  # OpenAI sends an explicit null until the usage chunk
        return body

    # logprobs -------------------------------------------------------------------------
    def _chat_logprobs(self, chunk: TokenChunk) -> dict | None:
        if not self.logprobs or chunk.logprobs is None:
            return None
        content = []
        for tid, lp in zip(chunk.token_ids, chunk.logprobs, strict=False):
            text = self.token_text(tid)
            top = [
                {
                    "token": (t := self.token_text(int(i))),
                    "logprob": float(v),
                    "bytes": list(t.encode()),
                }
                for i, v in lp.get("top", [])
            ]
            content.append(
                {
                    "token": text,
                    "logprob": float(lp["logprob"]),
                    "bytes": list(text.encode()),
                    "top_logprobs": top,
                }
            )
        return {"content": content}

    def _text_logprobs(
        self, chunk: TokenChunk, prompt: list[dict[str, Any]] | None = None
    ) -> dict | None:
        """Completions' logprobs; with echo, `prompt` (the prompt logprobs) come first: the
        first prompt token has no logprob (null), as vLLM answers."""
        if not self.logprobs or chunk.logprobs is None:
            return None
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry in prompt or ():
            text = self.token_text(int(entry["token_id"]))
            out["tokens"].append(text)
            first = entry.get("logprob") is None
            out["token_logprobs"].append(None if first else float(entry["logprob"]))
            out["top_logprobs"].append(
                None
                if first
                else {self.token_text(int(i)): float(v) for i, v in entry.get("top", [])}
            )
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        for tid, lp in zip(chunk.token_ids, chunk.logprobs, strict=False):
            text = self.token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(float(lp["logprob"]))
            out["top_logprobs"].append(
                {self.token_text(int(i)): float(v) for i, v in lp.get("top", [])}
            )
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out

    def prompt_logprobs(self, entries: list[dict[str, Any]] | None) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map of
        token id to {logprob, rank, decoded_token} (the prompt token, then the top-n)."""
        if entries is None:
            return None
        out: list[dict | None] = []
        for entry in entries:
            if entry.get("logprob") is None:
                out.append(None)
                continue
            tid = int(entry["token_id"])
            ranked = {
                tid: {
                    "logprob": float(entry["logprob"]),
                    "rank": int(entry["rank"]),
                    "decoded_token": self.token_text(tid),
                }
            }
            for rank, (i, v) in enumerate(entry.get("top", []), start=1):
                ranked.setdefault(
                    int(i),
                    {"logprob": float(v), "rank": rank, "decoded_token": self.token_text(int(i))},
                )
            out.append({str(i): v for i, v in ranked.items()})
        return out

    # streaming --------------------------------------------------------------------------
    def role_event(self) -> bytes:
        """The first chat event: the assistant role with empty content (no token, no id)."""
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse(self._envelope([choice]))

    def chunk_event(self, chunk: TokenChunk) -> bytes | None:
        """The event for one TokenChunk (None: nothing new). `id:` = index of its first token;
        a token-less ending (cancelled, timeout) has none: there is no token to resume at, so a
        client resuming from its last token's id gets the ending again."""
        self.completion_tokens = chunk.index + len(chunk.token_ids)
        text = chunk.text
        echoed = None
        if self.echo and chunk.index == 0 and chunk.finish_reason != FinishReason.ERROR:
            text, self.echo = self.echo + text, ""  # the first chunk starts with the prompt
            echoed = chunk.prompt_logprobs  # and its logprobs with the prompt tokens
        has_output = bool(chunk.token_ids or text)
        if not has_output and (not chunk.finished or chunk.finish_reason == FinishReason.ERROR):
            return None  # an error ending is sent as an error event by the caller
        finish = chunk.finish_reason if chunk.finish_reason != FinishReason.ERROR else None
        if self.api == Api.CHAT and self.tool_calls is not None:
            return self._tool_events(chunk, finish)
        if self.api == Api.CHAT:
            delta = {"content": text} if has_output else {}
            choice = {
                "index": self.index,
                "delta": delta,
                "logprobs": self._chat_logprobs(chunk),
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": self.index,
                "text": text,
                "logprobs": self._text_logprobs(chunk, echoed),
                "finish_reason": finish,
            }
        return sse(self._envelope([choice]), chunk.index if has_output else None)

    def _tool_events(self, chunk: TokenChunk, finish: str | None) -> bytes | None:
        """Chat with tools: the chunk's deltas, one event each; the last carries the logprobs,
        the finish reason and the `id:` line (the events before it have none)."""
        calls = self.tool_calls
        assert calls is not None
        deltas = calls.feed(chunk.text)
        if chunk.finished and chunk.finish_reason != FinishReason.ERROR:
            deltas += calls.finish()
        if not deltas and finish is None:
            return None
        if finish == FinishReason.STOP and calls.calls and calls.calling.mode != NAMED:
            finish = TOOL_CALLS
        events: list[dict[str, Any]] = [
            {"index": self.index, "delta": d, "logprobs": None, "finish_reason": None}
            for d in deltas
        ]
        if not events:
            events.append(
                {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": None}
            )
        events[-1]["logprobs"] = self._chat_logprobs(chunk)
        events[-1]["finish_reason"] = finish
        last = chunk.index if chunk.token_ids else None
        return b"".join(
            sse(self._envelope([choice]), last if i == len(events) - 1 else None)
            for i, choice in enumerate(events)
        )

    def usage_event(self, usage: dict[str, int] | None) -> bytes:
        body = self._envelope([])
        body["usage"] = usage_dict(usage, self.prompt_tokens, self.completion_tokens)
        return sse(body)

    @staticmethod
    def error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
        return sse(error_body(message, type_, None, code))

    # non-streaming ----------------------------------------------------------------------
    def response(self, result: Completion) -> dict:
        """The whole completion body for a non-streaming request."""
        chunk = TokenChunk(
            index=0, token_ids=result.token_ids, text=result.text, logprobs=result.logprobs
        )
        finish = result.finish_reason
        if self.api == Api.CHAT and self.tool_calls is not None:
            self.tool_calls.feed(result.text)
            self.tool_calls.finish()
            message = self.tool_calls.message()
            calling = self.tool_calls.calling
            if finish == FinishReason.STOP and self.tool_calls.calls and calling.mode != NAMED:
                finish = TOOL_CALLS
            choice = {
                "index": self.index,
                "message": message,
                "logprobs": self._chat_logprobs(chunk),
                "finish_reason": finish,
            }
            obj = "chat.completion"
        elif self.api == Api.CHAT:
            choice = {
                "index": self.index,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": self._chat_logprobs(chunk),
                "finish_reason": result.finish_reason,
            }
            obj = "chat.completion"
        else:
            echoed = result.prompt_logprobs if self.echo else None
            choice = {
                "index": self.index,
                "text": self.echo + result.text,
                "logprobs": self._text_logprobs(chunk, echoed),
                "finish_reason": result.finish_reason,
            }
            if result.prompt_logprobs is not None:  # vLLM's place: in the choice
                choice["prompt_logprobs"] = self.prompt_logprobs(result.prompt_logprobs)
            obj = "text_completion"
        body = {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_dict(result.usage, self.prompt_tokens, len(result.token_ids)),
        }
        if self.api == Api.CHAT and result.prompt_logprobs is not None:  # vLLM's: the response's
            body["prompt_logprobs"] = self.prompt_logprobs(result.prompt_logprobs)
        return body
