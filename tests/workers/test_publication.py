"""What a worker publishes about its model: the `models` entry and its tokenizer files."""

from __future__ import annotations

import json

import pytest

from kvrelay.core.keys import Keys
from kvrelay.core.model_bundle import ModelBundle
from kvrelay.core.modelref import DEFAULT_MODEL
from kvrelay.core.published_model import PublishedModel
from kvrelay.core.sampling import GenerationDefaults
from kvrelay.workers import publication as publication_module
from kvrelay.workers.publication import FILES_TTL_S, ModelPublication
from tests.queue_state import ValkeyClock, expires_at

KEYS = Keys("pub:")
NUMBERS = {"fingerprint": "f" * 32, "page_size": 16, "max_model_len": 8192, "vocab_size": 49152}
FILE_NAMES = [
    b"chat_template.jinja",
    b"config.json",
    b"generation_config.json",
    b"tokenizer.json",
    b"tokenizer_config.json",
]


def test_publication_writes_files_before_the_entry_and_restores_them(r, model_dir, fake_clock):
    publication = ModelPublication.from_dir(
        DEFAULT_MODEL,
        model_dir,
        PublishedModel(**NUMBERS),
        GenerationDefaults(top_k=40, max_tokens=512),
    )
    digest = ModelBundle.from_dir(model_dir).digest
    entry = json.loads(publication.entry.encode())
    assert entry == {
        **NUMBERS,
        "files": digest,
        # the model's own (kvrelay's table for SmolLM2) under the worker's override
        "generation_defaults": {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 512},
    }
    fake_clock.install(publication_module)
    fake_clock.sleep(12.3456)  # the clock at a fraction of a millisecond
    with ValkeyClock(r) as clock:
        publication.publish(r, KEYS)
    published = json.loads(r.hget(KEYS.models, DEFAULT_MODEL))
    assert published.pop("published") == round(fake_clock.time(), 3)  # the beat's time, in ms
    assert published == entry
    files = r.hgetall(KEYS.model_files(digest))
    assert sorted(files) == FILE_NAMES
    assert files[b"tokenizer.json"] == (model_dir / "tokenizer.json").read_bytes()
    assert expires_at(r, KEYS.model_files(digest)) in clock.window(FILES_TTL_S)

    # a Valkey that lost the files (restart without its data) gets them again on the next beat
    r.delete(KEYS.model_files(digest))
    r.expire(KEYS.models, 100)  # unrelated: the entry is rewritten each beat anyway
    publication.publish(r, KEYS)
    assert sorted(r.hgetall(KEYS.model_files(digest))) == FILE_NAMES


def test_worker_heartbeat_publishes_model_with_its_override(r, valkey_session, loaded_model):
    from kvrelay.workers.config import WorkerConfig
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    engine = Engine(EngineConfig(num_blocks=8, num_threads=1), loaded=loaded_model)
    config = WorkerConfig(
        redis_url=valkey_session.url,
        key_prefix="pub:",
        name="decode-p",
        metrics_port=-1,
        override_generation_config='{"temperature": 0.7, "max_new_tokens": 100}',
    )
    worker = DecodeWorker(config, engine, client=r)
    worker.streams.ensure_group(KEYS.decode_stream, "decode")
    worker.heartbeat.beat()
    entry = json.loads(r.hget(KEYS.models, DEFAULT_MODEL))
    entry.pop("published")
    digest = ModelBundle.from_dir(loaded_model.dir).digest
    assert entry == {
        "fingerprint": engine.fingerprint,
        "page_size": 16,
        "max_model_len": 8192,
        "vocab_size": 49152,
        "files": digest,
        "generation_defaults": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 100},
    }
    assert sorted(r.hgetall(KEYS.model_files(digest))) == FILE_NAMES


def test_heartbeat_republishes_after_an_interval_or_a_fence(r, valkey_session, loaded_model):
    from kvrelay.workers import emitter
    from kvrelay.workers.config import WorkerConfig
    from kvrelay.workers.decode import DecodeWorker
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    engine = Engine(EngineConfig(num_blocks=8, num_threads=1), loaded=loaded_model)
    config = WorkerConfig(
        redis_url=valkey_session.url, key_prefix="pub:", name="decode-q", metrics_port=-1
    )
    worker = DecodeWorker(config, engine, client=r)
    worker.streams.ensure_group(KEYS.decode_stream, "decode")
    worker.heartbeat.beat()
    assert r.hexists(KEYS.models, DEFAULT_MODEL)
    # later beats inside the interval write no entry: two commands a second saved per worker
    r.hdel(KEYS.models, DEFAULT_MODEL)
    worker.heartbeat.beat()
    assert not r.hexists(KEYS.models, DEFAULT_MODEL)
    # a Valkey that lost its data: the fence key is gone too, the beat reads a fence and the
    # entry is back at once
    r.delete(KEYS.fence(worker.streams.consumer))
    worker.heartbeat.beat()
    assert r.hexists(KEYS.models, DEFAULT_MODEL)
    # and every REPUBLISH_S without one
    r.hdel(KEYS.models, DEFAULT_MODEL)
    worker.heartbeat._last_publish -= emitter.REPUBLISH_S
    worker.heartbeat.beat()
    assert r.hexists(KEYS.models, DEFAULT_MODEL)


def test_bad_worker_override_is_a_config_error():
    from kvrelay.core.config import ConfigError
    from kvrelay.workers.config import load_worker_config

    with pytest.raises(ConfigError) as info:
        load_worker_config(environ={"KVRELAY_WORKER_OVERRIDE_GENERATION_CONFIG": '{"top_p": 2}'})
    assert str(info.value) == "override_generation_config: top_p must be in (0, 1], got 2.0"
