"""One streamed OpenAI request and what it measured: TTFT, gaps between tokens, usage, errors."""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field

import httpx


@dataclass(slots=True)
class Target:
    """A server under test: `label` is A for --url, B for --compare."""

    label: str
    url: str
    model: str
    api_key: str | None = None
    # False: a fresh connection per request (llama-server closes kept-alive connections between
    # requests, seen as "Server disconnected without sending a response")
    keep_alive: bool = True

    def headers(self) -> dict[str, str]:
        out = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if not self.keep_alive:
            out["Connection"] = "close"
        return out


@dataclass(slots=True)
class RequestOptions:
    """What every request asks for, whatever the prompt."""

    endpoint: str = "chat"  # chat | completions
    max_tokens: int = 128
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float | None = None  # None: the server's default
    # Per-request fields, each a function of the request's conversation and turn, so every
    # server of a comparison gets the same ones:
    seeded: bool = False  # `seed` (sampled comparisons draw the same way everywhere)
    cache_key: bool = False  # `prompt_cache_key` = the conversation (a server keeps its pages)
    cold: bool = False  # a `cache_salt` of its own: no cached page matches, every turn is cold


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome; times in seconds, offsets from the start of its run."""

    server: str
    point: float
    round: int
    session: int
    turn: int
    start_s: float = 0.0
    scheduled_s: float | None = None  # open loop: the Poisson arrival time of its session
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks carrying text
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (the request's inter-token latency)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def render_prompt(messages: list[dict[str, str]]) -> str:
    """Messages as one text prompt, for sending a chat set to /v1/completions."""
    turns = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n\n".join(turns) + "\n\nassistant:"


def request_seed(conversation: str, turn: int) -> int:
    """The sampling seed of one request: stable across servers and runs, within 32 bits."""
    return zlib.crc32(f"{conversation}/{turn}".encode())


def request_body(
    target: Target,
    opts: RequestOptions,
    messages: list[dict[str, str]],
    prompt: str | None,
    max_tokens: int | None,
    conversation: str = "",
    turn: int = 0,
) -> dict:
    """The JSON body of one streamed request, turn `turn` of `conversation` (its id)."""
    body: dict = {
        "model": target.model,
        "max_tokens": max_tokens or opts.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.top_p is not None:
        body["top_p"] = opts.top_p
    if opts.endpoint == "chat":
        body["messages"] = messages if prompt is None else [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt if prompt is not None else render_prompt(messages)
    if opts.ignore_eos:  # vLLM, kvrelay and llama.cpp honour ignore_eos; min_tokens backs it up
        body["ignore_eos"] = True
        body["min_tokens"] = body["max_tokens"]
    if opts.seeded:
        body["seed"] = request_seed(conversation, turn)
    if opts.cache_key:
        body["prompt_cache_key"] = conversation
    if opts.cold:
        body["cache_salt"] = f"cold/{conversation}/{turn}"
    return body


def _error_text(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    text = str(msg) if msg else raw.decode(errors="replace").strip()
    return f"HTTP {status}: {' '.join(text.split())[:300]}"


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        parts = (delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"))
        return "".join(p for p in parts if isinstance(p, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


async def send(
    client: httpx.AsyncClient, target: Target, body: dict, rec: RequestRecord, t0: float
) -> str:
    """Stream one request into `rec` (never raises); returns the answer's text."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.monotonic()
    rec.start_s = start - t0
    last: float | None = None
    answer: list[str] = []
    done = False
    try:
        async with client.stream(
            "POST", target.url + path, json=body, headers=target.headers()
        ) as resp:
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("error"):
                    err = event["error"]
                    rec.error = "stream error: " + str(
                        err.get("message", err) if isinstance(err, dict) else err
                    )
                    return "".join(answer)
                now = time.monotonic()
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                for choice in event.get("choices") or []:
                    text = _chunk_text(choice)
                    if choice.get("finish_reason"):
                        done = True
                    if not text:  # role-only and empty chunks are not tokens
                        continue
                    answer.append(text)
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
    except (httpx.HTTPError, ValueError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return "".join(answer)
    rec.e2e_s = time.monotonic() - start
    if not done:
        rec.error = "the stream ended before [DONE] or a finish_reason"
    elif rec.output_tokens == 0:  # the server sent no usage: count the chunks instead
        rec.output_tokens = len(answer)
    return "".join(answer)
