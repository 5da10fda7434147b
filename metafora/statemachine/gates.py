"""The first name of :mod:`metafora.gates`: gated partitions first shipped as
``metafora.statemachine.gates``. A published name, so it keeps working (the one policy for moved
names: :mod:`metafora.core._moved`): every public name of :mod:`metafora.gates` is a name of this
module too, looked up there at first use. New code writes ``from metafora import gates``.
Type checkers see the names as ``Any`` here.
"""

from __future__ import annotations

from metafora.core._moved import module_forward

__getattr__, __dir__ = module_forward(globals(), "metafora.gates")
