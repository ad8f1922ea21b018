"""Generation defaults: parsing an operator's override, the model's own, and how layers stack."""

from __future__ import annotations

import json

import pytest

from kvrelay.core import modelref
from kvrelay.core.config import ConfigError
from kvrelay.core.sampling import (
    GenerationDefaults,
    InvalidSamplingParams,
    SamplingParams,
    generation_override,
)

KNOWN = "temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, max_new_tokens"


def test_override_json_parses_every_field():
    text = json.dumps(
        {
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "max_new_tokens": 64,
        }
    )
    parsed = GenerationDefaults.from_json(text)
    assert parsed == GenerationDefaults(
        temperature=0.0, top_p=0.5, top_k=0, min_p=0.05, repetition_penalty=1.1, max_tokens=64
    )
    assert type(parsed.temperature) is float  # an integer temperature becomes a float
    assert GenerationDefaults.from_json("") == GenerationDefaults.from_json(None)
    assert GenerationDefaults.from_json('{"temperature": null}') == GenerationDefaults()


@pytest.mark.parametrize(
    ("text", "message", "param"),
    [
        ('{"temprature": 1}', f"unknown key 'temprature' (known: {KNOWN})", "temprature"),
        ('{"n": 2}', f"unknown key 'n' (known: {KNOWN})", "n"),
        ('{"temperature": 500}', "temperature must be in [0, 100], got 500.0", "temperature"),
        ('{"temperature": "hot"}', "temperature must be a number, got 'hot'", "temperature"),
        ('{"temperature": true}', "temperature must be a number, got True", "temperature"),
        ('{"temperature": NaN}', "temperature must be a number, got nan", "temperature"),
        ('{"top_p": 0}', "top_p must be in (0, 1], got 0.0", "top_p"),
        ('{"top_k": 1.5}', "top_k must be an integer, got 1.5", "top_k"),
        ('{"top_k": -2}', "top_k must be 0 (disabled) or positive, got -2", "top_k"),
        ('{"min_p": 2}', "min_p must be in [0, 1], got 2.0", "min_p"),
        (
            '{"repetition_penalty": 0}',
            "repetition_penalty must be in (0, 10], got 0.0",
            "repetition_penalty",
        ),
        ('{"max_tokens": 0}', "max_tokens must be at least 1, got 0", "max_tokens"),
        ('{"max_new_tokens": "9"}', "max_new_tokens must be an integer, got '9'", "max_new_tokens"),
        (
            '{"max_tokens": 3, "max_new_tokens": 4}',
            "max_new_tokens and max_tokens both given",
            "max_new_tokens",
        ),
        ("[1]", "must be a JSON object, got [1]", ""),
        ("temperature=0.2", "not valid JSON (Expecting value: line 1 column 1 (char 0))", ""),
    ],
)
def test_bad_override_names_the_key(text, message, param):
    with pytest.raises(InvalidSamplingParams) as info:
        GenerationDefaults.from_json(text)
    assert (str(info.value), info.value.param) == (message, param)
    with pytest.raises(ConfigError) as config_info:
        generation_override(text)
    assert str(config_info.value) == f"override_generation_config: {message}"


def test_layers_stack_request_over_override_over_model():
    model = GenerationDefaults(temperature=0.2, top_p=0.9, max_tokens=256)
    override = GenerationDefaults(temperature=0.5, top_k=40)
    layered = override.over(model)
    assert layered == GenerationDefaults(temperature=0.5, top_p=0.9, top_k=40, max_tokens=256)
    assert layered.effective() == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.0,  # no layer sets it: the SamplingParams (OpenAI) default
        "repetition_penalty": 1.0,
        "max_tokens": 256,
    }
    # the request's own fields win; max_tokens is left to the length check (a cap)
    asked = SamplingParams(temperature=1.0, seed=3)
    got = layered.apply(asked, fields_set={"temperature", "seed"})
    assert got == SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=3)
    assert asked == SamplingParams(temperature=1.0, seed=3)  # not modified in place
    assert GenerationDefaults().effective() == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": None,
    }


def test_model_defaults_from_generation_config_gguf_metadata_and_table(tmp_path):
    gen = {
        "bos_token_id": 1,
        "do_sample": False,  # ignored, as vLLM does
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 2.0,  # out of range: skipped with a warning, the rest still apply
        "max_new_tokens": 256,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    gguf = {
        "general.sampling.temp": 0.7,
        "general.sampling.penalty_repeat": 1.1,
        "general.sampling.mirostat": 2,  # no kvrelay equivalent
    }
    modelref.write_meta(tmp_path, {modelref.GGUF_SAMPLING_META: gguf})
    assert modelref.model_generation_defaults(tmp_path, "some-model") == GenerationDefaults(
        temperature=0.7, top_p=0.95, top_k=20, repetition_penalty=1.1, max_tokens=256
    )
    # a built-in name: kvrelay's table sits under what the files say
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "generation_config.json").write_text('{"temperature": 0.6, "max_new_tokens": 9}')
    assert modelref.model_generation_defaults(partial, "SmolLM2-135M-Instruct") == (
        GenerationDefaults(temperature=0.6, top_p=0.9, max_tokens=9)
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert modelref.model_generation_defaults(empty, modelref.DEFAULT_MODEL) == (
        GenerationDefaults(temperature=0.2, top_p=0.9)
    )
    assert modelref.model_generation_defaults(empty, "other") == GenerationDefaults()


def test_bundled_smollm2_gets_the_model_card_sampling(smollm_dir):
    # neither its generation_config.json nor its GGUF carry sampling values
    assert modelref.read_meta(smollm_dir)[modelref.GGUF_SAMPLING_META] == {}
    assert modelref.model_generation_defaults(smollm_dir, modelref.DEFAULT_MODEL) == (
        GenerationDefaults(temperature=0.2, top_p=0.9)
    )


@pytest.fixture(scope="module")
def smollm_dir():
    from kvrelay.workers.model.loader import prepare_model

    return prepare_model(modelref.DEFAULT_MODEL, progress=False)


def test_override_from_a_config_file_table():
    assert generation_override({"temperature": 0.3, "max_new_tokens": 12}) == GenerationDefaults(
        temperature=0.3, max_tokens=12
    )
    with pytest.raises(ConfigError) as info:
        generation_override(5)  # type: ignore[arg-type]
    assert str(info.value) == "override_generation_config: must be a JSON object, got 5"
