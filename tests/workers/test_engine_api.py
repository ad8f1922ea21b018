"""Engine API on the real model: stops, text deltas, handoff/resume, abort, bad input."""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.modelref import ModelNotFoundError
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.errors import EngineError, InvalidRequestError

# Greedy answer of SmolLM2-135M-Instruct to the chat "What is the capital of France?"
ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." <eos>
TEXT = "The capital of France is Paris."


@pytest.fixture(scope="module")
def engine(loaded_model):
    return Engine(EngineConfig(num_blocks=64, max_model_len=512), loaded=loaded_model)


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, "temperature": 0.0, **kw})


def stream(engine: Engine, rid: str, prompt: list[int], sp: SamplingParams, **kw):
    engine.add_request(rid, prompt, sp, **kw)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_greedy_answer_streams_text_deltas(engine, prompt):
    outs = stream(engine, "g", prompt, greedy())
    assert [t for o in outs for t in o.new_token_ids] == ANSWER
    # each output starts where the last ended (a verified draft gives several tokens)
    assert [o.index for o in outs] == [sum(len(p.new_token_ids) for p in outs[:i]) for i in
                                       range(len(outs))]  # fmt: skip
    assert "".join(o.text_delta for o in outs) == TEXT
    last = outs[-1]
    assert (last.finished, last.finish_reason, last.stop_reason) == (True, "stop", None)
    assert last.output_token_ids == ANSWER and last.num_prompt_tokens == len(prompt)
    assert not any(o.finished for o in outs[:-1])
    assert engine.pool.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(
    ("kw", "tokens", "text", "reason", "stop_reason"),
    [
        ({"stop": ["France"]}, ANSWER[:4], "The capital of ", "stop", "France"),
        ({"stop": ["France"], "include_stop_str_in_output": True}, ANSWER[:4],
         "The capital of France", "stop", "France"),
        ({"stop": ["xyz", "al of"]}, ANSWER[:3], "The capit", "stop", "al of"),
        ({"stop_token_ids": [7042]}, ANSWER[:6], "The capital of France is", "stop", 7042),
        ({"max_tokens": 3}, ANSWER[:3], "The capital of", "length", None),
        ({"ignore_eos": True, "max_tokens": 8}, ANSWER, TEXT, "length", None),
    ],
)  # fmt: skip
def test_stop_conditions(engine, prompt, kw, tokens, text, reason, stop_reason):
    outs = stream(engine, "s", prompt, greedy(**kw))
    assert [t for o in outs for t in o.new_token_ids] == tokens
    assert "".join(o.text_delta for o in outs) == text
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (reason, stop_reason)


def test_stop_string_is_never_partially_streamed(engine, prompt):
    outs = stream(engine, "b", prompt, greedy(stop=["Paris."]))
    deltas = [o.text_delta for o in outs]
    assert "".join(deltas) == "The capital of France is "
    assert all("Paris" not in d for d in deltas)


def test_min_tokens_masks_eos(engine, prompt):
    outs = stream(engine, "m", prompt, greedy(min_tokens=10, max_tokens=10))
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 10 and tokens[:7] == ANSWER[:7] and 2 not in tokens
    assert outs[-1].finish_reason == "length"


def test_logprobs_greedy_choice_is_top(engine, prompt):
    outs = stream(engine, "l", prompt, greedy(logprobs=3, max_tokens=4))
    for o in outs:
        (lp,) = o.new_logprobs
        assert len(lp) == 3 and max(lp.values()) == lp[o.new_token_ids[0]] < 0


def test_handoff_then_resume_elsewhere(engine, loaded_model, prompt):
    outs = stream(engine, "h", prompt, greedy(), handoff_after=1)
    assert len(outs) == 1
    first = outs[0]
    assert first.handoff and not first.finished and first.finish_reason is None
    assert first.new_token_ids == ANSWER[:1] and first.output_token_ids == ANSWER[:1]
    assert not engine.has_unfinished_requests()
    other = Engine(EngineConfig(num_blocks=16), loaded=loaded_model)
    rest = stream(other, "h", prompt, greedy(), output_token_ids=first.output_token_ids)
    assert [t for o in rest for t in o.new_token_ids] == ANSWER[1:]
    assert first.text_delta + "".join(o.text_delta for o in rest) == TEXT
    assert rest[0].index == 1


def test_resume_inside_a_multibyte_character_loses_and_repeats_no_text(engine, loaded_model):
    """Japanese output: most tokens carry part of a character's UTF-8 bytes. Handing off after
    any token (the next worker replays the outputs) gives exactly the uninterrupted text."""
    chat = [{"role": "user", "content": "Translate 'good morning' into Japanese and Chinese."}]
    jp = engine.tokenizer.apply_chat_template(chat)
    sp = greedy(max_tokens=12)
    full = stream(engine, "jp", jp, sp)
    tokens = [t for o in full for t in o.new_token_ids]
    text = "".join(o.text_delta for o in full)
    assert text == "わら・わら・"  # 12 tokens: every character spans two or three of them
    assert any(o.text_delta == "" for o in full)  # tokens that end inside a character
    other = Engine(EngineConfig(num_blocks=16), loaded=loaded_model)
    for k in range(1, len(tokens)):
        head = stream(engine, f"jp{k}", jp, sp, handoff_after=k)
        assert [t for o in head for t in o.new_token_ids] == tokens[:k]
        rest = stream(other, f"jp{k}", jp, sp, output_token_ids=tokens[:k])
        assert [t for o in rest for t in o.new_token_ids] == tokens[k:]
        sent = "".join(o.text_delta for o in head)
        assert sent + "".join(o.text_delta for o in rest) == text, k


def test_resume_sends_the_text_a_dead_worker_held_back(engine, loaded_model, prompt):
    """A worker that died held back a possible stop-string prefix: the client has fewer
    characters than the resumed tokens decode to, and the next worker sends the rest."""
    sp = greedy(stop=["Paris!"])
    first = stream(engine, "s", prompt, sp, handoff_after=5)  # stands in for the dead worker
    tokens = [t for o in first for t in o.new_token_ids]
    assert tokens == ANSWER[:5]
    assert "".join(o.text_delta for o in first) == "The capital of France is"
    other = Engine(EngineConfig(num_blocks=16), loaded=loaded_model)
    sent = "The capital of Fr"  # what reached out:{id} before the crash (the rest held back)
    rest = stream(other, "s", prompt, sp, output_token_ids=tokens, emitted_text_len=len(sent))
    assert sent + "".join(o.text_delta for o in rest) == TEXT


def test_abort_frees_blocks(engine, prompt):
    engine.add_request("x", prompt, greedy())
    engine.step()
    out = engine.abort_request("x")
    assert out.finished and out.finish_reason == "cancelled" and out.new_token_ids == []
    assert engine.abort_request("x") is None
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(
    ("prompt_ids", "sp", "kw", "match", "param"),
    [
        ([], greedy(), {}, "prompt is empty", "prompt"),
        ([1, 49152], greedy(), {}, r"token id 49152 is outside the vocabulary \(size 49152\)",
         "prompt"),
        ([1, -1], greedy(), {}, "token id -1", "prompt"),
        ([1, "a"], greedy(), {}, "token id 'a'", "prompt"),
        ([1] * 512, greedy(), {}, r"context length is 512 tokens\. However, you requested 528 "
         r"tokens \(512 in the prompt, 16 in the completion\)", "prompt"),
        ([1] * 500, greedy(max_tokens=20), {}, "maximum context length is 512", "max_tokens"),
        ([1], greedy(temperature=-1.0), {}, "temperature must be in", "temperature"),
        ([1], greedy(top_p=0.0), {}, "top_p must be in", "top_p"),
        ([1], greedy(stop_token_ids=[10**6]), {}, "invalid token id", "stop_token_ids"),
        ([1], greedy(), {"handoff_after": 0}, "handoff_after must be >= 1", "handoff_after"),
        ([1], greedy(max_tokens=2), {"output_token_ids": [5, 6]}, "already given",
         "output_token_ids"),
        ([1], greedy(max_tokens=100), {"output_token_ids": [5, 10**6]}, "token id 1000000",
         "output_token_ids"),
    ],
)  # fmt: skip
def test_bad_requests_raise_invalid_request(engine, prompt_ids, sp, kw, match, param):
    with pytest.raises(InvalidRequestError, match=match) as info:
        engine.add_request("bad", prompt_ids, sp, **kw)
    assert info.value.param == param
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_and_pool_too_small(engine, loaded_model, prompt):
    engine.add_request("dup", prompt, greedy())
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request("dup", prompt, greedy())
    with pytest.raises(EngineError, match="needs an idle engine"):
        engine.generate([prompt], greedy())
    engine.abort_request("dup")
    small = Engine(EngineConfig(num_blocks=2), loaded=loaded_model)
    with pytest.raises(InvalidRequestError, match="needs up to 4 KV blocks but the engine has 2"):
        small.add_request("big", list(range(40)), greedy(max_tokens=20))


def test_unknown_model_and_threads(loaded_model):
    with pytest.raises(ModelNotFoundError):
        Engine(EngineConfig(model="no-such-model-xyz"))
    before = torch.get_num_threads()
    try:
        Engine(EngineConfig(num_blocks=1, num_threads=1), loaded=loaded_model)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_penalties_reach_the_sampler(engine, prompt):
    sp = greedy(max_tokens=12, ignore_eos=True, repetition_penalty=1.5, presence_penalty=1.0)
    plain = engine.generate([prompt], greedy(max_tokens=12, ignore_eos=True))[0]
    a, b = engine.generate([prompt, prompt], [sp, sp])
    assert a.new_token_ids == b.new_token_ids != plain.new_token_ids
    assert len(set(a.new_token_ids)) > len(set(plain.new_token_ids))
