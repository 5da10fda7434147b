"""A node SIGKILLed in the middle of a prune leaves a store every reader still reads: each
batch is one transaction (SQL) or a txn per task (etcd), so a task is gone with its state or
kept with it; the next prune finishes the work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.contracts.coordinator import Finish, Outcome
from metafora.statemachine.machine import State, StateCode
from metafora.statemachine.store import state_store_for
from metafora.testing import RecordingContext

_CHILD = textwrap.dedent("""
    import sys
    from metafora import open_client
    from metafora.core.retention import Cutoffs, purge_policy

    with open_client(sys.argv[1]) as client:
        policy = purge_policy(None)  # every finished task, as purge takes them
        cutoffs = Cutoffs.at(policy, client._prune_now())
        while True:
            count = client._prune_batch(cutoffs, int(sys.argv[2]))
            print(count, flush=True)
            if count == 0:
                break
""")


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "etcd"])
def test_sigkill_mid_prune_leaves_whole_tasks(kind: str,
                                             metafora_store_url: Callable[[str], str]) -> None:
    url = metafora_store_url(kind)
    n = 300 if kind == "etcd" else 1500
    ids = [f"t{i:05d}" for i in range(n)]
    stateful = set(ids[::3])
    with open_client(url) as client:
        client.submit_tasks([Task(i) for i in ids])
        coord = open_coordinator(url, node_id="filler")
        coord.init(RecordingContext())
        try:
            store = state_store_for(coord)
            for start in range(0, n, 100):
                claimed = coord.claim_many([Task(i) for i in ids[start:start + 100]], 100)
                for task in claimed:
                    if task.id in stateful:
                        store.store(task, State(StateCode.COMPLETED))
                assert coord.finish_many([Finish(t, Outcome.DONE) for t in claimed]) == [None] * len(claimed)
        finally:
            coord.close()
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, url, "10" if kind == "etcd" else "50"],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for _ in range(3):  # three batches committed, the fourth under way
            assert proc.stdout.readline().strip()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()

        left = {info.id for info in client.tasks()}
        assert 0 < len(left) < n
        readers = state_store_for(client)
        for task_id in ids:  # a task and its state went together, or neither
            has_state = readers.get(task_id) is not None
            assert has_state == (task_id in left and task_id in stateful), task_id
        for task_id in sorted(left)[:20]:
            assert client.get_task(task_id).id == task_id
        assert client.purge() == len(left)  # the next run finishes the work
        assert client.tasks() == []
