"""`kvrelay worker prefill|decode`: run one worker process (engine + Redis streams + store)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

from kvrelay.core.modelref import QUANTIZATION_SCHEMES

logger = logging.getLogger(__name__)

LOADER_THREADS = 4  # concurrent store fetches of one worker (the node fetches 4 remotely too)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=["prefill", "decode"], help="which stream this worker serves")
    p.add_argument("--name", default=None, help="worker id (default role-host-pid)")
    p.add_argument("--model", default=None, help="model name or path")
    p.add_argument("--redis-url", default=None, help="Redis URL (env KVRELAY_REDIS_URL)")
    p.add_argument("--key-prefix", default=None, help="Redis key prefix")
    p.add_argument("--threads", type=int, default=None, help="compute threads")
    p.add_argument("--device", default=None, help="auto | cpu | cuda[:n]")
    p.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    p.add_argument("--quantization", default=None, choices=tuple(QUANTIZATION_SCHEMES),
                   help="int8-weight-only: int8 weights, fp32 math; fp16: half-size weights; "
                        "int8: int8 weights and activations "
                        "(CPU fp32; default none)")  # fmt: skip
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV pool bytes")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--store-run-dir", default=None, help="local store node run dir (none: off)")
    p.add_argument("--lease-ms", type=int, default=None, help="claim entries idle this long")
    p.add_argument("--metrics-port", type=int, default=None, help="0: any free port; -1: none")


def attach_store(engine: Any, run_dir: str, metrics: Any) -> str:
    """Connect the engine to the local store node; returns its node id ('' when unreachable)."""
    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.connector import StoreConnector
    from kvrelay.kvstore.errors import StoreError
    from kvrelay.kvstore.page import PageSpec
    from kvrelay.workers.metrics import CountingConnector

    pool = engine.runner.kv_pool  # [blocks, layers, 2, page_size, kv_heads, head_dim]
    _, layers, _, page_size, kv_heads, head_dim = pool.shape
    spec = PageSpec(fingerprint=engine.fingerprint, dtype=str(pool.dtype).removeprefix("torch."),
                    num_layers=layers, page_size=page_size, kv_heads=kv_heads,
                    head_dim=head_dim)  # fmt: skip
    client = StoreClient(run_dir, spec, timeout_s=3.0)  # a dead node must not stall compute long
    node = ""
    try:
        node = str(client.connect().get("node_id", ""))
    except StoreError as exc:  # the node may still be starting; the connector retries per call
        logger.warning("store node in %s not reachable yet (%s)", run_dir, exc)
    # Loads run on the engine's loader threads, each over its own socket: a slow fetch must
    # not queue the compute loop's saves, or other requests' fetches, behind it (one
    # StoreClient serves one call at a time).
    loads = [StoreClient(run_dir, spec, timeout_s=10.0) for _ in range(LOADER_THREADS)]
    engine.set_kv_connector(
        CountingConnector(StoreConnector(client), metrics),
        [CountingConnector(StoreConnector(c), metrics) for c in loads],
    )
    return node


def run(args: argparse.Namespace) -> int:
    from kvrelay.cli.main import CommandError
    from kvrelay.core.config import ConfigError
    from kvrelay.workers.config import load_worker_config
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    try:
        config = load_worker_config(
            name=args.name, model=args.model, redis_url=args.redis_url,
            key_prefix=args.key_prefix, threads=args.threads, device=args.device,
            dtype=args.dtype, quantization=args.quantization,
            kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            store_run_dir=args.store_run_dir, lease_ms=args.lease_ms,
            metrics_port=args.metrics_port)  # fmt: skip
    except ConfigError as exc:  # a bad setting is one line and exit 2, not a traceback
        raise CommandError(str(exc)) from exc
    engine = Engine(EngineConfig(
        model=config.model, dtype=config.dtype, device=config.device, page_size=config.page_size,
        kv_cache_bytes=config.kv_cache_bytes, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len, num_threads=config.threads,
        quantization=config.quantization))  # fmt: skip
    return serve(args.role, config, engine)


def serve(role: str, config: Any, engine: Any) -> int:
    """Run a worker of `role` over `engine` until SIGTERM/SIGINT (then drain and release)."""
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.metrics import WorkerMetrics
    from kvrelay.workers.prefill import PrefillWorker

    metrics = WorkerMetrics(engine.model_name, engine)
    node = attach_store(engine, config.store_run_dir, metrics) if config.store_run_dir else ""
    cls = PrefillWorker if role == "prefill" else DecodeWorker
    worker = cls(config, engine, store_node=node, metrics=metrics)
    metrics.serve(config.metrics_port)

    def on_signal(signum, _frame):
        logger.info("signal %d: stopping %s", signum, worker.name)
        worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.run()
    # everything is released; skip interpreter teardown of the model (seconds under supervisord)
    logging.shutdown()
    os._exit(0)
