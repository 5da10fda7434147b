"""The package's layout rules that an import can break, and the floors of the house.

- Every module stands on a floor (:mod:`metafora.core._layout`, drawn in docs/architecture.md):
  nothing imports up a floor, the consumer and the features import no store and no surface,
  only the stores (and the testing helpers) import a store module, and imports form no cycle
  -- read statically, a function's imports too.
- No module outgrows 600 lines, no class 400, no function 80; today's exceptions are pinned
  at their size (:data:`OVERSIZED`) and can only shrink.

- ``import metafora`` loads no module of the state machine or the gates (a user of plain tasks
  pays for neither), and importing the state machine does not load the gates, which are built
  on it.
- The features (``statemachine``, ``gates``) and the consumer's and balancers' packages never
  import a store package's internals (``metafora.coordinators.<store>``): they reach a store
  through the backend table (:mod:`metafora.contracts.backends`) and the interfaces they own.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import metafora
from tests.helpers import parse_source

PACKAGE = Path(metafora.__file__).resolve().parent
FEATURES = ("statemachine", "gates", "consumer", "balancers")
STORES = sorted(p.name for p in (PACKAGE / "coordinators").iterdir()
                if p.is_dir() and (p / "__init__.py").exists())


def _loaded_after(code: str) -> list[str]:
    """The metafora modules a fresh interpreter holds after running ``code``."""
    probe = (f"{code}\nimport json, sys\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith('metafora.'))))")
    path = os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True,
                         text=True, timeout=120).stdout
    loaded: list[str] = json.loads(out.splitlines()[-1])
    return loaded


def test_import_metafora_loads_no_state_machine_or_gates_module() -> None:
    loaded = _loaded_after("import metafora")
    assert "metafora.contracts.client" in loaded  # the probe sees what the import loaded
    assert [m for m in loaded if m.startswith(("metafora.statemachine", "metafora.gates"))] == []


def test_import_metafora_loads_the_consumer_at_first_use() -> None:
    """A command of the CLI that only talks to the store does not pay for the consumer's
    modules (asyncio, the HTTP server, the balancers) at start-up."""
    assert [m for m in _loaded_after("import metafora") if m.startswith("metafora.consumer")] == []
    loaded = _loaded_after("import metafora\nassert metafora.Consumer.__name__ == 'Consumer'\n"
                           "from metafora import Consumer")
    assert "metafora.consumer.core" in loaded


def test_the_state_machine_loads_no_gates_module() -> None:
    assert [m for m in _loaded_after("import metafora.statemachine") if m.startswith("metafora.gates")] == []
    assert "metafora.gates" in _loaded_after("from metafora import gates")


def test_a_feature_verb_of_the_client_loads_its_feature_on_first_use() -> None:
    """The client imports no feature: its stream verbs and the state reset are the features'
    registered verbs (metafora.contracts.recipes), loaded by the first call."""
    probe = ("import metafora\nfrom metafora.core.errors import TaskNotFound\n"
             "client = metafora.open_client('memory://recipes')\n"
             "for call in (lambda: client.stream('none'), lambda: client.retry_task('none', True)):\n"
             "    try:\n        call()\n    except TaskNotFound:\n        pass\n")
    loaded = _loaded_after(probe)
    assert {"metafora.streams.ops", "metafora.statemachine.retry"} <= set(loaded)


def test_a_store_found_by_name_loads_no_other_store(tmp_path: Path) -> None:
    """The registry finds the store of an open client among the entry points already
    imported: a SQLite user's state machine loads no etcd module (nor grpc)."""
    probe = ("import metafora\nfrom metafora.statemachine.store import state_store_for\n"
             f"client = metafora.open_client('sqlite:///{tmp_path / 'm.db'}')\n"
             "state_store_for(client).close()\n")
    loaded = _loaded_after(probe)
    assert "metafora.coordinators.sql.states" in loaded
    assert [m for m in loaded if m.startswith("metafora.coordinators.etcd")] == []


def test_a_node_on_a_sql_store_starts_without_the_orm(tmp_path: Path) -> None:
    """A worker's start imports no ``sqlalchemy.orm`` (a tenth of a second of every start):
    a ``Session`` passed as ``conn=`` is recognised without importing it (issue 51)."""
    probe = ("import sys, threading, metafora\n"
             f"url = 'sqlite:///{tmp_path / 'n.db'}'\n"
             "client = metafora.open_client(url)\nclient.submit_task(metafora.Task('a'))\n"
             "async def run(task, stop):\n"
             "    threading.Thread(target=consumer.shutdown).start()\n    return True\n"
             "consumer = metafora.Consumer(metafora.open_coordinator(url, node_id='n'),"
             " metafora.simple_handler(run), shutdown_timeout=5)\n"
             "consumer.run()\nassert client.get_task('a').state == 'done', client.get_task('a')\n"
             "client.close()\nprint('sqlalchemy.orm' in sys.modules)")
    path = os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=path),
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert out.splitlines()[-1] == "False"


def _imports(path: Path, top: Path = PACKAGE.parent) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (a module under ``top``), at
    any depth (a function's import too); ``from X import name`` also yields ``X.name``, which
    may be a module."""
    package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(parse_source(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found += [(node.lineno, base), *((node.lineno, f"{base}.{a.name}") for a in node.names)]
    return found


def test_features_import_no_store_package() -> None:
    assert STORES == ["etcd", "memory", "sql"]
    inside = tuple(f"metafora.coordinators.{store}" for store in STORES)
    reaching = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for feature in FEATURES
        for path in sorted((PACKAGE / feature).rglob("*.py"))
        for line, name in _imports(path)
        if name in inside or name.startswith(tuple(f"{p}." for p in inside))
    ]
    assert reaching == []


def test_the_import_reader_sees_relative_and_nested_imports(tmp_path: Path) -> None:
    """The check above would pass on a reader that saw nothing: it sees these forms."""
    module = tmp_path / "metafora" / "statemachine" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from ..coordinators.sql import store\n"
                      "    import metafora.coordinators.etcd.driver\n")
    assert {name for _, name in _imports(module, tmp_path)} >= {
        "metafora.coordinators.sql.store", "metafora.coordinators.etcd.driver"}


# --- the floors (metafora/core/_layout.py, docs/architecture.md) ------------------------------------

MODULE_LINES = 600
CLASS_LINES = 400
FUNCTION_LINES = 80
"""A function's most lines (today's longest but two; the two are pinned below)."""

# Today's exceptions to the size rules, each pinned at its size today so it cannot grow: a
# split lowers the figure (or removes the row), nothing may raise it.
OVERSIZED: dict[str, tuple[int, str]] = {}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str, bool]]:
    """(line, imported module of the package, only for type checking) of every import in
    ``path``, at any depth; ``from X import y`` names ``X.y`` where that is a module, else X;
    an import of a name inside a module names the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = parse_source(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing_only.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            module = owner(target) if target.startswith("metafora") else None
            if module is not None and module != name:
                found.append((node.lineno, module, id(node) in typing_only))
    return found


def _graph() -> dict[str, list[tuple[int, str, bool]]]:
    modules = _modules()
    return {name: _module_imports(name, path, modules) for name, path in modules.items()}


def _where(name: str, line: int) -> str:
    return f"{_modules()[name].relative_to(PACKAGE.parent)}:{line}"


def test_every_module_has_a_floor_read_from_its_folder() -> None:
    from metafora.core._layout import FLOORS, FOLDERS, MODULES, floor_of

    assert set(MODULES.values()) <= set(FLOORS) and set(FOLDERS.values()) == set(FLOORS)
    assert {name: floor_of(name) for name in _modules()}  # KeyError for a module on no floor
    assert floor_of("metafora.core.task") == "ground" and floor_of("metafora.balancers.fair") == "consumer"
    # MODULES keeps only what a folder cannot say
    folders_say = {name: FOLDERS[name.split(".")[1]] for name in MODULES
                   if name.count(".") >= 1 and name.split(".")[1] in FOLDERS}
    assert [name for name, floor in folders_say.items() if MODULES[name] == floor] == []
    assert sorted(set(MODULES) - set(_modules())) == []  # no row for a module that is gone


def test_nothing_but_the_floor_folders_stands_at_the_top_level() -> None:
    """A new module goes into the folder of its floor: a module added at the package's top
    level fails here (and has no floor: floor_of raises KeyError for it)."""
    from metafora.core._layout import FOLDERS, floor_of

    top = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert [name for name in top if name not in {"__init__.py", "__main__.py", "py.typed", *FOLDERS}] == []
    assert [name for name in FOLDERS if not (PACKAGE / name / "__init__.py").is_file()] == []
    with pytest.raises(KeyError):
        floor_of("metafora.newcomer")


def test_nothing_imports_up_a_floor() -> None:
    from metafora.core._layout import FLOORS, floor_of

    up = [f"{_where(name, line)}: {name} ({floor_of(name)}) imports {target} ({floor_of(target)})"
          for name, imports in _graph().items()
          for line, target, _typing in imports
          if FLOORS.index(floor_of(target)) > FLOORS.index(floor_of(name))]
    assert up == []


def test_the_consumer_and_the_features_import_no_store_and_no_surface() -> None:
    """Imports that run; a type-only one (``if TYPE_CHECKING:``, to name a store's class in a
    signature) loads nothing."""
    from metafora.core._layout import floor_of

    reaching = [f"{_where(name, line)}: {name} imports {target}"
                for name, imports in _graph().items() if floor_of(name) in ("consumer", "features")
                for line, target, typing in imports
                if floor_of(target) in ("stores", "surfaces") and not typing]
    assert reaching == []


def test_a_store_imports_no_other_store_and_only_the_stores_import_one() -> None:
    """Outside the stores, a store module is reached through the registry; the testing
    helpers (a surface) are the one exception: they start servers and drop memory stores.
    What the stores share sits beside them (``metafora.coordinators.members``). Imports that
    run: a type-only one names a store's class and loads nothing."""
    from metafora.core._layout import floor_of

    def store(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "coordinators" and parts[2] in STORES else None

    crossing = [f"{_where(name, line)}: {name} imports {target}"
                for name, imports in _graph().items()
                for line, target, typing in imports
                if store(target) is not None and store(name) != store(target) and not typing
                and not (floor_of(name) == "surfaces" and name.startswith("metafora.testing"))]
    assert crossing == []


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The modules of each import cycle of ``graph`` (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycle() -> None:
    """Imports that run (those under ``if TYPE_CHECKING:`` do not) form no cycle."""
    graph = {name: sorted({t for _line, t, typing in imports if not typing})
             for name, imports in _graph().items()}
    assert _cycles(graph) == []
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]  # it sees one


def _sizes() -> dict[str, tuple[int, int]]:
    """Lines of every module, and of every class and function in it (``path:Name``; a
    method is named by its own name), each with the rule's limit."""
    sizes: dict[str, tuple[int, int]] = {}
    for path in _modules().values():
        rel = str(path.relative_to(PACKAGE.parent))
        text = path.read_text()
        sizes[rel] = (len(text.splitlines()), MODULE_LINES)
        for node in ast.walk(parse_source(text, rel)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{rel}:{node.name}"
                assert node.end_lineno is not None
                rule = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
                lines = max(sizes.get(key, (0, 0))[0], node.end_lineno - node.lineno + 1)
                sizes[key] = (lines, rule)
    return sizes


def test_no_module_class_or_function_outgrows_the_rules() -> None:
    sizes = _sizes()
    grown = [f"{key}: {lines} lines (at most {OVERSIZED.get(key, (rule,))[0]})"
             for key, (lines, rule) in sorted(sizes.items())
             if lines > OVERSIZED.get(key, (rule,))[0]]
    assert grown == []
    # an exception that is no longer needed goes (the table only shrinks)
    assert [key for key in OVERSIZED if key not in sizes or sizes[key][0] <= sizes[key][1]] == []


def test_the_floor_reader_sees_function_imports_and_type_checking_blocks(tmp_path: Path) -> None:
    """The checks above would pass on a reader that saw nothing: it sees these forms."""
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from metafora.contracts.client import Client\n"
                      "def f():\n    from ..consumer import offers\n    import metafora.surfaces.connect\n")
    modules = {"metafora.contracts.client": module, "metafora.consumer": module,
               "metafora.consumer.offers": module, "metafora.surfaces.connect": module,
               "metafora.gates.x": module}
    found = {(target, typing)
             for _line, target, typing in _module_imports("metafora.gates.x", module, modules)}
    assert found == {("metafora.contracts.client", True), ("metafora.consumer.offers", False),
                     ("metafora.surfaces.connect", False)}
