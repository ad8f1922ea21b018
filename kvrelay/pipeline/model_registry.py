"""The models a producer may send requests for: tokenizers, context limits, generation defaults.

A model's files come from the converted directory on this host when the model is prepared
here, else from the copy its workers publish in Redis (`model-files:{digest}`, see
`kvrelay.workers.publication`): fetched once per digest, kept in memory and under
`$KVRELAY_CACHE_DIR/model-files/`, so a producer on another host needs only the Redis URL.
Numbers published by workers in the `models` hash win (their fingerprint depends on the dtype
they run in), and so do the generation defaults they publish (the model's own under the
workers' override); this registry's `override` (the ingress's --override-generation-config,
the client's argument) goes on top of them.

Several models: each model's requests go to its own pipeline's streams (`kvrelay.core.keys`),
the one its workers publish with the model; until one has, the pipeline the configured list
gives it (`model_pipelines`: the first model the unnamed one, as a single-model stack, each
other one the pipeline named after it, which is what `kvrelay up` gives its workers).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any, cast

from redis.exceptions import RedisError

from kvrelay.core import modelref
from kvrelay.core.config import cache_root
from kvrelay.core.keys import pipeline_name
from kvrelay.core.model_bundle import ModelBundle
from kvrelay.core.page_keys import DEFAULT_PAGE_SIZE, lora_fingerprint
from kvrelay.core.published_model import PublishedModel
from kvrelay.core.sampling import GenerationDefaults
from kvrelay.pipeline.errors import RequestError, model_not_found
from kvrelay.pipeline.queue.cluster import ClusterState

logger = logging.getLogger(__name__)

FILES_CACHE = "model-files"  # under $KVRELAY_CACHE_DIR: one directory per digest


@dataclass(slots=True)
class ModelEntry:
    """What the producer needs to know about one served model."""

    name: str
    tokenizer: Any  # kvrelay.core.tokenizer.Tokenizer
    vocab_size: int
    max_model_len: int
    fingerprint: str | None  # None: cached pages cannot be looked up
    page_size: int = DEFAULT_PAGE_SIZE
    # for the fields a request leaves out: override > published (or the model's own)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    pipeline: str = ""  # the model pipeline whose streams its requests go to ("" unnamed)
    served_name: str = ""  # the name its workers publish (a path's directory name); "": name
    lora: str = ""  # a LoRA adapter of the model its workers serve ("": the model itself)

    @property
    def worker_model(self) -> str:
        """The model name the heartbeats of this model's workers carry."""
        return self.served_name or self.name


def served_name(name: str) -> str:
    """The name a model's workers publish it under (`ModelRef.name`: a path's directory or
    file stem, a built-in's own), or `name` when it does not resolve on this host."""
    try:
        return modelref.resolve_model(name).name
    except (modelref.ModelNotFoundError, OSError, ValueError):
        return name


def model_pipelines(names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Served model name -> its pipeline for a stack serving `names` in this order: the first
    keeps the unnamed pipeline (a single-model stack's keys), each other one gets the pipeline
    named after it (`core.keys.pipeline_name`). ValueError when two share a pipeline."""
    out: dict[str, str] = {}
    for i, name in enumerate(names):
        served = served_name(name)
        if served in out:
            continue  # the same model twice (a path and its name)
        pipeline = pipeline_name(served) if i else ""
        if pipeline and pipeline in out.values():
            raise ValueError(f"models {name!r} and another one would share pipeline {pipeline!r}")
        out[served] = pipeline
    return out


@dataclass(slots=True)
class _Files:
    """What a model's files say: tokenizer, numbers and its own generation defaults."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    fingerprint: str | None
    defaults: GenerationDefaults
    digest: str | None = None  # of the files as a bundle (None: injected, never replaced)


def not_ready(name: str) -> RequestError:
    """503: nothing on this host and no worker has published the model's files yet."""
    return RequestError(
        f"model {name!r} is not ready: no worker serving it has published its files yet. Start "
        f"one (`kvrelay worker decode --model {name}`, or `kvrelay up`): a worker publishes "
        "the tokenizer and limits producers need, on any host",
        503,
        type="service_unavailable",
        code="model_not_ready",
    )


def _load_local(name: str) -> _Files | None:
    """Tokenizer and numbers from the converted directory on this host (None: not here)."""
    try:
        ref = modelref.resolve_model(name)
    except modelref.ModelNotFoundError:
        return None
    if not modelref.is_prepared(ref):
        return None
    directory = modelref.converted_dir(ref)
    bundle = ModelBundle.from_dir(directory)
    tokenizer = bundle.tokenizer()
    cfg = modelref.read_config(directory)
    # Only a digest cached at conversion is used: hashing 500 MB of weights here would stall.
    digest = modelref.read_meta(directory).get("weights_digest")
    fingerprint = modelref.model_fingerprint(directory, "float32") if digest else None
    vocab = max(int(cfg.get("vocab_size", 0)), tokenizer.vocab_size)
    max_len = modelref.context_length(cfg)
    defaults = modelref.model_generation_defaults(directory, ref.name)
    return _Files(tokenizer, vocab, max_len, fingerprint, defaults, bundle.digest)


def _bundle_files(bundle: ModelBundle, name: str) -> _Files:
    """The same from a published bundle (the fingerprint comes with the `models` entry)."""
    tokenizer = bundle.tokenizer()
    cfg = modelref.flat_config(bundle.json_file("config.json"))
    vocab = max(int(cfg.get("vocab_size", 0)), tokenizer.vocab_size)
    max_len = modelref.context_length(cfg)
    gen = bundle.json_file("generation_config.json")
    # workers publish their defaults with the entry; these only stand in when it has none
    defaults = modelref.generation_defaults_of(gen, {}, name, f"published files of {name}")
    return _Files(tokenizer, vocab, max_len, None, defaults, bundle.digest)


def _alias_of(published: dict[str, PublishedModel], name: str) -> str | None:
    """The model whose workers publish `name` as an alias (`--served-model-name`), if any."""
    for model, entry in published.items():
        if entry.aliases and name in entry.aliases:
            return model
    return None


def lora_parent(published: dict[str, PublishedModel], name: str) -> tuple[str, str] | None:
    """(the model, the adapter's page identity) of LoRA adapter `name` as its workers publish
    it, if any model's do."""
    for model, entry in published.items():
        if entry.loras and name in entry.loras:
            return model, entry.loras[name]
    return None


def _read_cached(digest: str) -> ModelBundle | None:
    """The bundle kept on disk by an earlier fetch, if it is there and intact."""
    path = cache_root() / FILES_CACHE / digest
    if not path.is_dir():
        return None
    try:
        bundle = ModelBundle.from_dir(path)
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the cached model files in %s: %s", path, exc)
        return None
    return bundle if bundle.digest == digest else None


def _keep(bundle: ModelBundle) -> None:
    """Keep a fetched bundle on disk for the next process (best effort)."""
    path = cache_root() / FILES_CACHE / bundle.digest
    try:
        bundle.write_dir(path)
    except OSError as exc:
        logger.info("cannot keep the model files in %s (%s); fetching them each start", path, exc)


class ModelRegistry:
    """Served model names -> ModelEntry, loading each model's files once."""

    def __init__(
        self,
        names: tuple[str, ...] | list[str],
        cluster: ClusterState | None = None,
        tokenizers: dict[str, Any] | None = None,
        override: GenerationDefaults | None = None,
    ):
        self.names = list(names)
        self._served = {name: served_name(name) for name in self.names}
        # before a model's workers publish its pipeline: the configured order's
        self.pipelines = model_pipelines(self.names)
        self.cluster = cluster
        self.override = override or GenerationDefaults()
        self._local: dict[str, _Files] = {}  # name -> from this host's directory (or injected)
        self._published_files: dict[str, _Files] = {}  # digest -> from a published bundle
        self._not_local: set[str] = set()  # names served from published files: stop looking
        self._locks: dict[str, asyncio.Lock] = {}
        for name, tok in (tokenizers or {}).items():
            defaults = modelref.builtin_generation_defaults(name)
            self._local[name] = _Files(tok, tok.vocab_size, 0, None, defaults)

    async def served(self) -> list[str]:
        """Configured names plus any model a worker publishes, and its aliases."""
        published = await self.cluster.models() if self.cluster else {}
        names = [*self.names]
        for model, entry in published.items():
            names += [model, *(entry.aliases or ())]
        for entry in published.values():
            names += sorted(entry.loras or ())
        return list(dict.fromkeys(names))

    async def parent(self, name: str) -> str | None:
        """The model whose LoRA adapter `name` is (None: no adapter of a published model)."""
        if self.cluster is None or name in self.names:
            return None
        published = await self.cluster.models()
        found = None if name in published else lora_parent(published, name)
        return found[0] if found else None

    async def canonical(self, name: str) -> str:
        """The name model `name` is served under: `name`, or the model that publishes it as
        an alias (`--served-model-name`; responses carry the first name)."""
        if name in self.names or self.cluster is None:
            return name
        published = await self.cluster.models()
        if name in published:
            return name
        return _alias_of(published, name) or name

    async def _published(self, name: str) -> PublishedModel | None:
        return (await self.cluster.models()).get(name) if self.cluster else None

    async def _files_for(self, name: str, published: PublishedModel | None) -> _Files:
        """The files on this host, unless the workers publish others (a --chat-template of
        theirs): every producer then renders and tokenizes as the published files say."""
        digest = published.files if published else None
        local = await self._local_files(name)
        if local is not None and (digest is None or local.digest in (None, digest)):
            return local
        if digest is None or self.cluster is None:
            raise not_ready(name)
        files = self._published_files.get(digest)
        if files is None:
            files = await self._fetch(name, digest)
        if local is None:
            self._not_local.add(name)
        return files

    async def _local_files(self, name: str) -> _Files | None:
        """The model's files on this host (None: not prepared here), loaded once."""
        local = self._local.get(name)
        if local is not None:
            return local
        if name not in self._not_local:
            async with self._locks.setdefault(name, asyncio.Lock()):
                local = self._local.get(name)
                if local is None and name not in self._not_local:
                    local = await asyncio.to_thread(_load_local, name)
                    if local is not None:
                        self._local[name] = local
                        logger.info("loaded tokenizer for model %s", name)
        return local

    async def _fetch(self, name: str, digest: str) -> _Files:
        """The published files of `digest`: from disk when kept there, else from Redis."""
        assert self.cluster is not None
        async with self._locks.setdefault(f"files:{digest}", asyncio.Lock()):
            files = self._published_files.get(digest)
            if files is not None:
                return files
            bundle = await asyncio.to_thread(_read_cached, digest)
            if bundle is None:
                key = self.cluster.keys.model_files(digest)
                # a binary client: the values are bytes
                fields = cast("dict[bytes | str, bytes]", await self.cluster.redis.hgetall(key))
                if not fields:  # expired, or Valkey lost it: the workers write it again
                    raise not_ready(name)
                try:
                    bundle = ModelBundle.from_fields(fields, digest)
                except ValueError as exc:
                    logger.error("model %s: unusable published files: %s", name, exc)
                    raise not_ready(name) from exc
                await asyncio.to_thread(_keep, bundle)
            files = await asyncio.to_thread(_bundle_files, bundle, name)
            self._published_files[digest] = files
            logger.info("loaded tokenizer for model %s from its published files %s", name, digest)
            return files

    def _defaults(
        self, name: str, published: PublishedModel | None, files: _Files | None
    ) -> GenerationDefaults:
        """The override over the published defaults (else the model's own from its files)."""
        model = published.generation_defaults if published else None
        if model is None:
            model = files.defaults if files else modelref.builtin_generation_defaults(name)
        return self.override.over(model)

    async def get(self, name: str) -> ModelEntry:
        """The entry for `name`; 404 for an unknown model, 503 while no files are available."""
        published = await self._published(name)
        if name not in self.names and published is None:
            model = await self.canonical(name)
            if model != name:  # an alias: the model's own entry
                return await self.get(model)
            adapter = lora_parent(await self.cluster.models(), name) if self.cluster else None
            if adapter is not None:  # the model's entry, with the adapter and its pages
                base = await self.get(adapter[0])
                fingerprint = base.fingerprint and lora_fingerprint(base.fingerprint, adapter[1])
                return replace(
                    base,
                    name=name,
                    served_name=base.worker_model,
                    lora=name,
                    fingerprint=fingerprint,
                )
            raise model_not_found(name, await self.served())
        served = self.served_as(name)  # a path's entry is under its workers' name
        by_workers = published if served == name else await self._published(served)
        # the files its workers publish (a path renders chats as the model's name does)
        files = await self._files_for(name, published or by_workers)
        entry = published or PublishedModel()
        max_len = entry.max_model_len or files.max_model_len or 0
        if max_len <= 0:
            max_len = 1 << 30  # an injected tokenizer without numbers: only flag limits apply
        return ModelEntry(
            name=name,
            tokenizer=files.tokenizer,
            vocab_size=entry.vocab_size or files.vocab_size,
            max_model_len=max_len,
            fingerprint=entry.fingerprint or files.fingerprint,
            page_size=entry.page_size or DEFAULT_PAGE_SIZE,
            generation_defaults=self._defaults(name, published, files),
            pipeline=self.pipeline_of(name, by_workers),
            served_name=served,
        )

    def served_as(self, name: str) -> str:
        """The name `name`'s workers publish (resolved once per name)."""
        served = self._served.get(name)
        if served is None:
            served = self._served[name] = served_name(name)
        return served

    def known_pipeline(self, name: str) -> str | None:
        """The pipeline of model `name` as known now, without a Redis call (backpressure's
        early check): what its workers last published, else the configured one; None for a
        name neither configured nor published (its request will be refused anyway)."""
        published = self.cluster.published_now() if self.cluster is not None else {}
        if name not in self._served and name not in published:
            name = _alias_of(published, name) or name
        served = self.served_as(name) if name in self._served or name in published else None
        entry = published.get(name) or (published.get(served) if served else None)
        if entry is not None:
            return entry.pipeline or ""
        if served is None:
            return None
        return self.pipelines.get(served)

    def pipeline_of(self, name: str, published: PublishedModel | None = None) -> str:
        """The pipeline of model `name`: what its workers publish (`published`: its entry,
        under its served name), else the configured one (the unnamed pipeline for a model not
        configured here)."""
        if published is not None:
            return published.pipeline or ""
        return self.pipelines.get(self.served_as(name), "")

    async def describe(self, name: str) -> dict[str, Any]:
        """`max_model_len` (None: not known yet) and the effective `generation_defaults` of a
        served model, from what is already loaded or published (no file is read)."""
        try:
            name = await self.canonical(name)
            name = await self.parent(name) or name  # an adapter: its model's numbers
            published = await self._published(name)
        except RedisError:  # what this process knows is still worth showing
            published = None
        entry = published or PublishedModel()
        files = self._local.get(name) or self._published_files.get(entry.files or "")
        max_len = entry.max_model_len or (files.max_model_len if files else 0)
        return {
            "max_model_len": max_len or None,
            "generation_defaults": self._defaults(name, published, files).effective(),
        }
