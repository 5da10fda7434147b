"""Test wiring: real-store fixtures are plugins under tests/fixtures/."""

from __future__ import annotations

import importlib.util

import pytest

from metafora.testing.pytest_plugin import AllowedSkip, fail_skips_in_ci

# Each store's fixtures live in their own plugin module; a module not written yet is skipped.
pytest_plugins = [
    name
    for name in ("tests.fixtures.postgres", "tests.fixtures.etcd", "tests.fixtures.faults")
    if importlib.util.find_spec(name) is not None
] + ["pytester"]  # metafora's own pytest plugin (metafora.testing.pytest_plugin) is tested with pytester

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


# Under CI=true every skip is a failure (the hook is metafora's pytest plugin, enabled below),
# except these, which are right on every machine. Add one only with its reason: a skip that
# hides a missing server, extra or binary in CI is a test that did not run.
ALLOWED_SKIPS = [
    # The test reads a thread limit from /proc/self/status, which only Linux has; on macOS the
    # skip is the truth, not a missing dependency.
    AllowedSkip("tests/unit/test_capacity_limit.py::", "reads /proc/self/status",
                "Linux only (/proc)"),
]


def pytest_configure(config: pytest.Config) -> None:
    """Fail every skip under CI=true, but for ALLOWED_SKIPS."""
    fail_skips_in_ci(config, ALLOWED_SKIPS)
