"""Engine on the real SmolLM2 model: batch/chunk/resume invariance, seeded resume, prefix cache,
preemption. Every comparison is exact (token ids and logprobs bitwise)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig, RequestOutput

NUM = 32
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def make_engine(loaded_model):
    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 160)
        connector = kw.pop("connector", None)
        return Engine(EngineConfig(**kw), connector, loaded=loaded_model)

    return make


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 120) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lens]


def mixed_params(i: int) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2,
                              ignore_eos=True)  # fmt: skip
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=100 + i,
                          logprobs=2, ignore_eos=True)  # fmt: skip


@pytest.fixture(scope="module")
def batch(make_engine):
    """32 mixed-length requests as one continuous batch (chunked: 512-token budget)."""
    prompts = random_prompts(NUM, seed=1)
    params = [mixed_params(i) for i in range(NUM)]
    ids = [f"r{i}" for i in range(NUM)]
    engine = make_engine(max_num_batched_tokens=512)
    outs = engine.generate(prompts, params, ids)
    assert engine.stats.num_steps > MAX_TOKENS  # prompts were spread over several steps
    return prompts, params, ids, outs


def same(a: RequestOutput, b: RequestOutput) -> bool:
    return a.new_token_ids == b.new_token_ids and a.new_logprobs == b.new_logprobs


def test_batch_outputs_complete(batch):
    prompts, _, ids, outs = batch
    for rid, prompt, out in zip(ids, prompts, outs, strict=True):
        assert out.request_id == rid and out.finished and out.finish_reason == "length"
        assert len(out.new_token_ids) == MAX_TOKENS == len(out.new_logprobs)
        assert out.num_prompt_tokens == len(prompt)
        assert all(len(lp) in (2, 3) and out.new_token_ids[k] in lp
                   for k, lp in enumerate(out.new_logprobs))  # fmt: skip


@pytest.mark.parametrize("budget", [512, 16, 37])
def test_alone_equals_in_batch_for_any_chunk_size(batch, make_engine, budget):
    prompts, params, ids, outs = batch
    picks = [0, 1, 2, 31] if budget == 512 else [max(range(NUM), key=lambda i: len(prompts[i]))]
    engine = make_engine(max_num_batched_tokens=budget)
    for i in picks:
        alone = engine.generate([prompts[i]], [params[i]], [ids[i]])[0]
        assert same(alone, outs[i]), (i, budget, alone.new_token_ids, outs[i].new_token_ids)


def test_seeded_sampling_resumes_from_output_token_ids(make_engine):
    prompt = random_prompts(1, seed=7, lo=40, hi=41)[0]
    sp = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    full = make_engine().generate([prompt], [sp], ["s"])[0].new_token_ids
    assert len(full) == 64
    fresh = make_engine()
    fresh.add_request("s2", prompt, sp, output_token_ids=full[:30])  # seed given: id irrelevant
    rest = []
    while fresh.has_unfinished_requests():
        for out in fresh.step():
            assert out.index == 30 + len(rest)
            rest.extend(out.new_token_ids)
    assert full[:30] + rest == full


def test_shared_prefix_computes_only_unshared_tokens(make_engine):
    prefix = random_prompts(1, seed=11, lo=1000, hi=1001)[0]
    a = prefix + [501, 502, 503, 504, 505]
    b = prefix + [601, 602, 603, 604, 605, 606, 607]
    sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    engine = make_engine(num_blocks=200)
    engine.generate([a], [sp], ["a"])
    before = engine.stats.num_prompt_tokens_computed
    out_b = engine.generate([b], [sp], ["b"])[0]
    cached = 1000 // 16 * 16  # 62 full pages of the shared prefix
    assert out_b.num_cached_tokens == cached == 992
    assert engine.stats.num_prompt_tokens_computed - before == len(b) - 1 - cached
    uncached = make_engine(num_blocks=200, enable_prefix_caching=False)
    ref = uncached.generate([b], [sp], ["b"])[0]
    assert ref.num_cached_tokens == 0
    assert uncached.stats.num_prompt_tokens_computed == len(b) - 1
    assert same(out_b, ref)


def test_preemption_under_tiny_pool_gives_same_tokens(make_engine):
    # 28-31 prompt tokens (2 blocks) + 12 outputs cross into a third block: with 7 blocks
    # three requests are admitted, then the growing ones must preempt the newest.
    prompts = random_prompts(5, seed=5, lo=28, hi=32)
    params = [mixed_params(i) for i in range(5)]
    for p in params:
        p.max_tokens = 12
    ids = [f"p{i}" for i in range(5)]
    ref = make_engine().generate(prompts, params, ids)
    tiny = make_engine(num_blocks=7)
    outs = tiny.generate(prompts, params, ids)
    assert tiny.scheduler.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) == tiny.scheduler.num_preemptions
    for r, o in zip(ref, outs, strict=True):
        assert same(r, o), (r.request_id, r.new_token_ids, o.new_token_ids)
    assert tiny.pool.num_free_blocks == 7
