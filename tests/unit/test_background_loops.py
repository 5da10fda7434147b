"""Issue 52, finding 1 and its class: no background loop can stop a node, and every duration a
user can set is bounded where it is parsed (memory store and pure logic; the process tests on
each store are in tests/integration/test_background_loops_processes.py)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner

from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.cli import cli
from metafora.consumer.http import render_metrics
from metafora.consumer.options import ConsumerOptions
from metafora.consumer.running import NodeLog
from metafora.consumer.supervisor import BACKOFF_FIRST, Supervisor
from metafora.coordinators.memory import drop_store
from metafora.core.durations import MAX_DURATION, parse_duration, seconds, whole_seconds
from metafora.core.errors import ConfigError
from metafora.core.metrics import ConsumerStats
from metafora.core.retention import Cutoffs, Pruner, Retention, parse_keep
from metafora.core.schedule_model import new_schedule
from metafora.testing import FakeClock, wait_for


@pytest.fixture
def url() -> Iterator[str]:
    name = f"loops-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


# -- bounds where parsed ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["800000d", "1000000000d", 10**30, timedelta(days=800000), "36501d"])
def test_set_retention_refuses_an_impossible_value(url: str, value: object) -> None:
    """Before: ``800000d`` was stored (and stopped every worker), ``10**30`` raised a raw
    OverflowError."""
    with open_client(url) as client:
        with pytest.raises(ConfigError, match="at most 36500d"):
            client.set_retention(done=value)  # type: ignore[arg-type]
        assert client.retention().done == timedelta(days=7)  # nothing written
        assert client.set_retention(done=MAX_DURATION).done == MAX_DURATION


@pytest.mark.parametrize("value", ["800000d", "1000000000d"])
def test_cli_retention_set_refuses_an_impossible_value(url: str, value: str) -> None:
    """Before: ``800000d`` exited 0 and ``1000000000d`` exited 70 (an unexpected OverflowError)."""
    result = CliRunner().invoke(cli, ["--url", url, "retention", "set", "--done", value])
    assert result.exit_code == 2, result.output
    assert "at most 36500d" in result.output and "Traceback" not in result.output


def test_every_parser_bounds_a_duration() -> None:
    with pytest.raises(ValueError, match="too long"):
        parse_duration("36501d")
    with pytest.raises(ConfigError, match="at most"):
        seconds(10**12, "prune_every")
    with pytest.raises(ConfigError, match="at most"):
        whole_seconds(10**12, "a schedule period")
    with pytest.raises(ConfigError, match="at most"):
        ConsumerOptions(prune_every=1e12)
    with pytest.raises(ConfigError, match="at most"):
        new_schedule("s", every="800000d", now=datetime(2026, 1, 1, tzinfo=UTC))
    assert parse_keep("36500d") == MAX_DURATION


def test_a_stored_policy_out_of_range_is_a_clear_error_and_can_be_replaced() -> None:
    with pytest.raises(ConfigError, match="stored retention of done tasks is out of range"):
        Retention.from_seconds(800000 * 86400, None, 60)
    assert Retention.from_seconds(60, None, 3600) == Retention(timedelta(seconds=60), None,
                                                               timedelta(hours=1))
    now = datetime(2026, 1, 1, tzinfo=UTC)  # a cut-off before year 1 is "never", no OverflowError
    assert Cutoffs.at(Retention(done=timedelta(days=999_999)), now).done is None


# -- background loops ---------------------------------------------------------------------------


def test_a_failing_background_loop_is_logged_counted_and_restarted() -> None:
    stats = ConsumerStats()
    clock = FakeClock()
    stopping, wake = threading.Event(), threading.Event()
    supervisor = Supervisor("n1", stopping=stopping, wake=wake, clock=clock,
                            log=NodeLog(logging.getLogger("test"), {"node": "n1"}),
                            on_error=stats.loop_error)
    calls: list[int] = []

    def loop() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise OverflowError("date value out of range")

    supervisor.start("prune", loop, background=True)
    # The fake clock moves on at each poll until the loop ran its third time (and returned).
    wait_for(lambda: clock.advance(BACKOFF_FIRST * 4) or len(calls) >= 3, 10.0, "three starts")
    supervisor.join()
    assert len(calls) == 3
    assert not stopping.is_set() and supervisor.fatal is None  # before: the node shut down
    assert stats.loop_error_counts() == {"prune": 2}
    text = render_metrics("n1", stats, 0).decode()
    assert 'metafora_loop_errors_total{loop="prune",node="n1"} 2.0' in text


def test_a_pruner_error_of_any_kind_is_counted_and_retried() -> None:
    class Broken:
        turns = 0

        def _prune_turn(self, interval: float) -> None:
            self.turns += 1
            raise OverflowError("date value out of range")

    counted: list[str] = []
    clock = FakeClock()
    store = Broken()
    pruner = Pruner(store, clock, interval=5, on_error=counted.append)  # type: ignore[arg-type]
    thread = threading.Thread(target=pruner.run)
    thread.start()
    wait_for(lambda: clock.advance(5) or store.turns >= 3, 10.0, "three prune turns")
    pruner.stop()
    clock.advance(5)
    thread.join(5)
    assert not thread.is_alive() and counted[:3] == ["prune"] * 3


def test_a_consumer_survives_a_policy_that_cannot_be_applied(url: str) -> None:
    """A memory store holding a policy past the bound (another tool wrote it): the node keeps
    claiming across prune turns."""
    with open_client(url) as client:
        client._retention_put(Retention(done=timedelta(days=900_000)))  # type: ignore[attr-defined]
        consumer = Consumer(open_coordinator(url), simple_handler(lambda task, stop: True),
                            prune_every=0.05)
        thread = threading.Thread(target=consumer.run)
        thread.start()
        try:
            for i in range(3):
                client.submit_task(Task(f"t{i}"))
                wait_for(lambda i=i: client.get_task(f"t{i}").state.value == "done", 10.0, "done")
            assert consumer.healthy()
        finally:
            consumer.shutdown()
            thread.join(30)
