"""Structured output: its cost, and whether it holds, against vLLM's CPU build in the same run.

Each server runs alone on 127.0.0.1 (started, warmed, stopped; `benchmarks/common.py`), in
alternating rounds. For each server:
- validity: 50 chat requests, each with its own JSON schema (objects with required fields,
  enums, bounded numbers, arrays, nested objects, booleans; every name varied, so every
  schema compiles anew), `response_format` `json_schema` with `strict`, greedy, 8 at a time:
  how many answers parse and validate (`jsonschema`), and one request through the official
  client's `chat.completions.parse(response_format=PydanticModel)`;
- speed: streamed chats at each `--streams` level, plain (`ignore_eos`, exactly `--tokens`
  tokens) and constrained by a JSON schema whose answers run long (a list of short strings),
  `max_tokens` `--tokens`: output tok/s counted from `usage`, TTFT p50.
Reports the constrained/plain ratio per server and kvrelay/vLLM per workload. Not part of CI;
run it on a quiet machine:

    python benchmarks/structured.py --write-docs
    python benchmarks/structured.py --servers kvrelay --streams 1 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DOCS,
    SERVERS,
    Server,
    div,
    machine_line,
    pct,
    precision,
    write_section,
)

MODEL = "smollm2-135m-instruct"
TOPICS = ["the sea", "a mountain village", "a city at night", "a robot", "a garden",
          "the moon", "a library", "winter", "a train", "a bakery"]  # fmt: skip


def schema_for(i: int) -> tuple[str, dict]:
    """Schema i of the validity set (5 shapes, every field name carrying i) and its prompt."""
    topic = TOPICS[i % len(TOPICS)]
    shape = i % 5
    s = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
    obj = lambda props: {"type": "object", "properties": props, "required": list(props),  # noqa: E731
                         "additionalProperties": False}  # fmt: skip
    if shape == 0:
        schema = obj({f"name_{i}": s(40), f"age_{i}": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}})  # fmt: skip
        ask = f"Invent a person who loves {topic}: give the name and age."
    elif shape == 1:
        sentiment = {"enum": ["positive", "negative", "neutral"]}
        confidence = {"type": "number", "minimum": 0, "maximum": 1}
        schema = obj({f"sentiment_{i}": sentiment, f"confidence_{i}": confidence})
        ask = f"Classify the sentiment of: 'I spent a day by {topic} and it was lovely.'"
    elif shape == 2:
        schema = obj({f"tags_{i}": {"type": "array", "items": s(20), "minItems": 1,
                                    "maxItems": 4}})  # fmt: skip
        ask = f"Give a few tags for a photo of {topic}."
    elif shape == 3:
        schema = obj({f"place_{i}": obj({"name": s(30), "country": s(30)}),
                      f"visitors_{i}": {"type": "integer", "minimum": 0}})  # fmt: skip
        ask = f"Name a real place known for {topic}, its country and yearly visitors."
    else:
        schema = obj({f"answer_{i}": {"type": "boolean"}, f"reason_{i}": s(80)})
        ask = f"Is {topic} a good subject for a poem? Answer and say why."
    return ask, schema


# Long answers under a constraint: the speed workload's schema.
LONG_SCHEMA = {"type": "object", "properties": {"lines": {"type": "array", "items": {
    "type": "string", "maxLength": 40}, "minItems": 1}}, "required": ["lines"]}  # fmt: skip


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def one(client, url: str, body: dict) -> dict:
    """One streamed chat: TTFT, latency, completion tokens (from usage) and the text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = {"ttft": None, "latency": None, "tokens": 0, "text": "", "error": None}
    start = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"Connection": "close"}) as resp:  # fmt: skip
            if resp.status_code != 200:
                res["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("usage"):
                    res["tokens"] = event["usage"].get("completion_tokens") or 0
                delta = ((event.get("choices") or [{}])[0].get("delta")) or {}
                if delta.get("content"):
                    if res["ttft"] is None:
                        res["ttft"] = time.monotonic() - start
                    res["text"] += delta["content"]
    except Exception as exc:  # a benchmark reports failures instead of dying on them
        res["error"] = repr(exc)
        return res
    res["latency"] = time.monotonic() - start
    return res


async def closed_loop(url: str, bodies: list[dict], streams: int) -> tuple[list[dict], float]:
    import httpx

    queue = list(enumerate(bodies))
    results: list[dict | None] = [None] * len(bodies)
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:

        async def user() -> None:
            while queue:
                i, body = queue.pop(0)
                results[i] = await one(client, url, body)

        start = time.monotonic()
        await asyncio.gather(*(user() for _ in range(streams)))
        return [r for r in results if r is not None], time.monotonic() - start


def validity(url: str, count: int) -> dict:
    """`count` varied schemas: how many answers parse and validate; plus one `.parse()`."""
    import jsonschema
    import openai
    import pydantic

    bodies, schemas = [], []
    for i in range(count):
        ask, schema = schema_for(i)
        schemas.append(schema)
        bodies.append({"model": MODEL, "messages": [{"role": "user", "content": ask}],
                       "max_tokens": 256, "temperature": 0,
                       "response_format": response_format(f"s{i}", schema)})  # fmt: skip
    results, wall = asyncio.run(closed_loop(url, bodies, 8))
    valid, failures = 0, []
    for i, (res, schema) in enumerate(zip(results, schemas, strict=True)):
        try:
            if res["error"]:
                raise ValueError(res["error"])
            jsonschema.validate(json.loads(res["text"]), schema)
            valid += 1
        except Exception as exc:  # invalid JSON or schema violation: counted, shown
            failures.append(f"{i}: {str(exc)[:160]} :: {res['text'][:160]!r}")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population: int = pydantic.Field(ge=0, le=50_000_000)  # unbounded, 135M loops on digits

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        msg = client.chat.completions.parse(
            model=MODEL, temperature=0, max_tokens=128, response_format=City,
            messages=[{"role": "user", "content": "Describe Paris as a city."}],
        ).choices[0].message  # fmt: skip
        parsed = msg.parsed.model_dump() if msg.parsed is not None else f"refusal {msg.refusal}"
    except Exception as exc:  # the peer may not serve it
        parsed = f"failed: {str(exc)[:200]}"
    return {"requests": count, "valid": valid, "wall_s": round(wall, 1),
            "failures": failures[:5], "parse": parsed}  # fmt: skip


def speed_bodies(workload: str, streams: int, tokens: int, salt: str) -> list[dict]:
    out = []
    for i in range(max(4, 2 * streams)):
        ask = f"[{salt}-{i}] Write short lines about {TOPICS[i % len(TOPICS)]}, as JSON."
        body = {"model": MODEL, "messages": [{"role": "user", "content": ask}],
                "max_tokens": tokens, "temperature": 0}  # fmt: skip
        if workload == "plain":
            body.update(min_tokens=tokens, ignore_eos=True)
        else:
            body["response_format"] = response_format("lines", LONG_SCHEMA)
        out.append(body)
    return out


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "output_tok_s": round(tokens / wall, 1) if wall else None,
        "mean_tokens": round(tokens / len(ok), 1) if ok else None,
        "ttft_ms_p50": round(pct(ttft, 0.5) * 1000, 1) if ttft else None,
        "first_error": next((r["error"] for r in results if r["error"]), None),
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    levels = [int(s) for s in args.streams.split(",") if s]
    raw: dict[tuple[str, str, int], tuple[list[dict], float]] = {}
    valid: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for rep in range(args.repeats):
        for name in args.servers:
            server: Server = SERVERS[name](args, slots=max(levels), ctx_per_slot=512)
            try:
                server.start()
            except Exception as exc:  # one peer failing to start must not lose the others
                failed[name] = str(exc)[-2000:]
                print(f"{name} failed to start: {exc}", file=sys.stderr, flush=True)
                continue
            try:
                warm = speed_bodies("json_schema", 2, 16, f"warm{rep}")[:2]
                asyncio.run(closed_loop(server.url, warm, 2))
                if rep == 0 and args.validity:
                    valid[name] = validity(server.url, args.validity)
                    print(json.dumps({"server": name, **valid[name]}), file=sys.stderr)
                for streams in levels:
                    for workload in ("plain", "json_schema"):
                        # new prompts per workload: no prefix-cache hits from the other one
                        salt = f"r{rep}-{streams}-{workload}"
                        bodies = speed_bodies(workload, streams, args.tokens, salt)
                        res, wall = asyncio.run(closed_loop(server.url, bodies, streams))
                        key = (name, workload, streams)
                        old = raw.get(key, ([], 0.0))
                        raw[key] = (old[0] + res, old[1] + wall)
                        row = {"round": rep, "server": name, "workload": workload,
                               "streams": streams, **summarize(res, wall)}  # fmt: skip
                        print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                server.stop()
    rows = [{"server": k[0], "workload": k[1], "streams": k[2], **summarize(*v)}
            for k, v in raw.items()]  # fmt: skip
    rows.sort(key=lambda r: (r["streams"], args.servers.index(r["server"]), r["workload"]))
    return {"rows": rows, "validity": valid, "start_failures": failed}


def tables(res: dict) -> str:
    by = {(r["server"], r["workload"], r["streams"]): r for r in res["rows"]}
    lines = ["| server | valid JSON (varied schemas) | `.parse(response_format=City)` |",
             "|---|---:|---|"]  # fmt: skip
    for name, v in res["validity"].items():
        lines.append(f"| {name} | {v['valid']} of {v['requests']} | `{v['parse']}` |")
    head = "| streams | server | workload | output tok/s | mean tokens | TTFT p50 (ms) | errors "
    lines += ["", head + "| constrained / plain |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        plain = by.get((r["server"], "plain", r["streams"]))
        ratio = div(r["output_tok_s"], plain["output_tok_s"]) if r["workload"] != "plain" else ""
        lines.append(f"| {r['streams']} | {r['server']} | {r['workload']} | {r['output_tok_s']} "
                     f"| {r['mean_tokens']} | {r['ttft_ms_p50']} | {r['errors']} | "
                     f"{ratio}{'x' if ratio else ''} |")  # fmt: skip
    peers = sorted({r["server"] for r in res["rows"]} - {"kvrelay"})
    if peers:
        lines += [
            "",
            "| streams | workload | kvrelay / peer | output tok/s |",
            "|---:|---|---|---:|",
        ]
        for (server, workload, streams), r in sorted(by.items(), key=lambda kv: kv[0][2]):
            k = by.get(("kvrelay", workload, streams))
            if server in peers and k is not None:
                lines.append(f"| {streams} | {workload} | kvrelay / {server} | "
                             f"{div(k['output_tok_s'], r['output_tok_s'])}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default="kvrelay,vllm")
    p.add_argument("--streams", default="1,32")
    p.add_argument("--tokens", type=int, default=64, help="max output tokens per request")
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds")
    p.add_argument("--validity", type=int, default=50, help="varied-schema requests (0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="auto", choices=(
        "auto", "none", "int8", "fp16", "int8-weight-only", "q8_0", "w8a16"))  # fmt: skip
    p.add_argument("--kvrelay-extra", default="", help="more `kvrelay up` arguments (one string)")
    p.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    p.add_argument("--vllm-extra", default="")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--docs", type=Path, default=DOCS, help="markdown file to update")
    args = p.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    for s in args.servers:
        if s not in SERVERS:
            raise SystemExit(f"unknown server {s!r}; choose from {sorted(SERVERS)}")
    for extra in ("kvrelay_extra", "vllm_extra"):
        setattr(args, extra, shlex.split(getattr(args, extra)))
    args.llama_extra = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    machine = machine_line()
    load_start = os.getloadavg()[0]
    res = run(args)
    res.update(machine=machine, load_at_start=round(load_start, 2),
               load_at_end=round(os.getloadavg()[0], 2),
               precision={s: precision(s, args) for s in args.servers})  # fmt: skip
    print(json.dumps({"benchmark": "structured", **res}))
    text = tables(res)
    print(text)
    if args.write_docs:
        cmd = "python benchmarks/structured.py " + " ".join(argv or sys.argv[1:])
        prec = "; ".join(f"{k}: {v}" for k, v in res["precision"].items())
        write_section("structured", "\n".join([
            "## Structured output: cost and validity against vLLM CPU", "",
            f"`{cmd.strip()}` ({time.strftime('%Y-%m-%d')}). {machine}. Load average "
            f"{res['load_at_start']} at start, {res['load_at_end']} at end. {prec}. Each "
            "server alone, greedy; plain requests are exactly the max tokens (`ignore_eos`), "
            "constrained ones stop where their JSON ends (mean tokens shown); tok/s counts "
            "the tokens in `usage`. vLLM's structured output uses its default backend.", "",
            text, "",
        ]), args.docs)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
