"""What the queue plane costs per generated token, measured through a real `kvrelay up` stack.

Starts `kvrelay up` (defaults, or `--up-args`), warms it, then diffs Valkey's `INFO
commandstats` and `used_cpu_sys/user` around one `kvrelay bench` run (streaming chats,
`--ignore-eos` so every answer is `--max-tokens` long) and reports commands and Valkey CPU per
generated token, the commands by name, and the polling commands (XPENDING, XCLAIM,
XAUTOCLAIM, EXISTS) seen while nothing failed. With `--url`/`--redis-url` it measures a stack
that is already running instead.

    python benchmarks/queue_cost.py --streams 32 --requests 32 --max-tokens 64 [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import redis.cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, machine_line, valkey_cpu_s, write_section  # noqa: E402

from kvrelay.core.redis_client import sync_redis  # noqa: E402

POLLING = ("xpending", "xclaim", "xautoclaim")  # claim and lease traffic: none while all live


def command_stats(r: redis.Redis) -> dict[str, tuple[int, float]]:
    """Command name -> (calls, total µs) from INFO commandstats."""
    out = {}
    for name, row in r.info("commandstats").items():
        out[name.removeprefix("cmdstat_")] = (int(row["calls"]), float(row["usec"]))
    return out


def shard_clients(url: str) -> list[redis.Redis]:
    """One client per Valkey node behind `url` (the primaries of a cluster, or the one server)."""
    client = sync_redis(url)
    if isinstance(client, redis.cluster.RedisCluster):
        return [redis.Redis(host=n.host, port=n.port) for n in client.get_primaries()]
    return [client]


def bench(url: str, streams: int, requests: int, max_tokens: int) -> dict:
    cmd = [
        "kvrelay", "bench", "--url", url, "--concurrency", str(streams),
        "--num-requests", str(requests), "--max-tokens", str(max_tokens), "--ignore-eos",
        "--json", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def measure(
    url: str, redis_url: str, streams: int, requests: int, max_tokens: int, idle_s: float = 5.0
) -> dict:
    """Commands and Valkey CPU per generated token over one bench run; the CPU also with the
    stack's idle CPU (heartbeats, Valkey's own timers, AOF fsync: measured over `idle_s`
    before the run) taken out, which is what the load itself costs."""
    clients = shard_clients(redis_url)
    # warm at full concurrency: scripts loaded, model files fetched, connection pools grown
    bench(url, streams, streams, 8)
    time.sleep(1.0)
    idle0 = [valkey_cpu_s(c) for c in clients]
    t0 = time.monotonic()
    time.sleep(idle_s)
    idle_cpu_per_s = sum(valkey_cpu_s(c) - i for c, i in zip(clients, idle0, strict=True))
    idle_cpu_per_s /= time.monotonic() - t0
    before = [(command_stats(c), valkey_cpu_s(c)) for c in clients]
    t0 = time.monotonic()
    result = bench(url, streams, requests, max_tokens)
    wall = time.monotonic() - t0
    after = [(command_stats(c), valkey_cpu_s(c)) for c in clients]
    calls: dict[str, int] = {}
    usec: dict[str, float] = {}
    cpu = 0.0
    for (b, bc), (a, ac) in zip(before, after, strict=True):
        cpu += ac - bc
        for name, (n, us) in a.items():
            n0, us0 = b.get(name, (0, 0.0))
            if n - n0:
                calls[name] = calls.get(name, 0) + n - n0
                usec[name] = usec.get(name, 0.0) + us - us0
    calls.pop("info", None)
    usec.pop("info", None)
    tokens = _output_tokens(result)
    return {
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "shards": len(clients),
        "commands": sum(calls.values()),
        "commands_per_token": round(sum(calls.values()) / tokens, 3),
        "valkey_cpu_us_per_token": round(cpu * 1e6 / tokens, 2),
        "valkey_idle_cpu_ms_per_s": round(idle_cpu_per_s * 1e3, 2),
        "valkey_load_cpu_us_per_token": round((cpu - idle_cpu_per_s * wall) * 1e6 / tokens, 2),
        "by_command": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
        "command_us_per_token": {
            k: round(v / tokens, 2) for k, v in sorted(usec.items(), key=lambda kv: -kv[1]) if v
        },
        "polling": {k: calls[k] for k in POLLING if k in calls},
    }


def _output_tokens(result) -> int:
    """Generated tokens in a `kvrelay bench --json` result (every point, every round)."""
    total = 0

    def walk(node) -> None:
        nonlocal total
        if isinstance(node, dict):
            if "output_tokens" in node and isinstance(node["output_tokens"], int):
                total += node["output_tokens"]
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(result)
    return total


def start_stack(run_dir: Path, port: int, extra: list[str]) -> tuple[str, str]:
    subprocess.run(
        ["kvrelay", "up", "--detach", "--port", str(port), "--run-dir", str(run_dir), *extra],
        check=True,
    )
    state = json.loads((run_dir / "stack.json").read_text())
    return f"http://127.0.0.1:{port}", state["redis_url"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--url", help="an ingress already running (with --redis-url)")
    ap.add_argument("--redis-url")
    ap.add_argument("--up-args", default="", help="extra `kvrelay up` arguments")
    ap.add_argument("--label", default="kvrelay up defaults")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    run_dir = None
    if args.url:
        url, redis_url = args.url, args.redis_url
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="kvrelay-qcost-"))
        url, redis_url = start_stack(run_dir, free_port(), args.up_args.split())
    try:
        row = measure(url, redis_url, args.streams, args.requests, args.max_tokens)
    finally:
        if run_dir is not None:
            subprocess.run(["kvrelay", "down", "--run-dir", str(run_dir)], check=False)
    row["label"] = args.label
    if args.json:
        print(json.dumps(row, indent=2))
        return
    print(json.dumps(row, indent=2))
    if args.write_docs:
        cmd = "python benchmarks/queue_cost.py " + " ".join(sys.argv[1:])
        by = ", ".join(f"{k} {v / row['tokens']:.2f}" for k, v in list(row["by_command"].items()))
        text = (
            f"Measured {machine_line()}; `{cmd.replace(' --write-docs', '')}`.\n\n"
            "| stack | shards | tokens | Valkey commands/token | Valkey CPU µs/token "
            "| of which the load's | polling |\n"
            "|---|---:|---:|---:|---:|---:|---|\n"
            f"| {row['label']} | {row['shards']} | {row['tokens']} | "
            f"{row['commands_per_token']} | {row['valkey_cpu_us_per_token']} | "
            f"{row['valkey_load_cpu_us_per_token']} | {row['polling'] or 'none'} |\n\n"
            f"Per token by command: {by}."
        )
        write_section("queue-cost", text)


if __name__ == "__main__":
    main()
