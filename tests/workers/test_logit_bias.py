"""logit_bias on the real model: forcing and banning tokens, resume, batch invariance, checks."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.messages import DecodeTask, MessageError
from kvrelay.core.sampling import InvalidSamplingParams, SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.engine.sampler import Sampler, SampleRow
from kvrelay.workers.errors import InvalidRequestError

# Greedy answer of SmolLM2-135M-Instruct to the chat "What is the capital of France?"
ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." <eos>
DOT = 30  # "."
# greedy with the first greedy token (504, "The") banned
BANNED = [60, 23, 39614, 1141, 552, 28, 2618, 2828]  # "L'Étoile, la Mar"
# temperature 0.8, seed 3, 504 banned: 12 tokens
SAMPLED = [15319, 2849, 1558, 367, 4649, 28, 339, 2971, 313, 30, 7042, 314]


@pytest.fixture(scope="module")
def engine(loaded_model):
    return Engine(EngineConfig(num_blocks=64, max_model_len=512), loaded=loaded_model)


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **kw})


def run(engine, prompt, sp, rid="r", **kw) -> list[int]:
    engine.add_request(rid, prompt, sp, **kw)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_plus_100_forces_the_token_every_step(engine, prompt):
    assert run(engine, prompt, greedy()) == ANSWER
    assert run(engine, prompt, greedy(logit_bias={DOT: 100.0})) == [DOT] * 8


def test_minus_100_bans_the_greedy_token(engine, prompt):
    assert run(engine, prompt, greedy(logit_bias={ANSWER[0]: -100.0})) == BANNED
    assert engine.tokenizer.decode(BANNED) == "L'Étoile, la Mar"


def test_sampled_request_with_bias_resumes_identically(engine, prompt):
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logit_bias={504: -100.0})
    assert run(engine, prompt, sp) == SAMPLED
    # resumed after 4 tokens (another worker, a claimed entry): the same continuation
    assert run(engine, prompt, sp, "resumed", output_token_ids=SAMPLED[:4]) == SAMPLED[4:]


def test_bias_is_batch_invariant(engine, prompt):
    other = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    outs = engine.generate(
        [other, prompt, other],
        [greedy(), greedy(logit_bias={ANSWER[0]: -100.0}), greedy(logit_bias={DOT: 100.0})],
    )
    assert outs[1].output_token_ids == BANNED
    assert outs[2].output_token_ids == [DOT] * 8


def test_sampler_adds_bias_before_penalties_and_keeps_raw_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    biased = SamplingParams(temperature=0.0, logprobs=1, logit_bias={1: -2.5, 3: 2.0})
    plain = SamplingParams(temperature=0.0, logprobs=1)
    [res] = Sampler()(logits, [SampleRow(biased, seed=1, index=0)])
    [ref] = Sampler()(logits, [SampleRow(plain, seed=1, index=0)])
    assert (ref.token_id, res.token_id) == (1, 3)  # 0.5 + 2.0 beats 2.0 and 3.0 - 2.5
    raw = torch.log_softmax(logits[0], dim=-1)
    assert res.logprobs == {3: float(raw[3]), 1: float(raw[1])}  # the model's, not the bias's
    # a repetition penalty divides the biased logit (the bias comes first, as in vLLM)
    both = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={3: 2.0})
    row = SampleRow(both, seed=1, index=0, output_token_ids=[3, 1])
    assert Sampler()(logits, [row])[0].token_id == 2  # 2.5/2 and 3.0/2 lose to 2.0


def test_out_of_vocab_ids_are_refused(engine, prompt):
    sp = greedy(logit_bias={5: 1.0, 49152: 1.0, -1: 2.0})
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, sp)
    assert info.value.param == "logit_bias"
    assert str(info.value) == (
        "token_id(s) [-1, 49152] in logit_bias contain out-of-vocab token ids. "
        "Vocabulary size: 49152"
    )


@pytest.mark.parametrize(
    "bias", [{1: 100.5}, {1: -101}, {1: float("nan")}, {1: True}, {"1": 1.0}, {True: 1.0}, [1]]
)
def test_invalid_values_are_refused(bias):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(logit_bias=bias).validate()
    assert info.value.param == "logit_bias"


def test_bias_rides_in_the_task():
    task = DecodeTask(
        request_id="r", prompt_token_ids=[1, 2], sampling=greedy(logit_bias={7: -100, 9: 2.5})
    )
    back = DecodeTask.decode(task.encode())
    assert back.sampling.logit_bias == {7: -100.0, 9: 2.5}
    assert back == task
    task.sampling.logit_bias = {7: 300.0}
    with pytest.raises(MessageError, match="logit_bias must map token ids"):
        DecodeTask.decode(task.encode())
