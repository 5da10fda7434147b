"""One conformance suite, every store: ``store_url`` runs each test on each backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

STORES = ["memory", "sqlite", "postgresql", "etcd"]


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> str:
    """A fresh, empty store URL (own namespace) for one test, from metafora's pytest plugin
    (the same stores users' suites get; PostgreSQL and etcd from tests/fixtures)."""
    return metafora_store_url(str(request.param))
