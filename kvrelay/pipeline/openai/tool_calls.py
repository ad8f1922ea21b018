"""Tool calls in a chat answer: finding them in the text as it streams, and their OpenAI shapes.

A `ToolCallStream` is fed the answer's text chunk by chunk and returns OpenAI's chat deltas:
`{"content": ...}` for text outside the calls and, per call, first `{"tool_calls": [{index,
id, type, function: {name, arguments: ""}}]}` then `{"tool_calls": [{index, function:
{arguments: fragment}}]}`. The same code makes the non-streaming message (the whole text fed
at once), so the fragments of a stream always join into the message's `arguments`: the
arguments exactly as the model wrote them. Everything depends only on the text and the request
id (call ids are derived from it and the call's index), so a reattached or resumed stream
gives the same deltas and ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay.pipeline.openai.tools import ToolCalling

CONTENT, CALL, ARGUMENTS = "content", "call", "arguments"
# the start of a call object whose name comes first: what a streamed call needs to begin
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')
_SPACE = " \t\r\n"


def call_id(request_id: str, index: int) -> str:
    """The id of a request's `index`-th tool call: `call_` + 24 hex digits of a hash."""
    return "call_" + hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]


@dataclass(slots=True)
class Piece:
    """One piece of parsed output: content text, a call's name (a new call) or arguments."""

    kind: str
    text: str


@dataclass(slots=True)
class CallScanner:
    """Reads one JSON call object, `{"name": ..., "arguments": ...}`, as its text arrives.

    Once the name and the `"arguments":` key are in, the name is a CALL piece and the
    arguments value streams as ARGUMENTS pieces, as written. An object with another key order
    is read whole when it closes (its arguments re-serialized). `closed` once the object's
    closing brace is read; text after it is handed back by `feed`.
    """

    text: str = ""
    name: str | None = None
    value_from: int = -1  # where the arguments value may start (after the key's colon)
    value_start: int = -1
    value_end: int = -1
    emitted: int = -1  # arguments text sent up to here
    scanned: int = 0
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    closed: bool = False
    failed: bool = False  # closed, or ended, and not a call: the caller shows it as text

    def feed(self, text: str) -> tuple[list[Piece], str]:
        """Pieces for `text`, and the text after the object's end ("" while it is open)."""
        self.text += text
        pieces: list[Piece] = []
        if self.name is None:
            head = _HEAD.match(self.text)
            if head is not None:
                self.name = json.loads(f'"{head.group(1)}"')
                self.value_from = head.end()
                # the head is one `{` and whole strings: the scan goes on from its end
                self.depth, self.scanned, self.in_string, self.escape = 1, head.end(), False, False
                pieces.append(Piece(CALL, self.name))
        rest = self._scan()
        pieces += self._arguments()
        if self.closed and self.name is None:
            pieces += self._whole(self.text[: len(self.text) - len(rest)])
        return pieces, rest

    def finish(self) -> list[Piece]:
        """The text ended (a closing tag, the answer's end): what is left to say."""
        if self.name is not None or self.closed:
            return []
        return self._whole(self.text)

    def _whole(self, text: str) -> list[Piece]:
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            self.failed = True
            return []
        arguments = obj.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        self.name = obj["name"]
        return [Piece(CALL, self.name), Piece(ARGUMENTS, arguments)]

    def _scan(self) -> str:
        text = self.text
        i = self.scanned
        while i < len(text) and not self.closed:
            c = text[i]
            at_value = self.value_from >= 0 and self.value_start < 0 and i >= self.value_from
            if at_value and c not in _SPACE:
                self.value_start = self.emitted = i
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 1:
                        self._value_ends(i + 1)
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_ends(i + 1)
                elif self.depth == 0:
                    self._value_ends(i)
                    self.closed = True
            elif self.depth == 1 and c in "," + _SPACE:
                self._value_ends(i)  # a number, true, false or null ends here
            i += 1
        self.scanned = i
        return text[i:] if self.closed else ""

    def _value_ends(self, end: int) -> None:
        if self.value_start >= 0 and self.value_end < 0 and end > self.value_start:
            self.value_end = end

    def _arguments(self) -> list[Piece]:
        if self.value_start < 0:
            return []
        end = self.value_end if self.value_end >= 0 else self.scanned
        if end <= self.emitted:
            return []
        piece = Piece(ARGUMENTS, self.text[self.emitted : end])
        self.emitted = end
        return [piece]


class ToolParser(Protocol):
    """Finds tool calls in an answer's text as it arrives (see tool_parsers.py)."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


@dataclass(slots=True)
class ToolCallStream:
    """One answer's tool calls and content, as OpenAI chat deltas (see the module doc)."""

    request_id: str
    calling: ToolCalling
    parser: ToolParser
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    _dropping: bool = False  # a call past the first without parallel_tool_calls: left out

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes."""
        return self._deltas(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas held back until the end (a partial tag, an unclosed call)."""
        return self._deltas(self.parser.finish())

    def message(self) -> dict[str, Any]:
        """The non-streaming message (after feeding the whole text and `finish`)."""
        text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.calls:
            message["content"] = text or None
            message["tool_calls"] = self.calls
        return message

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.kind == CONTENT:
                self.content.append(piece.text)
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += piece.text
                else:
                    deltas.append({"content": piece.text})
            elif piece.kind == CALL:
                self._dropping = bool(self.calls) and not self.calling.parallel
                if self._dropping:
                    continue
                index, name = len(self.calls), piece.text
                head = {"id": call_id(self.request_id, index), "type": "function"}
                self.calls.append({**head, "function": {"name": name, "arguments": ""}})
                function = {"name": name, "arguments": ""}
                deltas.append({"tool_calls": [{"index": index, **head, "function": function}]})
            elif not self._dropping and self.calls:
                index = len(self.calls) - 1
                self.calls[index]["function"]["arguments"] += piece.text
                last = (
                    deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
                )
                if last is not None and last["index"] == index and "id" not in last:
                    last["function"]["arguments"] += piece.text
                else:
                    deltas.append(
                        {"tool_calls": [{"index": index, "function": {"arguments": piece.text}}]}
                    )
        return deltas
