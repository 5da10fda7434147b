"""A cold start of short tasks under FairBalancer does not wait out the cold start's wait."""

from __future__ import annotations

from metafora import Consumer, Task, TaskState, simple_handler
from metafora.balancers import FairBalancer
from tests.helpers import Harness, wait_until

TASKS = 2_000  # its probe (1/200 of the work) holds the 8 runs that tell short tasks


def test_short_tasks_are_not_held_by_a_cold_start(harness: Harness) -> None:
    """Warm-up of ten minutes: only the probe may run until the probe's runs show the tasks
    are short; then the offers refused meanwhile are claimed at once (not in ten minutes)."""
    harness.client.submit_tasks(Task(f"t{i:04d}") for i in range(TASKS))
    consumer = Consumer(harness.coordinator("a"), simple_handler(lambda task, stop: True),
                        FairBalancer(warmup=600.0))
    harness.start(consumer)
    wait_until(lambda: harness.client.task_counts().get(TaskState.DONE, 0) == TASKS, timeout=60,
               message=f"all {TASKS} short tasks done long before the ten-minute warm-up")
