"""No closed-set state value is spelled as a quoted string outside its type (issue 24).

Walks `kvrelay/` with `ast` and flags a string constant equal to a member of one of the StrEnums
below where the code uses it *as* that set's value:

- compared (`==`, `!=`, `in`, `not in`) with an expression named like the set's subject
  (`self.mode == "auto"`, `opts.get("api") == "chat"`, `item.kind in ("emit", ...)`);
- given to such a name: a parameter or field default (`mode: str = "auto"`), an assignment
  (`via = "ucx_local"`), a keyword argument (`Router(mode="auto")`), a dict entry
  (`{"api": "chat"}`), `Outgoing`'s kind;
- a `worker:{name}` hash field: the field of `hget`/`hset`/`hdel` on a worker key, the keys of a
  dict given as `hset(..., mapping=...)`, and `.get("...")`/`["..."]` on a worker dict (`w`,
  `worker`, `w.fields`);
- a `req:{id}` record field (`kvrelay.core.record`): the fields of `hget`/`hmget`/`hset`/
  `hincrby`/... on a request key (`keys.request(...)`, or a name bound to one), and the keys of a
  dict given as `hset(..., mapping=...)` there, or as a worker's `req_fields=`; writers build
  those through `RequestRecord`.

The worker hash is also read and written only through `kvrelay.core.worker_record.WorkerRecord`
(issue 24): outside that module, a worker dict's field is not read by name (`w.get(WorkerField.X)`,
`w[WorkerField.X]`: read the record's attribute), no dict is keyed by `WorkerField` members (a
hand-built hash: use `WorkerRecord.encode`), and no `hset` on a worker key names a field itself
(write `mapping=record.encode(...)`).

The `models` hash entry (`kvrelay.core.published_model.PublishedModel`) and a dead-letter entry
(`kvrelay.core.dead_letter.DeadLetter`) are read and written only through their records too
(issue 24): outside the record's module, no write to the `models` hash or the `dlq` stream gives
anything but `record.encode()` (no `json.dumps(...)`, no dict), a function that reads the `models`
hash calls no `json.loads` of its own, a function that reads the `dlq` stream takes no field out
of an entry by name (`fields.get(MESSAGE_FIELD)`, `fields[b"reason"]`), no `DlqField.X` is named,
and no record field is read by its quoted name off a dict named like one (`published.get("files")`,
`row["request_id"]`).

Only these positions are read, so the text of docstrings, log messages and f-strings never
matches; the enum's own module may spell its values (it defines them).
"""

from __future__ import annotations

import ast
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core import dead_letter, published_model
from kvrelay.core import record as rec
from kvrelay.core.enums import (
    FinishReason,
    Quantization,
    RequestStatus,
    Speculation,
    Stage,
    WorkerField,
)
from kvrelay.kvstore.transport import Transport
from kvrelay.pipeline.openai.protocol import Api
from kvrelay.pipeline.queue.route import RouteMode
from kvrelay.workers.emitter import OutgoingKind

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvrelay"

COMPARE_ONLY = frozenset({"compare"})
ALL_POSITIONS = frozenset({"compare", "default", "assign", "keyword", "dict"})


@dataclass(frozen=True)
class ClosedSet:
    enum: type[enum.StrEnum]
    subjects: frozenset[str]  # names (variables, attributes, dict keys) that hold its values
    positions: frozenset[str] = ALL_POSITIONS
    elsewhere: tuple[str, ...] = ()  # packages where the subject names another protocol's set

    @property
    def module(self) -> Path:
        return PACKAGE.parent / (self.enum.__module__.replace(".", "/") + ".py")


SETS = (
    ClosedSet(RouteMode, frozenset({"mode"})),
    ClosedSet(Api, frozenset({"api"})),
    ClosedSet(Quantization, frozenset({"quantization", "method"})),
    ClosedSet(Transport, frozenset({"transport", "kind", "via"})),
    ClosedSet(OutgoingKind, frozenset({"kind"})),
    ClosedSet(Speculation, frozenset({"speculation"})),
    ClosedSet(Stage, frozenset({"stage", "role"})),
    ClosedSet(FinishReason, frozenset({"finish_reason", "reason"})),
    # "ok", "failed", "cancelled" are also other APIs' statuses (/health, the Responses API's
    # objects): only comparisons, where the code decides on a request's status;
    # in kvrelay/pipeline/openai/ a `status` is a Responses API object's
    ClosedSet(RequestStatus, frozenset({"status"}), COMPARE_ONLY, ("pipeline/openai/",)),
)

HASH_FIELD_CALLS = {"hget": 1, "hset": 1, "hdel": 1, "hincrby": 1, "hsetnx": 1, "hexists": 1}
WORKER_DICTS = frozenset({"w", "worker", "w.fields"})
WORKER_RECORD = PACKAGE / "core" / "worker_record.py"  # the one reader and writer of the hash
HASH_WRITES = frozenset({"hset", "hsetnx", "hincrby"})
# the req:{id} hash: these calls name every argument after the key a field (hset: the first)
REQUEST_FIELD_CALLS = {**HASH_FIELD_CALLS, "hmget": 1}
RECORD_MODULE = PACKAGE / "core" / "record.py"
# the `models` hash's entries and the `dlq` stream's: their records, and the names their dicts had
PUBLISHED_MODULE = PACKAGE / "core" / "published_model.py"
MODEL_DICTS = frozenset({"published", "info", "entry", "self.entry"})
DLQ_MODULE = PACKAGE / "core" / "dead_letter.py"
DLQ_DICTS = frozenset({"row", "fields", "letter", "entry"})
DLQ_ENTRY_FIELDS = dead_letter.FIELDS | {"m"}
KEY_READS = frozenset({"hget", "hgetall", "hmget", "hvals", "xrange", "xrevrange", "xread"})
KEY_WRITES = {"hset": 2, "hsetnx": 2, "xadd": 1}  # the position of the value written


def member_values(closed: type[enum.StrEnum]) -> set[str]:
    return {m.value for m in closed}  # `"x" in Enum` raises TypeError before Python 3.12


def subject(node: ast.expr) -> str | None:
    """The name an expression is about: `mode`, `self.mode`, `opts.get("mode")`, `d["mode"]`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
    ):
        return _str(node.args[0])
    if isinstance(node, ast.Subscript) and _str(node.slice) is not None:
        return _str(node.slice)
    return None


def _str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def leaves(node: ast.expr | None) -> Iterator[ast.Constant]:
    """The string constants an expression can evaluate to (or, for a container, hold)."""
    if node is None:
        return
    if _str(node) is not None:
        yield node  # type: ignore[misc]
    elif isinstance(node, ast.IfExp):
        yield from leaves(node.body)
        yield from leaves(node.orelse)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from leaves(value)
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for elt in node.elts:
            yield from leaves(elt)


def _target_names(target: ast.expr) -> list[str | None]:
    if isinstance(target, ast.Tuple | ast.List):
        return [subject(t) for t in target.elts]
    return [subject(target)]


def _bindings(func: ast.AST) -> dict[str, list[ast.expr]]:
    """Local name -> the expressions assigned to it (tuples paired up) or iterated by `for`."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(func):
        pairs: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(target.elts, node.value.elts, strict=False)
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs.append((node.target, node.value))
        elif isinstance(node, ast.For | ast.AsyncFor):
            pairs.append((node.target, node.iter))
        for target, value in pairs:
            if isinstance(target, ast.Name):
                out.setdefault(target.id, []).append(value)
    return out


class Finder(ast.NodeVisitor):
    """Collects (line, value, enum member, position) of the literals in one module."""

    def __init__(self, sets: tuple[ClosedSet, ...], path: Path | None = None):
        rel = "" if path is None else path.relative_to(PACKAGE).as_posix()
        self.sets = [
            s
            for s in sets
            if path is None or (s.module != path and not rel.startswith(s.elsewhere))
        ]
        self.check_worker_fields = path is None or path not in (
            ClosedSet(WorkerField, frozenset()).module,
            WORKER_RECORD,
        )
        self.check_request_fields = path is None or path != RECORD_MODULE
        self.check_models = path is None or path != PUBLISHED_MODULE
        self.check_dlq = path is None or path != DLQ_MODULE
        self._reads: list[set[str]] = [set()]  # per function: the record keys it reads
        self.found: list[tuple[int, str, str, str]] = []
        self._scopes: list[dict[str, list[ast.expr]]] = [{}]

    # -- the closed sets named by subject ---------------------------------------------------
    def _check(self, name: str | None, values: ast.expr | None, position: str) -> None:
        if name is None:
            return
        for const in leaves(values):
            for s in self.sets:
                if (
                    position in s.positions
                    and name in s.subjects
                    and const.value in member_values(s.enum)
                ):
                    member = s.enum(const.value)
                    where = f"{position} of {name!r}"
                    self.found.append((const.lineno, const.value, repr(member), where))

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
            if isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
                self._check(subject(left), right, "compare")
                if isinstance(op, ast.Eq | ast.NotEq):
                    self._check(subject(right), left, "compare")
        self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        defaulted = positional[len(positional) - len(args.defaults) :]
        for arg, default in zip(defaulted, args.defaults, strict=True):
            self._check(arg.arg, default, "default")
        for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
            self._check(arg.arg, default, "default")
        self._scopes.append(_bindings(node))
        self._reads.append(_key_reads(node))
        self.generic_visit(node)
        self._reads.pop()
        self._scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for t, v in zip(target.elts, node.value.elts, strict=False):
                    self._check(subject(t), v, "assign")
            else:
                for name in _target_names(target):
                    self._check(name, node.value, "assign")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check(subject(node.target), node.value, "default")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        for kw in node.keywords:
            self._check(kw.arg, kw.value, "keyword")
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name == "Outgoing" and node.args:
            self._check("kind", node.args[0], "keyword")
        if self.check_worker_fields:
            self._worker_call(node, name)
        if self.check_request_fields:
            self._request_call(node, name)
        self._record_call(node, name)
        self.generic_visit(node)

    # -- the models entries and dead letters ------------------------------------------------
    def _checked_keys(self) -> set[str]:
        return {k for k, on in (("models", self.check_models), ("dlq", self.check_dlq)) if on}

    def _record_call(self, node: ast.Call, name: str | None) -> None:
        key = _record_key(node.args[0]) if node.args else None
        if name in KEY_WRITES and key in self._checked_keys():
            record = "PublishedModel" if key == "models" else "DeadLetter"
            values = node.args[KEY_WRITES[name] :][:1]
            values += [kw.value for kw in node.keywords if kw.arg in ("mapping", "fields")]
            for value in values:
                if not _is_encode(value):
                    where = f"{name} on the {key} key, not {record}.encode"
                    self.found.append((node.lineno, ast.unparse(value), "a record", where))
        func = node.func
        if (
            "models" in self._reads[-1]
            and self.check_models
            and isinstance(func, ast.Attribute)
            and ast.unparse(func) == "json.loads"
        ):
            where = "json.loads where the models hash is read, not PublishedModel.decode"
            self.found.append((node.lineno, "json.loads", "a models entry", where))
        if name == "get" and isinstance(func, ast.Attribute) and node.args:
            self._record_read(func.value, node.args[0], ".get")

    def _record_read(self, value: ast.expr, field: ast.expr, how: str) -> None:
        owner, literal = ast.unparse(value), _str(field)
        if self.check_models and owner in MODEL_DICTS and literal in published_model.FIELDS:
            self.found.append((field.lineno, literal, "a models entry field", f"{owner}{how}"))
        if self.check_dlq:
            named = literal in DLQ_ENTRY_FIELDS and owner in DLQ_DICTS
            by_name = "dlq" in self._reads[-1] and (
                literal in DLQ_ENTRY_FIELDS
                or (isinstance(field, ast.Constant) and field.value in (b"m", b"reason"))
                or ast.unparse(field).split(".")[0] in ("MESSAGE_FIELD", "DlqField")
            )
            if named or by_name:
                text = literal or ast.unparse(field)
                self.found.append((field.lineno, text, "a dead-letter field", f"{owner}{how}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if (
            self.check_dlq
            and isinstance(node.value, ast.Name)
            and node.value.id == "DlqField"
            and node.attr.isupper()
        ):
            value = getattr(dead_letter.DlqField, node.attr, node.attr)
            self.found.append((node.lineno, value, f"DlqField.{node.attr}", "not DeadLetter"))
        self.generic_visit(node)

    # -- the req:{id} record ----------------------------------------------------------------
    def _record_field(self, node: ast.expr | None, position: str) -> None:
        value = _str(node)
        if value is not None and value in rec.FIELDS:
            self.found.append((node.lineno, value, f"record field {value!r}", position))  # type: ignore[union-attr]

    def _is_request_key(self, node: ast.expr, depth: int = 0) -> bool:
        if ".request(" in ast.unparse(node):
            return True
        if isinstance(node, ast.Name) and depth < 3:
            bound = self._scopes[-1].get(node.id, [])
            return any(self._is_request_key(v, depth + 1) for v in bound)
        return False

    def _request_call(self, node: ast.Call, name: str | None) -> None:
        if name in REQUEST_FIELD_CALLS and node.args and self._is_request_key(node.args[0]):
            named = node.args[1:]
            if name in ("hset", "hsetnx", "hget", "hincrby", "hexists"):
                named = named[:1]
            for arg in named:
                self._record_field(arg, f"{name} field")
            for kw in node.keywords:
                if kw.arg == "mapping":
                    for key in self._mapping_keys(kw.value):
                        self._record_field(key, f"{name} mapping key")
        for kw in node.keywords:
            if kw.arg == "req_fields":
                for key in self._mapping_keys(kw.value):
                    self._record_field(key, "req_fields key")

    # -- the worker:{name} hash -------------------------------------------------------------
    def _field(self, node: ast.expr | None, position: str, read: bool = False) -> None:
        value = _str(node)
        if value is not None and value in member_values(WorkerField):
            member = repr(WorkerField(value))
            self.found.append((node.lineno, value, member, position))  # type: ignore[union-attr]
        if read:
            self._member(node, f"{position}, not through WorkerRecord")

    def _member(self, node: ast.AST | None, where: str) -> None:
        """Flags `WorkerField.X` (the hash's field named past the record)."""
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "WorkerField"
            and node.attr in WorkerField.__members__
        ):
            value = WorkerField[node.attr].value
            self.found.append((node.lineno, value, f"WorkerField.{node.attr}", where))

    def _is_worker_key(self, node: ast.expr, depth: int = 0) -> bool:
        text = ast.unparse(node)
        if ".worker(" in text or "worker_pattern" in text:
            return True
        if isinstance(node, ast.Name) and depth < 3:
            return any(self._is_worker_key(v, depth + 1) for v in self._scopes[-1].get(node.id, []))
        return False

    def _mapping_keys(self, node: ast.expr) -> list[ast.expr | None]:
        if isinstance(node, ast.Dict):
            return list(node.keys)
        if isinstance(node, ast.Name):
            return [k for v in self._scopes[-1].get(node.id, []) for k in self._mapping_keys(v)]
        return []

    def _worker_call(self, node: ast.Call, name: str | None) -> None:
        worker_key = bool(node.args) and self._is_worker_key(node.args[0])
        if name in HASH_WRITES and worker_key and len(node.args) > 1:
            field = node.args[1]
            value = _str(field) or ast.unparse(field)
            self.found.append(
                (node.lineno, value, "a field", f"{name} field, not WorkerRecord.encode")
            )
        if name in HASH_FIELD_CALLS and worker_key:
            for arg in node.args[HASH_FIELD_CALLS[name] :][: 1 if name != "hdel" else None]:
                self._field(arg, f"{name} field")
            for kw in node.keywords:
                if kw.arg == "mapping":
                    for key in self._mapping_keys(kw.value):
                        self._field(key, f"{name} mapping key")
        if (
            name == "get"
            and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func.value) in WORKER_DICTS
            and node.args
        ):
            self._field(node.args[0], "worker dict .get", read=True)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load):
            self._record_read(node.value, node.slice, "[]")
        if self.check_worker_fields and ast.unparse(node.value) in WORKER_DICTS:
            self._field(node.slice, "worker dict subscript", read=isinstance(node.ctx, ast.Load))
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        if self.check_worker_fields:
            for key in node.keys:
                self._member(key, "dict key: a hand-built worker hash, not WorkerRecord.encode")
        for key, value in zip(node.keys, node.values, strict=True):
            self._check(_str(key), value, "dict")
        self.generic_visit(node)


def _record_key(node: ast.expr) -> str | None:
    """`models` or `dlq` for an expression naming that key (`keys.models`, `self.keys.dlq`)."""
    if isinstance(node, ast.Attribute) and node.attr in ("models", "dlq"):
        return node.attr
    return None


def _is_encode(node: ast.expr) -> bool:
    """`record.encode()` (or `record.stamped(now).encode()`)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "encode"
    )


def _key_reads(func: ast.AST) -> set[str]:
    """The record keys (`models`, `dlq`) a function reads."""
    out = set()
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in KEY_READS
            and node.args
            and (key := _record_key(node.args[0])) is not None
        ):
            out.add(key)
    return out


def find(source: str, path: Path | None = None) -> list[tuple[int, str, str, str]]:
    finder = Finder(SETS, path)
    finder.visit(ast.parse(source))
    return sorted(set(finder.found))


def test_no_state_literal_outside_its_type():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, value, member, where in find(path.read_text(), path):
            rel = path.relative_to(ROOT)
            problems.append(f"{rel}:{line}: {value!r} is {member} ({where})")
    assert not problems, "state literals outside their type:\n" + "\n".join(problems)


def test_finder_catches_each_position():
    source = """
def f(w, item, r, keys, mode="auto", *, api="chat"):
    if item.kind == "handoff" or opts.get("transport") in ("tcp", "ucx"):
        pass
    via = "ucx_local" if w else "tcp"
    Outgoing("dead_letter", 1, 2)
    Router(quantization="int8-weight-only")
    x = {"speculation": "ngram", "finish_reason": "length"}
    key = keys.worker(name)
    r.hget(key, "draining")
    fields = {"pid": 1, "other": 2}
    r.hset(key, mapping=fields)
    w.get("tokens_per_s"), w["load"], w.fields.get("drain")
    return record.status != "finished"
"""
    found = {(line, value) for line, value, _, _ in find(source)}
    assert found == {
        (2, "auto"),
        (2, "chat"),
        (3, "handoff"),
        (3, "tcp"),
        (3, "ucx"),
        (5, "ucx_local"),
        (5, "tcp"),
        (6, "dead_letter"),
        (7, "int8-weight-only"),
        (8, "ngram"),
        (8, "length"),
        (10, "draining"),
        (11, "pid"),
        (13, "tokens_per_s"),
        (13, "load"),
        (13, "drain"),
        (14, "finished"),
    }


def test_finder_catches_request_record_fields():
    source = """
def f(r, keys, rid, w):
    key = keys.request(rid)
    r.hget(key, "emitted"), r.hmget(keys.request(rid), "status", "error")
    r.hincrby(keys.request(rid), "attach", 1)
    fields = {"owner": w, "finish_reason": ""}
    r.hset(key, mapping=fields)
    Outgoing(kind, rid, 1, req_fields={"stage": "decode"})
    r.hget(keys.request(rid), rec.EMITTED), r.hset(key, mapping=RequestRecord().changes())
    r.hget(keys.worker(w), "status"), r.hget(keys.progress, "emitted")
"""
    found = {(line, value) for line, value, _, _ in find(source)}
    assert found == {
        (4, "emitted"),
        (4, "status"),
        (4, "error"),
        (5, "attach"),
        (6, "owner"),
        (6, "finish_reason"),
        (8, "stage"),
        (8, "decode"),  # a Stage, as before
    }
    # the record's own module spells its names
    assert find('r.hget(keys.request(rid), "emitted")', RECORD_MODULE) == []


def test_finder_ignores_text_and_other_hashes():
    source = '''
def g(r, keys, mode):
    """mode == "auto": the default."""
    logger.info("mode %s, transport tcp, draining", mode)
    msg = f"{mode == 'auto'}"
    r.hget(keys.store_node(n), "pid")
    info.get("name"), message.role == "user", kind == "fetch"
    return {"status": "ok", "model": "m"}, impl == "auto"
'''
    assert [(line, value) for line, value, _, _ in find(source)] == [(5, "auto")]


def test_finder_catches_worker_hash_access_past_the_record():
    source = """
def h(r, keys, w, pid):
    key = keys.worker(name)
    r.hset(key, WorkerField.DRAIN, 1)
    fields = {WorkerField.PID: pid}
    w.get(WorkerField.LOAD), w[WorkerField.RUNNING]
    w[WorkerField.TOKENS_PER_S] = 1.0
    r.hset(key, mapping=WorkerRecord(drain=True).encode((WorkerField.DRAIN,)))
    r.hget(key, WorkerField.PID)
    return WorkerRecord.decode(w).load
"""
    found = [(line, value, member) for line, value, member, _ in find(source)]
    assert found == [
        (4, "WorkerField.DRAIN", "a field"),
        (5, "pid", "WorkerField.PID"),
        (6, "load", "WorkerField.LOAD"),
        (6, "running", "WorkerField.RUNNING"),
    ]
    assert find(source, WORKER_RECORD) == []  # the record's own module reads and writes it


def test_finder_catches_models_entries_and_dead_letters_past_their_records():
    source = """
def publish(r, keys, entry):
    r.hset(keys.models, name, json.dumps({**entry, "published": 1.0}))
    r.hset(keys.models, name, entry.stamped(now).encode())

async def fetch(self):
    for name, raw in (await self.redis.hgetall(self.keys.models)).items():
        info = json.loads(raw)

def defaults(published, row):
    published.get("generation_defaults"), published["max_model_len"]
    row.get("request_id"), row["reason"], row.get("model")

def replay(r, keys, dlq_id):
    fields = r.xrange(keys.dlq, min=dlq_id, max=dlq_id)[0][1]
    fields.get(MESSAGE_FIELD), fields.get(DlqField.REASON.encode(), b"")
    r.xadd(keys.dlq, {MESSAGE_FIELD: b"x", "reason": "r"})
    r.xadd(keys.dlq, DeadLetter(payload=b"x").encode())
    return DeadLetter.decode(*r.xrange(keys.dlq)[0]).reason
"""
    found = [(line, value) for line, value, _, _ in find(source)]
    assert found == [
        (3, "json.dumps({**entry, 'published': 1.0})"),
        (8, "json.loads"),
        (11, "generation_defaults"),
        (11, "max_model_len"),
        (12, "reason"),
        (12, "request_id"),
        (16, "DlqField.REASON.encode()"),
        (16, "MESSAGE_FIELD"),
        (16, "reason"),  # DlqField.REASON itself
        (17, "{MESSAGE_FIELD: b'x', 'reason': 'r'}"),
    ]
    # the records' own modules spell their fields
    assert find('r.hset(keys.models, n, json.dumps({"files": d}))', PUBLISHED_MODULE) == []
    assert find("def f(r, k):\n    r.xrange(k.dlq)[0][1].get(DlqField.TIME)", DLQ_MODULE) == []
