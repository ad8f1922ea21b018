"""prompt_logprobs in the engine on the real SmolLM2 model: every prompt token's raw logprob,
rank and top-n equal log_softmax of an independent full-prompt forward (the same kernels:
bitwise), whatever the chunking, batching, prefix cache or preemption."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.engine.model_runner import ModelRunner
from kvrelay.workers.engine.scheduler import ScheduledSeq
from kvrelay.workers.engine.sequence import Sequence
from tests.workers.conftest import SeqChunk, run_batch
from tests.workers.test_engine import mixed_params, random_prompts

PAGE = 16
TOP = 3


@pytest.fixture(scope="module")
def make_engine(loaded_model):
    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 160)
        return Engine(EngineConfig(**kw), loaded=loaded_model)

    return make


@pytest.fixture(scope="module")
def prompt(loaded_model):
    tok = loaded_model.tokenizer
    return tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}])


def expected(model, prompt: list[int], n: int, kv_dtype: torch.dtype) -> list[dict]:
    """The entries from one forward of the whole prompt on a fresh pool of the engine's KV
    dtype (all rows' logits)."""
    blocks = list(range(-(-len(prompt) // PAGE)))
    pool = model.allocate_kv_pool(len(blocks), PAGE, kv_dtype)
    logits = run_batch(model, pool, [SeqChunk(blocks, 0, prompt)], PAGE)
    out = [{"token_id": prompt[0], "logprob": None, "rank": None, "top": []}]
    for k in range(1, len(prompt)):
        lp = torch.log_softmax(logits[(0, k - 1)].float(), dim=-1)
        values, ids = torch.topk(lp, n)
        chosen = lp[prompt[k]]
        out.append(
            {
                "token_id": prompt[k],
                "logprob": float(chosen),
                "rank": int((lp >= chosen).sum()),
                "top": [[i, v] for i, v in zip(ids.tolist(), values.tolist(), strict=True)],
            }
        )
    return out


def params(n: int | None = TOP, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=n, **kw)


@pytest.mark.parametrize("budget", [512, 16, 7])  # whole prompt, page-sized and odd chunks
def test_prompt_logprobs_equal_a_full_forward(make_engine, loaded_model, prompt, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    out = engine.generate([prompt], params(), ["a"])[0]
    assert len(prompt) > 2 * PAGE
    assert out.prompt_logprobs == expected(loaded_model.model, prompt, TOP, engine.kv_dtype)
    assert out.prompt_logprobs[1]["rank"] >= 1
    assert len(out.new_token_ids) == 2


def test_prompt_logprobs_zero_has_no_top(make_engine, loaded_model, prompt):
    engine = make_engine()
    out = engine.generate([prompt], params(0), ["z"])[0]
    want = expected(loaded_model.model, prompt, 1, engine.kv_dtype)
    for entry in want:
        entry["top"] = []
    assert out.prompt_logprobs == want


def test_prefix_cache_is_skipped_for_prompt_logprobs(make_engine, prompt):
    engine = make_engine()
    first = engine.generate([prompt], params(), ["c1"])[0]
    again = engine.generate([prompt], params(), ["c2"])[0]
    assert again.num_cached_tokens == 0  # the whole prompt was computed again
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.new_token_ids == first.new_token_ids
    plain = engine.generate([prompt], params(None), ["c3"])[0]
    assert plain.num_cached_tokens == (len(prompt) - 1) // PAGE * PAGE  # the pages were kept
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_alone_equal_batched(make_engine, prompt):
    alone = make_engine().generate([prompt], params(), ["b"])[0]
    others = random_prompts(6, seed=7, lo=5, hi=60)
    prompts = [*others[:3], prompt, *others[3:]]
    ps = [mixed_params(i) for i in range(7)]
    ps[3] = params()
    ps[5] = params(5)
    engine = make_engine(max_num_batched_tokens=64)
    outs = engine.generate(prompts, ps, [f"m{i}" for i in range(7)])
    assert outs[3].prompt_logprobs == alone.prompt_logprobs
    assert outs[3].new_token_ids == alone.new_token_ids
    assert [o.prompt_logprobs is None for o in outs] == [True, True, True, False, True, False, True]
    solo5 = make_engine().generate([prompts[5]], params(5), ["s5"])[0]
    assert outs[5].prompt_logprobs == solo5.prompt_logprobs
    assert len(outs[5].prompt_logprobs) == len(prompts[5])


def test_preemption_keeps_each_prompt_logprob_once(make_engine):
    prompts = random_prompts(5, seed=5, lo=28, hi=32)
    ps = [params(2) for _ in range(5)]
    for p in ps:
        p.max_tokens = 12
    ids = [f"p{i}" for i in range(5)]
    ref = make_engine().generate(prompts, ps, ids)
    tiny = make_engine(num_blocks=7)
    outs = tiny.generate(prompts, ps, ids)
    assert tiny.scheduler.num_preemptions > 0
    for r, o, p in zip(ref, outs, prompts, strict=True):
        assert len(o.prompt_logprobs) == len(p)
        assert o.prompt_logprobs == r.prompt_logprobs
        assert o.new_token_ids == r.new_token_ids


def test_recompute_adds_only_rows_not_collected(loaded_model):
    """A sequence preempted mid-prefill recomputes from 0: only the uncollected rows."""
    runner = ModelRunner(loaded_model.model, loaded_model.model.allocate_kv_pool(4, PAGE), PAGE)
    seq = Sequence("r", list(range(100, 140)), 40, params(), seed=0, block_table=[0, 1, 2])
    seq.prompt_logprobs = [{"token_id": 100}] * 10  # tokens 0..9 collected
    *_, indices, rows = runner.prepare([ScheduledSeq(seq, 20)])
    assert indices.tolist() == list(range(9, 20))  # positions 9..19 predict tokens 10..20
    assert (rows[0].first, rows[0].num_rows, rows[0].start_row) == (10, 11, 0)
    seq.num_computed_tokens = 20
    *_, indices, rows = runner.prepare([ScheduledSeq(seq, 20)])
    # positions 20..38 predict tokens 21..39 (rows 0..18); row 19 samples the first output
    assert indices.tolist() == list(range(0, 20))
    assert (rows[0].first, rows[0].num_rows) == (21, 19)


def test_resumed_request_has_no_prompt_logprobs(make_engine, prompt):
    """Resumed (its first token emitted elsewhere, with the prompt logprobs): neither computed
    again nor sent, and the prefix cache serves it as any other."""
    engine = make_engine()
    engine.generate([prompt], params(None), ["warm"])
    engine.add_request("res", prompt, params(), output_token_ids=[42])
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [o.new_token_ids for o in outs] == [outs[0].new_token_ids]
    assert outs[0].prompt_logprobs is None
    assert outs[0].num_cached_tokens == len(prompt) // PAGE * PAGE
