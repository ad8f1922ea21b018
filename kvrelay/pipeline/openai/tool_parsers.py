"""Tool parsers: where the calls are in an answer's text, one class per format.

`hermes` (for `tool_choice: auto`; `--tool-call-parser auto`, the default, picks it from the
model's chat template): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, several for parallel calls; text outside them is content (whitespace between and after
calls is dropped). The two formats
structured output enforces need no setting: `required` answers a JSON array of call objects,
a named choice the arguments alone. Each parser holds back only what may still turn into a
call (a tag's first characters), so content streams as it comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrelay.pipeline.openai.tool_calls import (
    ARGUMENTS,
    CALL,
    CONTENT,
    CallScanner,
    Piece,
    ToolCallStream,
    ToolParser,
)
from kvrelay.pipeline.openai.tools import NAMED, REQUIRED, ToolCalling

_SPACE = " \t\r\n"


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may be one)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class HermesParser:
    """`<tool_call>` JSON `</tool_call>` blocks in free text (Hermes, Qwen2.5, ...)."""

    START = "<tool_call>"
    END = "</tool_call>"
    pending: str = ""
    call: CallScanner | None = None  # inside a block
    block: str = ""  # the block's text, shown as content when it is not a call
    num_calls: int = 0
    space: str = ""  # whitespace after a call: content only if text follows

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while self.pending:
            if self.call is None:
                at = self.pending.find(self.START)
                cut = at if at >= 0 else len(self.pending) - _partial_tag(self.pending, self.START)
                pieces += self._content(self.pending[:cut])
                if at < 0:
                    self.pending = self.pending[cut:]
                    break
                self.pending = self.pending[at + len(self.START) :]
                self.call, self.block = CallScanner(), ""
            else:
                at = self.pending.find(self.END)
                cut = at if at >= 0 else len(self.pending) - _partial_tag(self.pending, self.END)
                pieces += self._in_block(self.pending[:cut])
                if at < 0:
                    self.pending = self.pending[cut:]
                    break
                self.pending = self.pending[at + len(self.END) :]
                pieces += self._end_block(closed=True)
        return pieces

    def finish(self) -> list[Piece]:
        rest, self.pending = self.pending, ""
        if self.call is None:
            return self._content(rest)
        return self._in_block(rest) + self._end_block(closed=False)

    def _content(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self.num_calls and not (self.space + text).strip(_SPACE):
            self.space += text
            return []
        text, self.space = self.space + text, ""
        return [Piece(CONTENT, text)]

    def _in_block(self, text: str) -> list[Piece]:
        assert self.call is not None
        self.block += text
        if self.call.closed:
            return []
        return self.call.feed(text)[0]

    def _end_block(self, closed: bool) -> list[Piece]:
        assert self.call is not None
        call, self.call = self.call, None
        pieces = call.finish()
        if call.name is None or call.failed:  # not a call: the block is text
            block = self.START + self.block + (self.END if closed else "")
            return pieces + self._content(block)
        self.num_calls += 1
        self.space = ""
        return pieces


@dataclass(slots=True)
class CallArrayParser:
    """`required`: the answer is a JSON array of call objects (structured output makes it so)."""

    pending: str = ""
    call: CallScanner | None = None

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        pieces: list[Piece] = []
        while self.pending:
            if self.call is not None:
                found, rest = self.call.feed(self.pending)
                pieces += found
                self.pending = rest
                if self.call.closed:
                    self.call = None
                continue
            head = self.pending.lstrip(_SPACE + ",[")
            if head.startswith("{"):
                self.call = CallScanner()
            elif head:  # "]": the array ends
                head = ""
            self.pending = head
        return pieces

    def finish(self) -> list[Piece]:
        return self.call.finish() if self.call is not None else []


@dataclass(slots=True)
class ArgumentsParser:
    """A named choice: the whole answer is the arguments of that one function."""

    name: str
    started: bool = False

    def feed(self, text: str) -> list[Piece]:
        head = [] if self.started else [Piece(CALL, self.name)]
        self.started = True
        return [*head, Piece(ARGUMENTS, text)]

    def finish(self) -> list[Piece]:
        return [] if self.started else [Piece(CALL, self.name)]


# --tool-call-parser choices (for tool_choice auto): a new format is a new class here
TOOL_PARSERS = {"hermes": HermesParser}
# the other settings: detect the parser from the model's chat template, or refuse auto
DETECT, NO_PARSER = "auto", "none"
PARSER_SETTINGS = (DETECT, NO_PARSER, *TOOL_PARSERS)


def detect_tool_parser(chat_template: str | None, reads_tools: bool) -> str | None:
    """The parser that reads a model's calls, from its chat template (None: none known).

    A template that does not read `tools` (SmolLM2's) gets them written hermes-style by the
    server (core/tool_prompt.py), so its answers are read as hermes; one that reads them is
    hermes when it writes `<tool_call>` blocks (Qwen2.5, Hermes, SmolLM3, ...).
    """
    if not chat_template:
        return None
    if not reads_tools or HermesParser.START in chat_template:
        return "hermes"
    return None


def tool_call_stream(request_id: str, calling: ToolCalling, parser: str = "") -> ToolCallStream:
    """The stream that finds `calling`'s calls (`parser`: the --tool-call-parser, for auto)."""
    found: ToolParser
    if calling.mode == NAMED:
        found = ArgumentsParser(calling.name)
    elif calling.mode == REQUIRED:
        found = CallArrayParser()
    else:
        found = TOOL_PARSERS[parser]()
    return ToolCallStream(request_id, calling, found)


def tool_stream(request_id: str, options: Any) -> ToolCallStream | None:
    """The tool-call finder of a request from its stored options (None: plain text)."""
    calling = ToolCalling.from_dict(options)
    if calling is None:
        return None
    return tool_call_stream(request_id, calling, str(options.get("parser") or ""))
