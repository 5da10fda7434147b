"""One conformance suite, every store: ``store_url`` runs each test on each backend."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from metafora.coordinators.memory import drop_store

STORES = ["memory", "sqlite", "postgresql", "etcd"]
_FIXTURE = {"sqlite": "sqlite_url", "postgresql": "postgres_url", "etcd": "etcd_url"}


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty store URL (own namespace) for one test."""
    kind = request.param
    if kind == "memory":
        name = f"conf-{uuid.uuid4().hex[:8]}"
        yield f"memory://{name}"
        drop_store(f"{name}/metafora")
        return
    fixture = _FIXTURE[kind]
    try:
        url = request.getfixturevalue(fixture)
    except pytest.FixtureLookupError:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the {kind} store fixture {fixture!r} is not available in CI")
        pytest.skip(f"no {kind} store fixture yet")
    yield url
