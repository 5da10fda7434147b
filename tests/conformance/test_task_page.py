"""Client.task_page and task_counts: the same paging and filters on every store."""

from __future__ import annotations

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.contracts.coordinator import CoordinatorContext


class _Ctx(CoordinatorContext):
    def lost(self, task: Task) -> None:
        return


def test_pages_filters_and_counts(store_url: str) -> None:
    with open_client(store_url) as client:
        for i in range(12):
            client.submit_task(Task(f"a-{i:02d}"))
        for i in range(3):
            client.submit_task(Task(f"b-{i:02d}"))
        with open_coordinator(store_url, node_id="pager") as coord:
            coord.init(_Ctx())
            claimed = coord.claim(Task("b-01"))
            assert claimed is not None

            first = client.task_page(limit=5)
            assert [t.id for t in first] == [f"a-{i:02d}" for i in range(5)]
            second = client.task_page(limit=5, after=first[-1].id)
            assert [t.id for t in second] == [f"a-{i:02d}" for i in range(5, 10)]
            assert [t.id for t in client.task_page(prefix="b-")] == ["b-00", "b-01", "b-02"]
            assert [t.id for t in client.task_page(prefix="b-", after="b-00", limit=1)] == ["b-01"]
            assert [t.id for t in client.task_page(owner="pager")] == ["b-01"]
            assert [t.id for t in client.task_page(state=TaskState.CLAIMED)] == ["b-01"]
            pending = client.task_page(state="pending", prefix="b-")
            assert [t.id for t in pending] == ["b-00", "b-02"]
            assert client.task_page(prefix="zzz") == []

            counts = client.task_counts()
            assert counts[TaskState.PENDING] == 14 and counts[TaskState.CLAIMED] == 1
            assert counts[TaskState.DONE] == counts[TaskState.FAILED] == counts[TaskState.EXPIRED] == 0
            with pytest.raises(ValueError, match="limit"):
                client.task_page(limit=0)


def test_paging_visits_every_task_once_whatever_the_ids(store_url: str) -> None:
    # Ids that are prefixes of one another, with characters sorting below and above "/" and
    # ones a store must escape: keyset paging must neither skip nor repeat any of them.
    ids = ["a", "a-1", "a.b", "a/b", "a%", "a b", "ab", "a~", "é", "b"]
    ids += [f"n{i:03d}" for i in range(120)]
    with open_client(store_url) as client:
        client.submit_tasks(Task(i) for i in ids)
        seen: list[str] = []
        after = None
        while True:
            page = client.task_page(limit=7, after=after)
            if not page:
                break
            seen += [t.id for t in page]
            after = page[-1].id
        assert sorted(seen) == sorted(ids)
        assert len(seen) == len(ids)
        pending = []
        after = None
        while page := client.task_page(state="pending", prefix="n0", limit=9, after=after):
            pending += [t.id for t in page]
            after = page[-1].id
        assert sorted(pending) == [f"n{i:03d}" for i in range(100)]
