"""Former name of :mod:`metafora.testing.pytest_plugin` (metafora's pytest plugin).

Kept so that imports of it and ``-p metafora.pytest_plugin`` (with plugin autoloading off) go
on working: pytest finds the same hooks and fixtures here. The ``pytest11`` entry point names
:mod:`metafora.testing.pytest_plugin`; register one of the two names, not both (each adds the
``--metafora-stores`` option).
"""

from __future__ import annotations

from metafora.testing.pytest_plugin import (
    ENV_STORES,
    STORE_KINDS,
    metafora_client,
    metafora_cluster,
    metafora_etcd_server,
    metafora_postgres_database,
    metafora_postgres_server,
    metafora_store_url,
    metafora_url,
    parse_kinds,
    pytest_addoption,
    pytest_configure,
    pytest_generate_tests,
)

__all__ = [
    "ENV_STORES",
    "STORE_KINDS",
    "metafora_client",
    "metafora_cluster",
    "metafora_etcd_server",
    "metafora_postgres_database",
    "metafora_postgres_server",
    "metafora_store_url",
    "metafora_url",
    "parse_kinds",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
]
