"""A small seeded body generator driven by the /openapi.json request schemas (no tests here).

`valid(schema)` builds a body the schema accepts; `mutate(body)` breaks it one way (wrong type,
out-of-range number, missing required field, unknown field, huge string, odd Unicode).
"""

from __future__ import annotations

import copy
import random
from typing import Any

ODD = ["a", "é", "€", "😀", "\u200d", "\u202e", "\x00", " ", "\n", "漢", "\u0301", "\ufeff"]
WRONG = [1, -1, 1.5, "s", True, False, [], {}, [1, "a"], {"k": 1}]
HUGE_NUMBERS = [2**64, -(2**70), 1e308, -5, 10**4, 0, -1, 0.0, 21, 2**63]


class Generator:
    """Bodies from a JSON schema with `#/components/schemas/...` references."""

    def __init__(self, components: dict[str, Any], seed: int, model: str):
        self.components, self.rng, self.model = components, random.Random(seed), model

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        ref = schema.get("$ref")
        return self.components[ref.rsplit("/", 1)[1]] if ref else schema

    def text(self, lo: int = 0, hi: int = 12) -> str:
        return "".join(self.rng.choice(ODD) for _ in range(self.rng.randint(lo, hi)))

    def value(self, schema: dict[str, Any], top: bool = False) -> Any:
        """A value `schema` accepts (small numbers: limits the schema cannot know stay far)."""
        rng, schema = self.rng, self.resolve(schema)
        for union in ("anyOf", "oneOf"):
            if union in schema:
                branches = [b for b in schema[union] if b.get("type") != "null"]
                return self.value(rng.choice(branches))
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return rng.choice(schema["enum"])
        kind = schema.get("type")
        if kind == "object":
            return self.obj(schema)
        if kind == "array":
            lo = schema.get("minItems", 0)
            hi = min(schema.get("maxItems", lo + 3), lo + 3)
            item = schema.get("items", {"type": "string"})
            return [self.value(item) for _ in range(rng.randint(lo, hi))]
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "integer":
            lo = max(schema.get("minimum", 0), 0)
            return rng.randint(lo, min(schema.get("maximum", lo + 40), lo + 40))
        if kind == "number":
            lo = schema.get("minimum", schema.get("exclusiveMinimum", -1.0))
            hi = schema.get("maximum", 1.0)
            value = rng.uniform(max(lo, -1.0), min(hi, 2.0))
            if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
                value = hi
            return value
        if kind == "string":
            lo, hi = schema.get("minLength", 0), schema.get("maxLength", 12)
            return self.text(max(lo, 1 if lo else 0), max(min(hi, 12), lo))
        return {}

    def obj(self, schema: dict[str, Any]) -> dict[str, Any]:
        props, required = schema.get("properties", {}), set(schema.get("required", []))
        out = {}
        for name, sub in props.items():
            if name in required or self.rng.random() < 0.3:
                out[name] = self.value(sub)
        return out

    def valid(self, schema: dict[str, Any]) -> dict[str, Any]:
        """A body the request schema accepts, cross-field rules applied."""
        body = self.obj(self.resolve(schema))
        body["model"] = self.model
        if "stream_options" in body:
            body["stream"] = True
        if "top_logprobs" in body:
            body["logprobs"] = True
        if body.get("stream"):  # prompt_logprobs are not streamed (vLLM's rule)
            body.pop("prompt_logprobs", None)
        body.pop("min_tokens", None)  # must not exceed max_tokens: keep it simple
        body.pop("best_of", None)  # at least n, and not past n when streaming: test_n_choices.py
        if "n" in body:  # within --max-choices, which no schema states
            body["n"] = self.rng.randint(1, 3)
        # a constraint's text (schema, regex, grammar) must compile, which no JSON schema
        # states: structured output has its own tests (test_structured_output.py)
        body.pop("structured_outputs", None)
        # likewise each function's parameters schema, and tool_choice must fit the tools:
        # tool calling has its own tests (test_tool_calling.py)
        body.pop("tools", None)
        body.pop("tool_choice", None)
        if (body.get("response_format") or {}).get("type") not in (None, "text"):
            body.pop("response_format")
        if ((body.get("text") or {}).get("format") or {}).get("type") not in (None, "text"):
            body.pop("text")  # the Responses API's format: likewise
        for msg in body.get("messages", []):
            if msg.get("content") is None and msg["role"] != "assistant":
                msg["content"] = "hi"
            if msg["role"] == "tool":  # it must answer the call before it: test_tool_calling.py
                msg["role"] = "user"
                msg.pop("tool_call_id", None)
        if isinstance(body.get("input"), list):  # likewise a function_call_output, here
            items = [i for i in body["input"] if i.get("type") != "function_call_output"]
            body["input"] = items or "hi"
        if self.rng.random() < 0.2:
            body["user"] = None  # null counts as absent
        return body

    def mutate(self, body: dict[str, Any], required: list[str]) -> tuple[str, dict[str, Any]]:
        """(kind of mutation, mutated copy)."""
        rng, body = self.rng, copy.deepcopy(body)
        kind = rng.choice(
            ["type", "range", "missing", "unknown", "huge", "unicode", "nested", "surrogate"]
        )
        field = rng.choice(sorted(body))
        if kind == "type":
            body[field] = rng.choice(WRONG)
        elif kind == "range":
            body[rng.choice(["max_tokens", "temperature", "top_p", "seed", "top_k", "min_p",
                             "presence_penalty", "n", "logprobs", "min_tokens",
                             "repetition_penalty"])] = rng.choice(HUGE_NUMBERS)  # fmt: skip
        elif kind == "missing":
            body.pop(rng.choice(required), None)
        elif kind == "unknown":
            body[f"x_{rng.randrange(10**6)}{self.text(0, 3)}"] = rng.choice(WRONG)
        elif kind == "huge":
            target = "messages" if "messages" in body else "prompt"
            big = "word " * rng.choice([1000, 60_000, 400_000])
            body[target] = [{"role": "user", "content": big}] if target == "messages" else big
        elif kind == "unicode":
            body[rng.choice(["user", "cache_salt", "stop", "model"])] = self.text(1, 40)
        elif kind == "nested":
            self._nested(body)
        else:
            where = rng.choice(["user", "stop", "bad-key"])
            if where == "bad-key":
                body["\ud83d"] = 1
            else:
                body[where] = "a\ud83d" if where == "user" else ["ok", "\udc00"]
        return kind, body

    def _nested(self, body: dict[str, Any]) -> None:
        rng = self.rng
        if "messages" in body:
            msg = body["messages"][0]
            choice = rng.choice(["role", "content", "part", "extra"])
            if choice == "role":
                msg["role"] = rng.choice(["bot", 1, None, "USER"])
            elif choice == "content":
                msg["content"] = rng.choice(WRONG + [None])
            elif choice == "part":
                msg["content"] = [rng.choice([{"type": "image_url"}, {"type": "text"}, "x", {}])]
            else:
                msg["tool_calls"] = [{"id": "c"}]
        else:
            body["prompt"] = rng.choice([[], [[1], [2]], ["a", "b"], [1.5], [True], [-1], [2**64]])
