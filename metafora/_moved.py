"""The one policy for moved names: they fail loudly, naming their new home (then they go).

A moved module raises :class:`ImportError` when imported (:func:`module_moved`); a moved name
of a module that stays raises :class:`AttributeError` (which ``from X import name`` turns into
an ImportError) from the module's ``__getattr__`` (:func:`names_moved`). Nothing forwards
silently: before a first release there is nothing to keep, and a forward would hide where a
name lives (and, for a name moved into a store, make a feature reach into that store).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NoReturn

__all__ = ["module_moved", "names_moved"]


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
