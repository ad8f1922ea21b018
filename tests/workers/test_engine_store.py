"""Engine + the real store (StoreNode in a thread, StoreClient, StoreConnector): pages saved once,
a fresh engine resumes from stored pages plus a recomputed tail with bitwise-equal results, with
fp32 pages and with bf16 pages (--kv-cache-dtype bf16: half the bytes, another fingerprint)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvrelay.core.messages import Retention
from kvrelay.core.page_keys import page_keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

PAGE = 16


@pytest.fixture(params=["float32", "bfloat16"])
def kv_dtype(request) -> str:
    return request.param


@pytest.fixture
def fingerprint(loaded_model, kv_dtype) -> str:
    from kvrelay.core.modelref import model_fingerprint

    return model_fingerprint(loaded_model.dir, "float32", "none", kv_dtype)


@pytest.fixture
def connector(tmp_path, loaded_model, kv_dtype, fingerprint):
    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.config import StoreConfig
    from kvrelay.kvstore.connector import StoreConnector
    from kvrelay.kvstore.page import PageSpec
    from kvrelay.kvstore.server import StoreNode, arena_path

    c = loaded_model.config
    spec = PageSpec(fingerprint, kv_dtype, c.num_layers, PAGE, c.num_kv_heads,
                    c.head_dim)  # fmt: skip
    config = StoreConfig(node_id=f"engtest{os.getpid()}", run_dir=str(tmp_path / "run"),
                         arena_bytes=48 * spec.slot_bytes, page_bytes=spec.page_bytes,
                         tcp_port=-1, ucx_port=-1)  # fmt: skip
    node = StoreNode(config, spec.page_bytes)
    node.start()
    thread = threading.Thread(target=node.serve_forever, daemon=True)
    thread.start()

    class CountingConnector(StoreConnector):
        """The real connector, recording every key the engine asks to save."""

        saved: list[bytes] = []

        def save(self, keys, block_ids, kv_pool):
            self.saved.extend(keys)
            super().save(keys, block_ids, kv_pool)

    client = StoreClient(config.run_dir, spec)
    yield CountingConnector(client)
    client.close()
    node.stop()
    thread.join(timeout=10)
    node.close()
    arena_path(config).unlink(missing_ok=True)


def test_resume_from_store_pages_and_recomputed_tail(loaded_model, connector, kv_dtype):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(100, 40000, (100,), generator=g).tolist()
    sp = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=9, logprobs=2,
                        ignore_eos=True)  # fmt: skip
    config = EngineConfig(num_blocks=16, kv_cache_dtype=kv_dtype)
    first = Engine(config, connector, loaded=loaded_model)
    assert first.runner.kv_pool.dtype == getattr(torch, kv_dtype)
    assert first.fingerprint == connector.client.spec.fingerprint
    assert (first.fingerprint == loaded_model.fingerprint) == (kv_dtype == "float32")
    full = first.generate([prompt], [sp], ["r"])[0]
    tokens = prompt + full.output_token_ids
    # every full page of prompt + generated tokens whose K/V was computed is in the store once
    keys = page_keys(tokens[:-1], PAGE, first.fingerprint)
    assert len(keys) == (140 - 1) // PAGE == 8
    assert connector.lookup(keys) == 8
    assert connector.saved == keys  # each full page saved exactly once, in order
    # a fresh engine (empty device cache) resumes after 30 outputs: 129 tokens known,
    # 8 pages (128 tokens) come from the store, 1 token is recomputed, then decoding goes on
    second = Engine(config, connector, loaded=loaded_model)
    second.add_request("r", prompt, sp, output_token_ids=full.output_token_ids[:30])
    outs = []
    while second.has_unfinished_requests():
        outs.extend(second.step())
    assert outs[0].num_cached_tokens == 128
    assert outs[-1].metrics["num_store_cached_tokens"] == 128
    assert second.stats.num_prompt_tokens_computed == 30 + 100 - 1 - 128
    assert [t for o in outs for t in o.new_token_ids] == full.new_token_ids[30:]
    assert [lp for o in outs for lp in o.new_logprobs] == full.new_logprobs[30:]
    # the same prompt again on the second engine: device cache first, the store is not needed
    again = second.generate([prompt], [sp], ["r2"])[0]
    assert again.num_cached_tokens == 96 and again.metrics["num_device_cached_tokens"] == 96
    assert again.new_token_ids == full.new_token_ids
    assert connector.saved == keys  # loaded and device-cached pages are never saved again


def test_store_refuses_pages_of_another_dtype(loaded_model, connector, kv_dtype):
    """A bf16 page is half an fp32 page; a pool of the other dtype is refused, not misread."""
    from kvrelay.kvstore.errors import StoreError

    spec = connector.client.spec
    c = loaded_model.config
    assert spec.page_bytes == c.num_layers * 2 * PAGE * c.num_kv_heads * c.head_dim * (
        4 if kv_dtype == "float32" else 2
    )
    other = "bfloat16" if kv_dtype == "float32" else "float32"
    engine = Engine(EngineConfig(num_blocks=4, kv_cache_dtype=other), loaded=loaded_model)
    with pytest.raises(StoreError, match=f"store pages are .* {kv_dtype}"):
        connector.save([b"k" * 16], [0], engine.runner.kv_pool)


def test_a_finished_request_retains_its_session_pages(loaded_model, connector, kv_dtype):
    """The engine asks the store to keep a session's pages (every saved full page of prompt and
    output) when its request finishes; a fresh engine's load of them is a recorded fetch span."""
    prompt = list(range(1000, 1100))
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    config = EngineConfig(num_blocks=16, kv_cache_dtype=kv_dtype)
    engine = Engine(config, connector, loaded=loaded_model)
    engine.add_request("r", prompt, sp, retention=Retention(session="chat-1", ttl_s=60))
    while engine.has_unfinished_requests():
        engine.step()
    pages = {}
    for _ in range(100):  # the retain is one-way: the node counts it a moment later
        pages = connector.client.stats()["pages"]
        if pages["sessions"]:
            break
        time.sleep(0.02)
    assert (pages["sessions"], pages["retained_host"]) == (1, (140 - 1) // PAGE)
    fresh = Engine(config, connector, loaded=loaded_model)
    fresh.generate([prompt], [sp], ["again"])
    load = fresh.kv.loader.spans["load"]
    assert (load.count, load.pages) == (1, (100 - 1) // PAGE)
    assert load.seconds > 0 and sum(load.buckets) == 1
