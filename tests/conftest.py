"""Test wiring: real-store fixtures are plugins under tests/fixtures/."""

from __future__ import annotations

import importlib.util

# Each store's fixtures live in their own plugin module; a module not written yet is skipped.
pytest_plugins = [
    name
    for name in ("tests.fixtures.postgres", "tests.fixtures.etcd", "tests.fixtures.faults")
    if importlib.util.find_spec(name) is not None
] + ["pytester"]  # metafora's own pytest plugin (metafora.pytest_plugin) is tested with pytester
