"""Every Redis key name kvrelay uses, in one place.

All keys share one hash tag (`{kvrelay}` by default, from the prefix) so Lua scripts may touch
several of them on Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.core.config import DEFAULT_KEY_PREFIX
from kvrelay.core.enums import Stage

PREFILL_GROUP = Stage.PREFILL.value  # consumer group names are the stage names
DECODE_GROUP = Stage.DECODE.value
MESSAGE_FIELD = b"m"  # each stream entry is one field holding a MessagePack map


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under a prefix; `Keys("kvrelay:")` gives `{kvrelay}:stream:prefill` and so on."""

    prefix: str = DEFAULT_KEY_PREFIX

    @property
    def _p(self) -> str:
        base = self.prefix.rstrip(":")
        return f"{{{base}}}:"

    @property
    def prefill_stream(self) -> str:
        return self._p + "stream:prefill"

    @property
    def decode_stream(self) -> str:
        return self._p + "stream:decode"

    @property
    def dlq(self) -> str:
        return self._p + "dlq"

    def out(self, request_id: str) -> str:
        return self._p + f"out:{request_id}"

    def request(self, request_id: str) -> str:
        return self._p + f"req:{request_id}"

    @property
    def progress(self) -> str:
        """Hash: request id -> its `Progress` (tokens emitted, feeds, owner, cancel flag), and
        `<request id>#<index>` -> each chunk not yet in out:{id} (its tail);
        `kvrelay.pipeline.queue.progress`."""
        return self._p + "prog"

    @property
    def consumers(self) -> str:
        """Hash: stream consumer name -> unix time of its worker's last heartbeat (the lease:
        the entries of a consumer silent for a lease are claimed)."""
        return self._p + "consumers"

    def fence(self, consumer: str) -> str:
        """String: the number of a stream consumer's last step, "f" once a claim fenced it (its
        steps are refused wholesale; `lua/step.lua`), with "!" appended while control items
        wait for it. Lua derives it from `progress` (same prefix)."""
        return self._p + f"fence:{consumer}"

    def control(self, consumer: str) -> str:
        """List: what the owner of requests must learn (`cancel <id>`, `feeds <id> <f1,f2>`),
        popped by its step script. Lua derives it from `progress` (same prefix)."""
        return self._p + f"control:{consumer}"

    def feed(self, reader_id: str) -> str:
        """Stream: the live chunks of every request one output reader (an ingress process or
        a producer client) follows, one entry per worker step (`progress.feed_item` per request)."""
        return self._p + f"feed:{reader_id}"

    def response(self, response_id: str) -> str:
        """Hash: a stored Responses API answer (`pipeline/server/response_store.py`)."""
        return self._p + f"resp:{response_id}"

    def worker(self, worker_id: str) -> str:
        return self._p + f"worker:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        return self._p + "worker:*"

    @property
    def request_pattern(self) -> str:
        return self._p + "req:*"

    @property
    def pages(self) -> str:
        """Hash: page key (hex) -> the store nodes holding it, comma-separated (the page
        directory; `core.page_keys.holders` reads a value)."""
        return self._p + "pages"

    def store_node(self, node_id: str) -> str:
        return self._p + f"node:{node_id}"

    @property
    def store_node_pattern(self) -> str:
        return self._p + "node:*"

    @property
    def models(self) -> str:
        """Hash: served model name -> JSON (fingerprint, page size, max context, generation
        defaults, digest of its files) from workers."""
        return self._p + "models"

    def model_files(self, digest: str) -> str:
        """Hash: file name -> contents, the tokenizer files of a model (`core.model_bundle`)."""
        return self._p + f"model-files:{digest}"
