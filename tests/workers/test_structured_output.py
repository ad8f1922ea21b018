"""Structured output in the engine (SmolLM2 on CPU, fp32): JSON schemas, regex, choice and
grammars constrain the output exactly; a constrained row is batch invariant, resumes from any
token, keeps the model's raw logprobs; grammars are compiled once per spec."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvrelay.core.sampling import SamplingParams
from kvrelay.core.structured import StructuredOutput


@pytest.fixture(scope="module")
def make_engine(loaded_model):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    def make(**kw):
        kw.setdefault("num_blocks", 128)
        kw.setdefault("num_threads", 1)
        return Engine(EngineConfig(dtype="float32", device="cpu", **kw), loaded=loaded_model)

    return make


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def chat(engine, question: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def constrained(kind: str, value=None, **params) -> SamplingParams:
    if kind == "json":
        value = json.dumps(value)
    spec = StructuredOutput(kind, value if value is not None else "", params.pop("ws", False))
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 60)
    return SamplingParams(structured=spec, **params)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
FRUITS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "population": {"type": "integer", "minimum": 0},
            },
            "required": ["name", "population"],
            "additionalProperties": False,
        }
    },
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}},
    "required": ["temperature"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("schema", "question", "expected"),
    [
        (PERSON, "Describe a person as JSON.", '{"name":"Alejandro","age":25}'),
        (COLOR, "Pick a colour. Answer in JSON.", '{"color":"blue"}'),
        (FRUITS, "List three fruits as JSON.", '{"items":["apple","banana","orange"]}'),
        (
            CITY,
            "Give a city and its population as JSON.",
            '{"city":{"name":"Santos","population":1000000}}',
        ),
        (
            WEATHER,
            "What is the temperature in Paris? Answer in JSON.",
            '{"temperature":18.0}',
        ),
    ],
    ids=["required-props", "enum", "array", "nested", "number-range"],
)
def test_json_schema_output_is_valid_and_exact(engine, schema, question, expected):
    out = engine.generate([chat(engine, question)], constrained("json", schema))[0]
    assert out.finish_reason == "stop"  # the grammar ended it: no EOS token
    assert out.output_token_ids[-1] not in engine.tokenizer.eos_token_ids
    assert out.text_delta == expected
    jsonschema.validate(json.loads(out.text_delta), schema)


def test_json_schema_with_whitespace_as_vllm_allows_it(engine):
    out = engine.generate(
        [chat(engine, "Describe a person as JSON.")], constrained("json", PERSON, ws=True)
    )[0]
    assert out.text_delta == '{\n  "name": "Ava",\n  "age": 25\n}'
    jsonschema.validate(json.loads(out.text_delta), PERSON)


def test_regex_choice_grammar_and_json_object(engine):
    phone = r"[0-9]{3}-[0-9]{4}"
    prompt = chat(engine, "Give me a phone number.")
    out = engine.generate([prompt], constrained("regex", phone, max_tokens=20))[0]
    assert (out.finish_reason, out.text_delta) == ("stop", "123-4567")
    assert re.fullmatch(phone, out.text_delta)

    prompt = chat(engine, "Sentiment of: I love it!")
    out = engine.generate([prompt], constrained("choice", ["positive", "negative"]))[0]
    assert (out.finish_reason, out.text_delta) == ("stop", "negative")

    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    prompt = chat(engine, "Is the sky blue?")
    out = engine.generate([prompt], constrained("grammar", lark))[0]
    assert (out.finish_reason, out.text_delta) == ("stop", "The answer is no.")

    gbnf = 'root ::= "Paris" | "London"'  # llama.cpp's GBNF, converted to Lark
    prompt = chat(engine, "What is the capital of France?")
    out = engine.generate([prompt], constrained("grammar", gbnf))[0]
    # the model's first choice, "The", is masked; of "P" and "L" it prefers "L" (135M...)
    assert (out.finish_reason, out.output_token_ids, out.text_delta) == (
        "stop",
        [60, 4221],
        "London",
    )

    prompt = chat(engine, "Give JSON for a cat.")
    sp = constrained("json_object", temperature=0.8, seed=3, max_tokens=80, ws=True)
    out = engine.generate([prompt], sp)[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text_delta), dict)


def test_mixed_batch_equals_each_row_alone(make_engine):
    """A row's tokens do not depend on the other rows, constrained or not (greedy and seeded)."""
    engine = make_engine(max_num_batched_tokens=64)
    prompts = [
        chat(engine, "Describe a person as JSON."),
        chat(engine, "What is the capital of France?"),
        chat(engine, "List three fruits as JSON."),
        chat(engine, "Give me a phone number."),
    ]
    params = [
        constrained("json", PERSON),
        SamplingParams(max_tokens=12, temperature=0.0),
        constrained("json", FRUITS, temperature=0.9, seed=11, ws=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5),
    ]
    batch = engine.generate(prompts, params)
    for prompt, sp, got in zip(prompts, params, batch, strict=True):
        alone = make_engine().generate([prompt], sp)[0]
        assert alone.output_token_ids == got.output_token_ids
        assert alone.text_delta == got.text_delta
    jsonschema.validate(json.loads(batch[2].text_delta), FRUITS)


@pytest.fixture(scope="module")
def fruits(engine):
    """(prompt, sampling, full output) of a seeded, constrained request."""
    prompt = chat(engine, "List three fruits as JSON.")
    sp = constrained("json", FRUITS, temperature=0.9, seed=7, ws=True)
    full = engine.generate([prompt], sp, request_ids=["fruits"])[0]
    assert full.finish_reason == "stop" and len(full.output_token_ids) > 9
    jsonschema.validate(json.loads(full.text_delta), FRUITS)
    return prompt, sp, full


@pytest.mark.parametrize("k", [1, 9])
def test_resume_from_token_k_gives_the_same_tokens(engine, make_engine, fruits, k):
    """A request resumed elsewhere with its first k outputs (as a DecodeTask carries them)
    rebuilds its matcher from them and continues exactly."""
    prompt, sp, full = fruits
    other = make_engine()
    other.add_request("fruits", prompt, sp, output_token_ids=full.output_token_ids[:k])
    rest: list[int] = []
    text = ""
    while other.has_unfinished_requests():
        for out in other.step():
            rest += out.new_token_ids
            text += out.text_delta
            finish = out.finish_reason
    assert full.output_token_ids[:k] + rest == full.output_token_ids
    assert finish == "stop"
    assert text == full.text_delta[len(engine.tokenizer.decode(full.output_token_ids[:k])) :]


def test_raw_logprobs_stay_the_models(engine):
    """logprobs are the model's distribution (vLLM's raw_logprobs), not the masked one."""
    prompt = chat(engine, "What is the capital of France?")
    free = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))
    sp = constrained("choice", ["London", "Rome"], logprobs=3)
    fixed = engine.generate([prompt], sp)[0]
    assert fixed.text_delta in ("London", "Rome")
    first, raw = fixed.new_logprobs[0], free[0].new_logprobs[0]
    assert first == raw  # the model's top 3 with their raw values (the chosen "L" among them)
    # "The" (504) scores higher but the grammar masks it: "L" (60) is taken with its raw score
    assert fixed.output_token_ids[0] == 60 and raw[60] < raw[504]


def test_grammar_compiled_once_per_spec(make_engine):
    engine = make_engine()
    prompt = chat(engine, "Pick a colour. Answer in JSON.")
    first = engine.generate([prompt, prompt], [constrained("json", COLOR)] * 2)
    assert (engine.grammars.num_misses, engine.grammars.num_hits) == (1, 1)
    again = engine.generate([prompt], constrained("json", COLOR))[0]
    assert (engine.grammars.num_misses, engine.grammars.num_hits) == (1, 2)
    assert again.output_token_ids == first[0].output_token_ids == first[1].output_token_ids
    spec = StructuredOutput("json", json.dumps(COLOR))
    assert engine.grammars.submit(spec) is engine.grammars.submit(spec)
    engine.generate([prompt], constrained("json", COLOR, ws=True))  # another spec
    assert engine.grammars.num_misses == 2


def test_a_grammar_that_does_not_compile_or_fit_ends_with_error(make_engine):
    engine = make_engine()
    prompt = chat(engine, "Hi")
    bad = constrained("regex", "a(b")  # the ingress refuses it; an engine given it anyway
    out = engine.generate([prompt], bad)[0]
    assert (out.finish_reason, out.output_token_ids) == ("error", [])
    digits = constrained("regex", "[0-9]+", max_tokens=8)
    letters = engine.tokenizer.encode("abc")
    engine.add_request("misfit", prompt, digits, output_token_ids=letters)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [
        ("misfit", "error", [])
    ]
