"""The one loader of the Lua scripts in `lua/`, with the Redis-side names filled in from Python.

A script never spells a name Python defines; it writes a placeholder that becomes a quoted Lua
string literal (`$` is no Lua token, so a placeholder cannot be mistaken for Lua):
`${EMITTED}` -> 'emitted' (any `kvrelay.core.record` field constant), `${STATUS.FAILED}` ->
'failed' (a member of the enum that types the field: STATUS, STAGE, FINISH_REASON),
`${MESSAGE_FIELD}` -> 'm' (`kvrelay.core.keys`) and `${DLQ.REASON}` -> 'reason'
(`kvrelay.core.dead_letter`). An unknown placeholder raises ScriptError when the script is
loaded, and each script is read and filled in once per process.
"""

from __future__ import annotations

import enum
import functools
import re
from importlib import resources

from kvrelay.core import record as rec
from kvrelay.core.dead_letter import DlqField
from kvrelay.core.enums import FinishReason, RequestStatus, Stage, WorkerField
from kvrelay.core.errors import KvrelayError
from kvrelay.core.keys import MESSAGE_FIELD
from kvrelay.core.usage import UsageField

PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_ENUMS: dict[str, type[enum.StrEnum]] = {
    "STATUS": RequestStatus,
    "STAGE": Stage,
    "FINISH_REASON": FinishReason,
    "WORKER": WorkerField,  # the worker:{name} hash's fields
    "USAGE": UsageField,  # the usage hashes' metrics (core.usage)
}


class ScriptError(KvrelayError, ValueError):
    """A Lua script with an unknown or malformed placeholder (a programming error)."""


def _names() -> dict[str, str]:
    """Placeholder -> the value it stands for (unquoted)."""
    fields = {
        name: value
        for name, value in vars(rec).items()
        if name.isupper() and isinstance(value, str) and value in rec.FIELDS
    }
    out = dict(fields)
    for field, enum_type in _ENUMS.items():
        out.update({f"{field}.{member.name}": member.value for member in enum_type})
    out["MESSAGE_FIELD"] = MESSAGE_FIELD.decode()
    out.update({f"DLQ.{name}": value for name, value in vars(DlqField).items() if name.isupper()})
    return out


NAMES = _names()


def _lua_string(value: str) -> str:
    if "'" in value or "\\" in value or "\n" in value:
        raise ScriptError(f"{value!r} cannot be written as a plain Lua string literal")
    return f"'{value}'"


def fill(text: str, where: str = "<script>") -> str:
    """`text` with each placeholder replaced by its quoted value; ScriptError for an unknown one."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in NAMES:
            raise ScriptError(f"{where}: unknown placeholder ${{{name}}}")
        return _lua_string(NAMES[name])

    filled = PLACEHOLDER.sub(one, text)
    if "${" in filled:  # an unterminated `${`: never send half a placeholder to Redis
        near = filled[filled.index("${") :][:40]
        raise ScriptError(f"{where}: unterminated placeholder at {near!r}")
    return filled


@functools.cache
def source(name: str) -> str:
    """lua/{name}.lua with its placeholders filled in (read and checked once per process)."""
    path = resources.files("kvrelay.pipeline.queue") / "lua" / f"{name}.lua"
    return fill(path.read_text(), f"lua/{name}.lua")


@functools.cache
def fenced(name: str) -> str:
    """lua/{name}.lua after the owner.lua prelude (`owns`, `hset_pairs`) and the progress one."""
    return source("owner") + with_progress(name)


@functools.cache
def with_progress(name: str) -> str:
    """lua/{name}.lua after the progress.lua prelude (`prog_parse`, `prog_encode`,
    `prog_store`, `frame`): the scripts that read or write a request's progress."""
    return source("progress") + source(name)


@functools.cache
def ordered(name: str) -> str:
    """lua/{name}.lua after the ordered.lua prelude (`unread`, `waiting`, `ordered_add`,
    `queue_on`): the scripts that queue work or move it out of a wait set."""
    return source("ordered") + source(name)


def names() -> list[str]:
    """Every script under lua/ by name (the file stem)."""
    lua = resources.files("kvrelay.pipeline.queue") / "lua"
    return sorted(p.name.removesuffix(".lua") for p in lua.iterdir() if p.name.endswith(".lua"))
