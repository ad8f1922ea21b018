"""`kvrelay worker prefill|decode`: run one worker process (engine + Redis streams + store)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from kvrelay.core.config import config_file_help
from kvrelay.core.enums import Speculation, Stage
from kvrelay.core.modelref import ATTENTION_PRECISIONS, KV_CACHE_DTYPES, QUANTIZATIONS

if TYPE_CHECKING:  # (loaded when a worker runs: `kvrelay --help` needs no torch)
    from collections.abc import Callable

    from kvrelay.workers.base import Worker
    from kvrelay.workers.config import WorkerConfig
    from kvrelay.workers.engine.llm_engine import Engine
    from kvrelay.workers.metrics import WorkerMetrics
    from kvrelay.workers.slot import WorkerSlot

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
LOADER_THREADS = 4  # concurrent store fetches of one worker (the node fetches 4 remotely too)
# The KV pool's pages are faulted in (~1 s of a core per GB) this long after the worker is
# ready, not during its start: a restarted worker's resume (claim, fetch, recompute, first
# token) takes well under this on 2 cores, and gets both of them. A standby faults them in
# while it waits.
KV_POPULATE_DELAY_S = 2.0


QUANTIZATION_HELP = (
    "int8-weight-only: int8 weights, fp32 math; q8_0: int8 weights and activations, a "
    "scale per 32 each (llama.cpp's Q8_0 dot; AMX tiles where the CPU has them); w8a16: "
    "int8 weights with a scale per output, bf16 activations (AMX-BF16 CPUs only); "
    "fp16: half-size weights; int8: int8 weights and activations (CPU fp32)"
)
KV_DTYPE_HELP = (
    "KV page dtype: auto (bf16 for an fp32 model on CPU with the C++ kernels, else the "
    "model's: bf16 on CUDA, fp32 on the torch path), fp32, bf16 or fp16; 16-bit pages fit "
    "twice the tokens in --kv-cache-bytes"
)
ATTENTION_HELP = (
    "attention dot products: auto (bf16 on CPUs with AMX-BF16 and bf16 pages, else fp32), "
    "fp32, or bf16 (q and p rounded to bf16 on AMX tiles: 4x faster prefill attention)"
)
SPECULATION_HELP = (
    "speculative decoding, never changing the output: auto (draft with --draft-model, else "
    "ngram), off, ngram (prompt lookup) or draft (a draft model); decode steps only"
)
SPECULATION_CHOICES = tuple(m.value for m in Speculation)
# the speculation settings' (field, help), shared by `kvrelay worker` and `kvrelay generate`
SPECULATION_HELP_TABLE = [
    ("speculation", SPECULATION_HELP),
    ("num_speculative_tokens", "the longest draft verified in one step"),
    ("prompt_lookup_min", "shortest n-gram prompt lookup matches"),
    ("prompt_lookup_max", "longest n-gram prompt lookup matches (tried first)"),
    ("draft_model", "draft model name or path, with the model's tokenizer (--speculation draft)"),
]
# --kv-cache-dtype values: the short names, and the long ones normalize_dtype also takes
KV_DTYPE_CHOICES = (*KV_CACHE_DTYPES, "float32", "bfloat16", "float16")


def flag_options(dest: str) -> dict[str, Any]:
    """argparse choices (and metavar) of an engine setting's flag; none: any value of its type."""
    if dest == "quantization":
        return {"choices": QUANTIZATIONS}
    if dest == "speculation":
        return {"choices": SPECULATION_CHOICES}
    if dest == "attention_precision":
        return {"choices": ATTENTION_PRECISIONS}
    if dest == "lora_modules":  # repeatable (each may also hold several, comma-separated)
        return {"action": "append"}
    if dest == "kv_cache_dtype":  # the long names are accepted, the short ones shown
        return {"choices": KV_DTYPE_CHOICES, "metavar": "{" + ",".join(KV_CACHE_DTYPES) + "}"}
    return {}


# (field, help): flag names, types and defaults come from WorkerConfig (KVRELAY_WORKER_*).
_HELP: list[tuple[str, ...]] = [
    ("name", "worker id (none: role-host-pid)"),
    ("model", "model name or path"),
    ("redis_url", "Redis URL (or the shared KVRELAY_REDIS_URL)"),
    ("key_prefix", "Redis key prefix (or the shared KVRELAY_KEY_PREFIX)"),
    ("shards", "pipeline shards, the same for every process (or the shared KVRELAY_SHARDS)"),
    ("serve_shards", "the shards this worker serves, e.g. 0,2 (none: every shard)"),
    ("threads", "compute threads (none: torch's default)"),
    ("device", "auto | cpu | cuda[:n]"),
    ("dtype", "auto | float32 | bfloat16 | float16"),
    ("quantization", QUANTIZATION_HELP),
    ("kv_cache_dtype", KV_DTYPE_HELP),
    ("attention_precision", ATTENTION_HELP),
    *SPECULATION_HELP_TABLE,
    ("kv_cache_bytes", "KV pool bytes"),
    (
        "lora_modules",
        "a LoRA adapter to serve, name=path of a PEFT directory (repeat the flag for more); "
        "requests name it as their model",
    ),
    ("max_loras", "most LoRA adapters held at once (at start and loaded at run time)"),
    ("max_lora_rank", "highest LoRA rank an adapter may have"),
    ("max_num_seqs", "most sequences per step"),
    ("max_num_batched_tokens", "most tokens per step"),
    ("store_run_dir", "local store node run dir (none: off; or KVRELAY_STORE_RUN_DIR)"),
    ("lease_ms", "claim entries idle this long"),
    (
        "redis_socket_timeout_s",
        "a Redis call unanswered this long fails and is retried (above block_ms)",
    ),
    ("redis_keepalive_s", "idle seconds before the Redis connections' TCP keepalive probes"),
    (
        "stream_interval_ms",
        "write a streaming request's further tokens at most this often, several engine steps "
        "in one queue-plane call (first tokens and ends at once; 0: every step)",
    ),
    ("metrics_port", "0: any free port; -1: none"),
    ("slot_dir", "where this host's worker-name slots live (none: <temp dir>/kvrelay-slots)"),
    (
        "override_generation_config",
        "JSON object of defaults for the sampling fields a request leaves out, over the "
        "model's own, published for every producer (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_tokens)",
    ),
    (
        "chat_template",
        "the model's chat template instead of its own: a Jinja file, or the template text; "
        "published with the model for every producer",
    ),
    (
        "served_model_name",
        "the names the API serves the model under, comma-separated: the first in responses "
        "and /v1/models, the others aliases",
    ),
]


def worker_flags() -> list[tuple[str, str, Any, str]]:
    """(flag, field, type, help) of `kvrelay worker`, generated from WorkerConfig."""
    from kvrelay.core.config import setting_flags
    from kvrelay.workers.config import SECTION, WorkerConfig

    return setting_flags(WorkerConfig, SECTION, _HELP)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=list(Stage), help="which stream this worker serves")
    for flag, dest, kind, help_text in worker_flags():
        p.add_argument(
            flag, dest=dest, type=kind, default=None, help=help_text, **flag_options(dest)
        )
    p.add_argument(
        "--config", default=None, metavar="FILE", help=config_file_help("worker")["help"]
    )


def attach_store(engine: Engine, run_dir: str, metrics: WorkerMetrics) -> str:
    """Connect the engine to the local store node; returns its node id ('' when unreachable)."""
    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.connector import StoreConnector
    from kvrelay.kvstore.errors import StoreError
    from kvrelay.kvstore.page import PageSpec
    from kvrelay.workers.metrics import CountingConnector

    pool = engine.runner.kv_pool  # [blocks, layers, 2, page_size, kv_heads, head_dim]
    _, layers, _, page_size, kv_heads, head_dim = pool.shape
    spec = PageSpec(
        fingerprint=engine.fingerprint,
        dtype=str(pool.dtype).removeprefix("torch."),
        num_layers=layers,
        page_size=page_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
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


SPECULATION_FIELDS = (
    "speculation",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_model",
)


def run(args: argparse.Namespace) -> int:
    # No collections while torch and the model load (~10% of the imports' CPU time: they
    # allocate many objects and no garbage); serve() collects once and freezes what is left.
    gc.disable()
    from kvrelay.workers.config import load_worker_config
    from kvrelay.workers.engine.llm_engine import Engine

    # a bad setting (ConfigError) is one line and exit 2 (kvrelay.cli.main.exit_code)
    overrides = {dest: getattr(args, dest) for _f, dest, _k, _h in worker_flags()}
    if overrides.get("lora_modules") is not None:  # the repeated flag: a list
        overrides["lora_modules"] = tuple(overrides["lora_modules"])
    config = load_worker_config(config_file=args.config, **overrides)
    return serve(args.role, config, Engine(config.engine, populate_kv=False))


def take_slot(
    config: WorkerConfig, role: str, on_standby: Callable[[], None] | None = None
) -> WorkerSlot | None:
    """The worker name's slot on this host (`workers.slot`): at once when it is free, else
    after its holder dies, this process waiting loaded (a warm standby, announced under
    `standby:{name}` for `kvrelay up` and `status`; `on_standby` called as it starts to
    wait); None when stopped (SIGTERM/SIGINT) while waiting."""
    import threading
    import time

    from kvrelay.workers.slot import WorkerSlot, announce_standby, slot_path

    name = config.worker_name(role)
    path = slot_path(config.redis_url, config.key_prefix, config.pipeline, name, config.slot_dir)
    slot = WorkerSlot(path)
    if slot.try_acquire():
        slot.acquired_at = None  # serving since the process started: `startup_s` says so
        return slot
    logger.info(
        "%s worker %s: standby, loaded (pid %s serves the name on this host)",
        role, name, slot.holder(),
    )  # fmt: skip
    if on_standby is not None:
        on_standby()
    stop, taken = threading.Event(), threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    announcer = threading.Thread(
        target=announce_standby, args=(config, name, stop, taken), name="standby", daemon=True
    )
    announcer.start()
    try:
        if not slot.wait(stop):
            logger.info("%s worker %s: standby stopped", role, name)
            return None
    finally:
        taken.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    slot.acquired_at = time.monotonic()
    logger.info("%s worker %s: the name's process is gone; taking over", role, name)
    return slot


def populate_when_settled(engine: Engine, worker: Worker) -> None:
    """Fault in the engine's KV pool `KV_POPULATE_DELAY_S` after the worker is ready (on a
    thread; not at all when it stops first)."""
    import threading

    def populate() -> None:
        worker.ready.wait()
        if not worker.stop_event.wait(KV_POPULATE_DELAY_S):
            engine.populate_kv_pool()

    threading.Thread(target=populate, name="kv-pool-settle", daemon=True).start()


def serve(role: str, config: WorkerConfig, engine: Engine) -> int:
    """Run a worker of `role` over `engine` until SIGTERM/SIGINT (then drain and release)."""
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.metrics import WorkerMetrics
    from kvrelay.workers.prefill import PrefillWorker

    metrics = WorkerMetrics((config.served_names or (engine.model_name,))[0], engine)
    node = attach_store(engine, config.store_run_dir, metrics) if config.store_run_dir else ""
    cls = PrefillWorker if role == Stage.PREFILL else DecodeWorker

    def on_standby() -> None:  # waiting, perhaps for days: collect as usual meanwhile
        gc.enable()
        engine.populate_kv_pool()

    slot = take_slot(config, role, on_standby=on_standby)
    if slot is None:
        return 0  # stopped while a standby
    worker = cls(config, engine, store_node=node, metrics=metrics, started=slot.acquired_at)
    worker.slot_held = True
    metrics.serve(config.metrics_port)
    populate_when_settled(engine, worker)

    def on_signal(signum, _frame):
        logger.info("signal %d: stopping %s", signum, worker.name)
        worker.stop()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    # The model, tokenizer and store client are loaded: move every object allocated so far out
    # of the collector's sight, so a full collection on the compute thread scans only what the
    # requests allocate (a collection during a step shows as a late token).
    gc.collect()
    gc.freeze()
    gc.enable()  # (run() turned it off for the start)
    worker.run()
    # everything is released; skip interpreter teardown of the model (seconds under supervisord)
    logging.shutdown()
    os._exit(0)
