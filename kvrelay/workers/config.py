"""`WorkerConfig`: one frozen dataclass for prefill and decode workers (`KVRELAY_WORKER_*`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvrelay.core.config import (
    ConfigError,
    RedisSettings,
    env_name,
    from_env,
    read_config_file,
)
from kvrelay.core.enums import Quantization, Speculation
from kvrelay.core.modelref import normalize_kv_cache_dtype, normalize_quantization
from kvrelay.core.sampling import GenerationDefaults, generation_override
from kvrelay.kvstore.config import SECTION as STORE_SECTION

SECTION = "WORKER"
# The store's own run dir variable names the store a worker talks to (KVRELAY_WORKER_* wins).
STORE_RUN_DIR_ENV = env_name(STORE_SECTION, "run_dir")
# Engine settings (model, dtype, threads, ...) read by both `kvrelay worker` and
# `kvrelay generate`: one spelling, KVRELAY_WORKER_*; `generate`'s old KVRELAY_ENGINE_* still
# works with a warning.
DEPRECATED_SECTIONS = ("ENGINE",)


@dataclass(frozen=True, slots=True)
class WorkerConfig(RedisSettings):
    """Settings of one prefill or decode worker process (after the Redis section)."""

    name: str | None = None  # stable worker id (heartbeat key); default role-host-pid
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    # none | int8 | fp16 (CPU fp32 only; see kvrelay.workers.model.quant)
    quantization: str = Quantization.NONE
    # KV page dtype: auto (the model dtype) | fp32 | bf16 | fp16; part of the page fingerprint
    kv_cache_dtype: str = "auto"
    threads: int | None = None  # compute threads (torch); None: torch's default
    # Speculative decoding (never changes the output; docs/internals.md "Speculative
    # decoding"): auto | off | ngram | draft (auto: draft with a draft_model, else ngram).
    # Only decode steps speculate; a prefill worker stops after the first token.
    speculation: str = Speculation.AUTO
    num_speculative_tokens: int = 6  # the longest draft verified per step
    prompt_lookup_min: int = 2  # n-gram lengths prompt lookup matches, longest first
    prompt_lookup_max: int = 4
    draft_model: str | None = None  # a smaller model with the model's tokenizer (draft mode)
    page_size: int = 16
    kv_cache_bytes: int = 1 << 30
    # 64: a CPU box at 64 streams serves 1.17x the tokens of 32 with TTFT 1.5 s instead of 17 s
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    store_run_dir: str | None = None  # the local store node's run dir; None: no store
    lease_ms: int = 10000  # a worker silent (no heartbeat) this long loses its entries
    # redeliveries in a row with no new token in between (poison, not churn) -> DLQ
    max_deliveries: int = 5
    read_batch: int = 16  # entries per XREADGROUP
    block_ms: int = 500  # XREADGROUP BLOCK slice (stop/drain checks happen between slices)
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: int = 10
    # a cancel is seen at the next write; requests silent this long are checked on their own
    cancel_poll_s: float = 0.5
    out_ttl_s: int = 600  # out:{id} lifetime after the final chunk
    req_ttl_s: int = 86400  # req:{id} lifetime after the final chunk
    stop_grace_s: float = 5.0  # on SIGTERM, finish in-flight work this long, then release it
    metrics_port: int = 0  # 0: any free port (published in the heartbeat); -1: none
    # JSON object of defaults for fields a request leaves out (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_tokens), over the model's own; published with the model, so every
    # producer (ingress, client) applies them. Give every worker of a model the same value.
    # A config file may give a table.
    override_generation_config: str | None = None

    def validate(self) -> WorkerConfig:
        """Raise ConfigError for values a worker cannot run with; return self."""
        for name in (
            "lease_ms",
            "max_deliveries",
            "read_batch",
            "block_ms",
            "max_num_seqs",
            "heartbeat_ttl_s",
            "page_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        try:
            normalize_quantization(self.quantization)
            normalize_kv_cache_dtype(self.kv_cache_dtype)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be at least 1")
        check_speculation(
            self.speculation,
            self.num_speculative_tokens,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.draft_model,
        )
        if self.name is not None and (not self.name or any(c in self.name for c in " {}:")):
            raise ConfigError(f"invalid worker name {self.name!r} (no spaces, braces or ':')")
        generation_override(self.override_generation_config)
        return self

    @property
    def generation_override(self) -> GenerationDefaults:
        return generation_override(self.override_generation_config)

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
    return {"num_threads": env_name(SECTION, "threads")}
