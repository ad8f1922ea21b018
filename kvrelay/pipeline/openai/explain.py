"""Turn a request model's ValidationError into the one OpenAI-shaped 400 the client gets.

The wording lives with the fields: a `Says` in a field's `Annotated[...]` metadata states how
its errors read, and validators raise `fail(...)`/`refuse(...)` for an exact answer. Without a
`Says`, a wrong type reads "'<param>' must be <a boolean | an integer | ...>", an absent (or
null) field "'<param>' is a required property". `param` is the field's path, as the client
wrote it: `messages[0].content[1].text`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from kvrelay.core.sampling import INT64_MAX, INT64_MIN, Bound
from kvrelay.pipeline.errors import RequestError, bad_request, unsupported
from kvrelay.pipeline.openai.validate import missing, outside_int64, type_error

# what a wrong type "must be", by pydantic error type
_EXPECTED = {
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a number",
    "finite_number": "a number",
    "string_type": "a string",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "an array",
}
# errors where an integer outside int64 is refused as such (and never echoed)
_NUMERIC = frozenset(
    ["float_type", "greater_than", "greater_than_equal", "less_than", "less_than_equal"]
)
_CUSTOM = "kvrelay"
Text = str | Callable[[Any], str]


@dataclass(frozen=True, slots=True)
class Says:
    """How one field's errors read (put it in the field's `Annotated` metadata).

    `expect`: what a wrong type (or a list under its minimum length) must be instead.
    `refused`: a value this server does not implement ("<refused> is not supported ..."; a
    template with `{value}` or a function of the value). `bound`: the sampling range a value
    broke (core.sampling.BOUNDS). `invalid`: any other bad value (template with `{param}`,
    `{value}`). `missing`: the message when the field is absent, null or empty. `whole`: errors
    inside the field (an item of its list) are reported for the field itself.
    """

    expect: str | None = None
    refused: Text | None = None
    bound: Bound | None = None
    invalid: Text | None = None
    missing: str | None = None
    whole: bool = False


def fail(
    message: str, *, field: str = "", code: str | None = None, templated: bool = False
) -> Exception:
    """An exact answer from a validator; `field` is a path below the validated location.

    `templated`: "{param}" in `message` stands for the field's path (messages[2].role).
    """
    context = {"message": message, "field": field, "code": code, "templated": templated}
    return PydanticCustomError(_CUSTOM, "{message}", context)


def refuse(what: str, *, field: str = "") -> Exception:
    """A value this server does not implement (400 unsupported_value)."""
    return fail(unsupported("", what).message, field=field, code="unsupported_value")


def fail_as(kind: str, *, field: str = "", expected: str = "") -> Exception:
    """A common error (kind: "missing", "type" with `expected`, "int64") worded for the path."""
    return PydanticCustomError(_CUSTOM, kind, {"kind": kind, "field": field, "expected": expected})


def explain(exc: ValidationError, model: type[BaseModel]) -> RequestError:
    """The RequestError for the first field that failed, from its most telling error.

    A union (stop, content) fails once per branch: a validator's own answer wins, then the
    deepest path (the branch the value's shape chose), then a bad value over a wrong type.
    """
    errors = exc.errors(include_url=False)
    first = errors[0]["loc"][:1]
    # depth: the number of location items, how far into the value the check got
    ranked = [(_render(err, model), len(err["loc"])) for err in errors if err["loc"][:1] == first]
    best, _depth = max(ranked, key=lambda r: (r[0].custom, r[1], not r[0].type_error))
    return best.error


@dataclass(slots=True)
class _Rendered:
    error: RequestError
    custom: bool = False
    type_error: bool = False


def _render(err: ErrorDetails, model: type[BaseModel]) -> _Rendered:
    path, exact, name, says = _walk(err["loc"], model)
    kind, value = err["type"], err.get("input")
    says = says or Says()
    if kind == _CUSTOM:
        ctx = err.get("ctx") or {}
        where = _join(exact, ctx.get("field", ""))
        if ctx.get("kind") == "missing":
            return _Rendered(missing(where), custom=True)
        if ctx.get("kind") == "type":
            return _Rendered(type_error(where, ctx["expected"]), custom=True)
        if ctx.get("kind") == "int64":
            return _Rendered(outside_int64(where), custom=True)
        message = ctx["message"]
        if ctx.get("templated"):
            message = message.replace("{param}", where)
        error = RequestError(message, 400, param=where or None, code=ctx.get("code"))
        return _Rendered(error, custom=True)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    huge = is_int and not INT64_MIN <= value <= INT64_MAX  # values travel as MessagePack int64
    if huge and kind in _NUMERIC:
        if kind == "float_type" or (says.bound and says.bound.kind is float):
            # a number field: float() of it may overflow, and no sane value is this big
            return _Rendered(bad_request(f"'{path}' is out of range", param=path))
        return _Rendered(outside_int64(exact))
    empty = kind in ("string_too_short", "too_short")
    if kind == "missing" or value is None or (says.missing and empty):
        if says.missing:
            code = "missing_required_parameter"
            return _Rendered(bad_request(says.missing, param=path, code=code))
        return _Rendered(missing(path))
    if kind in _EXPECTED or (empty and says.expect and not says.invalid):
        return _Rendered(type_error(path, says.expect or _EXPECTED[kind]), type_error=True)
    if says.refused is not None:
        return _Rendered(unsupported(path, _text(says.refused, value, path)))
    if says.bound is not None:
        return _Rendered(bad_request(says.bound.message(name, value), param=path))
    if says.invalid is not None:
        return _Rendered(bad_request(_text(says.invalid, value, path), param=path))
    return _Rendered(bad_request(f"'{path}' is invalid", param=path, code="invalid_value"))


def _text(text: Text, value: Any, param: str) -> str:
    return text(value) if callable(text) else text.format(value=value, param=param)


def _join(path: str, below: str) -> str:
    if not below or below.startswith("["):
        return path + below
    return f"{path}.{below}" if path else below


def _walk(loc: tuple[int | str, ...], model: type[BaseModel]) -> tuple[str, str, str, Any]:
    """(reported path, exact path, field name, the field's Says) for an error location.

    Location items are field names, list indices and union branch tags (skipped; the field
    is looked up in each model of the union, first first). Below a `whole` field the
    reported path stays the field's; the exact one goes on (for int64).
    """
    path = exact = name = ""
    says, current, whole = None, [model], False
    for item in loc:
        if isinstance(item, int):
            exact += f"[{item}]"
            if not whole:  # an item of the list: the list's own wording is not the item's
                path, says = exact, None
            continue
        fields = next((m.model_fields for m in current if item in m.model_fields), {})
        if item not in fields:
            continue  # a union branch tag such as 'list[TextPart]'
        info = fields[item]
        exact = _join(exact, item)
        if whole:
            continue
        path, name = exact, item
        says = next((m for m in info.metadata if isinstance(m, Says)), None)
        says = says or _says_in(info.annotation)
        current = _models_in(info.annotation)
        whole = says is not None and says.whole
    return path, exact, name, says


def _says_in(annotation: Any) -> Says | None:
    """A Says nested in an optional type: `Annotated[int, ..., Says(...)] | None`."""
    for arg in get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ():
        found = next((m for m in getattr(arg, "__metadata__", ()) if isinstance(m, Says)), None)
        if found is not None:
            return found
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The request models nested in a field's type, in order (`list[ChatMessage] | None`;
    a union of input items gives each)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [found for arg in get_args(annotation) for found in _models_in(arg)]
