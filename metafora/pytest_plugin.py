"""Former name of :mod:`metafora.testing.pytest_plugin` (metafora's pytest plugin).

Kept so that imports of it and ``-p metafora.pytest_plugin`` (with plugin autoloading off) go
on working: pytest finds the same hooks and fixtures here. The ``pytest11`` entry point names
:mod:`metafora.testing.pytest_plugin`; register one of the two names, not both (each adds the
``--metafora-stores`` option).
"""

from __future__ import annotations

from metafora.testing import pytest_plugin as _plugin
from metafora.testing.pytest_plugin import *  # noqa: F403  (the fixtures and constants)
from metafora.testing.pytest_plugin import (  # noqa: F401  (pytest looks hooks up by name)
    parse_kinds,
    pytest_addoption,
    pytest_configure,
    pytest_generate_tests,
)

__all__ = list(_plugin.__all__)
