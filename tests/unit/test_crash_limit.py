"""max_crashes on the memory store: claims that end with their node dead are counted in a row,
an outcome starts the count afresh, and the limit fails the task instead of claiming it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from metafora import Consumer, Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.contracts.coordinator import crash_limit_error
from metafora.coordinators.memory import MemoryCoordinator, drop_store
from metafora.core.errors import ConfigError
from metafora.testing import RecordingContext


@pytest.fixture
def url() -> Iterator[str]:
    name = f"crash-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


def _die_holding(url: str, node: str, max_crashes: int | None) -> Task | None:
    """A node claims ``t`` and dies holding it (its lease is lost; no outcome is written)."""
    coord = open_coordinator(url, node_id=node)
    assert isinstance(coord, MemoryCoordinator)
    coord.init(RecordingContext(max_crashes=max_crashes))
    claimed = coord.claim(Task("t"))
    if claimed is not None:
        coord.expire_lease()
    coord.close()
    return claimed


def test_the_limit_fails_the_task_on_the_claim_after_the_last_crash(url: str) -> None:
    with open_client(url) as client:
        client.submit_task(Task("t"))
        for i in range(3):
            assert _die_holding(url, f"n{i}", 3) is not None, f"claim {i} refused"
        assert _die_holding(url, "n3", 3) is None
        info = client.get_task("t")
        assert info.state is TaskState.FAILED
        assert info.error == crash_limit_error(3, 3)
        assert "process died while running it" in (info.error or "")
        client.retry_task("t")  # a retry counts afresh
        assert _die_holding(url, "n4", 3) is not None


def test_an_outcome_between_crashes_resets_the_count(url: str) -> None:
    with open_client(url) as client:
        client.submit_task(Task("t"))
        for i in range(2):
            assert _die_holding(url, f"n{i}", 3) is not None
        coord = open_coordinator(url, node_id="survivor")
        coord.init(RecordingContext(max_crashes=3))
        claimed = coord.claim(Task("t"))
        assert claimed is not None
        coord.release(claimed)  # an outcome: the count starts again
        coord.close()
        for i in range(2, 5):
            assert _die_holding(url, f"n{i}", 3) is not None
        assert client.get_task("t").state is TaskState.PENDING  # three crashes since the release
        assert _die_holding(url, "n5", 3) is None
        assert client.get_task("t").state is TaskState.FAILED


def test_the_limit_can_be_turned_off(url: str) -> None:
    with open_client(url) as client:
        client.submit_task(Task("t"))
        for i in range(8):
            assert _die_holding(url, f"n{i}", None) is not None
        assert client.get_task("t").state is not TaskState.FAILED


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_consumer_validates_max_crashes(url: str, bad: object) -> None:
    coord = open_coordinator(url, node_id="v")
    with pytest.raises(ConfigError, match="max_crashes"):
        Consumer(coord, simple_handler(lambda t, s: True), max_crashes=bad)  # type: ignore[arg-type]
    coord.close()
