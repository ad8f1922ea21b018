"""Split pipeline TTFT into stages using Redis entry timestamps, against a running stack.

    kvrelay up --detach --run-dir RUN && python benchmarks/ttft_split.py RUN [--requests 12]

Stages (median ms): client send -> XADD to the work stream (ingress), XADD -> worker admits
(`req:{id}.started`), admit -> first out:{id} entry (worker: compute + emit), first entry ->
first token at the client (ingress relay). Prints a JSON line and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import redis


def probe(
    client: httpx.Client, url: str, r: redis.Redis, prefix: str, i: int
) -> dict[str, float] | None:
    rid = f"ttft-{time.time_ns()}-{i}"
    prompt = f"[t{i}-{time.time_ns()}] Write a short poem about the sea."
    body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    t0, first = time.time(), None
    headers = {"X-Request-Id": rid}
    with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            print(f"request {i}: HTTP {resp.status_code} {resp.read()[:200]!r}")
            return None
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {") and '"text":""' not in line:
                first = time.time()
    queued = None
    for stream in ("stream:decode", "stream:prefill"):
        for entry_id, fields in r.xrevrange(prefix + stream, count=64):
            if rid.encode() in fields[b"m"]:
                queued = int(entry_id.split(b"-")[0])
    out = r.xrange(prefix + f"out:{rid}", count=1)
    out_ms = int(out[0][0].split(b"-")[0])
    started = float(r.hget(prefix + f"req:{rid}", "started")) * 1000
    return {
        "ingress_ms": queued - t0 * 1000,
        "queue_ms": started - queued,
        "worker_ms": out_ms - started,
        "relay_ms": first * 1000 - out_ms,
        "ttft_ms": (first - t0) * 1000,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--requests", type=int, default=12)
    args = ap.parse_args()
    state = json.loads((Path(args.run_dir) / "stack.json").read_text())
    url = f"http://127.0.0.1:{state['port']}/v1/completions"
    prefix = "{" + state.get("key_prefix", "kvrelay:").rstrip(":") + "}:"
    from kvrelay.core.redis_client import sync_redis  # a Sentinel URL too (--valkey-replicas)

    r = sync_redis(state["redis_url"])
    with httpx.Client(timeout=60) as client:  # one client: its setup is not request latency
        rows = [probe(client, url, r, prefix, i) for i in range(args.requests)][2:]  # 2 warm-ups
    rows = [row for row in rows if row is not None]
    med = {k: round(statistics.median(row[k] for row in rows), 1) for k in rows[0]}
    print(json.dumps(med))
    for k, v in med.items():
        print(f"{k:>12} {v:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
