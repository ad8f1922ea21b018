"""No test asserts a bound on the wall clock or the CPU clock (CONTRIBUTING.md, issue 24).

Walks `tests/` with `ast` and flags an ordering comparison (`<`, `<=`, `>`, `>=`), or an `==`
against `pytest.approx(...)`, inside an `assert` when one side reads a clock: a call of
`time.time()`, `time.monotonic()`, `time.perf_counter()`, `time.process_time()`, ...,
`loop.time()`, `datetime.now()`, or a name the same function (or an enclosing one) bound from
such a read (`t0 = time.monotonic()`, `elapsed = time.monotonic() - t0`). Such an assertion
fails on a loaded machine or proves little: assert on the event instead, or give the code a
clock of its own (`fake_clock` in tests/conftest.py).

A key's time to live counts down on Valkey's clock: `r.ttl(key)`, `r.pttl(key)` (or `TTL`,
`PTTL`, `HTTL`, `HPTTL`) compared with a number other than 0 (`90 < r.ttl(key) <= 100`) bounds how
long the test took too; bracket the write with Valkey's TIME instead (`ValkeyClock` in
tests/queue_state.py) and compare the expiry time (`expires_at`).

Allowed: a polling loop's guard, `assert time.monotonic() < deadline` inside a `while` loop that
waits for an event (the clock read on the left of `<`/`<=`, or on the right of `>`/`>=`), and
clock reads outside assertions (setting up records, deadlines).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CLOCK_MODULE_CALLS = frozenset(
    {"time", "monotonic", "perf_counter", "process_time", "thread_time", "time_ns",
     "monotonic_ns", "perf_counter_ns", "process_time_ns", "thread_time_ns", "clock_gettime"}
)  # fmt: skip
LOOP_NAMES = frozenset({"loop", "event_loop"})
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def is_clock_read(node: ast.AST) -> bool:
    """`time.time()`, `time.monotonic()`, ..., `loop.time()`, `datetime.now()`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    owner, attr = node.func.value, node.func.attr
    if isinstance(owner, ast.Name):
        if owner.id == "time":
            return attr in CLOCK_MODULE_CALLS
        if owner.id in LOOP_NAMES:
            return attr == "time"
        if owner.id == "datetime":
            return attr in ("now", "utcnow", "today")
    if isinstance(owner, ast.Attribute) and owner.attr == "datetime":
        return attr in ("now", "utcnow", "today")
    # asyncio.get_running_loop().time(), asyncio.get_event_loop().time()
    return (
        attr == "time"
        and isinstance(owner, ast.Call)
        and isinstance(owner.func, ast.Attribute)
        and owner.func.attr in ("get_running_loop", "get_event_loop")
    )


def dotted(node: ast.AST) -> str | None:
    """`t0`, `self.t0`: the name an assignment binds or an expression reads."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def reads_clock(node: ast.AST, tainted: set[str]) -> bool:
    """Whether `node` reads a clock, directly or through a name bound from one."""
    for sub in ast.walk(node):
        if is_clock_read(sub):
            return True
        name = dotted(sub) if isinstance(sub, ast.Name | ast.Attribute) else None
        if name is not None and name in tainted:
            return True
    return False


def own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of `function`'s body, not those of the functions defined in it."""
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, FUNCTIONS):
            todo.extend(ast.iter_child_nodes(node))


def bind(target: ast.AST, value: ast.AST | None, tainted: set[str]) -> bool:
    """Taint `target` when `value` reads a clock (tuples element by element); True if it grew."""
    if isinstance(target, ast.Tuple | ast.List):
        if isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts):
            pairs = zip(target.elts, value.elts, strict=True)
            return any([bind(t, v, tainted) for t, v in pairs])
        return any([bind(t, value, tainted) for t in target.elts])
    name = dotted(target)
    if name is None or name in tainted or value is None or not reads_clock(value, tainted):
        return False
    tainted.add(name)
    return True


def taint(function: ast.AST, inherited: set[str]) -> set[str]:
    """The names `function` binds from a clock read, with those of its enclosing functions."""
    tainted = set(inherited)
    grew = True
    while grew:  # a fixpoint: `elapsed = now - t0` may come before `t0 = ...` in the text
        grew = False
        for node in own_nodes(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    grew |= bind(target, node.value, tainted)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                grew |= bind(node.target, node.value, tainted)
    return tainted


TTL_CALLS = frozenset({"ttl", "pttl"})
TTL_COMMANDS = frozenset({"TTL", "PTTL", "HTTL", "HPTTL"})
NOT_A_BOUND = (0, -1, -2)  # "has an expiry", "has none", "is gone"


def is_ttl_read(node: ast.AST) -> bool:
    """`r.ttl(key)`, `r.pttl(key)`, `r.execute_command("HTTL", ...)`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr in TTL_CALLS:
        return True
    first = node.args[0] if node.args else None
    return (
        node.func.attr == "execute_command"
        and isinstance(first, ast.Constant)
        and str(first.value).upper() in TTL_COMMANDS
    )


def is_number(node: ast.AST) -> bool:
    """A number written in the test: literals and UPPER_CASE constants, with arithmetic."""
    return all(
        isinstance(sub, ast.Constant | ast.BinOp | ast.UnaryOp | ast.operator | ast.unaryop)
        or (isinstance(sub, ast.Name) and sub.id.isupper())
        or isinstance(sub, ast.expr_context)
        for sub in ast.walk(node)
    )


def ttl_bound(left: ast.AST, right: ast.AST) -> bool:
    """A time to live read compared with a number other than 0, -1, -2."""
    for ttl, number in ((left, right), (right, left)):
        if any(is_ttl_read(sub) for sub in ast.walk(ttl)) and is_number(number):
            try:
                return ast.literal_eval(number) not in NOT_A_BOUND
            except ValueError:  # a named constant: a bound
                return True
    return False


def is_approx(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (dotted(node.func) or "").endswith("approx")


def polling_guard(compare: ast.Compare, in_while: bool) -> bool:
    """`time.monotonic() < deadline` in a `while` loop that waits for an event."""
    if not in_while or len(compare.ops) != 1:
        return False
    op, left, right = compare.ops[0], compare.left, compare.comparators[0]
    if isinstance(op, ast.Lt | ast.LtE):
        return is_clock_read(left)
    if isinstance(op, ast.Gt | ast.GtE):
        return is_clock_read(right)
    return False


def clock_bounds(compare: ast.Compare, tainted: set[str], in_while: bool) -> bool:
    """Whether `compare` bounds a clock reading (the polling guard aside)."""
    sides = [compare.left, *compare.comparators]
    for op, left, right in zip(compare.ops, sides[:-1], sides[1:], strict=True):
        bounded = isinstance(op, ORDERING) or (
            isinstance(op, ast.Eq | ast.NotEq) and (is_approx(left) or is_approx(right))
        )
        if bounded and (reads_clock(left, tainted) or reads_clock(right, tainted)):
            return not polling_guard(compare, in_while)
        if isinstance(op, ORDERING) and ttl_bound(left, right):
            return True
    return False


def findings(tree: ast.AST, path: str) -> Iterator[str]:
    """`path:line: assert ...` for each assertion that bounds a clock."""

    def visit(function: ast.AST, inherited: set[str]) -> Iterator[str]:
        tainted = taint(function, inherited)
        yield from check(function, tainted, in_while=False)

    def check(node: ast.AST, tainted: set[str], in_while: bool) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FUNCTIONS):
                yield from visit(child, tainted)
                continue
            if isinstance(child, ast.Assert):
                for sub in ast.walk(child.test):
                    if isinstance(sub, ast.Compare) and clock_bounds(sub, tainted, in_while):
                        yield f"{path}:{child.lineno}: {ast.unparse(child.test)}"
                        break
            yield from check(child, tainted, in_while or isinstance(child, ast.While))

    yield from visit(tree, set())


def scan(text: str, path: str = "<test>") -> list[str]:
    return list(findings(ast.parse(text), path))


def test_no_assertion_bounds_a_clock():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += scan(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert found == []


def test_the_check_flags_clock_bounds_and_allows_polling_guards():
    flagged = scan(
        "import time\n"
        "def f(rows, record, loop):\n"
        "    before = time.time()\n"
        "    assert before - 1 < rows[0] < time.time() + 1\n"  # a tolerance around the clock
        "    t0, n = time.monotonic(), 0\n"
        "    elapsed = time.monotonic() - t0\n"
        "    assert elapsed < 3 and n == 0\n"  # a bound on how long something took
        "    assert abs(record - time.time()) < 60\n"
        "    assert record == pytest.approx(time.time(), abs=1)\n"
        "    for row in rows:\n"
        "        assert row <= time.perf_counter()\n"  # a `for` loop is no polling loop
        "    def inner():\n"
        "        assert time.monotonic() - t0 >= 1.5\n"  # t0 of the enclosing function
        "    end = loop.time() + 5\n"
        "    while not rows:\n"
        "        assert end > loop.time() + 1\n"  # the clock on the wrong side: a bound
        "    assert 0 < r.ttl('k') <= 600\n"  # Valkey's countdown
        "    assert FILES_TTL_S - 5 <= r.pttl('k')\n"
        "    assert 90 < r.execute_command('HTTL', 'h', 'FIELDS', 1, 'f')[0]\n"
    )
    lines = [line.split(":")[1] for line in flagged]
    assert lines == ["4", "7", "8", "9", "11", "13", "16", "17", "18", "19"]
    allowed = scan(
        "import time\n"
        "def f(r, proc, fake_clock, deadline_in_s):\n"
        "    deadline = time.monotonic() + 5\n"
        "    while not r.exists('k'):\n"
        "        assert time.monotonic() < deadline, 'never came'\n"  # the polling guard
        "        assert proc.poll() is None and deadline > time.monotonic()\n"
        "    r.hset('w', mapping={'updated': time.time()})\n"  # setup, no assertion
        "    now = time.time()\n"
        "    assert r.hget('w', 'updated') == now\n"  # the value the code was given back
        "    assert fake_clock.time() == deadline_in_s\n"  # a clock of the test's own
        "    assert fake_clock.waited <= 3\n"
        "    assert r.ttl('k') > 0 and r.pttl('gone') == -2 and r.ttl('kept') != 5\n"
        "    assert ttl_after <= status['ttl_s'] <= r.ttl('k')\n"  # readings in order
    )
    assert allowed == []
