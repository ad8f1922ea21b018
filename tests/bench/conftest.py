"""The SmolLM2 tokenizer, shared by the prompt-set tests that count real tokens."""

from __future__ import annotations

import pytest

from kvrelay.core.modelref import converted_dir, resolve_model
from kvrelay.core.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(converted_dir(resolve_model("smollm2-135m-instruct")))
