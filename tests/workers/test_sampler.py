"""Sampler: exact tokens and values for every processing step, counter-based draws."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.sampler import Sampler, SampleRow, _apply_penalties, uniform


def row(seed: int = 0, index: int = 0, **kw) -> SampleRow:
    fields = {k: kw.pop(k) for k in ("prompt_token_ids", "output_token_ids", "banned_token_ids")
              if k in kw}  # fmt: skip
    return SampleRow(SamplingParams(**kw), seed, index, **fields)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def inverse_cdf(probs: list[float], u: float) -> int:
    """Reference draw: first index whose cumulative probability exceeds u * total."""
    total = sum(probs)
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if acc > u * total:
            return i
    return len(probs) - 1


def test_uniform_depends_only_on_seed_and_index():
    assert uniform(0, 0) == 0.3859926107094097
    assert uniform(1234, 5) == 0.4004222215699482
    assert uniform(7, 0) == 0.0007727454463428707
    assert uniform(7, 1) != uniform(7, 0)


def test_greedy_takes_argmax_first_on_ties():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 0.0, 0.0]])
    out = Sampler()(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert [r.token_id for r in out] == [1, 0]
    assert out[0].logprobs is None


def test_greedy_rows_of_a_whole_vocabulary_take_the_first_maximum():
    """The batched greedy path at a real vocabulary size (49,152) and 32 rows: ties planted
    far apart resolve to the first, as argmax does (the path the engine's steps take)."""
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(0))
    for i, spots in enumerate([(7, 40000), (30000, 49151), (0, 1), (16, 17, 48000)] * 8):
        logits[i, list(spots)] = 100.0 + i % 3
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(32)])
    want = [[7, 30000, 0, 16][i % 4] for i in range(32)]
    assert [r.token_id for r in out] == want == logits.argmax(dim=-1).tolist()


def test_temperature_draw_is_inverse_cdf_of_counter_uniform():
    probs = [0.1, 0.2, 0.3, 0.4]
    sampler = Sampler()
    for seed, index in [(0, 0), (1234, 5), (7, 0), (7, 1), (99, 3)]:
        tok = sampler(logits_of(probs), [row(seed, index, temperature=1.0)])[0].token_id
        assert tok == inverse_cdf(probs, uniform(seed, index)), (seed, index)
    assert sampler(logits_of(probs), [row(7, 0, temperature=1.0)])[0].token_id == 0  # u=0.0008


def test_temperature_rescales_before_draw():
    probs = [0.2, 0.8]
    # temperature 0.5 squares the odds: 0.04 : 0.64
    sharp = [0.04 / 0.68, 0.64 / 0.68]
    u = uniform(3, 0)
    tok = Sampler()(logits_of(probs), [row(3, 0, temperature=0.5)])[0].token_id
    assert tok == inverse_cdf(sharp, u)


def test_top_k_one_is_greedy_and_top_k_renormalises():
    probs = [0.05, 0.5, 0.15, 0.3]
    s = Sampler()
    for seed in range(20):
        assert s(logits_of(probs), [row(seed, 0, top_k=1)])[0].token_id == 1
    # top_k=2 keeps tokens 1 and 3 in descending order: [0.5, 0.3] renormalised
    for seed in range(20):
        want = [1, 3][inverse_cdf([0.5, 0.3], uniform(seed, 0))]
        assert s(logits_of(probs), [row(seed, 0, top_k=2)])[0].token_id == want


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = [0.15, 0.5, 0.05, 0.3]
    s = Sampler()
    # sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05); exclusive cumsum 0, .5, .8, .95
    for seed in range(30):
        u = uniform(seed, 2)
        want = [1, 3][inverse_cdf([0.5, 0.3], u)]
        assert s(logits_of(probs), [row(seed, 2, top_p=0.7)])[0].token_id == want
        want = [1, 3, 0][inverse_cdf([0.5, 0.3, 0.15], u)]
        assert s(logits_of(probs), [row(seed, 2, top_p=0.81)])[0].token_id == want


def test_top_p_over_large_vocab_grows_candidate_set():
    # Flat distribution over 5,000 tokens: top_p=0.9 needs 4,500 of them (> the first top-k).
    vocab = 5000
    logits = torch.zeros(1, vocab)
    seen = {Sampler()(logits, [row(s, 0, top_p=0.9)])[0].token_id for s in range(200)}
    assert max(seen) >= 1000  # candidates beyond the first 256 are reachable
    assert len(seen) > 150


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = [0.6, 0.3, 0.1]
    s = Sampler()
    for seed in range(30):
        want = inverse_cdf([0.6, 0.3, 0.0], uniform(seed, 0))
        assert s(logits_of(probs), [row(seed, 0, min_p=0.2)])[0].token_id == want


def test_penalties_exact_values():
    logits = torch.tensor([3.0, 2.0, -1.0, 1.0])
    r = row(temperature=0.0, repetition_penalty=2.0, prompt_token_ids=[2],
            output_token_ids=[0, 0, 1])  # fmt: skip
    assert _apply_penalties(logits, r).tolist() == [1.5, 1.0, -2.0, 1.0]
    r = row(frequency_penalty=1.0, presence_penalty=0.5, output_token_ids=[0, 0, 1])
    assert _apply_penalties(logits, r).tolist() == [0.5, 0.5, -1.0, 1.0]
    # greedy after penalties picks the unpenalised token 3
    out = Sampler()(
        logits[None],
        [
            row(
                temperature=0.0,
                frequency_penalty=1.0,
                presence_penalty=0.6,
                output_token_ids=[0, 0, 1],
            )
        ],
    )
    assert out[0].token_id == 3


def test_banned_tokens_are_never_drawn():
    probs = [0.97, 0.01, 0.02]
    s = Sampler()
    toks = {s(logits_of(probs), [row(i, 0, banned_token_ids=[0])])[0].token_id
            for i in range(40)}  # fmt: skip
    assert toks == {1, 2}
    assert s(logits_of(probs), [row(temperature=0.0, banned_token_ids=[0])])[0].token_id == 2


def test_logprobs_are_raw_model_logprobs_with_top_n():
    probs = [0.1, 0.6, 0.3]
    lg = logits_of(probs)
    out = Sampler()(lg, [row(temperature=0.0, logprobs=2, repetition_penalty=5.0,
                             prompt_token_ids=[1])])[0]  # fmt: skip
    # the penalty moves the choice to token 2, logprobs stay those of the model
    assert out.token_id == 2
    raw = torch.log_softmax(lg[0], -1)
    assert out.logprobs == {2: raw[2].item(), 1: raw[1].item()}
    assert list(out.logprobs) == [2, 1]
    assert math.isclose(out.logprobs[1], math.log(0.6), rel_tol=1e-6)
    out0 = Sampler()(lg, [row(temperature=0.0, logprobs=0)])[0]
    assert out0.logprobs == {1: raw[1].item()}


def test_batch_rows_equal_single_rows_bitwise():
    torch.manual_seed(0)
    vocab = 49152
    logits = torch.randn(6, vocab) * 4
    rows = [
        row(1, 0, temperature=0.0, logprobs=3),
        row(2, 4, temperature=0.8, top_p=0.9, logprobs=1),
        row(3, 1, temperature=1.0, top_k=50),
        row(4, 9, temperature=0.7, min_p=0.05, repetition_penalty=1.3,
            prompt_token_ids=[5, 6, 7], output_token_ids=[9, 9]),
        row(5, 2, temperature=1.2, presence_penalty=0.4, frequency_penalty=0.2,
            output_token_ids=[1, 2, 3], banned_token_ids=[0]),
        row(6, 0, temperature=0.0, top_k=3),
    ]  # fmt: skip
    s = Sampler()
    batch = s(logits, rows)
    for i, r in enumerate(rows):
        single = s(logits[i : i + 1].clone(), [r])[0]
        assert single.token_id == batch[i].token_id
        assert single.logprobs == batch[i].logprobs


def test_rows_mismatch_raises():
    with pytest.raises(ValueError, match="2 logits rows for 1 sample rows"):
        Sampler()(torch.zeros(2, 4), [row()])
