"""The `long-context` prompt set: exact SmolLM2 token counts through the real tokenizer and chat
template, one distinct document per request, and its default concurrency."""

from __future__ import annotations

import hashlib

from kvrelay.bench.datasets import (
    CHAT_TEMPLATE_TOKENS,
    LONG_CONTEXT_TOKENS,
    builtin,
    default_concurrency,
)
from kvrelay.core.tokenizer import Tokenizer


def prompt_ids(tokenizer: Tokenizer, seed: int, index: int) -> list[int]:
    messages = builtin("long-context", seed).session(index).messages
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_every_prompt_is_exactly_4000_smollm2_tokens(tokenizer):
    assert LONG_CONTEXT_TOKENS == 4000
    sizes = {(seed, i): len(prompt_ids(tokenizer, seed, i)) for seed in (0, 7) for i in range(8)}
    assert set(sizes.values()) == {4000}
    # the template around one user message is what the builder assumes
    hello = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], True)
    assert len(hello) - len(tokenizer.encode("hello")) == CHAT_TEMPLATE_TOKENS


def test_documents_are_fixed_by_the_seed_and_share_only_the_template(tokenizer):
    content = builtin("long-context", 0).session(0).messages[0]["content"]
    assert content.startswith(
        "The quick doctor builds the village slowly. This worker under the engine follows an "
        "old builder, slowly."
    )
    assert content.endswith("\n\nWhat is the text above about?")
    assert (len(content), content.count("\n\n"), len(content.split())) == (19660, 57, 3377)
    assert hashlib.sha256(content.encode()).hexdigest()[:16] == "5a86d59ae766d43c"
    assert builtin("long-context", 0).session(0) == builtin("long-context", 0).session(0)
    ids = [prompt_ids(tokenizer, 0, i) for i in range(8)]
    # 24 tokens: the default system prompt and "<|im_start|>user\n"; one more when two
    # documents open with the same word
    shared = [common_prefix(ids[0], other) for other in ids[1:]]
    assert shared == [24] * 7
    assert max(common_prefix(a, b) for i, a in enumerate(ids) for b in ids[i + 1 :]) == 25
    other_seed = prompt_ids(tokenizer, 1, 0)
    assert common_prefix(ids[0], other_seed) <= 25


def test_long_context_runs_at_8_and_32_streams_by_default():
    assert default_concurrency("long-context") == "8,32"
    assert default_concurrency("short") == default_concurrency("x.jsonl") == "8"
