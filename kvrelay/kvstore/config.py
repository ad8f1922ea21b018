"""`StoreConfig`: the store node's frozen settings; `KVRELAY_STORE_*` env vars override them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.config import DEFAULT_KEY_PREFIX, ConfigError
from kvrelay.core.enums import Quantization
from kvrelay.kvstore.retention import MAX_TTL_S
from kvrelay.kvstore.transport import TRANSPORT_CHOICES, Transport

SOCKET_NAME = "kvstore.sock"
PREFETCH_CHOICES = ("off", "local", "remote")
SECTION = "STORE"


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of one store node (one per host)."""

    node_id: str = "node0"
    run_dir: str = "/tmp/kvrelay"
    redis_url: str | None = None  # None: no page directory, no remote fetches
    # the Redis section's prefix (kvrelay.core.config.RedisSettings); the URL is optional here
    key_prefix: str = DEFAULT_KEY_PREFIX
    # the pipeline shards (KVRELAY_SHARDS, as every process): the page directory is spread
    # over them by page key
    shards: int = 1
    arena_bytes: int = 1 << 30
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 16 << 30
    page_bytes: int | None = None  # payload bytes of one page; or derived from `model`
    model: str | None = None
    # with `model`: the page dtype (the workers' --kv-cache-dtype); auto: what `auto` gives
    # fp32 workers on this host's CPU (bfloat16 with the C++ kernels, else float32)
    dtype: str = "auto"
    # with `model`: the workers' compute dtype (fingerprint) when it is not the page dtype
    # (default: float32 under dtype auto, else the page dtype)
    model_dtype: str | None = None
    page_size: int = 16  # with `model`: tokens per page
    quantization: str = Quantization.NONE  # with `model`: the workers' (in the fingerprint)
    # with `model`: the workers' --attention-precision (in the fingerprint); auto: what `auto`
    # gives fp32 workers on this host's CPU
    attention_precision: str = "auto"
    fingerprint: str | None = None  # None: accept any model whose pages have page_bytes
    listen_host: str = "127.0.0.1"
    advertise_host: str | None = None  # address peers dial; default listen_host
    tcp_port: int = 0  # 0: pick a free port; -1: no TCP listener
    ucx_port: int = 0  # 0: pick a free port; -1: no UCX listener (also when ucxx is missing)
    transport: str = Transport.AUTO  # remote fetch transport: auto (UCX if both sides have it)
    ucx_same_host: bool = True  # same-host peers: UCX over exchanged worker addresses (shm)
    secret: str | None = None  # shared secret for store-to-store transfers
    transfer_timeout_s: float = 5.0
    # a peer a fetch could not reach (timeout, refused connection, broken session) is skipped
    # this long: a cut or hopeless link costs one transfer timeout, not one per request
    peer_retry_s: float = 5.0
    heartbeat_s: float = 2.0
    node_ttl_s: float = 10.0
    keep_arena: bool = True  # leave the arena file for the next start (False: remove it)
    pin_timeout_s: float = 60.0  # a reader or writer holding a slot longer than this lost it
    metrics_port: int | None = None
    # the longest a session's pages are retained (a request's own TTL is cut to it)
    max_retention_s: float = MAX_TTL_S
    # prefetch hints (the ingress names a queued request's pages): off, local (this node's
    # disk pages into the arena) or remote (also pages a peer holds)
    prefetch: str = "local"

    def __post_init__(self) -> None:
        if not self.node_id or any(c in self.node_id for c in " :/{}"):
            raise ConfigError(f"invalid node id {self.node_id!r} (no spaces, ':', '/', braces)")
        if self.arena_bytes <= 0:
            raise ConfigError(f"arena_bytes must be positive, got {self.arena_bytes}")
        if self.page_bytes is not None and self.page_bytes <= 0:
            raise ConfigError(f"page_bytes must be positive, got {self.page_bytes}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ConfigError(f"transport must be auto, ucx or tcp, got {self.transport!r}")
        if self.transfer_timeout_s <= 0:
            raise ConfigError("transfer_timeout_s must be positive")
        if self.peer_retry_s < 0:
            raise ConfigError("peer_retry_s must not be negative")
        if self.max_retention_s < 0:
            raise ConfigError("max_retention_s must not be negative")
        if self.prefetch not in PREFETCH_CHOICES:
            raise ConfigError(f"prefetch must be one of {PREFETCH_CHOICES}, got {self.prefetch!r}")

    @property
    def socket_path(self) -> Path:
        return Path(self.run_dir) / SOCKET_NAME

    @property
    def socket_url(self) -> str:
        return f"ipc://{self.socket_path}"


def socket_url(run_dir: str | Path) -> str:
    """The ZeroMQ address of the store node serving `run_dir`."""
    return f"ipc://{Path(run_dir) / SOCKET_NAME}"
