"""Engine + the real store (StoreNode in a thread, StoreClient, StoreConnector): pages saved once,
a fresh engine resumes from stored pages plus a recomputed tail with bitwise-equal results."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvrelay.core.page_keys import page_keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

PAGE = 16


@pytest.fixture
def connector(tmp_path, loaded_model):
    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.config import StoreConfig
    from kvrelay.kvstore.connector import StoreConnector
    from kvrelay.kvstore.page import PageSpec
    from kvrelay.kvstore.server import StoreNode, arena_path

    c = loaded_model.config
    spec = PageSpec(loaded_model.fingerprint, "float32", c.num_layers, PAGE, c.num_kv_heads,
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


def test_resume_from_store_pages_and_recomputed_tail(loaded_model, connector):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(100, 40000, (100,), generator=g).tolist()
    sp = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=9, logprobs=2,
                        ignore_eos=True)  # fmt: skip
    first = Engine(EngineConfig(num_blocks=16), connector, loaded=loaded_model)
    full = first.generate([prompt], [sp], ["r"])[0]
    tokens = prompt + full.output_token_ids
    # every full page of prompt + generated tokens whose K/V was computed is in the store once
    keys = page_keys(tokens[:-1], PAGE, loaded_model.fingerprint)
    assert len(keys) == (140 - 1) // PAGE == 8
    assert connector.lookup(keys) == 8
    assert connector.saved == keys  # each full page saved exactly once, in order
    # a fresh engine (empty device cache) resumes after 30 outputs: 129 tokens known,
    # 8 pages (128 tokens) come from the store, 1 token is recomputed, then decoding goes on
    second = Engine(EngineConfig(num_blocks=16), connector, loaded=loaded_model)
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
