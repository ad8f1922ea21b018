"""`WorkerConfig`: one frozen dataclass for prefill and decode workers (`KVRELAY_WORKER_*`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvrelay.core.config import (
    ConfigError,
    RedisSettings,
    check_shards,
    env_name,
    from_env,
    nested,
    read_config_file,
)
from kvrelay.core.keys import check_pipeline
from kvrelay.core.modelref import (
    normalize_attention_precision,
    normalize_kv_cache_dtype,
    normalize_quantization,
)
from kvrelay.core.sampling import GenerationDefaults, generation_override
from kvrelay.kvstore.config import SECTION as STORE_SECTION
from kvrelay.workers.engine.config import EngineConfig

SECTION = "WORKER"
# EngineConfig field -> the worker's spelling of it (variable, flag, config file key)
ENGINE_NAMES = {"num_threads": "threads"}
# 64: a CPU box at 64 streams serves 1.17x the tokens of 32 with TTFT 1.5 s instead of 17 s
MAX_NUM_SEQS = 64
# The store's own run dir variable names the store a worker talks to (KVRELAY_WORKER_* wins).
STORE_RUN_DIR_ENV = env_name(STORE_SECTION, "run_dir")
# Engine settings (model, dtype, threads, ...) read by both `kvrelay worker` and
# `kvrelay generate`: one spelling, KVRELAY_WORKER_*; `generate`'s old KVRELAY_ENGINE_* still
# works with a warning.
DEPRECATED_SECTIONS = ("ENGINE",)


def worker_engine() -> EngineConfig:
    """A worker's default engine settings: the engine's, with more sequences per step and the
    attention precision the host runs fastest (auto)."""
    return EngineConfig(max_num_seqs=MAX_NUM_SEQS, attention_precision="auto")


@dataclass(frozen=True, slots=True)
class WorkerConfig(RedisSettings):
    """Settings of one prefill or decode worker process (after the Redis section)."""

    name: str | None = None  # stable worker id (heartbeat key); default role-host-pid
    # The engine's settings (model, dtype, device, quantization, kv_cache_dtype, speculation,
    # page_size, kv_cache_bytes, max_num_seqs, ...), spelled as the worker's own
    # (KVRELAY_WORKER_MODEL, --model, `model` in [worker], `threads` for num_threads).
    # Only decode steps speculate; a prefill worker stops after the first token.
    engine: EngineConfig = nested(worker_engine, ENGINE_NAMES)
    store_run_dir: str | None = None  # the local store node's run dir; None: no store
    # the model pipeline whose streams this worker reads (`kvrelay.core.keys`): "" the unnamed
    # one (a single-model stack's keys), else `stream:prefill:<pipeline>`; `kvrelay up` names
    # one per model after the first. Every worker of a model, and only those, set the same.
    pipeline: str = ""
    # the pipeline shards this worker serves, comma-separated ("1,2"); None: every shard
    serve_shards: str | None = None
    lease_ms: int = 10000  # a worker silent (no heartbeat) this long loses its entries
    # holders that died running an entry with no new token in between (poison, not churn) -> DLQ
    max_deliveries: int = 5
    read_batch: int = 16  # entries per XREADGROUP
    block_ms: int = 500  # XREADGROUP BLOCK slice (stop/drain checks happen between slices)
    # a Redis call with no reply this long fails (the caller retries on a new connection): a
    # partitioned worker notices in seconds, not after TCP's retransmissions (up to ~2 min);
    # above block_ms, which a blocking read waits for by design
    redis_socket_timeout_s: float = 5.0
    # TCP keepalive of its Redis connections: probes after this many idle seconds, one a
    # second, 3 unanswered ones close the connection (a dead link found while idle too)
    redis_keepalive_s: int = 5
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: int = 10
    # a cancel is seen at the next step; a worker writing nothing this long steps anyway
    cancel_poll_s: float = 0.5
    # further tokens of a streaming request are written at most this often (ms), several
    # engine steps in one Valkey call; first tokens, ends and hand-offs go at once. 0: every
    # step. Fewer queue-plane calls per token, each token later by up to the interval.
    stream_interval_ms: int = 0
    out_ttl_s: int = 600  # out:{id} lifetime after the final chunk
    req_ttl_s: int = 86400  # req:{id} lifetime after the final chunk
    stop_grace_s: float = 5.0  # on SIGTERM, finish in-flight work this long, then release it
    metrics_port: int = 0  # 0: any free port (published in the heartbeat); -1: none
    # where the host's worker-name slots live (`workers.slot`: one process serves a name, the
    # others wait as standbys); "": <temp dir>/kvrelay-slots
    slot_dir: str = ""
    # JSON object of defaults for fields a request leaves out (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_tokens), over the model's own; published with the model, so every
    # producer (ingress, client) applies them. Give every worker of a model the same value.
    # A config file may give a table.
    override_generation_config: str | None = None
    # the model's chat template instead of its own (vLLM's --chat-template): a file, or the
    # template text; published with the model's files, so every producer renders chats with it
    chat_template: str | None = None
    # the names the API serves the model under, comma-separated (vLLM's --served-model-name):
    # the first is published (the `models` hash, heartbeats, responses), the others as aliases
    served_model_name: str | None = None

    def validate(self) -> WorkerConfig:
        """Raise ConfigError for values a worker cannot run with; return self."""
        engine = self.engine
        for name in ("lease_ms", "max_deliveries", "read_batch", "block_ms", "heartbeat_ttl_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        for name in ("max_num_seqs", "page_size"):
            if getattr(engine, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        try:
            normalize_quantization(engine.quantization)
            normalize_kv_cache_dtype(engine.kv_cache_dtype)
            normalize_attention_precision(engine.attention_precision)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if not self.block_ms < self.redis_socket_timeout_s * 1000:
            raise ConfigError(
                f"block_ms ({self.block_ms}) must be below redis_socket_timeout_s "
                f"({self.redis_socket_timeout_s} s): a blocking read would time out"
            )
        if self.redis_keepalive_s < 1:
            raise ConfigError("redis_keepalive_s must be at least 1")
        if self.stream_interval_ms < 0:
            raise ConfigError(
                f"stream_interval_ms must be 0 or more, got {self.stream_interval_ms}"
            )
        if engine.num_threads is not None and engine.num_threads < 1:
            raise ConfigError("threads must be at least 1")
        check_speculation(
            engine.speculation,
            engine.num_speculative_tokens,
            engine.prompt_lookup_min,
            engine.prompt_lookup_max,
            engine.draft_model,
        )
        if self.name is not None and (not self.name or any(c in self.name for c in " {}:")):
            raise ConfigError(f"invalid worker name {self.name!r} (no spaces, braces or ':')")
        generation_override(self.override_generation_config)
        if self.chat_template is not None:
            self.chat_template_text()
        if self.served_model_name is not None:
            names = self.served_names
            bad = [n for n in names if any(c in n for c in " {}")]
            if not names or bad or len(set(names)) < len(names):
                raise ConfigError(
                    "served_model_name must be distinct names separated by commas (no spaces "
                    f"or braces), got {self.served_model_name!r}"
                )
        check_shards(self.shards)
        self.shard_list()
        try:
            check_pipeline(self.pipeline)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return self

    def shard_list(self) -> list[int]:
        """The shards this worker serves (`serve_shards`, else every one), sorted."""
        if not self.serve_shards:
            return list(range(self.shards))
        try:
            chosen = sorted({int(part) for part in self.serve_shards.split(",") if part.strip()})
        except ValueError:
            raise ConfigError(
                f"serve_shards must be shard numbers separated by commas, got {self.serve_shards!r}"
            ) from None
        if not chosen or chosen[0] < 0 or chosen[-1] >= self.shards:
            raise ConfigError(f"serve_shards {self.serve_shards!r}: shards are 0-{self.shards - 1}")
        return chosen

    @property
    def generation_override(self) -> GenerationDefaults:
        return generation_override(self.override_generation_config)

    @property
    def served_names(self) -> tuple[str, ...]:
        """`served_model_name`'s names, in order (empty: the model's own name)."""
        return tuple(n.strip() for n in (self.served_model_name or "").split(",") if n.strip())

    def chat_template_text(self) -> str | None:
        """The template `chat_template` gives (None: the model's own); ConfigError when it
        names no file or does not compile."""
        from kvrelay.core.tokenizer import ChatTemplateError, read_chat_template

        if self.chat_template is None:
            return None
        try:
            return read_chat_template(self.chat_template)
        except ChatTemplateError as exc:
            raise ConfigError(str(exc)) from None

    def worker_name(self, role: str) -> str:
        return self.name or f"{role}-{socket.gethostname()}-{os.getpid()}"


def check_speculation(
    mode: str, num_tokens: int, lookup_min: int, lookup_max: int, draft_model: str | None
) -> str:
    """The resolved speculation mode ("off", "ngram", "draft") of these settings; ConfigError
    for an unknown mode, no draft tokens, an empty or inverted n-gram range, or `draft` without
    a draft model."""
    from kvrelay.workers.engine.speculator import resolve_speculation

    try:
        resolved = resolve_speculation(mode, draft_model or None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if num_tokens < 1:
        raise ConfigError(f"num_speculative_tokens must be at least 1, got {num_tokens}")
    if lookup_min < 1:
        raise ConfigError(f"prompt_lookup_min must be at least 1, got {lookup_min}")
    if lookup_min > lookup_max:
        raise ConfigError(
            f"prompt_lookup_min ({lookup_min}) must not exceed prompt_lookup_max ({lookup_max})"
        )
    return str(resolved)


def load_worker_config(
    environ: dict[str, str] | None = None, config_file: str | None = None, **overrides
) -> WorkerConfig:
    """Flags over `KVRELAY_WORKER_*` (or the shared `KVRELAY_*`) over `--config` over defaults."""
    file_values = read_config_file(config_file, SECTION)
    config = from_env(
        WorkerConfig,
        SECTION,
        environ=environ,
        file_values=file_values,
        deprecated=DEPRECATED_SECTIONS,
        fallbacks={"store_run_dir": STORE_RUN_DIR_ENV},
        **overrides,
    )
    return config.validate()


def engine_env_names() -> dict[str, str]:
    """EngineConfig field -> its variable: the worker's spelling (`threads` for num_threads)."""
    return {field: env_name(SECTION, name) for field, name in ENGINE_NAMES.items()}
