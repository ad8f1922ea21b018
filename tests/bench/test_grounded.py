"""The `grounded` prompt set: which task on which source each request gets for a seed, every
combination's size through the real SmolLM2 tokenizer and chat template, and its sources."""

from __future__ import annotations

import hashlib

from kvrelay.bench import grounded
from kvrelay.bench.datasets import (
    BUILTIN,
    GROUNDED_MAX_TOKENS,
    GROUNDED_MIN_TOKENS,
    builtin,
    default_concurrency,
    grounded_task,
    load,
)


def combinations() -> list[tuple[str, int, int]]:
    """Every (kind, source, task) the set can draw."""
    out = []
    for kind in grounded.KINDS:
        if kind == "code-edit":
            out += [(kind, s, t) for s, src in enumerate(grounded.CODE) for t in range(3)]
        else:
            tasks = grounded.SUMMARIZE if kind == "summarize" else grounded.REWRITE
            out += [(kind, s, t) for s in range(len(grounded.PASSAGES)) for t in range(len(tasks))]
    return out


def drawn(seed: int, index: int) -> tuple[str, int, int]:
    """The (kind, source, task) of request `index`, read back from its text."""
    content = builtin("grounded", seed).session(index).messages[0]["content"]
    tag = f"({index}) "
    assert content.startswith(tag)
    (match,) = [c for c in combinations() if grounded_task(*c) == content[len(tag) :]]
    return match


def test_requests_for_a_seed_are_fixed():
    assert "grounded" in BUILTIN and load("grounded", 0).name == "grounded"
    assert [drawn(0, i) for i in range(6)] == [
        ("summarize", 4, 1),
        ("rewrite", 7, 2),
        ("code-edit", 5, 0),
        ("summarize", 3, 2),
        ("rewrite", 7, 2),
        ("code-edit", 5, 2),
    ]
    assert [drawn(1, i) for i in range(3)] == [
        ("summarize", 6, 2),
        ("rewrite", 3, 0),
        ("code-edit", 5, 2),
    ]
    content = builtin("grounded", 0).session(0).messages[0]["content"]
    assert content.startswith(
        "(0) Write a one-paragraph summary of the text below. Keep its names and numbers.\n\n"
        "Every June a team of volunteers walks the length of the Calder Brook,"
    )
    assert hashlib.sha256(content.encode()).hexdigest()[:16] == "26272e303df54144"
    code = builtin("grounded", 0).session(2).messages[0]["content"]
    assert code.startswith("(2) Convert `Shift` to a dataclass")
    assert "\n\n```python\n# schedule.py\nfrom datetime import date, timedelta\n" in code
    assert code.endswith("or 'nobody'}\")\n```")
    assert builtin("grounded", 0).session(7) == builtin("grounded", 0).session(7)
    assert builtin("grounded", 0).session(7) != builtin("grounded", 1).session(7)
    assert default_concurrency("grounded") == "8"


def test_kinds_take_turns_and_draw_every_source():
    picks = [drawn(0, i) for i in range(90)]
    assert [p[0] for p in picks] == list(grounded.KINDS) * 30
    passages = {p[1] for p in picks if p[0] != "code-edit"}
    assert passages == set(range(len(grounded.PASSAGES)))
    assert {p[1] for p in picks if p[0] == "code-edit"} == set(range(len(grounded.CODE)))


def test_every_prompt_is_300_to_900_smollm2_tokens(tokenizer):
    assert (GROUNDED_MIN_TOKENS, GROUNDED_MAX_TOKENS) == (300, 900)
    sizes = {}
    for c in combinations():
        # a five-digit index tag, the longest a run is likely to reach
        messages = [{"role": "user", "content": "(12345) " + grounded_task(*c)}]
        sizes[c] = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert len(sizes) == 8 * 4 * 2 + 6 * 3 == 82
    assert min(sizes.values()) >= GROUNDED_MIN_TOKENS and max(sizes.values()) <= GROUNDED_MAX_TOKENS
    assert (min(sizes.values()), max(sizes.values())) == (342, 530)
    first = builtin("grounded", 0).session(0).messages
    assert len(tokenizer.apply_chat_template(first, add_generation_prompt=True)) == 357


def test_sources_are_distinct_passages_and_valid_python_files():
    assert len(grounded.PASSAGES) == 8 and len(grounded.CODE) == 6
    assert len({title for title, _ in grounded.PASSAGES}) == 8
    for _, text in grounded.PASSAGES:
        assert 250 <= len(text.split()) <= 320 and text.count("\n\n") == 3
    for src in grounded.CODE:
        compile(src.code, src.name, "exec")
        assert 35 <= len(src.code.splitlines()) <= 80 and len(src.edits) == 3
        assert all(e.endswith("Return the whole file.") for e in src.edits)
    assert len({src.name for src in grounded.CODE}) == 6
