"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import Harness


@pytest.fixture
def harness() -> Iterator[Harness]:
    """A :class:`~tests.helpers.Harness` on a fresh memory store, closed after the test."""
    h = Harness()
    try:
        yield h
    finally:
        h.close()
