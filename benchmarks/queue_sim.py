"""Queue-plane load simulator: how many generated tokens/s one Valkey carries, at what latency.

Simulated decode workers (no model) run the real worker code paths against a real Valkey:
`Streams.read` + `Streams.admit` for new requests, then per step a one-token chunk for each
of their sequences (the last one ending the request) written by the worker's own `Emitter`
(one step script call: tails, flushes at the end, step numbers, the control list), and a
heartbeat a second. Simulated ingress processes submit requests with the real submit script
(`Producer.enqueue`, routed straight to decode) and read every chunk through the real
`OutputFeed`, one reader per process. Each chunk's text carries the time it was emitted, so
the readers measure emit-to-reader latency.

With `--shards N` the queue plane is N pipeline shards on a local N-node Valkey cluster (AOF
on, each shard's hash tag on its own node, as `kvrelay up --shards N` forms it): `--workers`
simulated workers serve each shard (each with a plain client to its shard's node, as a
worker's lane for that shard), and the ingress processes place requests by id
(`Keys.of`) and read them through one `OutputFeed` per shard.

For each point (workers x batch x steps/s) it reports offered and carried tokens/s, p50/p99
latency, Valkey commands and CPU per token and Valkey's CPU use (summed over the nodes, and
the busiest node's). Python, not Valkey, is the
ceiling on a small host: a point whose carried rate falls short of the offered one with
Valkey below one core is limited by the load generator, and `per core` (tokens per Valkey CPU
second) is the capacity that Valkey itself shows.

    python benchmarks/queue_sim.py --workers 1 --batch 32 --rates 50,100,200,0 --write-docs
    python benchmarks/queue_sim.py --shards 3 --workers 1 --batch 32 --rates 0
    python benchmarks/queue_sim.py --shards 3 --workers 1 --batch 32 --rates 0 --valkey-cpu 0.15

`--valkey-cpu F` caps each Valkey node at F of a core (a cgroup per node; root): on a host
with fewer cores than nodes plus load generator, shards are compared at equal CPU per node.

`--emitter-thread` runs each simulated worker as a real one does: its steps go to the
emitter's thread and the next step does not wait for the write, so when Valkey cannot take a
call per step, the steps queued behind a write go out together (one chunk per request). With
a capped Valkey it shows what a worker carries once the queue plane is its bottleneck:

    python benchmarks/queue_sim.py --workers 1 --batch 32 --rates 200,400 --valkey-cpu 0.05 \
        [--emitter-thread]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, machine_line, pct, start_valkey, write_section  # noqa: E402

from kvrelay.core.keys import DECODE_GROUP, Keys  # noqa: E402
from kvrelay.core.messages import TokenChunk  # noqa: E402
from kvrelay.pipeline.queue.streams import Streams  # noqa: E402
from kvrelay.workers.emitter import Emitter, Inflight, Outgoing, OutgoingKind  # noqa: E402

PREFIX = "sim:"


# ---- Valkey ------------------------------------------------------------------------------------
def start_cluster(data_dir: Path, shards: int) -> tuple[list[subprocess.Popen], list[str]]:
    """A local cluster of `shards` primaries formed as `kvrelay up --shards N` forms it: each
    pipeline shard's tag on its own node (AOF on); the nodes' URLs, node i holding shard i."""
    from kvrelay.cli.up.valkey_cluster import form, make_nodes, valkey_command

    ports = [free_port() for _ in range(2 * shards)]
    nodes = make_nodes(data_dir, ports[:shards], ports[shards:], PREFIX)
    procs = []
    for node in nodes:
        Path(node.data_dir).mkdir(parents=True, exist_ok=True)
        cmd = valkey_command(node.port, node.data_dir, node.bus_port)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    form(nodes)
    return procs, [node.url for node in nodes]


def cap_cpu(pids: list[int], fraction: float) -> list[Path]:
    """Give each process its own CPU cgroup capped at `fraction` of one core (CFS quota), so
    every Valkey node gets the same CPU however many share the host; the cgroups made (remove
    them with `uncap`). Needs root and the cgroup v1 `cpu` controller or cgroup v2."""
    root_v1, root_v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    made = []
    for pid in pids:
        if (root_v1 / "cpu.cfs_quota_us").exists():
            group = root_v1 / f"kvrelay-qsim-{pid}"
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(round(fraction * 100000)))
            (group / "cgroup.procs").write_text(str(pid))  # every thread of it
        elif (root_v2 / "cgroup.controllers").exists():
            group = root_v2 / f"kvrelay-qsim-{pid}"
            group.mkdir()
            (group / "cpu.max").write_text(f"{round(fraction * 100000)} 100000")
            (group / "cgroup.procs").write_text(str(pid))
        else:
            raise SystemExit("--valkey-cpu needs a cgroup cpu controller (and root)")
        made.append(group)
    return made


def uncap(groups: list[Path]) -> None:
    for group in groups:
        for _ in range(50):  # empty once its process has exited
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def valkey_counters(r: redis.Redis) -> tuple[int, float]:
    """(commands so far, Valkey CPU seconds so far), INFO itself left out."""
    stats = r.info("commandstats")
    calls = sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")
    cpu = r.info("cpu")
    return calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


# ---- simulated decode worker -------------------------------------------------------------------
def worker_main(
    url: str, index: int, shard: int, shards: int, batch: int, tokens: int, rate: float,
    until: float, q, threaded: bool = False,
):  # fmt: skip
    r = redis.Redis.from_url(url)  # the node holding `shard` (a plain client: one slot)
    keys = Keys(PREFIX, shard, shards)
    streams = Streams(r, keys, f"sim-{index}.{os.getpid()}")
    streams.ensure_group(keys.decode_stream, DECODE_GROUP)
    streams.beat(keys.worker(f"sim-{index}"), {"name": f"sim-{index}"}, 10)  # registers it
    active: dict[str, list] = {}  # request id -> [entry id, next index]
    # the worker's own emitter (tails, flushes, step numbers, the control list): its batch
    # written in line (the simulated step waits for it), or with `threaded` put on the
    # emitter's queue, as a worker's compute loop does
    inflight = Inflight()
    emitter = Emitter(streams, keys.decode_stream, DECODE_GROUP, inflight)
    if threaded:
        emitter.thread.start()
    steps = written = 0
    period = 1.0 / rate if rate > 0 else 0.0
    next_step = time.monotonic()
    last_beat = 0.0
    while time.time() < until:
        room = batch - len(active)
        if room > 0:
            got = streams.read(keys.decode_stream, DECODE_GROUP, room, None if active else 50)
            from kvrelay.core.messages import DecodeTask

            tasks = [(e.entry_id, DecodeTask.decode(e.payload).request_id) for e in got]
            found = streams.admit([(eid, rid, 0, {}) for eid, rid in tasks])
            for (eid, rid), admitted in zip(tasks, found, strict=True):
                active[rid] = [eid, 0]
                inflight.add(rid, eid)
                emitter.follow(rid, admitted.feeds)
        if not active:
            continue
        now = time.time()
        writes: list[Outgoing] = []
        for rid, (eid, index_) in list(active.items()):
            last = index_ + 1 >= tokens
            chunk = TokenChunk(
                index=index_,
                token_ids=[1000 + index_],
                text=f"{now:.6f} ",  # (chunks merged by the emitter join their texts)
                finish_reason="length" if last else None,
                usage={"prompt_tokens": 8, "completion_tokens": tokens} if last else None,
            )
            writes.append(Outgoing(OutgoingKind.EMIT, rid, eid, chunk, done=last))
            if last:
                del active[rid]
            else:
                active[rid][1] += 1
        n = len(writes)
        if threaded:
            for item in writes:
                emitter.put(item)
        else:
            emitter._write_once(writes)
        steps += 1
        written += n
        if time.monotonic() - last_beat > 1.0:
            last_beat = time.monotonic()
            streams.beat(keys.worker(f"sim-{index}"), {"name": f"sim-{index}"}, 10)
        if period:
            next_step += period
            delay = next_step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_step = time.monotonic()
    if threaded:
        emitter.close(30)
    q.put({"worker": index, "steps": steps, "tokens": written})


# ---- simulated ingress -------------------------------------------------------------------------
def ingress_main(
    url: str, shards: int, index: int, inflight: int, tokens: int, start: float, until: float, q
):
    asyncio.run(_ingress(url, shards, index, inflight, tokens, start, until, q))


async def _ingress(url, shards, index, inflight, tokens, start, until, q) -> None:
    from kvrelay.core.messages import PrefillTask
    from kvrelay.core.sampling import SamplingParams
    from kvrelay.pipeline.model_registry import ModelEntry
    from kvrelay.pipeline.queue.feed import output_feed
    from kvrelay.pipeline.queue.redis_options import async_redis
    from kvrelay.pipeline.queue.route import RouteMode, Router
    from kvrelay.pipeline.queue.submit import Producer, new_request_id

    client = async_redis(url, inflight + 8)
    keys = Keys(PREFIX, shards=shards)
    feed = output_feed(client, keys)
    await feed.start()
    producer = Producer(client, keys, None, Router(client, keys, RouteMode.COLOCATED))
    entry = ModelEntry("sim", None, 50000, 4096, None)
    latencies: list[float] = []
    received = 0

    async def one_request() -> None:
        nonlocal received
        rid = new_request_id("sim")
        task = PrefillTask(
            request_id=rid,
            model="sim",
            prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
            sampling=SamplingParams(max_tokens=tokens),
            arrival_time=time.time(),
        )
        subscription = await feed.subscribe(rid)
        await producer.enqueue(task, entry, feed=feed.reader_id)
        async for chunk in subscription.chunks(submitted=True):
            now = time.time()
            if start <= now < until and chunk.token_ids:
                received += len(chunk.token_ids)
                latencies.extend(now - float(t) for t in chunk.text.split())

    async def loop() -> None:
        while time.time() < until:
            await one_request()

    tasks = [asyncio.create_task(loop()) for _ in range(inflight)]
    await asyncio.sleep(max(0.0, until - time.time()) + 2)
    for t in tasks:
        t.cancel()
    await feed.stop()
    q.put({"ingress": index, "received": received, "latencies": latencies})


# ---- one point ---------------------------------------------------------------------------------
def run_point(urls: list[str], workers: int, batch: int, rate: float, args) -> dict:
    """One load point; `urls`: the node of each shard (one URL: one plain Valkey)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shards = len(urls)
    nodes = [redis.Redis.from_url(u) for u in urls]
    start = time.time() + args.warmup_s + 3  # process start-up, then warm-up
    until = start + args.duration_s
    per_ingress = max(1, (shards * workers * batch * 5 // 4) // args.ingresses)
    procs = [
        ctx.Process(
            target=ingress_main,
            args=(urls[0], shards, i, per_ingress, args.tokens, start, until, q),
        )
        for i in range(args.ingresses)
    ]
    procs += [
        ctx.Process(
            target=worker_main,
            args=(
                urls[k],
                k * workers + i,
                k,
                shards,
                batch,
                args.tokens,
                rate,
                until + 1,
                q,
                args.emitter_thread,
            ),
        )
        for k in range(shards)
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start - time.time()))
    before = [valkey_counters(r) for r in nodes]
    time.sleep(max(0.0, until - time.time()))
    after = [valkey_counters(r) for r in nodes]
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    received = sum(x.get("received", 0) for x in results)
    lat = [v for x in results for v in x.get("latencies", [])]
    calls0, calls1 = sum(c for c, _ in before), sum(c for c, _ in after)
    node_cpu = [b[1] - a[1] for a, b in zip(before, after, strict=True)]
    cpu = sum(node_cpu)
    carried = received / args.duration_s
    return {
        "shards": shards,
        "workers": workers,
        "batch": batch,
        "steps_per_s": rate or "max",
        "offered": shards * workers * batch * rate if rate else None,
        "carried": round(carried),
        "p50_ms": round(pct(lat, 0.5) * 1000, 2) if lat else None,
        "p99_ms": round(pct(lat, 0.99) * 1000, 2) if lat else None,
        "commands_per_token": round((calls1 - calls0) / max(received, 1), 3),
        "valkey_cpu_us_per_token": round(cpu * 1e6 / max(received, 1), 2),
        "valkey_cpu_util": round(cpu / args.duration_s, 2),
        "busiest_node_cpu_util": round(max(node_cpu) / args.duration_s, 2),
        "tokens_per_valkey_core_s": round(received / cpu) if cpu > 0 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", help="a Valkey to load (default: start a fresh one)")
    ap.add_argument(
        "--shards", type=int, default=1, help="pipeline shards on a local N-node cluster"
    )
    ap.add_argument("--workers", default="1", help="simulated decode workers (a list sweeps)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per worker step")
    ap.add_argument("--rates", default="25,50,100,0", help="steps/s per worker (0: flat out)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--ingresses", type=int, default=1, help="ingress processes (readers)")
    ap.add_argument("--duration-s", type=float, default=8.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument(
        "--valkey-cpu",
        type=float,
        help="cap each Valkey node at this fraction of one core (cgroup; root): shards "
        "compared at equal CPU per node on a host too small to give each node a core",
    )
    ap.add_argument(
        "--emitter-thread",
        action="store_true",
        help="workers hand their steps to the emitter's thread, as real ones do (fixed rates "
        "only): steps queued behind a write go out together",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.emitter_thread and any(float(x) <= 0 for x in args.rates.split(",")):
        ap.error(
            "--emitter-thread needs fixed rates (steps/s > 0): a flat-out producer "
            "would queue without bound"
        )
    if args.shards > 1 and args.redis_url:
        ap.error("--shards starts its own cluster; leave out --redis-url")
    data_dir = None
    procs: list[subprocess.Popen] = []
    if args.redis_url:
        urls = [args.redis_url]
    else:
        data_dir = Path(tempfile.mkdtemp(prefix="kvrelay-qsim-"))
        if args.shards > 1:
            procs, urls = start_cluster(data_dir, args.shards)
        else:
            proc, url = start_valkey(data_dir, "--appendonly", "yes", "--appendfsync", "everysec")
            procs, urls = [proc], [url]
    if args.valkey_cpu and not procs:
        ap.error("--valkey-cpu caps the Valkeys it starts; leave out --redis-url")
    groups = cap_cpu([p.pid for p in procs], args.valkey_cpu) if args.valkey_cpu else []
    rows = []
    try:
        for workers in [int(w) for w in args.workers.split(",")]:
            for rate in [float(x) for x in args.rates.split(",")]:
                for u in urls:
                    redis.Redis.from_url(u).flushall()
                row = run_point(urls, workers, args.batch, rate, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        uncap(groups)
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    if args.write_docs:
        argv = [a for a in sys.argv[1:] if a != "--write-docs"]
        cmd = "python benchmarks/queue_sim.py " + " ".join(argv)
        lines = [
            f"Measured {machine_line()}; `{cmd}`.",
            "",
            "| shards | workers x batch | steps/s per worker | offered tok/s | carried tok/s "
            "| p50 ms | p99 ms | commands/token | Valkey CPU µs/token | Valkey CPU "
            "| busiest node | tokens per Valkey core-s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for x in rows:
            lines.append(
                f"| {x['shards']} | {x['workers']} x {x['batch']} | {x['steps_per_s']} | "
                f"{x['offered'] or '-'} | {x['carried']} | {x['p50_ms']} | {x['p99_ms']} | "
                f"{x['commands_per_token']} | {x['valkey_cpu_us_per_token']} | "
                f"{x['valkey_cpu_util']} | {x['busiest_node_cpu_util']} | "
                f"{x['tokens_per_valkey_core_s']} |"
            )
        write_section("queue-sim", "\n".join(lines))


if __name__ == "__main__":
    main()
