"""The old name of :mod:`metafora.gates`: gated partitions first shipped as
``metafora.statemachine.gates``. The name fails loudly, naming the new one (the one policy for
moved names: :mod:`metafora._moved`); write ``from metafora import gates``.
"""

from __future__ import annotations

from metafora._moved import module_moved

module_moved(__name__, "metafora.gates", "write 'from metafora import gates'")
