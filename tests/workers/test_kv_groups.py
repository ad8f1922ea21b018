"""KV groups (core.kv_layout): layouts of real configs, and the KVCacheManager over a
sliding-window group: exact block tables, blocks behind the window released, prefix hits that
need the window's pages, eviction falling back to a shorter prefix."""

from __future__ import annotations

import os

import pytest

from kvrelay.core.kv_layout import KVGroup, KVLayout, group_key, layer_windows
from kvrelay.core.page_keys import page_keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.block_pool import BlockPool
from kvrelay.workers.engine.kv_cache_manager import RELEASED, KVCacheManager
from kvrelay.workers.engine.sequence import Sequence

P = 4
R = RELEASED


def test_gemma3_270m_layout_six_groups_of_three():
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 18, "sliding_window": 512,
           "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                           for i in range(18)]}  # fmt: skip
    layout = KVLayout.from_config(cfg)
    assert layout.group_size == 3 and layout.num_groups == 6
    assert layout.groups[0] == KVGroup((5, 11, 17), 0)
    assert layout.groups[1] == KVGroup((0, 1, 2), 512)
    assert layout.groups[2] == KVGroup((3, 4, 6), 512)
    assert layout.groups[5] == KVGroup((14, 15, 16), 512)
    assert (layout.layer_group[11], layout.layer_slot[11]) == (0, 1)
    assert (layout.layer_group[6], layout.layer_slot[6]) == (2, 2)
    assert layout.describe() == "6 KV group(s) of 3 layer(s): 1 full, 5 local (window 512)"
    # the older configs' pattern gives the same layers
    old = {k: v for k, v in cfg.items() if k != "layer_types"} | {"sliding_window_pattern": 6}
    assert KVLayout.from_config(old) == layout


def test_one_kind_of_layer_is_one_group_of_every_layer():
    llama = KVLayout.from_config({"model_type": "llama", "num_hidden_layers": 30})
    assert llama.groups == (KVGroup(tuple(range(30)), 0),) and llama.group_size == 30
    assert llama.layer_slot == tuple(range(30))
    mistral = KVLayout.from_config(
        {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 4096}
    )
    assert mistral.groups == (KVGroup((0, 1, 2, 3), 4096),)
    # Qwen2's window is not applied (context_length caps the context at it instead)
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096}
    assert layer_windows(qwen) == ()
    # uneven counts: groups of gcd(2, 3) = 1 layer
    assert KVLayout.from_windows(5, [0, 8, 8, 0, 8]).group_size == 1
    with pytest.raises(ValueError, match="sliding_window"):
        layer_windows({"model_type": "gemma3_text", "num_hidden_layers": 2,
                       "layer_types": ["sliding_attention", "full_attention"]})  # fmt: skip


def test_group_keys():
    key = bytes(range(16))
    assert group_key(key, 0) == key
    assert len({group_key(key, g) for g in range(4)}) == 4
    assert all(len(group_key(key, g)) == 16 for g in range(4))


def test_first_block_a_query_reads():
    g = KVGroup((0,), window=8)
    # the next token at position 12 reads keys 5..12: block 1 (positions 4-7) on
    assert g.first_block(12, 4) == 1
    assert g.first_block(7, 4) == 0
    assert g.first_block(15, 4) == 2
    assert KVGroup((0,), 0).first_block(1000, 4) == 0


def _manager(num_blocks: int, window: int = 8) -> KVCacheManager:
    layout = KVLayout.from_windows(2, [0, window])  # group 0: layer 0 (full), 1: layer 1
    return KVCacheManager(BlockPool(num_blocks), page_size=P, fingerprint="fp", layout=layout)


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, len(tokens), SamplingParams(max_tokens=64), seed=0)


def _compute(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    assert kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    kv.commit(seq)


def test_local_group_keeps_only_the_window():
    kv = _manager(40)
    a = _seq("a", list(range(100, 140)))
    kv.match_prefix(a)
    _compute(kv, a, 8)  # blocks 0, 1 in both groups
    assert (a.block_table, a.group_tables) == ([0, 1], [[2, 3]])
    _compute(kv, a, 8)  # 16 computed: the next token (16) reads 9..16, block 2 on
    assert a.block_table == [0, 1, 4, 5]
    assert a.group_tables == [[R, R, 6, 7]]
    assert kv.num_held_blocks(a) == [4, 2] == kv.held_blocks
    for _ in range(6):  # decode-sized steps of 4: the local group holds 2 blocks after each
        _compute(kv, a, 4)
        assert kv.num_held_blocks(a)[1] == 2
    assert a.num_computed_tokens == 40 and len(a.block_table) == 10
    assert kv.pool.num_free_blocks == 40 - 12
    # released local blocks stay cached (free, keyed): a prefix could still hit them
    assert kv.pool.num_cached_blocks == 20
    assert kv.max_blocks(40, 4) == 10 + 4


def test_prefix_hit_needs_the_window_pages_of_the_local_group():
    kv = _manager(40)
    a = _seq("a", list(range(100, 140)))
    kv.match_prefix(a)
    _compute(kv, a, 40)  # one chunk: every block registered, local ones behind released
    keys = page_keys(a.token_ids, P, "fp")
    b = _seq("b", a.token_ids + [7, 7, 7])  # 43 tokens: a prefix of 10 blocks
    assert kv.match_prefix(b) == 40
    assert b.block_table == a.block_table
    # the next token (40) reads 33..40: local blocks 8, 9
    assert b.group_tables == [[R] * 8 + a.group_tables[0][8:]]
    kv.free(b)
    # evict the local page of block 9: the best prefix left ends where a window is whole
    block9 = kv.pool.cached(group_key(keys[9], 1))
    kv.pool.blocks[block9].key = None
    del kv.pool._cached[group_key(keys[9], 1)]
    c = _seq("c", a.token_ids + [7, 7, 7])
    # 9 blocks would read local blocks 7, 8: 7 is cached (released after the chunk, keyed)
    assert kv.match_prefix(c) == 36
    assert c.group_tables[0][:7] == [R] * 7 and R not in c.group_tables[0][7:]
    kv.free(c)
    kv.free(a)
    assert kv.pool.num_free_blocks == 40 and kv.held_blocks == [0, 0]


def test_released_blocks_go_back_to_the_pool_under_pressure():
    kv = _manager(8)  # 4 tokens per block, 2 groups: a sequence of 40 tokens fits only with
    a = _seq("a", list(range(100, 120)))  # local blocks released
    kv.match_prefix(a)
    for _ in range(5):
        _compute(kv, a, 4)
    assert kv.num_held_blocks(a) == [5, 2]
    assert kv.pool.num_free_blocks == 1


# ---- a tiny random Gemma 3 through the engine and the real store ----------------------------

GEMMA = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, vocab_size=320, max_position_embeddings=1024,
    sliding_window=24, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                 "full_attention"],
)  # fmt: skip
PAGE = 16


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory, model_dir):
    import shutil

    import torch
    import transformers

    from kvrelay.kernels import cpu_build

    cpu_build.load()  # built in the default cache before KVRELAY_CACHE_DIR moves
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma3"
    torch.manual_seed(5)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, path / name)
    return hf, path


def _store(run_dir, spec):
    import threading

    from kvrelay.kvstore.config import StoreConfig
    from kvrelay.kvstore.server import StoreNode

    config = StoreConfig(node_id=f"kvgroups{os.getpid()}", run_dir=str(run_dir),
                         arena_bytes=400 * spec.slot_bytes, page_bytes=spec.page_bytes,
                         tcp_port=-1, ucx_port=-1)  # fmt: skip
    node = StoreNode(config, spec.page_bytes)
    node.start()
    thread = threading.Thread(target=node.serve_forever, daemon=True)
    thread.start()
    return node, thread


@pytest.mark.parametrize("quantization", ["none", "int8-weight-only"])
def test_gemma3_window_memory_store_and_resume(tiny_gemma, quantization, tmp_path, monkeypatch):
    """300 prompt tokens and 120 greedy ones with a window of 24: the local groups hold at
    most the window's blocks plus a step's, the output is transformers', only local pages a
    resume reads are saved, and a fresh engine resumes from the store exactly."""
    import torch

    from kvrelay.kvstore.client import StoreClient
    from kvrelay.kvstore.connector import StoreConnector
    from kvrelay.kvstore.page import PageSpec
    from kvrelay.kvstore.server import arena_path
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
    from kvrelay.workers.model.loader import load_model

    hf, path = tiny_gemma
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    loaded = load_model(path, dtype="float32", device="cpu", quantization=quantization,
                        progress=False)  # fmt: skip
    config = EngineConfig(num_blocks=200, max_num_batched_tokens=64, speculation="off",
                          kv_cache_dtype="fp32", quantization=quantization)  # fmt: skip
    decoder = loaded.model.grouped_cpu_decoder
    assert (decoder is None) == (quantization == "none")
    ran: list[bool] = []
    if decoder is not None:  # count the steps the C++ decoder took over the grouped pool
        run = decoder.run
        monkeypatch.setattr(decoder, "run", lambda *a: ran.append(run(*a)) or ran[-1])
    first = Engine(config, loaded=loaded)
    assert [g.window for g in first.kv.groups] == [0, 24, 24, 24]
    pool = first.runner.kv_pool
    assert tuple(pool.shape[1:3]) == (1, 2)  # one layer per block: groups of one
    spec = PageSpec(first.fingerprint, "float32", 1, PAGE, 1, 32)
    node, thread = _store(tmp_path / "run", spec)
    saved: list[bytes] = []

    class Recording(StoreConnector):
        def save(self, keys, block_ids, kv_pool):
            saved.extend(keys)
            super().save(keys, block_ids, kv_pool)

    clients = [StoreClient(str(tmp_path / "run"), spec) for _ in range(2)]
    try:
        first.set_kv_connector(Recording(clients[0]))
        g = torch.Generator().manual_seed(11)
        prompt = torch.randint(3, 320, (300,), generator=g).tolist()
        greedy = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        first.add_request("a", prompt, greedy)
        out: list[int] = []
        most = [0, 0, 0, 0]
        while first.has_unfinished_requests():
            for o in first.step():
                out.extend(o.new_token_ids)
            most = [max(m, h) for m, h in zip(most, first.kv.held_blocks, strict=True)]
        # window 24, steps of <= 64 tokens: (23 + 64) / 16 rounded up, + 1 = 7 blocks at most
        assert most[0] == -(-(300 + 120 - 1) // PAGE)
        assert max(most[1:]) <= 7 and first.kv.max_blocks(10_000, 64) == 625 + 3 * 7
        assert first.kv.held_blocks == [0, 0, 0, 0]
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=120, do_sample=False,
                              min_new_tokens=120)[0, 300:].tolist()  # fmt: skip
        if quantization == "none":
            assert out == ref
        else:
            assert len(ran) > 100 and all(ran)
        # every full page saved once; a local group's only near resume points
        keys = page_keys(prompt + out, PAGE, first.fingerprint)[: (300 + 120 - 1) // PAGE]
        assert len(set(saved)) == len(saved) and set(keys) <= set(saved)
        local = [k for k in saved if k not in set(keys)]
        print("saved local pages", len(local), "of", 3 * len(keys))
        assert len(local) < 3 * len(keys)
        # the local pages behind the last window were demoted: the arena evicts them first
        first = first_engine_window = (300 + 120 - 1 - 24 + 1) // PAGE  # block 24 on: in it
        assert first_engine_window == 24
        behind = {group_key(keys[i], g).hex() for i in range(first) for g in (1, 2, 3)}
        behind &= {k.hex() for k in local}
        lru = clients[0].ls()["host"]
        assert len(lru) == len(saved) and len(behind) > 30
        assert set(lru[: len(behind)]) == behind
        # a fresh engine, given 40 of the outputs, resumes from the store: same tokens
        fresh = Engine(config, loaded=loaded)
        fresh.set_kv_connector(StoreConnector(clients[1]))
        fresh.add_request("b", prompt, greedy, output_token_ids=out[:40])
        rest: list[int] = []
        while fresh.has_unfinished_requests():
            for o in fresh.step():
                rest.extend(o.new_token_ids)
        assert out[:40] + rest == out
        assert fresh.stats.num_prompt_tokens_computed < 64  # the prefix came from the store
    finally:
        for c in clients:
            c.close()
        node.stop()
        thread.join(timeout=10)
        node.close()
        arena_path(node.config).unlink(missing_ok=True)
