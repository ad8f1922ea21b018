"""Every Redis key name kvrelay uses, in one place.

The queue plane is cut into `shards` pipeline shards, each with its own hash tag (`{kvrelay}`
for shard 0, from the prefix; `{kvrelay.k}` for shard k), so Lua scripts may touch several keys
of one shard on Redis Cluster. A request lives on the shard of its id (`shard_of`); the keys
every shard shares (models, model files, store nodes, the page directory) are shard 0's.

Several models on one stack: each model's requests go through its own *pipeline*, a pair of
work streams (and the consumers hash their leases live in) named after it, so a model's
entries never reach another model's workers. The unnamed pipeline (`pipeline=""`) has the keys
of a single-model stack (`{kvrelay}:stream:prefill`); pipeline `b` has
`{kvrelay}:stream:prefill:b`, `{kvrelay}:stream:decode:b` and `{kvrelay}:consumers:b`. Every
other key (requests, output, progress, feeds, fences) is shared: request ids are unique.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from kvrelay.core.config import DEFAULT_KEY_PREFIX, MAX_SHARDS
from kvrelay.core.enums import Stage

PREFILL_GROUP = Stage.PREFILL.value  # consumer group names are the stage names
DECODE_GROUP = Stage.DECODE.value
MESSAGE_FIELD = b"m"  # each stream entry is one field holding a MessagePack map
# a work stream's wait set (--scheduling-policy priority: pipeline/queue/lua/ordered.lua) is
# the hash `<stream>:wait:m` of the requests waiting to be moved into it, beside its order keys
WAIT_SET = ":wait:m"
# a Responses API id (`resp_<x>`) and its request's (`resp-<x>`) share a shard
_RESPONSE_PREFIXES = ("resp_", "resp-")
_CHOICE_SUFFIXES = re.compile(r"(\.[0-9]+)+$")  # choice k of request r is `r.k`
_PIPELINE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


def check_pipeline(name: str) -> str:
    """`name` when it can name a pipeline ("" or 1-64 of [a-z0-9._-], starting with a letter or
    digit), else ValueError."""
    if name and _PIPELINE.fullmatch(name) is None:
        raise ValueError(
            f"invalid pipeline name {name!r}: 1-64 lower-case letters, digits and ._- "
            "(starting with a letter or digit)"
        )
    return name


def pipeline_name(model: str) -> str:
    """The pipeline name a served model name maps to: lower case, runs of other characters as
    `-` (`SmolLM2 135M` -> `smollm2-135m`); `model` when nothing is left."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-._")[:64].strip("-._")
    return slug or "model"


def base_id(request_id: str) -> str:
    """What places a request on a shard: its id without the choice suffixes (`r.0`, `r.1`
    -> `r`) and without the Responses prefix (`resp_x`, `resp-x` -> `x`)."""
    for prefix in _RESPONSE_PREFIXES:
        if request_id.startswith(prefix):
            request_id = request_id[len(prefix) :]
            break
    return _CHOICE_SUFFIXES.sub("", request_id) or request_id


def shard_of(request_id: str, shards: int) -> int:
    """The shard of a request (or a response) id among `shards`: a stable hash of its base id,
    so any process finds it from the id alone."""
    if shards <= 1:
        return 0
    return zlib.crc32(base_id(request_id).encode()) % shards


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under a prefix; `Keys("kvrelay:")` gives `{kvrelay}:stream:prefill` and so on.

    `shard` picks the pipeline shard whose keys these are (its hash tag), `shards` is how many
    there are: `of(request_id)` gives the Keys of a request's shard, `all()` every shard's.
    `pipeline` names the model pipeline whose work streams these are ("" the unnamed one);
    `for_pipeline(name)` gives another's, with the same shards."""

    prefix: str = DEFAULT_KEY_PREFIX
    shard: int = 0
    shards: int = 1
    pipeline: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards must be 1-{MAX_SHARDS}, got {self.shards}")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard {self.shard} is not one of the {self.shards} shards")
        check_pipeline(self.pipeline)

    @property
    def tag(self) -> str:
        """This shard's hash tag without braces: `kvrelay` (shard 0), `kvrelay.k`."""
        base = self.prefix.rstrip(":")
        return base if self.shard == 0 else f"{base}.{self.shard}"

    @property
    def _p(self) -> str:
        return f"{{{self.tag}}}:"

    @property
    def _g(self) -> str:
        """The prefix of the keys every shard shares (shard 0's)."""
        return f"{{{self.prefix.rstrip(':')}}}:"

    def at(self, shard: int) -> Keys:
        """The keys of shard `shard`."""
        if shard == self.shard:
            return self
        return Keys(self.prefix, shard, self.shards, self.pipeline)

    def for_pipeline(self, pipeline: str) -> Keys:
        """These keys with the work streams of model pipeline `pipeline` ("" the unnamed one)."""
        if pipeline == self.pipeline:
            return self
        return Keys(self.prefix, self.shard, self.shards, pipeline)

    @property
    def _s(self) -> str:
        """The suffix of this pipeline's work streams and consumers hash ("" unnamed)."""
        return f":{self.pipeline}" if self.pipeline else ""

    def of(self, request_id: str) -> Keys:
        """The keys of the shard that holds `request_id` (a choice's and a response's too)."""
        return self.at(shard_of(request_id, self.shards))

    def all(self) -> list[Keys]:
        """Every shard's keys, shard 0 first."""
        return [self.at(k) for k in range(self.shards)]

    @property
    def global_keys(self) -> Keys:
        """Shard 0's keys: where the settings every shard shares live."""
        return self.at(0)

    @property
    def shard_count(self) -> str:
        """String: the number of shards the first process wrote (SET NX; every process checks
        its own against it at start). Shard 0's."""
        return self._g + "shards"

    @property
    def prefill_stream(self) -> str:
        return self._p + "stream:prefill" + self._s

    @property
    def decode_stream(self) -> str:
        return self._p + "stream:decode" + self._s

    @property
    def stream_pattern(self) -> str:
        """SCAN pattern of this shard's work streams of every pipeline."""
        return self._p + "stream:*"

    def stream_pipeline(self, stream: str) -> tuple[str, str] | None:
        """(stage, pipeline) of a work stream name of this shard, None for another key."""
        rest = stream.removeprefix(self._p)
        if rest == stream:
            return None
        for stage in (PREFILL_GROUP, DECODE_GROUP):
            base = f"stream:{stage}"
            if rest == base:
                return stage, ""
            if rest.startswith(base + ":"):
                name = rest[len(base) + 1 :]
                if name and _PIPELINE.fullmatch(name):
                    return stage, name
        return None

    @property
    def dlq(self) -> str:
        return self._p + "dlq"

    def out(self, request_id: str) -> str:
        return self._p + f"out:{request_id}"

    def request(self, request_id: str) -> str:
        return self._p + f"req:{request_id}"

    @property
    def progress(self) -> str:
        """Hash: request id -> its `Progress` (tokens emitted, feeds, owner, cancel flag);
        `kvrelay.pipeline.queue.progress`."""
        return self._p + "prog"

    @property
    def consumers(self) -> str:
        """Hash: stream consumer name -> unix time of its worker's last heartbeat (the lease:
        the entries of a consumer silent for a lease are claimed). One per pipeline: a
        pipeline's claims read its own consumers only."""
        return self._p + "consumers" + self._s

    def fence(self, consumer: str) -> str:
        """String: the number of a stream consumer's last step, "f" once a claim fenced it (its
        steps are refused wholesale; `lua/step.lua`), with "!" appended while control items
        wait for it. Lua derives it from `progress` (same prefix)."""
        return self._p + f"fence:{consumer}"

    def control(self, consumer: str) -> str:
        """List: what the owner of requests must learn (`cancel <id>`, `feeds <id> <f1,f2>`),
        popped by its step script. Lua derives it from `progress` (same prefix)."""
        return self._p + f"control:{consumer}"

    def tail(self, consumer: str) -> str:
        """Hash: a stream consumer's step number -> the chunks its step added to requests'
        tails (the chunks not yet in out:{id}), one `progress.tail_entry` per step; the tail
        of a request is in its owner's hash (`lua/progress.lua` walks it). Lua derives it
        from `progress` (same prefix)."""
        return self._p + f"tail:{consumer}"

    def feed(self, reader_id: str) -> str:
        """Shard channel (SPUBLISH, not a key): the live chunks of every request one output
        reader (an ingress process or a producer client) follows, one message per worker step
        (`progress.feed_item` per request)."""
        return self._p + f"feed:{reader_id}"

    def response(self, response_id: str) -> str:
        """Hash: a stored Responses API answer (`pipeline/server/response_store.py`)."""
        return self._p + f"resp:{response_id}"

    def usage(self, start: int) -> str:
        """Hash: this shard's usage counts of the hour starting at unix time `start`
        (`core.usage`: field `<metric> <account>`); the step script that ends a request
        derives it from `progress` (same prefix) and writes it."""
        return self._p + f"usage:{start}"

    @property
    def usage_total(self) -> str:
        """Hash: this shard's usage counts since it began (never expires; /metrics)."""
        return self._p + "usage:total"

    @property
    def replicated(self) -> str:
        """String with TTL: the marker a cluster submission writes under its shard's tag so
        that `WAIT` on that node covers it (`pipeline/queue/submit.py`)."""
        return self._p + "replicated"

    def _quota(self, key_id: str) -> str:
        """The prefix of one API key's quota keys: its own hash tag (`{kvrelay.quota.<id>}`),
        the same on every shard, so its quota script touches one slot."""
        return f"{{{self.prefix.rstrip(':')}.quota.{key_id}}}:"

    def quota_requests(self, key_id: str) -> str:
        """String: the requests an API key (`KeyPolicy.key_id`) made in its current minute
        window, which ends when the key expires (`lua/quota.lua`)."""
        return self._quota(key_id) + "requests"

    def quota_tokens(self, key_id: str) -> str:
        """String: the tokens (prompt + max_tokens) an API key asked for in its current minute
        window, which ends when the key expires (`lua/quota.lua`)."""
        return self._quota(key_id) + "tokens"

    def quota_open(self, key_id: str) -> str:
        """Sorted set: an API key's open requests (one member each) -> when the member lapses
        (unix ms) if its ingress never removes it (`lua/quota.lua`)."""
        return self._quota(key_id) + "open"

    def standby(self, worker_id: str) -> str:
        """String with TTL: the pid of a process waiting, loaded, to serve worker `worker_id`
        when the one serving it dies (`workers.slot`; `kvrelay up --standby`)."""
        return self._p + f"standby:{worker_id}"

    def worker(self, worker_id: str) -> str:
        """Hash: a worker's heartbeat record on this shard (each shard a worker serves has one:
        `lua/beat.lua` writes it with the consumer's lease, one slot per script)."""
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
        directory; `core.page_keys.holders` reads a value). One per shard: a page's entry is in
        the shard of its key (`pages_of`), so the directory spreads over the slots too."""
        return self._p + "pages"

    def pages_of(self, page_hex: str) -> str:
        """The `pages` hash holding the entry of page key `page_hex`."""
        if self.shards == 1:
            return self.pages
        return self.at(int(page_hex[:8] or "0", 16) % self.shards).pages

    def page_groups(self, page_hexes: list[str]) -> dict[str, list[int]]:
        """`pages` hash -> the positions in `page_hexes` of the keys whose entries it holds."""
        groups: dict[str, list[int]] = {}
        for i, page_hex in enumerate(page_hexes):
            groups.setdefault(self.pages_of(page_hex), []).append(i)
        return groups

    def store_node(self, node_id: str) -> str:
        return self._g + f"node:{node_id}"

    @property
    def prefetch(self) -> str:
        """Pub/sub channel: the pages of a request just queued (`core.page_keys.PrefetchHint`);
        store nodes bring them up from disk (or peers) while it waits. Shard 0's."""
        return self._g + "prefetch"

    @property
    def store_node_pattern(self) -> str:
        return self._g + "node:*"

    @property
    def models(self) -> str:
        """Hash: served model name -> JSON (fingerprint, page size, max context, generation
        defaults, digest of its files) from workers."""
        return self._g + "models"

    @property
    def loras(self) -> str:
        """Hash: LoRA adapter name -> the last run-time command for it (`core.lora_command`),
        which every worker of this pipeline applies once (`workers.lora_control`). Shard 0's,
        one per pipeline."""
        return self._g + "loras" + self._s

    def lora_result(self, command_id: str) -> str:
        """Hash with TTL: worker name -> "" (done) or why LoRA command `command_id` failed."""
        return self._g + f"lora-result:{command_id}"

    def model_files(self, digest: str) -> str:
        """Hash: file name -> contents, the tokenizer files of a model (`core.model_bundle`)."""
        return self._g + f"model-files:{digest}"
