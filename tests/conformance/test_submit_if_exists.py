"""Issue 35: ``submit_task`` / ``submit_tasks`` with ``if_exists`` on every store, decided in
the statement or txn that inserts (the sync client here; ``test_async_client`` runs the same
bodies through the async client)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import pytest

from metafora import Task, TaskInfo, TaskState, open_client, open_coordinator, simple_handler
from metafora.core.errors import ConfigError, TaskExists
from metafora.testing import LocalCluster, wait_for
from tests.helpers import RanIds


class ClientLike(Protocol):
    """The verbs the bodies use: the sync client's (``task`` is ``get_task``) or the async
    client's run to completion."""

    def submit_task(self, task: Task, *, if_exists: str = ...) -> bool: ...

    def submit_tasks(self, tasks: list[Task], *, if_exists: str = ...) -> int: ...

    def task(self, task_id: str) -> TaskInfo: ...

    def tasks(self) -> list[TaskInfo]: ...


def check_error_is_the_default(client: ClientLike) -> None:
    assert client.submit_task(Task("a", {"v": 1})) is True
    with pytest.raises(TaskExists, match="'a'"):
        client.submit_task(Task("a", {"v": 2}))
    with pytest.raises(TaskExists, match="'a'"):
        client.submit_task(Task("a", {"v": 2}), if_exists="error")
    assert client.task("a").props == {"v": 1}
    with pytest.raises(ConfigError, match="if_exists"):
        client.submit_task(Task("b"), if_exists="skip")


def check_ignore_leaves_the_existing_task(client: ClientLike) -> None:
    assert client.submit_task(Task("a", {"v": 1}), if_exists="ignore") is True
    assert client.submit_task(Task("a", {"v": 2}, priority=5), if_exists="ignore") is False
    info = client.task("a")
    assert info.props == {"v": 1} and info.priority == 0
    ids = [f"i-{n:04d}" for n in range(700)]  # more than one SQL batch and many etcd txns
    assert client.submit_tasks([Task(i, {"n": 1}) for i in ids[:300]]) == 300
    added = client.submit_tasks([Task(i, {"n": 2}) for i in ids], if_exists="ignore")
    assert added == 400
    infos = {i.id: i for i in client.tasks()}
    assert len(infos) == 701
    assert infos["i-0000"].props == {"n": 1} and infos["i-0299"].props == {"n": 1}
    assert infos["i-0300"].props == {"n": 2} and infos["i-0699"].props == {"n": 2}


def check_replace_changes_a_pending_task_only(client: ClientLike, url: str) -> None:
    assert client.submit_task(Task("p", {"v": 1}), if_exists="replace") is True
    later = "2999-01-01T00:00:00+00:00"
    new = Task("p", {"v": 2, "launch_at": later}, priority=7, selector={"zone": "a"}, group="g")
    assert client.submit_task(new, if_exists="replace") is True
    info = client.task("p")
    assert info.state is TaskState.PENDING
    assert (info.props, info.priority, info.selector) == (new.props, 7, {"zone": "a"})
    assert info.group is None  # the limit group is fixed at submit (docs/limits.md; issue 52)
    # A claimed task is left as it is, and the call says so.
    client.submit_task(Task("held", {"v": 1}))
    with open_coordinator(url, node_id="holder") as coord:
        from metafora.testing.cluster import RecordingContext

        coord.init(RecordingContext())
        claimed = wait_for(lambda: coord.claim(Task("held")), 10, "the claim of 'held'")
        assert claimed is not None
        assert client.submit_task(Task("held", {"v": 2}), if_exists="replace") is False
        assert client.task("held").props == {"v": 1}
        assert client.task("held").state is TaskState.CLAIMED
        coord.done(claimed)
    assert client.submit_task(Task("held", {"v": 3}), if_exists="replace") is False
    assert client.task("held").props == {"v": 1}
    # In bulk: the pending ones replaced, the new ones added, the finished one left.
    ids = [f"r-{n:03d}" for n in range(60)]
    client.submit_tasks([Task(i, {"n": 1}) for i in ids[:30]])
    got = client.submit_tasks([Task(i, {"n": 2}) for i in [*ids, "held"]], if_exists="replace")
    assert got == 60
    infos = {i.id: i for i in client.tasks()}
    assert all(infos[i].props == {"n": 2} for i in ids)
    assert infos["held"].props == {"v": 1} and infos["held"].state is TaskState.DONE


def test_error_is_the_default(store_url: str) -> None:
    with open_client(store_url) as client:
        check_error_is_the_default(_Sync(client))  # type: ignore[arg-type]


def test_ignore_leaves_the_existing_task(store_url: str) -> None:
    with open_client(store_url) as client:
        check_ignore_leaves_the_existing_task(_Sync(client))  # type: ignore[arg-type]


def test_replace_changes_a_pending_task_only(store_url: str) -> None:
    with open_client(store_url) as client:
        check_replace_changes_a_pending_task_only(_Sync(client), store_url)  # type: ignore[arg-type]


class _Sync:
    """The sync client under the async client's names (``task`` for ``get_task``)."""

    def __init__(self, client: object) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(self._client, "get_task" if name == "task" else name)  # type: ignore[no-any-return]


_SUBMIT_ONE = """
import sys
from metafora import Task, open_client
with open_client(sys.argv[1]) as client:
    sys.stdin.readline()  # all three start, then submit together
    print(client.submit_task(Task("once", {"by": sys.argv[2]}), if_exists="ignore"))
"""


def test_three_submitters_of_one_id_with_ignore_make_one_task_and_one_run(store_url: str) -> None:
    results: list[str] = []
    if store_url.startswith("memory"):  # one process: three threads through one store
        gate = threading.Barrier(3)
        lock = threading.Lock()

        def submit(n: int) -> None:
            with open_client(store_url) as client:
                gate.wait(10)
                added = client.submit_task(Task("once", {"by": str(n)}), if_exists="ignore")
            with lock:
                results.append(str(added))

        threads = [threading.Thread(target=submit, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    else:
        procs = [subprocess.Popen([sys.executable, "-c", _SUBMIT_ONE, store_url, str(n)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for n in range(3)]
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0
            results.append(out.strip())
    assert sorted(results) == ["False", "False", "True"]
    ran = RanIds()
    with LocalCluster(store_url) as cluster:
        assert [i.id for i in cluster.client.tasks()] == ["once"]
        cluster.add(simple_handler(ran), "runner-1")
        cluster.add(simple_handler(ran), "runner-2")
        cluster.wait_for_state("once", "done", 30)
        assert ran.ids == ["once"] and not cluster.errors
        assert cluster.client.get_task("once").attempts == 1


def test_a_replaced_task_runs_with_its_new_props(store_url: str) -> None:
    """A pending task not yet due is replaced by one due now: a consumer runs it, once, with
    the new props (the watch offers the new version; a claim of the old one fails its fence)."""
    seen: list[dict[str, Any]] = []

    def handler(task: Task, stop: threading.Event) -> bool:
        seen.append(dict(task.props))
        return True

    with LocalCluster(store_url) as cluster:
        cluster.add(simple_handler(handler), "runner")
        client = cluster.client
        client.submit_task(Task("later", {"v": 1, "launch_at": "2999-01-01T00:00:00+00:00"}))
        client.submit_task(Task("marker"))
        cluster.wait_for_state("marker", "done", 30)  # the consumer has seen "later", not due
        assert client.submit_task(Task("later", {"v": 2}), if_exists="replace") is True
        cluster.wait_for_state("later", "done", 30)
        assert seen == [{}, {"v": 2}] and not cluster.errors
