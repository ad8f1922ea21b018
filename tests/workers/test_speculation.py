"""Speculative decoding never changes the output: prompt-lookup drafts, verification, the
draft-length rule, and 100 requests token-, logprob- and text-identical to plain decoding."""

from __future__ import annotations

import math

import pytest

from kvrelay.core.enums import Quantization, Speculation
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.ngram import NgramIndex
from kvrelay.workers.engine.sequence import SpecState
from kvrelay.workers.engine.speculator import (
    CPU_STEP_OVERHEAD_BYTES,
    Speculator,
    StepCost,
    default_free_rows,
    default_row_cost,
    fixed_step_bytes,
    resolve_speculation,
)
from kvrelay.workers.model.config import ModelConfig

from .conftest import quantized_engine_factory

make_engine = quantized_engine_factory("int8-weight-only")  # `kvrelay up`'s CPU default

# ---- prompt lookup ---------------------------------------------------------------------------


def test_ngram_index_proposes_what_followed_the_longest_latest_match() -> None:
    index = NgramIndex(2, 4)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    # suffix 4-gram (3, 1, 2, 3)? no; 3-gram (1, 2, 3) ends at 2 -> followed by 4, 9, 2
    assert index.propose(tokens, 3) == [4, 9, 2]
    tokens.append(4)  # suffix (2, 3, 4) at 1..3, then (1, 2, 3, 4) at 0..3
    assert index.propose(tokens, 2) == [9, 2]
    tokens.append(7)  # (4, 7) never occurred, 1-grams are below min_n
    assert index.propose(tokens, 5) == []
    assert index.propose(tokens, 0) == []


def test_ngram_index_prefers_the_latest_occurrence_and_stops_at_the_end() -> None:
    index = NgramIndex(1, 2)
    tokens = [5, 6, 7, 5, 6, 8, 5, 6]
    assert index.propose(tokens, 4) == [8, 5, 6]  # latest (5, 6) ends at 4
    assert NgramIndex(1, 1).propose([3, 3, 3], 5) == [3]  # follows the match at 1: just one


def test_ngram_index_is_incremental() -> None:
    tokens = [1, 2, 1, 2, 1]
    incremental = NgramIndex(1, 3)
    seen = []
    for t in [2, 1, 2, 3, 1, 2]:
        tokens.append(t)
        seen.append(incremental.propose(tokens, 3))
    fresh = [NgramIndex(1, 3).propose(tokens[: 6 + i], 3) for i in range(6)]
    assert seen == fresh
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


# ---- the draft-length rule -------------------------------------------------------------------


def test_draft_length_follows_acceptance_and_batch_size() -> None:
    spec = Speculator(drafter=None, max_draft=6, cost=StepCost(0.05), max_model_len=100)  # type: ignore[arg-type]
    one = 0.05 / 1.05  # threshold at one decoding sequence
    assert spec._worth(0.5, one) == 4  # 0.5 ** 4 = 0.0625 > 0.0476 > 0.5 ** 5
    assert spec._worth(0.9, one) == 6  # capped
    assert spec._worth(1.0, one) == 6
    assert spec._worth(0.04, one) == 0
    many = 0.05 * 32 / (1 + 0.05 * 32)  # 32 decoding sequences: 0.615
    assert spec._worth(0.5, many) == 0
    assert spec._worth(0.9, many) == 4  # 0.9 ** 4 = 0.656, 0.9 ** 5 = 0.590
    assert spec._worth(0.9, 0.66) == 3  # 0.9 ** 4 = 0.6561 is not above 0.66


def test_step_cost_without_context_or_free_rows_is_the_plain_rule() -> None:
    plain = StepCost(row_cost=0.05)
    assert plain.threshold(1, 10_000, 0.0) == pytest.approx(0.05 / 1.05)
    assert plain.threshold(32, 0, 0.0) == pytest.approx(0.05 * 32 / (1 + 0.05 * 32))
    assert plain.threshold(4, 0, 0.2) == pytest.approx((0.05 * 4 + 0.2) / (1 + 0.05 * 4))


def test_step_cost_counts_context_and_free_rows() -> None:
    # F = 1,000 bytes, 10 bytes per token: 300 tokens of context cost 3 T0
    cost = StepCost(row_cost=0.04, free_rows=32, fixed_bytes=1000.0, kv_bytes_per_token=10)
    assert cost.threshold(8, 0, 0.0) == pytest.approx(0.04 * 8)  # all 8 rows are free
    assert cost.threshold(8, 300, 0.0) == pytest.approx(0.04 * 8 / 4)
    assert cost.threshold(40, 300, 0.0) == pytest.approx(0.04 * 40 / (1 + 0.04 * 8 + 3))
    # long contexts make drafts pay where the plain rule (0.25 per row) would draft nothing
    spec = Speculator(drafter=None, max_draft=6, cost=cost, max_model_len=100)  # type: ignore[arg-type]
    old = Speculator(drafter=None, max_draft=6, cost=StepCost(0.25), max_model_len=100)  # type: ignore[arg-type]
    assert old.cost.threshold(8, 300, 0.0) == pytest.approx(2 / 3)
    assert old._worth(0.6, old.cost.threshold(8, 300, 0.0)) == 0
    assert spec._worth(0.6, spec.cost.threshold(8, 300, 0.0)) == 4  # 0.6 ** 4 = 0.13 > 0.08
    assert spec.row_cost == 0.04


def test_default_costs_by_device_and_quantization() -> None:
    assert default_row_cost("cpu") == 0.25
    assert default_row_cost("cpu", Quantization.INT8_WEIGHT_ONLY) == 0.25
    assert default_row_cost("cpu", Quantization.W8A16) == 0.04
    assert default_row_cost("cuda", Quantization.NONE) == 0.01
    assert default_free_rows("cpu", Quantization.W8A16) == 32
    assert default_free_rows("cpu", Quantization.Q8_0) == 0
    assert default_free_rows("cuda", Quantization.NONE) == 0
    smollm2 = ModelConfig(model_type="llama", hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          vocab_size=49152, max_position_embeddings=8192)  # fmt: skip
    weights = 30 * (576 * 15 * 64 + 9 * 64 * 576 + 3 * 576 * 1536) + 49152 * 576
    assert weights == 134_479_872
    assert fixed_step_bytes(smollm2, Quantization.W8A16, 4) == weights + CPU_STEP_OVERHEAD_BYTES
    assert fixed_step_bytes(smollm2, Quantization.NONE, 4) == 4 * weights + CPU_STEP_OVERHEAD_BYTES
    assert fixed_step_bytes(smollm2, Quantization.FP16, 4) == 2 * weights + CPU_STEP_OVERHEAD_BYTES


def test_acceptance_estimate_learns_and_drifts_back() -> None:
    s = SpecState()
    assert s.acceptance == 0.5
    s.record(4, 4, rejected=False)
    assert s.acceptance == pytest.approx((0.9 + 4) / (1.8 + 4))
    for _ in range(30):
        s.record(4, 0, rejected=True)
    low = s.acceptance
    assert low < 0.05
    for _ in range(40):
        s.idle()
    assert low < s.acceptance < 0.5
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_verifications) == (124, 4, 31)


def test_resolve_speculation() -> None:
    assert resolve_speculation("auto", None) is Speculation.NGRAM
    assert resolve_speculation("auto", "some-draft") is Speculation.DRAFT
    assert resolve_speculation("off", "some-draft") is Speculation.OFF
    with pytest.raises(ValueError, match="needs a draft model"):
        resolve_speculation("draft", None)
    with pytest.raises(ValueError, match="one of auto, off, ngram, draft"):
        resolve_speculation("eagle", None)


# ---- identical outputs -----------------------------------------------------------------------

PASSAGE = (
    "The harbor master keeps a ledger of every ship that enters the bay. Each entry lists the "
    "ship's name, its cargo, the hour it arrived and the berth it was given. On stormy nights "
    "the ledger fills quickly, because fishing boats come in early and the ferries wait in the "
    "channel until the wind drops."
)
CODE = """def total_weight(items):
    total = 0
    for item in items:
        if item.weight is None:
            continue
        total = total + item.weight * item.count
    return total


def heaviest(items):
    best = None
    for item in items:
        if best is None or item.weight > best.weight:
            best = item
    return best
"""
TASKS = [
    ("chat", "Repeat this text exactly, word for word:\n\n" + PASSAGE),
    ("chat", "Rewrite this code with type hints, changing nothing else:\n\n" + CODE),
    ("chat", "Summarise in two sentences:\n\n" + PASSAGE),
    ("chat", "Write a short poem about the sea."),
    ("chat", "List five colours, one per line."),
    ("text", CODE + "\n\ndef lightest(items):\n"),
    ("text", PASSAGE + " The harbor master"),
    ("text", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
    ("text", "Once upon a time"),
    ("chat", "Translate to French: The harbor is quiet tonight."),
]


def _params(i: int) -> SamplingParams:
    """Greedy and seeded sampling with stops, penalties and max_tokens at draft boundaries."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=i),
        dict(temperature=0.7, top_p=0.9, seed=1000 + i),
        dict(temperature=1.0, top_k=20, seed=7 * i),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.0, stop=["ledger", "\n\n"]),
        dict(temperature=0.0, repetition_penalty=1.2),
        dict(temperature=0.9, seed=i, frequency_penalty=0.5, presence_penalty=0.3, logprobs=2),
        dict(temperature=0.0, min_tokens=5, stop=["."], include_stop_str_in_output=True),
        dict(temperature=0.6, seed=i, min_p=0.05, stop_token_ids=[30]),
    ]
    kw = kinds[i % len(kinds)]
    max_tokens = [1, 2, 3, 7, 8, 13, 40, 64][i % 8]
    kw["min_tokens"] = min(kw.get("min_tokens", 0), max_tokens)
    return SamplingParams(max_tokens=max_tokens, **kw)


def _prompts(engine) -> list[list[int]]:
    out = []
    for kind, text in TASKS:
        if kind == "chat":
            out.append(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        else:
            out.append(engine.tokenizer.encode(text))
    return out


def _run(engine, prompts, params) -> list[tuple]:
    outs = engine.generate(prompts, params, request_ids=[f"r{i}" for i in range(len(prompts))])
    return [
        (o.new_token_ids, o.new_logprobs, o.text_delta, o.finish_reason, o.stop_reason)
        for o in outs
    ]


def _requests(engine, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = _prompts(engine)
    return [prompts[i % len(prompts)] for i in range(n)], [_params(i) for i in range(n)]


def test_100_requests_identical_with_and_without_speculation(make_engine) -> None:
    plain = make_engine(speculation="off", num_blocks=512, kv_cache_dtype="auto")
    prompts, params = _requests(plain, 100)
    expected = _run(plain, prompts, params)
    # Forced drafting (every row "free") exercises verification on every step; the default
    # rule drafts where it pays.
    for row_cost in (1e-9, 0.0):
        spec = make_engine(
            speculation="ngram", spec_row_cost=row_cost, num_blocks=512, kv_cache_dtype="auto"
        )
        assert _run(spec, prompts, params) == expected
        assert spec.stats.num_generated_tokens == plain.stats.num_generated_tokens
        assert spec.stats.num_accepted_tokens > 0
        assert spec.stats.num_steps < plain.stats.num_steps
    assert plain.stats.num_draft_tokens == 0


def test_copying_is_verified_several_tokens_per_step(make_engine) -> None:
    """A verbatim copy accepts long drafts: far fewer steps than tokens."""
    plain = make_engine(speculation="off")
    spec = make_engine(speculation="ngram")
    prompt = _prompts(plain)[0]
    p = SamplingParams(max_tokens=48, temperature=0.0)
    expected = plain.generate([prompt], p)[0]
    out = spec.generate([prompt], p)[0]
    assert out.new_token_ids == expected.new_token_ids and out.text_delta == expected.text_delta
    s = spec.stats
    assert s.num_generated_tokens == 48
    assert s.num_steps <= 24  # prefill + verification steps
    assert s.num_accepted_tokens >= 30
    m = out.metrics
    assert (m["num_draft_tokens"], m["num_accepted_tokens"], m["num_verifications"]) == (
        s.num_draft_tokens,
        s.num_accepted_tokens,
        s.num_verifications,
    )


def test_identical_under_preemption_and_a_tiny_token_budget(make_engine) -> None:
    plain = make_engine(speculation="off", num_blocks=512)
    short = [plain.tokenizer.encode(t) for k, t in TASKS[7:] if k == "text"]
    prompts = [short[i % len(short)] for i in range(8)]
    params = [_params(i) for i in range(8)]
    for p in params:
        p.max_tokens, p.min_tokens = 40, 0
    expected = _run(plain, prompts, params)
    # 8 blocks of 16 tokens hold the prompts, not 8 requests' outputs: the growing ones are
    # preempted and recomputed. A budget of 5 tokens a step cuts drafts short.
    tight = make_engine(speculation="ngram", spec_row_cost=1e-9, num_blocks=8)
    assert _run(tight, prompts, params) == expected
    assert tight.scheduler.num_preemptions > 0 and tight.stats.num_accepted_tokens > 0
    small = make_engine(speculation="ngram", spec_row_cost=1e-9, max_num_batched_tokens=5)
    assert _run(small, prompts, params) == expected
    assert small.stats.num_accepted_tokens > 0


def test_resume_mid_output_is_identical(make_engine) -> None:
    """A request resumed with its first outputs (a decode worker taking over) drafts from
    them and continues exactly as the uninterrupted run."""
    plain = make_engine(speculation="off")
    prompt = _prompts(plain)[1]
    for p in (SamplingParams(max_tokens=40, temperature=0.0),
              SamplingParams(max_tokens=40, temperature=0.8, seed=5)):  # fmt: skip
        full = plain.generate([prompt], p)[0].new_token_ids
        spec = make_engine(speculation="ngram", spec_row_cost=1e-9)
        spec.add_request("r", prompt, p, output_token_ids=full[:17])
        rest = []
        while spec.has_unfinished_requests():
            for out in spec.step():
                assert out.index == 17 + len(rest)
                rest.extend(out.new_token_ids)
        assert full[:17] + rest == full


def test_fp32_kv_pages_identical(make_engine) -> None:
    plain = make_engine(speculation="off")
    spec = make_engine(speculation="ngram", spec_row_cost=1e-9)
    prompts, params = _requests(plain, 20)
    assert _run(spec, prompts, params) == _run(plain, prompts, params)


def test_off_drafts_nothing_and_bad_settings_are_refused(make_engine) -> None:
    eng = make_engine(speculation="off")
    assert eng.speculator is None
    with pytest.raises(ValueError, match="max_draft"):
        make_engine(num_speculative_tokens=0)
    assert math.isclose(make_engine().speculator.row_cost, 0.25)


def test_a_cpu_engine_prices_context(make_engine) -> None:
    eng = make_engine()
    cost = eng.speculator.cost
    per_token = 30 * 2 * 3 * 64 * eng.kv_dtype.itemsize  # layers x K and V x heads x dims
    assert cost.kv_bytes_per_token == eng.kv_bytes_per_token == per_token
    assert cost.fixed_bytes == fixed_step_bytes(eng.loaded.config, "int8-weight-only", 4)
    assert cost.free_rows == 0
