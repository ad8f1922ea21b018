"""How the ingress answers a request: the options a POST fixes and every later reader reuses.

They travel in the request's record (`req:{id}`, field `ingress`, private to the ingress), so
a client reattaching at any ingress, after any restart, is answered as the first post was: the
same endpoint's chunks, creation time, echo, logprobs and tool-call parsing. A record written
by an older ingress, or one whose options do not decode, reads as the defaults (the request is
still delivered; only its formatting may differ).
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from kvrelay.core import record as fields
from kvrelay.pipeline.openai.completion_format import ResponseFormatter
from kvrelay.pipeline.openai.protocol import Api, GenerationRequest
from kvrelay.pipeline.openai.tool_parsers import tool_stream


class IngressOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's delivery options (see the module docstring)."""

    api: Api = Api.COMPLETION  # whose chunks: chat or text completions (Responses: chat)
    created: int = 0  # the unix time the answer carries (0: unknown, the record's is used)
    stream: bool = False  # as first posted (a reattaching POST streams as it asks)
    include_usage: bool = False  # as first posted (the /stream endpoint reuses it)
    logprobs: bool = False
    digest: str = ""  # of what was asked (attach.request_digest): a re-post must match it
    echo: str = ""  # completions with echo: the prompt text, sent first
    echoes: list[str] = []  # the same per prompt, for a request of several choices
    tool_calls: dict[str, Any] | None = None  # how to find its tool calls (None: plain text)
    n: int = 1  # several choices: how many are answered per prompt ...
    per_prompt: int = 1  # ... of how many generated (best_of)
    temperature: float | None = None  # the Responses API's object repeats these
    top_p: float | None = None

    @classmethod
    def posted(cls, req: GenerationRequest, digest: str, **more: Any) -> IngressOptions:
        """The options of a completion request `req` posted now, its digest `digest`;
        `more`: the other fields (echo, tool_calls, choices)."""
        return cls(
            api=Api(req.api),
            created=int(time.time()),
            stream=req.stream,
            include_usage=req.include_usage,
            logprobs=req.logprobs,
            digest=digest,
            **more,
        )

    def record(self) -> dict[str, Any]:
        """The value of the record's `ingress` field (core.record.RequestRecord.ingress)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def of(cls, rec: dict[str, str]) -> IngressOptions:
        """The options in a stored record (its raw fields); the defaults where they are
        missing or do not decode."""
        try:
            raw = json.loads(rec.get(fields.INGRESS) or "{}")
            return msgspec.convert(raw, cls)
        except (ValueError, msgspec.ValidationError):
            return cls()

    def created_at(self, fallback: float | None) -> int:
        """The answer's creation time: this one, else the record's, else now."""
        return int(self.created or fallback or time.time())

    def formatter(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        *,
        token_text: Any,
        include_usage: bool,
        created: int | None = None,
        index: int = 0,
        calls_id: str | None = None,
    ) -> ResponseFormatter:
        """The chunk formatter of choice `index` (0: the request's only one); `calls_id`:
        the id its tool calls' ids derive from (a choice's own; default the request's)."""
        echo = self.echoes[index // self.per_prompt] if self.echoes else self.echo
        return ResponseFormatter(
            self.api,
            request_id,
            model,
            self.created if created is None else created,
            prompt_tokens,
            logprobs=self.logprobs,
            include_usage=include_usage,
            token_text=token_text,
            echo=echo,
            index=index,
            tool_calls=tool_stream(calls_id or request_id, self.tool_calls),
        )
