"""Structured output at the grammar engine's limits (SmolLM2 on CPU, fp32): a matcher that
fails mid-answer (a parser row of more than 2,000 items, reached only after some tokens) fails
the request with "error" and outputs nothing that breaks the constraint; a choice of more than
2,000 strings is one lexeme and is answered; JSON is compact unless asked otherwise, and a
whitespace_pattern is what the whitespace between tokens matches."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest

from kvrelay.core.sampling import SamplingParams
from kvrelay.core.structured import StructuredOutput, grammar_error

# three digits, a dot, then a rule of 3,000 alternatives: the parser row that predicts it has
# 3,001 items, and llguidance refuses rows of more than 2,000 once the dot is consumed
BIG = " | ".join(f'" x{i}"' for i in range(3000))
LATE_LIMIT = f'start: /[0-9]{{3}}/ "." big\nbig: {BIG}\n'
ROW_ERROR = (
    "Parser Error: Current row has 3001 items; max is 2000; consider making your grammar "
    "left-recursive if it's right-recursive"
)
THREE_DIGITS = StructuredOutput("regex", "[0-9]{3}")
CHOICES = StructuredOutput("choice", [f"item{i}" for i in range(2001)])
SENTIMENT = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "stars"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(loaded_model):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    config = EngineConfig(dtype="float32", device="cpu", num_blocks=128, num_threads=1)
    return Engine(config, loaded=loaded_model)


def chat(engine, question: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def sampling(spec: StructuredOutput, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec)


def test_a_matcher_error_mid_answer_fails_the_request(engine, caplog):
    """The digits are output; the dot, on which the matcher fails, is not; the request ends
    "error" (the client gets a 500), not "stop" with text that breaks the grammar."""
    spec = StructuredOutput("grammar", LATE_LIMIT)
    assert grammar_error(spec) == f"the grammar engine cannot follow it: {ROW_ERROR}"
    engine.add_request("late", chat(engine, "Give me a number."), sampling(spec))
    outs = []
    with caplog.at_level(logging.WARNING, logger="kvrelay.workers.engine.llm_engine"):
        while engine.has_unfinished_requests():
            outs += engine.step()
    digits = engine.tokenizer.encode("123")
    assert [(o.new_token_ids, o.text_delta, o.finish_reason) for o in outs] == [
        (digits[:1], "1", None),
        (digits[1:2], "2", None),
        (digits[2:], "3", None),
        ([], "", "error"),  # "." fails the matcher: it is not output
    ]
    final = outs[-1]
    assert (final.finished, final.output_token_ids, final.index) == (True, digits, 3)
    assert [r.getMessage() for r in caplog.records if r.name.endswith("llm_engine")] == [
        f"request late: the structured output constraint failed: {ROW_ERROR}"
    ]
    assert not engine.has_unfinished_requests()
    # the failure was the request's, not the loop's: the engine goes on serving
    [out] = engine.generate([chat(engine, "Give me a number.")], sampling(THREE_DIGITS))
    assert (out.finish_reason, out.text_delta) == ("stop", "123")


def test_a_choice_of_2001_strings_is_answered_with_one_of_them(engine):
    """Before, the 2,001 alternatives were one parser row: the matcher failed on the first
    token and the answer was "item", finish "stop"."""
    assert grammar_error(CHOICES) is None
    [out] = engine.generate([chat(engine, "Pick an item.")], sampling(CHOICES))
    assert (out.finish_reason, out.text_delta) == ("stop", "item1")


def test_json_is_compact_by_default_and_any_whitespace_on_request(engine):
    prompt = chat(engine, "Classify the sentiment of 'I love it' as JSON.")
    schema = json.dumps(SENTIMENT)
    [out] = engine.generate([prompt], sampling(StructuredOutput("json", schema, False)))
    assert (out.finish_reason, out.text_delta) == ("stop", '{"sentiment":"positive","stars":1}')
    assert "\n" not in out.text_delta
    # vLLM's default (disable_any_whitespace: false): the model may put any whitespace there
    [out] = engine.generate([prompt], sampling(StructuredOutput("json", schema, True)))
    assert (out.finish_reason, out.text_delta) == (
        "stop",
        '{\n  "sentiment": "positive",\n  "stars": 1\n}',
    )


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("[ ]?", '{ "sentiment": "positive" ,"stars": 2 }'),
        (r"(\n[ ]{0,4})?", '{\n  "sentiment":\n    "positive"\n,\n"stars":\n 1\n}'),
    ],
    ids=["one-space", "newline-indent"],
)
def test_whitespace_pattern_is_what_the_whitespace_matches(engine, pattern, expected):
    prompt = chat(engine, "Classify the sentiment of 'I love it' as JSON.")
    spec = StructuredOutput("json", json.dumps(SENTIMENT), False, pattern)
    [out] = engine.generate([prompt], sampling(spec))
    assert (out.finish_reason, out.text_delta) == ("stop", expected)
    # every run of whitespace (there is none in the strings) is one the pattern matches
    assert all(re.fullmatch(pattern, run) for run in re.findall(r"\s+", out.text_delta))
    jsonschema.validate(json.loads(out.text_delta), SENTIMENT)
