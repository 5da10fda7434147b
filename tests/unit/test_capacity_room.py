"""A slot freed by a handler's end is offered again at once, whatever bounds the node.

The finisher tells the consumer's loop that a slot is free when the handler returns, not when
its outcome has been written: claims for the slot overlap the group commit. That held for a
node bounded by ``max_tasks`` only; a node bounded by its thread cap (or by a capacity reduced
after a failed start) waited for the outcome's write before it took deferred work.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence

import pytest

from metafora import Consumer, Task, simple_handler
from metafora.contracts.coordinator import Finish
from metafora.core.errors import MetaforaError
from metafora.surfaces.connect import open_client, open_coordinator
from tests.helpers import wait_until


@pytest.mark.parametrize("bound", [{"thread_cap": 1}, {"max_tasks": 1}])
def test_a_freed_slot_takes_deferred_work_before_the_outcome_is_written(
        bound: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://room-{uuid.uuid4().hex}?poll_interval=600"  # no re-offer by polling
    coordinator = open_coordinator(url, node_id="n")
    write_may_go = threading.Event()
    finish_many: Callable[[Sequence[Finish]], list[MetaforaError | None]] = coordinator.finish_many

    def held_write(finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        write_may_go.wait(30)  # the store is slow to write outcomes
        return finish_many(finishes)

    monkeypatch.setattr(coordinator, "finish_many", held_write)
    first_may_end = threading.Event()
    started: list[str] = []

    def handler(task: Task, stop: threading.Event) -> bool:
        started.append(task.id)
        if task.id == "t1":
            first_may_end.wait(30)
        return True

    consumer = Consumer(coordinator, simple_handler(handler), **bound)  # type: ignore[arg-type]
    client = open_client(url)
    runner = threading.Thread(target=consumer.run, daemon=True)
    try:
        client.submit_task(Task("t1"))
        runner.start()
        wait_until(lambda: started == ["t1"])
        client.submit_task(Task("t2"))  # offered while the one slot is taken: deferred
        wait_until(lambda: len(consumer._offers.deferred) == 1)  # (the loop's own queue)
        first_may_end.set()  # t1 returns; its outcome's write is held
        # t2 takes the free slot while no outcome can be written (finish_many is held).
        wait_until(lambda: "t2" in started, timeout=5)
    finally:
        write_may_go.set()
        first_may_end.set()
        consumer.shutdown()
        runner.join(30)
        client.close()
