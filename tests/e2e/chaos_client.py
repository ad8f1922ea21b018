"""An SSE chat client for the chaos test: checks token indices and retries as real clients do.

Each streamed event carries `logprobs` (one entry per token), so the token indices an event
covers are known: `id: n` and k tokens cover n..n+k-1; the next event must start at n+k.
A refused submission (503/429, connection refused) is retried with the same X-Request-Id, which
either queues the request or reattaches to the one already queued; a stream cut without an
ending is reattached with Last-Event-ID. Both are counted so the test can report them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(slots=True)
class StreamResult:
    """What one request's SSE streams delivered, with the indices checked."""

    request_id: str
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    error: dict | None = None
    index_errors: list[str] = field(default_factory=list)
    retries: int = 0  # submissions refused before a stream started
    reattaches: int = 0  # streams cut before their ending, resumed with Last-Event-ID
    done: bool = False
    # the client-side port of each response's connection, the latest last (which ingress of
    # several behind one address serves it: tests/e2e/test_ingress_failover.py)
    client_ports: list[int] = field(default_factory=list)
    usage: dict | None = None  # the usage event's (stream_options.include_usage)
    model: str = ""  # the events' `model`: the name asked


def _events(resp: httpx.Response):
    """(event id or None, decoded data or '[DONE]') per SSE event."""
    event_id: int | None = None
    for line in resp.iter_lines():
        if line.startswith("id:"):
            event_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data = line[5:].strip()
            yield event_id, (data if data == "[DONE]" else json.loads(data))
            event_id = None


def _consume(resp: httpx.Response, res: StreamResult) -> None:
    for event_id, data in _events(resp):
        if data == "[DONE]":
            res.done = True
            return
        if "error" in data:
            res.error = data["error"]
            continue
        if data.get("usage"):  # the usage event (a reattached stream's again: the same)
            res.usage, res.model = data["usage"], data.get("model", "")
        if not data.get("choices"):
            continue
        choice = data["choices"][0]
        lps = (choice.get("logprobs") or {}).get("content") or []
        if event_id is not None:
            if event_id != res.num_tokens:
                res.index_errors.append(f"event id {event_id}, expected {res.num_tokens}")
            res.num_tokens = max(res.num_tokens, event_id + len(lps))
        elif lps:
            res.index_errors.append(f"{len(lps)} tokens in an event without id")
        res.text += choice["delta"].get("content") or ""
        res.finish_reason = choice.get("finish_reason") or res.finish_reason


def _client_port(resp: httpx.Response) -> int:
    stream = resp.extensions["network_stream"]  # httpcore's: the connection's socket
    return int(stream.get_extra_info("client_addr")[1])


def stream_chat(
    client: httpx.Client,
    url: str,
    body: dict,
    request_id: str,
    give_up_s: float = 600,
    res: StreamResult | None = None,
) -> StreamResult:
    """Stream one chat completion to its end (retrying refusals, reattaching cut streams);
    `res`: the result to fill (another thread may watch it fill), else a new one."""
    res = res or StreamResult(request_id)
    give_up = time.monotonic() + give_up_s
    body = {**body, "stream": True, "logprobs": True, "stream_options": {"include_usage": True}}
    while time.monotonic() < give_up:
        headers = {"X-Request-Id": request_id}
        if res.num_tokens:
            headers["Last-Event-ID"] = str(res.num_tokens - 1)
        try:
            with client.stream(
                "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=300
            ) as resp:
                if resp.status_code in (429, 502, 503):
                    res.retries += 1
                    time.sleep(0.5)
                    continue
                if resp.status_code != 200:
                    resp.read()
                    res.error = {"status": resp.status_code, "body": resp.text}
                    return res
                res.client_ports.append(_client_port(resp))
                _consume(resp, res)
        except httpx.HTTPError:  # refused, cut, or silent for `timeout` s: try again by id
            if not res.num_tokens and res.error is None:
                res.retries += 1
                time.sleep(0.5)
                continue
        if res.error is not None and res.error.get("code") == "queue_unavailable":
            res.error = None  # the ingress lost Redis for longer than it waits: reattach
        elif res.done or res.error is not None:
            return res
        res.reattaches += 1
        time.sleep(0.5)
    res.error = res.error or {"message": f"gave up after {give_up_s}s"}
    return res
