"""The old name of :mod:`metafora.gates`: gated partitions first shipped as
``metafora.statemachine.gates``. Every public name of :mod:`metafora.gates` is re-exported
here, so code written against the first release keeps working; new code imports
``from metafora import gates``.
"""

from __future__ import annotations

from metafora.gates import *  # noqa: F403
from metafora.gates import __all__ as __all__  # noqa: PLC0414 (the re-export names the same list)
