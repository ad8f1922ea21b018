"""Draft-model speculation (engine/draft_model.py) on the real SmolLM2 model as both target and
draft: outputs equal plain decoding's token for token (and logprobs), greedy and seeded, with
stops, max_tokens and preemption; a same-model greedy draft is always accepted."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from kvrelay.core.config import ConfigError
from kvrelay.core.enums import Speculation
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine import draft_model
from kvrelay.workers.engine.draft_model import DraftModelDrafter
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig, RequestOutput
from kvrelay.workers.engine.speculator import matmul_params, resolve_speculation

DRAFT = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def make_engine(loaded_model):
    """make(speculation, **kw): an Engine over the session's model; its draft model is the same
    loaded model (shared weights, a pool of its own), drafting as if free (a same-size draft
    never pays by the cost rule)."""

    def make(speculation: str = "draft", **kw) -> Engine:
        kw.setdefault("num_blocks", 64)
        kw.setdefault("spec_row_cost", 0.001)
        kw.setdefault("num_speculative_tokens", 4)
        config = EngineConfig(speculation=speculation, draft_model=DRAFT, **kw)
        with mock.patch.object(draft_model, "load_model", return_value=loaded_model):
            engine = Engine(config, loaded=loaded_model)
        if engine.speculator is not None:
            engine.speculator.drafter.cost = 0.0
        return engine

    return make


def chat_prompts(tokenizer) -> list[list[int]]:
    questions = [
        "What is the capital of France?",
        "Count from one to twenty, separated by commas.",
        "Write a haiku about the sea.",
    ]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    g = torch.Generator().manual_seed(7)
    return [*prompts, torch.randint(100, 40000, (70,), generator=g).tolist()]


def same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids
        assert x.new_logprobs == y.new_logprobs
        assert x.text_delta == y.text_delta
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, logprobs=2, **kw)


def test_greedy_same_output_and_every_draft_accepted(make_engine):
    off = make_engine("off")
    prompts = chat_prompts(off.tokenizer)
    params = [greedy(max_tokens=n, ignore_eos=True) for n in (24, 17, 30, 9)]
    want = off.generate(prompts, params)
    # chunked catch-up: the 70-token prompt's draft prefill spans several steps
    engine = make_engine(max_num_batched_tokens=32)
    got = engine.generate(prompts, params)
    same(want, got)
    assert [len(o.output_token_ids) for o in got] == [24, 17, 30, 9]
    stats = engine.stats
    assert stats.num_draft_tokens > 40
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # same model, greedy: always
    assert stats.num_steps < off.stats.num_steps
    per_request = sum(o.metrics["num_draft_tokens"] for o in got)
    assert per_request == stats.num_draft_tokens


def test_seeded_sampling_same_output(make_engine):
    off, engine = make_engine("off"), make_engine()
    prompts = chat_prompts(off.tokenizer)
    params = [
        SamplingParams(temperature=0.8, seed=10 + i, logprobs=1, max_tokens=20, ignore_eos=True)
        for i in range(len(prompts))
    ]
    same(off.generate(prompts, params), engine.generate(prompts, params))
    assert engine.stats.num_accepted_tokens > 0


def test_stops_and_eos_same_output(make_engine):
    off, engine = make_engine("off"), make_engine()
    prompts = chat_prompts(off.tokenizer)
    params = [
        greedy(max_tokens=32, stop=["Paris"]),  # a stop string inside a draft
        greedy(max_tokens=32, stop=["in 1999"], include_stop_str_in_output=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=32, stop=["\n"]),
        greedy(max_tokens=1),  # no room for a draft
    ]
    want = off.generate(prompts, params)
    got = engine.generate(prompts, params)
    same(want, got)
    assert [o.finish_reason for o in got[:2]] == ["stop", "stop"]
    assert engine.stats.num_draft_tokens > 0


def test_preemption_same_output(make_engine):
    off = make_engine("off", num_blocks=9)
    engine = make_engine(num_blocks=9)
    prompts = chat_prompts(off.tokenizer)[:3]  # 3 pages each, 4 once done: 9 do not hold all
    params = greedy(max_tokens=24, ignore_eos=True)
    want = off.generate(prompts, params)
    got = engine.generate(prompts, params)
    same(want, got)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.num_accepted_tokens == engine.stats.num_draft_tokens > 0
    assert engine.pool.num_free_blocks == engine.num_blocks  # every block came back


def test_draft_kv_equals_target_kv(make_engine):
    """With the same model, the draft K/V the bookkeeping counts as valid is bitwise the
    target's, after rejections (sampling), preemptions and prefix-cache sharing."""
    engine = make_engine(num_blocks=12, max_num_batched_tokens=32)
    drafter = engine.speculator.drafter
    prompts = chat_prompts(engine.tokenizer)
    prompts.append(prompts[0])  # shares the first prompt's cached blocks
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    P, checked = engine.config.page_size, 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            n = min(seq.spec.draft_computed, seq.num_computed_tokens)
            pos = torch.arange(n)
            blocks = torch.tensor(seq.block_table)[pos // P]
            target = engine.runner.kv_pool[blocks, :, :, pos % P]
            assert torch.equal(drafter.runner.kv_pool[blocks, :, :, pos % P], target)
            checked += n
    assert checked > 0
    assert engine.scheduler.num_preemptions > 0
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens


def test_draft_pool_mirrors_target_pool(make_engine):
    engine = make_engine(num_blocks=20, page_size=8)
    drafter = engine.speculator.drafter
    assert isinstance(drafter, DraftModelDrafter)
    target, draft = engine.runner.kv_pool, drafter.runner.kv_pool
    assert draft.shape == target.shape and draft.dtype == target.dtype
    assert draft.data_ptr() != target.data_ptr()


def test_same_size_draft_never_pays(loaded_model):
    with mock.patch.object(draft_model, "load_model", return_value=loaded_model):
        engine = Engine(
            EngineConfig(speculation="draft", draft_model=DRAFT, num_blocks=16), loaded=loaded_model
        )
    assert engine.speculator.drafter.cost == 1.0
    engine.generate([[1, 2, 3, 4]], greedy(max_tokens=4, ignore_eos=True))
    assert engine.stats.num_draft_tokens == 0


def test_auto_picks_draft_with_a_draft_model(loaded_model):
    assert resolve_speculation("auto", DRAFT) is Speculation.DRAFT
    assert resolve_speculation("auto", None) is Speculation.NGRAM
    config = EngineConfig(draft_model=DRAFT, num_blocks=16)  # speculation="auto"
    with mock.patch.object(draft_model, "load_model", wraps=draft_model.load_model) as load:
        engine = Engine(config, loaded=loaded_model)  # loads the draft model (~3 s)
    load.assert_called_once_with(DRAFT, dtype="float32", device="cpu", quantization="none")
    drafter = engine.speculator.drafter
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.loaded.model is not loaded_model.model
    assert (
        drafter.loaded.dtype == loaded_model.dtype and drafter.runner.device == engine.runner.device
    )


def test_mismatched_vocabulary_refused(loaded_model):
    config = EngineConfig(speculation="draft", draft_model=DRAFT, num_blocks=16)
    bigger = dataclasses.replace(
        loaded_model.config, vocab_size=loaded_model.config.vocab_size + 64
    )
    other = dataclasses.replace(loaded_model, config=bigger)
    with (
        mock.patch.object(draft_model, "load_model", return_value=other),
        pytest.raises(ConfigError, match="vocabulary"),
    ):
        Engine(config, loaded=loaded_model)

    class Swapped:  # same size, two tokens swapped
        def __init__(self, tok):
            self.tok, self.vocab_size = tok, tok.vocab_size

        def id_to_token(self, i):
            return self.tok.id_to_token({5: 6, 6: 5}.get(i, i))

    other = dataclasses.replace(loaded_model, tokenizer=Swapped(loaded_model.tokenizer))
    with (
        mock.patch.object(draft_model, "load_model", return_value=other),
        pytest.raises(ConfigError, match="tokenizer"),
    ):
        Engine(config, loaded=loaded_model)


def test_matmul_params_ratio(loaded_model):
    c = loaded_model.config
    assert 100e6 < matmul_params(c) < 200e6
    half = dataclasses.replace(c, num_layers=c.num_layers // 2)
    assert matmul_params(half) < matmul_params(c)
