"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metafora.testing import LocalCluster
from tests.helpers import Harness


@pytest.fixture
def harness() -> Iterator[Harness]:
    """A :class:`~tests.helpers.Harness` on a fresh memory store, closed after the test."""
    h = Harness()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A :class:`~metafora.testing.LocalCluster` on a fresh memory store (5 s shutdown)."""
    with LocalCluster(shutdown_timeout=5.0) as c:
        yield c
