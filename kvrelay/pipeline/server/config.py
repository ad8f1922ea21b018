"""The ingress configuration: one frozen dataclass, read from `KVRELAY_INGRESS_*` and flags."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvrelay.core.config import (
    ConfigError,
    RedisSettings,
    check_shards,
    from_env,
    read_config_file,
)
from kvrelay.core.modelref import DEFAULT_MODEL
from kvrelay.core.sampling import GenerationDefaults, generation_override
from kvrelay.pipeline.model_registry import model_pipelines
from kvrelay.pipeline.openai.tool_parsers import DETECT, PARSER_SETTINGS
from kvrelay.pipeline.queue.feed import BLOCK_MS
from kvrelay.pipeline.queue.route import ROUTE_THRESHOLD, RouteMode
from kvrelay.pipeline.queue.submit import MAX_PROMPT_TOKENS, MAX_TOKENS_LIMIT, REQUEST_TIMEOUT_S
from kvrelay.pipeline.server.api_keys import ApiKeys

SECTION = "INGRESS"
MODES = tuple(m.value for m in RouteMode)  # plain strings: argparse shows them
FCFS, PRIORITY = "fcfs", "priority"
SCHEDULING_POLICIES = (FCFS, PRIORITY)


@dataclass(frozen=True, slots=True)
class IngressConfig(RedisSettings):
    """Settings of the OpenAI-compatible HTTP ingress (`kvrelay serve`), after the Redis section."""

    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    max_body_bytes: int = 4 << 20
    # 408 when a request body sends nothing for this long (between two reads, as nginx's
    # client_body_timeout, 60 s there): a stalled body must not hold a connection forever
    body_timeout_s: float = 30.0
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # also capped by the model's context length
    max_tokens_limit: int = MAX_TOKENS_LIMIT  # largest max_tokens a request may ask for
    mode: str = RouteMode.AUTO
    route_threshold: int = ROUTE_THRESHOLD  # auto: uncached prompt tokens at most -> decode
    max_waiting: int = 512  # backpressure: undelivered stream entries before 429
    max_inflight: int = 4096  # backpressure: open requests in this ingress before 429
    # most choices one request may ask for: n, best_of, and their product with the prompts
    max_choices: int = 16
    retry_after_s: int = 1
    request_timeout_s: float = REQUEST_TIMEOUT_S  # deadline given to workers
    api_keys: tuple[str, ...] = ()  # empty (and no keys file): no authentication
    # TOML keys file: each key's tenant, weight, priorities and quotas (server/api_keys.py)
    api_keys_file: str | None = None
    # vLLM's --scheduling-policy: fcfs (the streams' order; a priority other than 0 is
    # refused) or priority (queued by priority, lower first, then by tenants' weighted fair
    # shares: queue/lua/ordered.lua); a request waiting longer than priority_age_s goes first
    scheduling_policy: str = FCFS
    priority_age_s: float = 60.0
    record_ttl_s: int = 86400  # req:{id} expiry set at submission
    # A client that loses its connection may reconnect (Last-Event-ID) this long before its
    # request is cancelled; 0 cancels at once. Long enough for a prompt retry, short enough
    # that an abandoned request does not hold a worker's batch slot for long.
    disconnect_grace_s: float = 10.0
    read_block_ms: int = BLOCK_MS  # the output feed's longest wait for a message
    state_refresh_s: float = 0.25  # how stale worker/lag/model snapshots may be
    # A Redis command answering later than this fails (503); pooled connections (the output
    # feed's pub/sub one among them) read with read_block_ms on top.
    redis_timeout_s: float = 2.0
    # A new request waits this long for an unreachable Redis (a Valkey restart) before its
    # 503, never past its deadline: as long as the output readers wait (REDIS_RETRY_S)
    submit_wait_s: float = 30.0
    # With a replicated Valkey (a redis+sentinel:// URL, or a Valkey Cluster with replicas:
    # `kvrelay up --shards S --valkey-replicas N`): a submission is answered only once a
    # replica holds it (WAIT 1 this long, on a cluster on the primary of the request's slot;
    # none: 503 not_replicated), and so is a retry with its X-Request-Id that reattaches to
    # it; 0 disables the wait
    replica_ack_timeout_ms: int = 1000
    # A request naming a session (prompt_cache_key, user, a Responses chain) has its pages
    # retained this long after it ends (prompt_cache_retention "in_memory" or unset), at most
    # max_cache_retention_s (a longer ask is refused: 400)
    cache_retention_s: float = 600.0
    max_cache_retention_s: float = 86400.0
    # publish a queued request's page keys so store nodes bring them up while it waits
    prefetch_hints: bool = True
    # JSON object of defaults for fields a request leaves out (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_tokens), over those the model's workers publish (its own, under
    # their override): vLLM's --override-generation-config. A config file may give a table.
    override_generation_config: str | None = None
    # how `tool_choice: auto` finds tool calls in the text (vLLM's --tool-call-parser): a
    # parser (hermes), "auto" to pick it from the model's chat template, "none" to refuse
    # tool_choice auto (not an optional field: "none" stays that word)
    tool_call_parser: str = DETECT
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): off, the routes do not exist
    allow_runtime_lora_updating: bool = False

    def validate(self) -> IngressConfig:
        """Raise ConfigError for values the ingress cannot run with; return self."""
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.models:
            raise ConfigError("at least one model name is required")
        try:
            model_pipelines(self.models)  # each model after the first: a pipeline of its own
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in (
            "max_body_bytes",
            "max_prompt_tokens",
            "max_tokens_limit",
            "max_waiting",
            "max_inflight",
            "max_choices",
            "read_block_ms",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.redis_timeout_s <= 0:
            raise ConfigError("redis_timeout_s must be > 0")
        if not 0 <= self.cache_retention_s <= self.max_cache_retention_s:
            raise ConfigError("cache_retention_s must be >= 0 and <= max_cache_retention_s")
        if self.body_timeout_s <= 0:
            raise ConfigError("body_timeout_s must be > 0")
        if self.disconnect_grace_s < 0:
            raise ConfigError("disconnect_grace_s must be >= 0")
        if self.submit_wait_s < 0:
            raise ConfigError("submit_wait_s must be >= 0")
        if not 0 <= self.replica_ack_timeout_ms < self.redis_socket_timeout_s * 1000:
            raise ConfigError("replica_ack_timeout_ms must be >= 0 and below the socket timeout")
        if self.route_threshold < 0 or self.request_timeout_s <= 0:
            raise ConfigError("route_threshold must be >= 0 and request_timeout_s > 0")
        generation_override(self.override_generation_config)
        keys = self.keys  # a bad keys file fails here, at start
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.scheduling_policy == FCFS and any(
            p.priority or p.min_priority > 0 or p.max_priority < 0 for p in keys.policies
        ):
            raise ConfigError(
                "the keys file sets priorities other than 0: serve them with "
                "scheduling_policy priority"
            )
        if self.priority_age_s <= 0:
            raise ConfigError("priority_age_s must be > 0")
        check_shards(self.shards)
        if self.tool_call_parser not in PARSER_SETTINGS:
            raise ConfigError(
                f"tool_call_parser must be one of {', '.join(PARSER_SETTINGS)}, "
                f"got {self.tool_call_parser!r}"
            )
        return self

    @property
    def keys(self) -> ApiKeys:
        """The accepted keys and their policies (the file read once per process)."""
        return _api_keys(self.api_keys, self.api_keys_file)

    @property
    def generation_override(self) -> GenerationDefaults:
        return generation_override(self.override_generation_config)

    @property
    def redis_socket_timeout_s(self) -> float:
        """Read timeout of a pooled connection: longer than the feed's longest wait."""
        return self.redis_timeout_s + self.read_block_ms / 1000


@lru_cache(maxsize=8)
def _api_keys(keys: tuple[str, ...], keys_file: str | None) -> ApiKeys:
    return ApiKeys.load(keys, keys_file)


def load_config(
    environ: dict[str, str] | None = None, config_file: str | None = None, **overrides
) -> IngressConfig:
    """Flags over `KVRELAY_INGRESS_*` (or the shared `KVRELAY_*`) over `--config` over defaults."""
    file_values = read_config_file(config_file, SECTION)
    return from_env(
        IngressConfig, SECTION, environ=environ, file_values=file_values, **overrides
    ).validate()
