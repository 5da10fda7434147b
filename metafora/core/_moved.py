"""The one policy for moved names: a name the contract published keeps working; any other
moved name fails loudly, naming its new home.

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
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

__all__ = ["module_forward", "module_moved", "names_moved"]


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
