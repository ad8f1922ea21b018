"""Prompt sets for `kvrelay bench`: built-in synthetic ones and user JSONL files.

Every set is deterministic for a given seed and needs no tokenizer, so the same requests go to
any OpenAI-compatible server. Sizes in tokens are measured with the SmolLM2 tokenizer; other
tokenizers give somewhat different counts. `long-context` documents are built from pieces that
are one SmolLM2 token each, so their prompts are exactly LONG_CONTEXT_TOKENS long for that model
(chat template included); `doc-qa` documents are built the same way, DOC_QA_TOKENS each.
`multi-turn` conversations start with the `shared-prefix` system prompt and pause a think
time before each follow-up; `doc-qa` asks about each document in turn, then again, so each
re-ask comes after the others (what a cache must keep). `grounded` requests are tasks on a
passage or a Python file given in the prompt (summarize, rewrite, edit the code;
kvrelay.bench.grounded), whose answers copy long spans of the input, the case prompt-lookup
(n-gram) speculative decoding speeds up.

JSONL files hold one request per line, either `{"messages": [{"role": ..., "content": ...}]}`
(chat) or `{"prompt": "..."}` (text), each with an optional `"max_tokens"`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.bench import grounded
from kvrelay.core.errors import KvrelayError

BUILTIN = ("short", "shared-prefix", "long", "long-context", "multi-turn", "doc-qa", "grounded")
TOPICS = [
    "the sea",
    "mountains",
    "a city at night",
    "a robot",
    "a garden",
    "the moon",
    "a library",
    "winter",
    "trains",
    "a bakery",
    "the desert",
    "rain",
]
TASKS = [
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "Describe {} in two sentences.",
    "Tell a very short story about {}.",
    "What should a child know about {}?",
    "List four words that remind you of {}.",
]
_WORD_TEXT = (
    "the a of and to in is was it for on with as at by from this that which be are were an or "
    "river stone light house market winter harbor engine garden window letter music paper road "
    "machine forest city table village ship station morning evening bridge tower field cloud "
    "teacher worker doctor farmer sailor painter writer builder runner keeper merchant pilot "
    "quiet bright old new small large warm cold slow quick careful early late green red golden "
    "walks carries builds opens watches follows keeps finds brings turns holds reads paints "
    "slowly often always never again together alone nearly almost suddenly gently"
)
WORDS = _WORD_TEXT.split()  # the vocabulary of synthetic sentences
SHARED_PREFIX_RULES = 34  # about 1,500 SmolLM2 tokens
LONG_WORDS = 1800  # about 2,000 SmolLM2 tokens
MULTI_TURN_TURNS = 4
DOC_QA_DOCUMENTS = 8  # `doc-qa`: distinct documents asked about in turn
DOC_QA_TOKENS = 3000  # SmolLM2 tokens of one doc-qa document (its question adds a few)
DOC_QA_QUESTIONS = [
    "What is the text above about?",
    "Name three things the text above mentions.",
    "Which place appears most often in the text above?",
    "Summarize the text above in one sentence.",
    "Who are the people in the text above?",
    "What happens last in the text above?",
]
LONG_CONTEXT_TOKENS = 4000  # SmolLM2 tokens of one long-context prompt, chat template included
# SmolLM2 tokens of a grounded prompt, chat template included (checked for every combination of
# source and task in tests/bench).
GROUNDED_MIN_TOKENS, GROUNDED_MAX_TOKENS = 300, 900
# SmolLM2's template around one user message: its default system prompt, role markers and the
# generation prompt (checked against the real template in tests/bench).
CHAT_TEMPLATE_TOKENS = 30
# `kvrelay bench --concurrency` when not given, per dataset (others: 8).
DEFAULT_CONCURRENCY = {"long-context": "8,32"}

# long-context prose: every word below is one SmolLM2 token after a space, every opener one
# token with or without a space, so a document's token count is its number of pieces.
_NOUNS = WORDS[WORDS.index("river") : WORDS.index("quiet")]
_ADJECTIVES = WORDS[WORDS.index("quiet") : WORDS.index("walks")]
_VERBS = WORDS[WORDS.index("walks") : WORDS.index("slowly")]
_ADVERBS = ["slowly", "often", "always", "again", "together", "alone", "suddenly", "gently"]
_PREPOSITIONS = ["near", "by", "from", "with", "behind", "under", "across", "beside"]
_OPENERS = ["The", "Each", "Every", "One", "That", "This"]
# sentence shapes: O opener, N noun, A adjective, V verb, D adverb, P preposition, others literal
_SHAPES = [
    "O A N V the N D .",
    "O N V a A N P the N .",
    "O N V the A N , and the N V it D .",
    "O A N D V the N P the A N .",
    "O N P the N V a A N , D .",
]
_LONGEST_SHAPE = max(len(s.split()) for s in _SHAPES)
_QUESTION = ["\n", "\n", "What", " is", " the", " text", " above", " about", "?"]


class DatasetError(KvrelayError, ValueError):
    """A prompt set that cannot be built (unknown name, unreadable or malformed file)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """The conversation shape of `multi-turn` and `doc-qa` (`kvrelay bench` flags).

    `turns`: requests per multi-turn conversation; `think_s`: the (low, high) bounds of the
    uniform pause before each follow-up (a user reading, a tool running), seeded;
    `documents`: how many doc-qa documents are asked about in turn.
    """

    turns: int = MULTI_TURN_TURNS
    think_s: tuple[float, float] = (0.0, 0.0)
    documents: int = DOC_QA_DOCUMENTS

    def __post_init__(self) -> None:
        lo, hi = self.think_s
        if self.turns < 1 or self.documents < 1 or not 0 <= lo <= hi:
            raise DatasetError(
                "turns and documents must be >= 1 and think time 0 <= low <= high, got "
                f"{self.turns} turns, {self.documents} documents, think {lo:g}-{hi:g} s"
            )


@dataclass(slots=True)
class Session:
    """Requests sent one after another: the first with `messages`, then one per follow-up.

    Each follow-up is sent as the conversation so far plus the server's previous answer plus
    the new user message, so later requests share a prefix with earlier ones.
    """

    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | None = None  # a text prompt instead of messages (JSONL `prompt`)
    follow_ups: list[str] = field(default_factory=list)
    max_tokens: int | None = None  # per-request output budget from a JSONL file
    think_s: list[float] = field(default_factory=list)  # pause before each follow-up
    # the turn its first request counts as in reports (doc-qa: how often its document was
    # asked before, so turn 0 is each document's cold prefill and later turns its re-asks)
    first_turn: int = 0
    # the conversation its requests continue, when it outlives the session (doc-qa: its
    # document, asked again by later sessions); None: the session is its own conversation
    conversation: str | None = None

    @property
    def num_requests(self) -> int:
        return 1 + len(self.follow_ups)


@dataclass(slots=True)
class Dataset:
    """A named, deterministic source of sessions: `session(i)` is the same for one seed."""

    name: str
    make: Callable[[int], Session]

    def session(self, index: int) -> Session:
        return self.make(index)

    def sessions(self, num_requests: int) -> list[Session]:
        """Sessions holding exactly `num_requests` requests (the last one cut short if needed)."""
        out: list[Session] = []
        left = num_requests
        while left > 0:
            s = self.session(len(out))
            if s.num_requests > left:
                s.follow_ups = s.follow_ups[: left - 1]
                s.think_s = s.think_s[: left - 1]
            out.append(s)
            left -= s.num_requests
        return out


def parse_think_time(text: str) -> tuple[float, float]:
    """`S` or `LOW,HIGH` seconds (`--think-time`) as (low, high); Shape checks the order."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(math.isfinite(v) for v in values):
        raise DatasetError(f"{text!r} is not S or LOW,HIGH")
    return values[0], values[-1]


def _sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def _text(rng: random.Random, num_words: int) -> str:
    parts, used = [], 0
    while used < num_words:
        n = min(rng.randint(8, 18), num_words - used)
        parts.append(_sentence(rng, n))
        used += n
    return " ".join(parts)


def shared_system_prompt() -> str:
    """The ~1,500-token system prompt every `shared-prefix` request starts with."""
    lines = ["You are the support assistant of Harbor Tools. Follow every rule below."]
    for i in range(1, SHARED_PREFIX_RULES + 1):
        lines.append(
            f"Rule {i}: when a customer asks about {TOPICS[i % len(TOPICS)]}, answer politely, "
            f"cite section {i * 7 % 97} of the handbook, offer the {WORDS[40 + i % 60]} option "
            f"first, and never promise delivery before day {i % 28 + 1} of the month."
        )
    return "\n".join(lines)


def _piece(rng: random.Random, slot: str, first: bool) -> str:
    words = {"N": _NOUNS, "A": _ADJECTIVES, "V": _VERBS, "D": _ADVERBS, "P": _PREPOSITIONS}
    if slot == "O":
        word = rng.choice(_OPENERS)
        return word if first else " " + word
    if slot in (".", ","):
        return slot
    return " " + (rng.choice(words[slot]) if slot in words else slot)


def _sentence_pieces(rng: random.Random, shape: str, first: bool) -> list[str]:
    pieces = [_piece(rng, slot, first and i == 0) for i, slot in enumerate(shape.split())]
    for i, p in enumerate(pieces[:-1]):
        if p == " a" and pieces[i + 1][1] in "aeiou":
            pieces[i] = " an"
    return pieces


def long_context_document(rng: random.Random, num_tokens: int) -> list[str]:
    """Paragraphs of plain sentences as pieces of one SmolLM2 token each, `num_tokens` of them."""
    pieces: list[str] = []
    left = num_tokens
    paragraph_left = rng.randint(4, 8)  # sentences until the next paragraph break
    first = True
    # Whole sentences while another one still fits, then one sentence of exactly what is left.
    while left > _LONGEST_SHAPE + 2 + 6:
        if paragraph_left == 0:
            pieces += ["\n", "\n"]
            left -= 2
            paragraph_left, first = rng.randint(4, 8), True
        sentence = _sentence_pieces(rng, rng.choice(_SHAPES), first)
        pieces += sentence
        left -= len(sentence)
        paragraph_left -= 1
        first = False
    pairs, odd = divmod(left - 6, 2)
    tail = ["O", "N", "V", "the", "N"] + [",", "N"] * pairs + ["D"] * odd + ["."]
    pieces += _sentence_pieces(rng, " ".join(tail), first)
    return pieces


def long_context_prompt(rng: random.Random) -> str:
    """A user message of its own document and a question: LONG_CONTEXT_TOKENS with the template."""
    body = LONG_CONTEXT_TOKENS - CHAT_TEMPLATE_TOKENS - len(_QUESTION)
    return "".join(long_context_document(rng, body) + _QUESTION)


def default_concurrency(name: str) -> str:
    """`--concurrency` of a run on this dataset when none is given."""
    return DEFAULT_CONCURRENCY.get(name, "8")


def grounded_task(kind: str, source: int, task: int) -> str:
    """The user message of one grounded request: task `task` of `kind` on source `source`
    (passages for summarize and rewrite, Python files for code-edit), without the index tag."""
    if kind == "code-edit":
        src = grounded.CODE[source]
        return f"{src.edits[task]}\n\n```python\n# {src.name}\n{src.code}```"
    tasks = grounded.SUMMARIZE if kind == "summarize" else grounded.REWRITE
    return f"{tasks[task]}\n\n{grounded.PASSAGES[source][1]}"


def grounded_prompt(rng: random.Random, index: int) -> str:
    """Request `index` of the grounded set: kinds in turn, source and task drawn from `rng`."""
    kind = grounded.KINDS[index % len(grounded.KINDS)]
    if kind == "code-edit":
        source = rng.randrange(len(grounded.CODE))
        task = rng.randrange(len(grounded.CODE[source].edits))
    else:
        source = rng.randrange(len(grounded.PASSAGES))
        task = rng.randrange(len(grounded.SUMMARIZE if kind == "summarize" else grounded.REWRITE))
    return f"({index}) " + grounded_task(kind, source, task)


def _question(rng: random.Random, index: int) -> str:
    return f"({index}) " + rng.choice(TASKS).format(rng.choice(TOPICS))


def doc_qa_document(seed: int, document: int) -> str:
    """Document `document` of a doc-qa set: DOC_QA_TOKENS SmolLM2 tokens of plain prose."""
    rng = random.Random(f"{seed}:doc-qa:{document}")
    return "".join(long_context_document(rng, DOC_QA_TOKENS))


def builtin(name: str, seed: int, shape: Shape | None = None) -> Dataset:
    """One of BUILTIN; `seed` varies the user turns (and long documents), not the shape."""
    shape = shape or Shape()
    system = shared_system_prompt() if name in ("shared-prefix", "multi-turn") else None

    def make(index: int) -> Session:
        rng = random.Random(f"{seed}:{name}:{index}")
        if name == "short":
            return Session(messages=[{"role": "user", "content": _question(rng, index)}])
        if name == "shared-prefix":
            return Session(
                messages=[
                    {"role": "system", "content": system or ""},
                    {"role": "user", "content": _question(rng, index)},
                ]
            )
        if name == "long-context":
            return Session(messages=[{"role": "user", "content": long_context_prompt(rng)}])
        if name == "grounded":
            return Session(messages=[{"role": "user", "content": grounded_prompt(rng, index)}])
        if name == "long":
            doc = _text(rng, LONG_WORDS)
            ask = "Summarize the text above in one sentence."
            return Session(messages=[{"role": "user", "content": f"{doc}\n\n{ask}"}])
        if name == "doc-qa":
            document, visit = index % shape.documents, index // shape.documents
            question = DOC_QA_QUESTIONS[visit % len(DOC_QA_QUESTIONS)]
            text = f"{doc_qa_document(seed, document)}\n\n({visit}) {question}"
            return Session(
                messages=[{"role": "user", "content": text}],
                first_turn=visit,
                conversation=f"doc-{document}",
            )
        topic = rng.choice(TOPICS)
        first = f"({index}) Let us talk about {topic}. What is it?"
        follow = [f"Tell me more about {topic}, point {t}." for t in range(2, shape.turns + 1)]
        lo, hi = shape.think_s
        think = [rng.uniform(lo, hi) if hi > 0 else 0.0 for _ in follow]
        return Session(
            messages=[
                {"role": "system", "content": system or ""},
                {"role": "user", "content": first},
            ],
            follow_ups=follow,
            think_s=think,
        )

    if name not in BUILTIN:
        raise DatasetError(f"unknown dataset {name!r} (one of {', '.join(BUILTIN)} or a .jsonl)")
    return Dataset(name, make)


def _record(line: str, where: str) -> Session:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected an object with 'messages' or 'prompt'")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise DatasetError(f"{where}: max_tokens must be a positive integer")
    messages, prompt = obj.get("messages"), obj.get("prompt")
    if isinstance(prompt, str) and messages is None:
        return Session(prompt=prompt, max_tokens=max_tokens)
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok or prompt is not None:
        raise DatasetError(
            f"{where}: needs either 'prompt' (a string) or 'messages' "
            "(a non-empty list of {role, content} strings)"
        )
    assert isinstance(messages, list)  # ok
    return Session(messages=[dict(m) for m in messages], max_tokens=max_tokens)


def from_jsonl(path: str) -> Dataset:
    """Requests from a JSONL file, used in file order and repeated when more are needed."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    records = [_record(ln, f"{path}:{i + 1}") for i, ln in enumerate(lines) if ln.strip()]
    if not records:
        raise DatasetError(f"{path} holds no requests")

    def make(index: int) -> Session:
        r = records[index % len(records)]
        return Session(list(r.messages), r.prompt, [], r.max_tokens)

    return Dataset(Path(path).name, make)


def load(name: str, seed: int, shape: Shape | None = None) -> Dataset:
    """A built-in set by name, or a JSONL file when `name` is not one."""
    if name in BUILTIN:
        return builtin(name, seed, shape)
    if name.endswith(".jsonl") or Path(name).exists():
        return from_jsonl(name)
    return builtin(name, seed, shape)  # raises with the list of names
