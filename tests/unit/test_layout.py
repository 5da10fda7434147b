"""The package's layout rules that an import can break.

- ``import metafora`` loads no module of the state machine or the gates (a user of plain tasks
  pays for neither), and importing the state machine does not load the gates, which are built
  on it, although ``metafora.statemachine.gates`` (their first name) still answers.
- The features (``statemachine``, ``gates``) and the consumer's and balancers' packages never
  import a store package's internals (``metafora.coordinators.<store>``): they reach a store
  through the backend table (:mod:`metafora.backends`) and the interfaces they own.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import metafora

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
    assert "metafora.consumer" in loaded  # the probe sees what the import loaded
    assert [m for m in loaded if m.startswith(("metafora.statemachine", "metafora.gates"))] == []


def test_the_state_machine_loads_no_gates_module_until_the_old_name_is_used() -> None:
    assert [m for m in _loaded_after("import metafora.statemachine") if m.startswith("metafora.gates")] == []
    assert "metafora.gates" in _loaded_after("from metafora.statemachine.gates import ItemStore")


def _imports(path: Path, top: Path = PACKAGE.parent) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (a module under ``top``), at
    any depth (a function's import too); ``from X import name`` also yields ``X.name``, which
    may be a module."""
    package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
