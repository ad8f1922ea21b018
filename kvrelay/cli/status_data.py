"""What `kvrelay status` adds to the Redis view: worker counters (scraped), KV tiers, rates."""

from __future__ import annotations

import logging
import re
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.enums import Stage, WorkerField
from kvrelay.core.modelref import SHORT_DTYPE_NAMES
from kvrelay.core.record import as_str
from kvrelay.core.worker_record import WorkerRecord

logger = logging.getLogger(__name__)


def worker_record(w: dict[str, Any]) -> WorkerRecord:
    """A worker of the status snapshot (`WorkerRecord.status`, with what `status` adds: age,
    TTL, metrics) as its typed record."""
    return WorkerRecord.decode(w) or WorkerRecord()


def worker_compute(w: dict[str, Any]) -> tuple[str, str]:
    """The KERNELS and KV columns of a worker's heartbeat: the C++ CPU kernel ISA ("avx512"; "-"
    when none runs: GPU, torch path) and the KV page dtype ("bf16"; "-" when not reported)."""
    record = worker_record(w)
    kv = record.kv_dtype
    return record.kernel_isa or "-", SHORT_DTYPE_NAMES.get(kv, kv or "-")


def worker_attention(w: dict[str, Any]) -> str:
    """The ATTN column: the worker's attention precision (fp32, bf16; "-" when not reported)."""
    return worker_record(w).attention or "-"


def worker_speculation(w: dict[str, Any]) -> str:
    """The SPEC column: the worker's speculative decoding (off, ngram, draft; "-" when not
    reported)."""
    return worker_record(w).speculation or "-"


def worker_startup(w: dict[str, Any]) -> str:
    """The START column: seconds from the worker's process start to its engine ready ("7.9s";
    "-" when not reported)."""
    seconds = worker_record(w).startup_s
    return "-" if seconds is None else f"{seconds:.1f}s"


# Worker series read from its /metrics (summed over labels), as status keys
WORKER_SERIES = {
    "kvrelay:generation_tokens_total": "generation_tokens",
    "kvrelay:prompt_tokens_total": "prompt_tokens",
    "kvrelay:prefix_cache_queries_total": "prefix_cache_queries",
    "kvrelay:prefix_cache_hits_total": "prefix_cache_hits",
    "kvrelay:kv_cache_usage_perc": "kv_cache_usage_perc",
    # speculative decoding: acceptance = accepted / draft tokens, tokens per request-step =
    # generation_tokens / generation_steps
    "kvrelay:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "kvrelay:spec_decode_num_accepted_tokens_total": "spec_accepted_tokens",
    "kvrelay:generation_steps_total": "generation_steps",
}
STORE_TIERS = (("host", "host_slots"), ("disk", "disk_capacity"))  # (tier, its capacity field)


NUM_BLOCKS = re.compile(r'^kvrelay:cache_config_info\{.*num_gpu_blocks="(\d+)"')


def parse_metrics(text: str, wanted: dict[str, str]) -> dict[str, float]:
    """Sum the samples of each wanted series in Prometheus text format (labels ignored), and
    `num_blocks` from the worker's cache_config_info label."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        blocks = NUM_BLOCKS.match(line)
        if blocks:
            out["num_blocks"] = float(blocks.group(1))
        if name in wanted:
            try:
                out[wanted[name]] = out.get(wanted[name], 0.0) + float(value)
            except ValueError:
                continue
    return out


def metrics_url(worker: dict[str, Any]) -> str | None:
    """The worker's /metrics URL (loopback when it runs on this host), None when it has none."""
    record = worker_record(worker)
    port = record.metrics_port
    if port is None or port <= 0:
        return None
    host = record.host or "127.0.0.1"
    if host == socket.gethostname():
        host = "127.0.0.1"
    return f"http://{host}:{port}/metrics"


def scrape_workers(workers: list[dict[str, Any]], timeout_s: float = 0.5) -> None:
    """Set each worker's `metrics` to its scraped counters (None: no port or no answer)."""
    for w in workers:
        url = metrics_url(w)
        w["metrics"] = None
        if url is None:
            continue
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                w["metrics"] = parse_metrics(resp.read().decode(errors="replace"), WORKER_SERIES)
        except (OSError, ValueError) as exc:  # a worker going away must not break `status`
            name = worker_record(w).name
            logger.debug("worker %s: no metrics from %s: %s", name, url, exc)


def _tier(tier: str, pages: Any, capacity: Any, hits: float, lookups: float) -> dict[str, Any]:
    usage = pages / capacity if isinstance(pages, int | float) and capacity else None
    return {
        "tier": tier,
        "pages": pages,
        "capacity": capacity,
        "usage": None if usage is None else round(usage, 4),
        "hits": hits,
        "lookups": lookups,
        "hit_rate": round(hits / lookups, 4) if lookups else None,
    }


def kv_tiers(workers: list[dict[str, Any]], store: dict[str, Any] | None) -> list[dict[str, Any]]:
    """KV cache by tier: `device` (the workers' pools: blocks used, usage, prompt tokens hit),
    then the store node's `host` (DRAM arena) and `disk` pages with their lookup hit rates."""
    scraped = [w["metrics"] for w in workers if w.get("metrics")]
    usages = [m["kv_cache_usage_perc"] for m in scraped if "kv_cache_usage_perc" in m]
    device = _tier(
        "device",
        None,
        None,
        sum(m.get("prefix_cache_hits", 0.0) for m in scraped),
        sum(m.get("prefix_cache_queries", 0.0) for m in scraped),
    )
    device["usage"] = round(sum(usages) / len(usages), 4) if usages else None
    sized = [m for m in scraped if "kv_cache_usage_perc" in m and m.get("num_blocks")]
    if sized:  # blocks in use / blocks, over the workers that publish both
        device["pages"] = sum(round(m["kv_cache_usage_perc"] * m["num_blocks"]) for m in sized)
        device["capacity"] = int(sum(m["num_blocks"] for m in sized))
    tiers = [device]
    if store is None or "error" in store:
        return tiers
    pages, counters = store.get("pages", {}), store.get("counters", {})
    hits, misses = counters.get("hits", {}), counters.get("misses", {})
    for tier, capacity in STORE_TIERS:
        h, m = hits.get(tier, 0.0), misses.get(tier, 0.0)
        tiers.append(_tier(tier, pages.get(tier, 0), pages.get(capacity), h, h + m))
    return tiers


@dataclass(slots=True)
class RateSampler:
    """Rates of counters between two samples: (value - previous) / (now - previous time)."""

    last: dict[str, tuple[float, float]] = field(default_factory=dict)

    def rate(self, name: str, value: float, now: float) -> float | None:
        """Per-second rate since the previous sample of `name`; None for the first, or after a
        counter went backwards (the process restarted)."""
        before = self.last.get(name)
        self.last[name] = (value, now)
        if before is None or now <= before[1] or value < before[0]:
            return None
        return (value - before[0]) / (now - before[1])


def add_rates(data: dict[str, Any], sampler: RateSampler | None, now: float) -> None:
    """Set each worker's `tokens_per_s` from its sampled counter when there is one (else keep
    the heartbeat's), and the total `tokens_per_s`."""
    total = 0.0
    for w in data["workers"]:
        counters = w.get("metrics") or {}
        if sampler is not None and "generation_tokens" in counters:
            name = worker_record(w).name
            rate = sampler.rate(name, counters["generation_tokens"], now)
            if rate is not None:
                w[WorkerField.TOKENS_PER_S] = round(rate, 1)
                w["tokens_per_s_source"] = "counter"
        tokens_per_s = worker_record(w).tokens_per_s
        if tokens_per_s is not None:
            total += tokens_per_s
    data["tokens_per_s"] = round(total, 1)


def collect(r: Any, keys: Any, store_dir: str | None, sampler: RateSampler | None) -> dict:
    """One status snapshot: the Redis view, worker counters, KV tiers and tokens/s."""
    data = status(r, keys, store_dir)
    scrape_workers(data["workers"])
    data["tiers"] = kv_tiers(data["workers"], data["store"])
    data["time"] = round(time.time(), 3)
    add_rates(data, sampler, time.monotonic())
    return data


def store_stats(store_run_dir: str | None) -> dict[str, Any] | None:
    """The local store node's stats (tier usage, hits), or an error note."""
    if not store_run_dir:
        return None
    try:
        from kvrelay.kvstore.client import StoreClient

        client = StoreClient(store_run_dir, timeout_s=2.0)
        try:
            return client.stats()
        finally:
            client.close()
    except Exception as exc:  # the store being down must not break `status`
        return {"error": str(exc)}


def model_stores(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Each model's store node on a stack of several models (`kvrelay up --model A --model B`
    gives each its own): served name, program, node id and the node's stats (or an error
    note); [] for a stack of one model, whose node is `store`."""
    models = state.get("models") or []
    if len(models) < 2:
        return []
    return [
        {
            "model": m.get("served") or m.get("model"),
            "program": m.get("store"),
            "stats": store_stats(m.get("store_run_dir")),
        }
        for m in models
    ]


def status(r: Any, keys: Any, store_run_dir: str | None = None) -> dict[str, Any]:
    """Everything `kvrelay status` shows, as one JSON-able dict."""
    from kvrelay.core.enums import OPEN_STATUSES
    from kvrelay.core.keys import DECODE_GROUP, PREFILL_GROUP
    from kvrelay.pipeline.queue.admin import requests_in_flight, stream_info, workers

    inflight = requests_in_flight(r, keys)
    entries = published_models(r, keys)
    published = {name: entry.pipeline or "" for name, entry in entries.items()}
    aliases = {name: list(entry.aliases or ()) for name, entry in entries.items()}
    # each shard's streams, shard 0 first (the load per shard): the unnamed pipeline's two
    # (always), then those of every other model pipeline found on the shard or published
    streams = []
    for shard in keys.all():
        pipelines = {""} | set(published.values())
        for key in shard_streams(r, shard):
            pipelines.add(key[1])
        for pipeline in sorted(pipelines):
            keyed = shard.for_pipeline(pipeline)
            for stream, group in (
                (keyed.prefill_stream, PREFILL_GROUP),
                (keyed.decode_stream, DECODE_GROUP),
            ):
                info = stream_info(r, stream, group)
                streams.append({**info, "shard": shard.shard, "stage": group, "pipeline": pipeline})
    live = workers(r, keys)
    return {
        "workers": live,
        "streams": streams,
        "models": model_fleets(live, streams, published, aliases),
        "shards": keys.shards,
        "dlq": sum(r.xlen(shard.dlq) for shard in keys.all()),
        "requests": inflight,
        "requests_in_flight": sum(v for k, v in inflight.items() if k in OPEN_STATUSES),
        "store": store_stats(store_run_dir),
    }


def standbys(r: Any, keys: Any) -> list[dict[str, Any]]:
    """The processes waiting, loaded, to serve a worker name (`standby:{name}`, `kvrelay up
    --standby`): name and pid, by name."""
    prefix = keys.standby("")
    out = []
    for key in sorted(r.scan_iter(match=prefix + "*", count=1000)):
        name = as_str(key)[len(prefix) :]
        pid = r.get(key)
        if pid is not None:
            out.append({"name": name, "pid": int(pid)})
    return out


def shard_streams(r: Any, shard: Any) -> set[tuple[str, str]]:
    """(stage, pipeline) of every work stream on one shard (SCAN: any model pipeline's)."""
    from kvrelay.core.record import as_str

    found = set()
    for key in r.scan_iter(match=shard.stream_pattern, count=1000, _type="stream"):
        where = shard.stream_pipeline(as_str(key))
        if where is not None:
            found.add(where)
    return found


def published_models(r: Any, keys: Any) -> dict[str, Any]:
    """Model name -> what its workers publish (`PublishedModel`: pipeline, aliases, ...)."""
    from kvrelay.core.published_model import PublishedModel
    from kvrelay.core.record import as_str

    out = {}
    for name, raw in r.hgetall(keys.models).items():
        entry = PublishedModel.decode(raw, as_str(name))
        if entry is not None:
            out[as_str(name)] = entry
    return out


def _waiting(stream: dict[str, Any]) -> int:
    """Entries of a stream nobody read yet (its lag; all of them while no group exists)."""
    if stream["lag"] is not None:
        return int(stream["lag"])
    return int(stream["length"]) if not stream["consumers"] else 0


def several_models(data: dict[str, Any]) -> bool:
    """Whether the snapshot shows more than one model, a named pipeline or a model served
    under aliases: `status` then lists each model's fleet."""
    models = data.get("models") or []
    return len(models) > 1 or any(m["pipeline"] or m.get("aliases") for m in models)


def model_fleets(
    workers: list[dict[str, Any]],
    streams: list[dict[str, Any]],
    published: dict[str, str],
    aliases: dict[str, list[str]] | None = None,
) -> list[dict[str, Any]]:
    """Per model (those live workers serve, then those only published): its pipeline, the
    other names it is served under (`aliases`, --served-model-name), live workers per role
    (names, and how many are draining) and its streams' load summed over the shards
    (waiting = lag, pending)."""
    records = [worker_record(w) for w in workers]
    names = [r.model for r in records]
    order = list(dict.fromkeys([n for n in names if n] + sorted(published)))
    out = []
    for model in order:
        pipeline = published.get(model, "")
        fleet: dict[str, Any] = {
            "model": model,
            "pipeline": pipeline,
            "aliases": (aliases or {}).get(model, []),
        }
        mine = [r for r in records if r.model == model]
        for stage in Stage:
            role = [r for r in mine if r.role == stage]
            fleet[f"{stage}_workers"] = sorted(r.name or "?" for r in role)
            own = [s for s in streams if s["pipeline"] == pipeline and s["stage"] == stage]
            fleet[f"{stage}_waiting"] = sum(_waiting(s) for s in own)
            fleet[f"{stage}_pending"] = sum(s["pending"] for s in own)
        fleet["draining"] = sum(1 for r in mine if r.draining)
        out.append(fleet)
    return out


def cluster_nodes(r: Any, state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Each Valkey cluster node's port, slots, keys and up/down: the nodes `kvrelay up
    --shards N` started (from stack.json, so a stopped one shows as down), else the primaries
    a cluster client knows; None for a plain Redis."""
    from redis.cluster import RedisCluster

    from kvrelay.cli.up.valkey_cluster import node_status

    nodes = (state.get("cluster") or {}).get("nodes")
    if not nodes and isinstance(r, RedisCluster):
        nodes = [
            {"name": f"{n.host}:{n.port}", "host": n.host, "port": n.port}
            for n in sorted(r.get_primaries(), key=lambda n: (n.host, n.port))
        ]
    return [node_status(n) for n in nodes] if nodes else None
