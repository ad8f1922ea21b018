"""What a worker publishes about its model, so producers on any host can queue requests for it.

Two keys: the `models` hash entry (fingerprint, page size, max_model_len, vocab size, the
generation defaults, the digest of the files, when it was `published`) and
`model-files:{digest}`, the tokenizer files (`core.model_bundle`). The files are
content-addressed: every worker of a model writes the same key, and a producer fetches it once
per digest. The heartbeat calls `publish` on its first beat, every `REPUBLISH_S` and after a
fence (which a Valkey restarted without its data also reads as): it refreshes the files' expiry
and writes them again only when they are gone, before the entry that names them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import redis

from kvrelay.core.keys import Keys
from kvrelay.core.model_bundle import PUBLICATION_TTL_S, ModelBundle
from kvrelay.core.modelref import model_generation_defaults
from kvrelay.core.published_model import PublishedModel
from kvrelay.core.sampling import GenerationDefaults

logger = logging.getLogger(__name__)

FILES_TTL_S = PUBLICATION_TTL_S


@dataclass(slots=True)
class ModelPublication:
    """One model's `models` entry and files, as a worker publishes them."""

    name: str
    entry: PublishedModel
    bundle: ModelBundle | None = None

    @classmethod
    def from_dir(
        cls,
        name: str,
        directory: str | Path | None,
        numbers: PublishedModel,
        override: GenerationDefaults | None = None,
        chat_template: str | None = None,
        own_name: str | None = None,
    ) -> ModelPublication:
        """The publication of model `name` converted in `directory` (None: numbers only).

        `numbers`: fingerprint, page_size, max_model_len, vocab_size. The generation defaults
        are the model's own under the operator's `override` (the worker's
        --override-generation-config), so every producer applies the same ones; a
        `chat_template` (its --chat-template) replaces the model's own in the files.
        `own_name`: the model's own name when it is served under another (`name`).
        """
        override = override or GenerationDefaults()
        if directory is None:
            bundle, model_defaults = None, GenerationDefaults()
        else:
            bundle = ModelBundle.from_dir(directory)
            if chat_template is not None:
                bundle = bundle.with_chat_template(chat_template)
            model_defaults = model_generation_defaults(directory, own_name or name)
        entry = replace(
            numbers,
            files=bundle.digest if bundle else None,
            generation_defaults=override.over(model_defaults),
        )
        return cls(name, entry, bundle)

    def publish(
        self, r: redis.Redis | redis.RedisCluster, keys: Keys, ttl_s: int = FILES_TTL_S
    ) -> None:
        """Make sure the files are there (refreshing their expiry), then write the entry."""
        if self.bundle is not None:
            key = keys.model_files(self.bundle.digest)
            if not r.expire(key, ttl_s):  # 0: no such key
                pipe = r.pipeline(transaction=False)
                # (redis-py types `mapping` with an invariant key union: str keys are fine)
                pipe.hset(key, mapping=dict(self.bundle.files))  # type: ignore[arg-type]
                pipe.expire(key, ttl_s)
                pipe.execute()
                logger.info(
                    "published the files of model %s (%s, %d bytes)",
                    self.name,
                    self.bundle.digest,
                    sum(len(data) for data in self.bundle.files.values()),
                )
        # stamped each publication: readers skip a model no worker has served for a week
        r.hset(keys.models, self.name, self.entry.stamped(time.time()).encode())
