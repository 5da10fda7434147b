"""A lint of the suite: every wall-clock upper bound is in a test marked ``timing``.

A bound on elapsed real time (``assert time.monotonic() - started < 2``) holds on an idle
machine and fails on a loaded one; CI runs such tests alone, in their own stage, once they are
marked ``timing`` (tests/conftest.py). Twelve had slipped outside the marker (issue 53). The
lint reads each test module's syntax tree: a name set from ``time.monotonic()``,
``time.perf_counter()`` or ``time.time()`` is a timestamp, a difference with a timestamp is
an elapsed time (and so is a name set from one), and an ``assert`` ordering an elapsed time
(``<``, ``<=``, ``>``, ``>=``) is a bound. It must be in a test marked ``timing`` (by its
decorator, its class or the module's ``pytestmark``), or in a helper only such tests call.
The fake clock (``FakeClock``) is not the wall clock: its readings are not timestamps here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import SOAK_MODULES
from tests.helpers import parse_source

TESTS = Path(__file__).resolve().parents[1]
CLOCK_FUNCTIONS = frozenset({"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
                             "time", "time_ns"})
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@dataclass(frozen=True)
class Bound:
    """A wall-clock bound outside the ``timing`` marker."""

    path: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: in {self.function}()"


def _is_timing_mark(node: ast.expr) -> bool:
    """``pytest.mark.timing`` or ``mark.timing``, called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "timing" and (
        (isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
        or (isinstance(node.value, ast.Name) and node.value.id == "mark"))


def _module_is_timing(tree: ast.Module) -> bool:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            marks = stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
            if any(_is_timing_mark(m) for m in marks):
                return True
    return False


def _clock_names(tree: ast.Module) -> set[str]:
    """Names ``from time import ...`` brought in that read the wall clock."""
    return {alias.asname or alias.name for stmt in ast.walk(tree)
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "time"
            for alias in stmt.names if alias.name in CLOCK_FUNCTIONS}


AGGREGATES = frozenset({"min", "max", "abs", "round", "float", "int", "sum"})


def _target_names(target: ast.expr) -> set[str]:
    """The names an assignment sets: ``x``, ``x, y``; ``x[k]`` and ``x.a`` set ``x``."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return {name for t in target.elts for name in _target_names(t)}
    if isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
        return _target_names(target.value)
    return set()


def _is_duration(node: ast.expr) -> bool:
    """A literal or a CONSTANT expression (``FLUSH + SLACK``, ``2 * TTL``): a time span."""
    return all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop,
                              ast.Load, ast.Attribute)) or (isinstance(n, ast.Name) and n.id.isupper())
               for n in ast.walk(node))


class _Function:
    """The timestamps, deadlines, elapsed times and bounds of one function (nested ones
    included): names set from the wall clock are timestamps (``started``), a timestamp plus a
    span is a deadline (``deadline``), a timestamp minus a timestamp (or minus anything that
    is not a span) is an elapsed time; a timestamp minus a deadline is a time left."""

    def __init__(self, node: ast.FunctionDef | ast.AsyncFunctionDef, clock_names: set[str]) -> None:
        self.node = node
        self.clock_names = clock_names
        self.stamps: set[str] = set()
        self.deadlines: set[str] = set()
        self.elapsed: set[str] = set()
        sets: list[tuple[set[str], ast.expr]] = []
        for n in ast.walk(node):
            if isinstance(n, ast.Assign):
                sets.append(({name for t in n.targets for name in _target_names(t)}, n.value))
            elif isinstance(n, (ast.AnnAssign, ast.AugAssign)) and n.value is not None:
                sets.append((_target_names(n.target), n.value))
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                  and n.func.attr in ("append", "add", "setdefault") and n.args):
                sets.append((_target_names(n.func.value), n.args[-1]))
        for _ in range(len(sets) + 1):  # to a fixed point: names set from names
            before = (len(self.stamps), len(self.deadlines), len(self.elapsed))
            for names, value in sets:
                if self.is_elapsed(value):
                    self.elapsed |= names
                elif (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)
                      and self.is_stamp(value)):
                    self.deadlines |= names
                elif self.is_stamp(value):
                    self.stamps |= names
            if (len(self.stamps), len(self.deadlines), len(self.elapsed)) == before:
                break

    def _is_clock_call(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        if isinstance(func, ast.Attribute):
            return (func.attr in CLOCK_FUNCTIONS and isinstance(func.value, ast.Name)
                    and func.value.id == "time")
        return isinstance(func, ast.Name) and func.id in self.clock_names

    def is_stamp(self, node: ast.AST) -> bool:
        """A reading of the wall clock, or one moved by a span (a deadline too)."""
        if self._is_clock_call(node):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.stamps or node.id in self.deadlines
        if isinstance(node, ast.Subscript):  # stamps[k]
            return self.is_stamp(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            if self.is_stamp(node.left) and self.is_stamp(node.right):
                return False  # a difference of two stamps is elapsed, not a stamp
            return ((self.is_stamp(node.left) and _is_duration(node.right))
                    or (self.is_stamp(node.right) and _is_duration(node.left)))
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in AGGREGATES:
                return any(self.is_stamp(a) for a in node.args)
            return isinstance(func, ast.Attribute) and self.is_stamp(func.value)  # d.values()
        return False

    def _is_deadline(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.deadlines

    def is_elapsed(self, node: ast.AST) -> bool:
        """A span of wall-clock time measured by the test (not a time left to a deadline)."""
        if isinstance(node, ast.Name):
            return node.id in self.elapsed
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Sub) and (self.is_stamp(node.left) or self.is_stamp(node.right)):
                if self._is_deadline(node.left) or self._is_deadline(node.right):
                    return False
                return not (_is_duration(node.left) or _is_duration(node.right))
            return self.is_elapsed(node.left) or self.is_elapsed(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.is_elapsed(node.operand)
        if isinstance(node, ast.Subscript):
            return self.is_elapsed(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in AGGREGATES:
            return any(self.is_elapsed(a) for a in node.args)
        return False

    def bounds(self) -> list[int]:
        """The lines of the asserts that bound an elapsed time from above."""
        lines = []
        for stmt in ast.walk(self.node):
            if not isinstance(stmt, ast.Assert):
                continue
            for cmp in ast.walk(stmt.test):
                if not isinstance(cmp, ast.Compare):
                    continue
                sides = [cmp.left, *cmp.comparators]
                if any((isinstance(op, (ast.Lt, ast.LtE)) and self.is_elapsed(sides[i]))
                       or (isinstance(op, (ast.Gt, ast.GtE)) and self.is_elapsed(sides[i + 1]))
                       for i, op in enumerate(cmp.ops)):
                    lines.append(stmt.lineno)
                    break
        return lines


def wall_clock_bounds(source: str, path: str = "<source>") -> list[Bound]:
    """The wall-clock bounds of a test module's ``source`` outside the ``timing`` marker."""
    tree = parse_source(source, "<source>")
    if _module_is_timing(tree):
        return []
    clock_names = _clock_names(tree)
    timing: dict[str, bool] = {}  # top-level test function -> marked timing
    functions: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef):
            in_timing_class = any(_is_timing_mark(d) for d in stmt.decorator_list)
            functions += [(f, in_timing_class) for f in stmt.body
                          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append((stmt, False))
    for func, in_timing_class in functions:
        if func.name.startswith("test"):
            timing[func.name] = in_timing_class or any(_is_timing_mark(d) for d in func.decorator_list)
    calls = {f.name: {n.id for n in ast.walk(f) if isinstance(n, ast.Name)} for f, _ in functions}
    found = []
    for func, _ in functions:
        if func.name in timing:
            exempt = timing[func.name]
        else:  # a helper: exempt when the tests that use it are all marked timing
            users = [name for name in timing if func.name in calls[name]]
            exempt = bool(users) and all(timing[name] for name in users)
        if not exempt:
            found += [Bound(path, line, func.name)
                      for line in _Function(func, clock_names).bounds()]
    return found


def test_no_wall_clock_bound_outside_the_timing_marker() -> None:
    # The soaks (tests/conftest.py SOAK_MODULES) run in a stage of their own, after the answer
    # to a push, and bound their failovers by deadlines generous for a saturated machine.
    soaks = {TESTS.parent / module for module in SOAK_MODULES}
    found = [bound for path in sorted(set(TESTS.rglob("test_*.py")) - soaks)
             for bound in wall_clock_bounds(path.read_text(), str(path.relative_to(TESTS.parent)))]
    assert not found, ("wall-clock upper bounds outside the `timing` marker (mark the test "
                       "@pytest.mark.timing, or bound it on metafora.testing.FakeClock):\n"
                       + "\n".join(map(str, found)))


PLANTED = '''
import time
import pytest

def test_planted() -> None:
    started = time.monotonic()
    work()
    took = time.monotonic() - started
    assert took < 2.0

def test_inline() -> None:
    began = time.perf_counter()
    assert time.perf_counter() - began <= 1.0, "fast"

@pytest.mark.timing
def test_marked() -> None:
    started = time.monotonic()
    assert time.monotonic() - started < 2.0

def test_fake_clock(clock) -> None:
    started = clock.monotonic()
    assert clock.monotonic() - started < 2.0

def test_a_deadline_of_a_loop() -> None:
    deadline = time.monotonic() + 15
    while not done():
        assert time.monotonic() < deadline

def test_an_order_of_events() -> None:
    first = time.monotonic()
    second = time.monotonic()
    assert first <= second

def _measure() -> float:
    started = time.monotonic()
    took = time.monotonic() - started
    assert took < 1
    return took

@pytest.mark.timing
def test_through_a_helper() -> None:
    _measure()
'''


def test_the_lint_finds_a_planted_bound() -> None:
    found = wall_clock_bounds(PLANTED)
    assert [(b.function, b.line) for b in found] == [("test_planted", 9), ("test_inline", 13)]


def test_the_lint_finds_a_bound_in_a_helper_an_unmarked_test_calls() -> None:
    source = PLANTED + "\ndef test_unmarked_user() -> None:\n    _measure()\n"
    assert ("_measure", 37) in [(b.function, b.line) for b in wall_clock_bounds(source)]


def test_the_lint_finds_a_bound_with_a_from_import() -> None:
    source = ("from time import perf_counter as clock\n\n"
              "def test_x() -> None:\n    t = clock()\n    assert clock() - t < 1\n")
    assert [b.line for b in wall_clock_bounds(source)] == [5]


def test_a_timing_module_is_exempt() -> None:
    source = "import pytest\n\npytestmark = [pytest.mark.timing]\n" + PLANTED
    assert wall_clock_bounds(source) == []
