"""Test wiring: real-store fixtures are plugins under tests/fixtures/."""

from __future__ import annotations

import importlib.util

import pytest

# Each store's fixtures live in their own plugin module; a module not written yet is skipped.
pytest_plugins = [
    name
    for name in ("tests.fixtures.postgres", "tests.fixtures.etcd", "tests.fixtures.faults")
    if importlib.util.find_spec(name) is not None
] + ["pytester"]  # metafora's own pytest plugin (metafora.pytest_plugin) is tested with pytester

# Tests that need a store server get a marker of its name, so `-m "not postgresql and not etcd"`
# selects the memory and SQLite tests (CI runs those on every supported Python).
_SERVER_FIXTURES = {
    "postgresql": {"postgres_server_url", "postgres_database_url", "postgres_url", "temp_postgres",
                   "metafora_postgres_server", "metafora_postgres_database"},
    "etcd": {"etcd_server", "etcd_url", "etcd_factory", "etcd_cluster", "metafora_etcd_server"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the store servers its fixtures or its store parameter need."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        params = {str(v) for v in callspec.params.values()} if callspec is not None else set()
        for server, names in _SERVER_FIXTURES.items():
            if fixtures & names or server in params:
                item.add_marker(getattr(pytest.mark, server))
