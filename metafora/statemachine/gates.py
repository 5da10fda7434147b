"""The old name of :mod:`metafora.gates`: gated partitions first shipped as
``metafora.statemachine.gates``. Every public name of :mod:`metafora.gates` is also a name of
this module, so code written against the first release keeps working; new code imports
``from metafora import gates``.

The gated partitions are built on the state machine, so no module of the state machine
imports them: a name asked of this module is looked up in :mod:`metafora.gates` then (by its
module name, as :mod:`metafora.backends` finds a store's classes), and only code that uses the
old name loads the gates. Type checkers see the names as ``Any`` here.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_NEW_NAME = "metafora.gates"


def _gates() -> ModuleType:
    return importlib.import_module(_NEW_NAME)


def __getattr__(name: str) -> Any:
    """``metafora.gates.NAME`` (``__all__`` too, so ``import *`` works), kept here once found:
    code that names ``gates.Response`` for every item looks it up through this hook only once."""
    value = getattr(_gates(), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_gates().__all__})
