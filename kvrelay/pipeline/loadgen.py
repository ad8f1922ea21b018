"""Closed-loop load over the OpenAI HTTP API: TTFT, inter-token latency and throughput."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestResult:
    """Timings of one streamed request (seconds, monotonic clock)."""

    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between content events
    cached_tokens: int = 0
    error: str | None = None

    @property
    def itl(self) -> float | None:
        """Mean time per output token after the first."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def _one(client, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    res = RequestResult()
    start = time.monotonic()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.monotonic()
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                    details = event["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                # Every choices event carries tokens (SSE `id:` = token index); token 0 may be a
                # special token with empty text, and it still counts as the first token, as it
                # does for the in-process engine.
                if event.get("choices"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last)
                    last = now
    except Exception as exc:  # a benchmark reports failures instead of dying on them
        res.error = repr(exc)
        return res
    res.latency = time.monotonic() - start
    return res


async def _run(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
               ) -> tuple[list[RequestResult], float]:  # fmt: skip
    import httpx

    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def user() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                results.append(await _one(client, url, model, prompt, max_tokens))

        start = time.monotonic()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return results, time.monotonic() - start


def run_load(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
             ) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Send `prompts` with `concurrency` in flight; returns (results, wall seconds)."""
    return asyncio.run(_run(url.rstrip("/"), model, prompts, max_tokens, concurrency))


def summarize(run: tuple[list[RequestResult], float], concurrency: int) -> dict:
    """Median/p90 TTFT and ITL in ms, output tokens/s, errors."""
    results, wall = run
    ok = [r for r in results if r.error is None]
    ttfts = sorted(r.ttft * 1000 for r in ok)
    itls = sorted(r.itl * 1000 for r in ok if r.itl is not None)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None

    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "ttft_ms_p50": round(statistics.median(ttfts), 2) if ttfts else None,
        "ttft_ms_p90": pct(ttfts, 0.9),
        "itl_ms_p50": round(statistics.median(itls), 2) if itls else None,
        "itl_ms_p90": pct(itls, 0.9),
        "output_tok_s": round(sum(r.output_tokens for r in ok) / wall, 2) if wall else None,
        "first_error": next((r.error for r in results if r.error), None),
    }  # fmt: skip
