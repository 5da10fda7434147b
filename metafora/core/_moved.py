"""The one policy for moved names: a name users were given keeps working; any other moved
name fails loudly, naming its new home.

- A **moved module** (one of the package's top-level modules, moved into the folder of its
  floor: ``metafora.task`` is now ``metafora.core.task``) keeps its old name with no file
  left behind: :data:`MOVED_MODULES` is the one table of them, and :class:`MovedModuleFinder`
  (on ``sys.meta_path``, installed by ``metafora/__init__.py``) serves an old name as the
  *same* module object (``metafora.task is metafora.core.task``), so ``import metafora.task``,
  ``from metafora.task import Task`` and old pickles all work. The package's own code, its
  docs and tests import the new names (a type checker does not see the finder).

- A **published** name (one ``DESIGN.md`` gave users, such as ``metafora.statemachine.gates``,
  the first name of :mod:`metafora.gates`) forwards to its new home (:func:`module_forward`),
  looked up by module name at first use, so the old module imports nothing up a floor and only
  code that uses the old name loads the new one.
- An **internal** name that moved raises: a moved module :class:`ImportError` when imported
  (:func:`module_moved`); a moved name of a module that stays :class:`AttributeError` (which
  ``from X import name`` turns into an ImportError) from the module's ``__getattr__``
  (:func:`names_moved`). Forwarding those would hide where a name lives (and, for a name moved
  into a store, make a feature reach into that store).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Final, NoReturn

__all__ = ["MOVED_MODULES", "MovedModuleFinder", "install_finder", "module_forward", "module_moved",
           "names_moved"]

_FLOORS: Final = {
    "core": ("errors", "clock", "durations", "heap", "hosts", "masking", "metrics", "tracing",
             "jsontext", "logs", "node", "config", "groupcommit", "submitting", "task", "task_retry",
             "bulk", "commands", "limits", "schedule_model", "retention", "leases", "holds"),
    "contracts": ("handler", "binding", "balancer", "coordinator", "client", "aio", "registry",
                  "recipes", "backends"),
    "consumer": ("schedule", "cluster_metrics", "http"),
    "features": ("waiting",),
    "surfaces": ("connect",),
}

MOVED_MODULES: Final[Mapping[str, str]] = {
    f"metafora.{name}": f"metafora.{folder}.{name}" for folder, names in _FLOORS.items() for name in names}
"""Old dotted name -> new, of every module that moved from the package's top level into the
folder of its floor (the private ``_layout`` and ``_moved`` moved too, and keep no old name)."""


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module of its new one: the module object itself, not a copy."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        # the import system sets module.__spec__ to the old name's spec after this call: keep
        # the module's own, to put back in exec_module
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # already run under its new name: only undo the import system's __spec__ swap
        spec = module.__spec__
        if spec is not None and isinstance(spec.loader_state, importlib.machinery.ModuleSpec):
            module.__spec__ = spec.loader_state


_ALIAS_LOADER: Final = _AliasLoader()


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds each old name of :data:`MOVED_MODULES` (and nothing else: any other missing
    ``metafora.x`` is still a ModuleNotFoundError)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """The spec of an old name, served by the alias loader; None for any other name."""
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _ALIAS_LOADER)


def install_finder() -> None:
    """Put :class:`MovedModuleFinder` last on ``sys.meta_path``, once (a real module of an old
    name, were one ever added back, would win)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def module_forward(
    namespace: dict[str, Any], new: str,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a published module whose names moved to ``new``:
    each name is looked up there (``__all__`` too, so ``import *`` works) at first use and kept
    in ``namespace`` (the old module's globals), so a name used per item is looked up once."""

    def __getattr__(name: str) -> Any:
        value = getattr(importlib.import_module(new), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *importlib.import_module(new).__all__})

    return __getattr__, __dir__


def module_moved(old: str, new: str, how: str) -> NoReturn:
    """Raise the ImportError of a module ``old`` that moved to ``new`` (``how``: the import
    to write instead)."""
    raise ImportError(f"{old} moved to {new}: {how}", name=old)


def names_moved(module: str, moves: Mapping[str, str], why: str = "") -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` whose names ``moves`` maps to their new module:
    a moved name raises AttributeError naming its new home (and ``why``), any other the
    usual AttributeError."""

    def __getattr__(name: str) -> object:
        if name in moves:
            because = f" ({why})" if why else ""
            raise AttributeError(f"{module}.{name} moved to {moves[name]}.{name}{because}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
