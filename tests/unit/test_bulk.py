"""metafora.core.bulk: the checks, batching and refusal every store's submit_tasks shares."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from metafora.core.bulk import batches, checked, exists_error
from metafora.core.errors import ConfigError, InvalidProps, TaskExists
from metafora.core.task import Task

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def test_checked_returns_the_tasks_in_order_from_any_iterable() -> None:
    tasks = checked((Task(f"t{i}") for i in range(3)), NOW)
    assert [t.id for t in tasks] == ["t0", "t1", "t2"]
    assert checked([], NOW) == []


@pytest.mark.parametrize("bad", ["t1", b"t1", Task("t1"), 5, None])
def test_checked_refuses_what_is_not_an_iterable_of_tasks(bad: object) -> None:
    with pytest.raises(ConfigError, match="submit_tasks takes an iterable of Task"):
        checked(bad, NOW)  # type: ignore[arg-type]


def test_checked_names_the_item_that_is_not_a_task() -> None:
    with pytest.raises(ConfigError, match="item 2 is a str, not a Task"):
        checked([Task("a"), "b"], NOW)  # type: ignore[list-item]


def test_checked_names_a_task_that_could_never_be_claimed() -> None:
    past = (NOW - timedelta(seconds=1)).isoformat()
    with pytest.raises(InvalidProps, match=r"task 'late' \(item 2\):.*already past"):
        checked([Task("ok"), Task("late", {"expires_at": past})], NOW)


def test_checked_refuses_an_id_given_twice_and_lists_them_all() -> None:
    with pytest.raises(TaskExists, match="given more than once; nothing was added") as err:
        checked([Task("a"), Task("b"), Task("a"), Task("b"), Task("c")], NOW)
    assert sorted(err.value.ids) == ["a", "b"] and err.value.submitted == 0


def test_batches_cut_by_count() -> None:
    tasks = [Task(f"t{i}") for i in range(7)]
    assert [[t.id for t in b] for b in batches(tasks, 3)] == [
        ["t0", "t1", "t2"], ["t3", "t4", "t5"], ["t6"]]
    assert list(batches([], 3)) == []


def test_batches_cut_by_bytes_and_a_large_task_goes_alone() -> None:
    small = [Task(f"s{i}", {"v": "x" * 10}) for i in range(4)]  # 20 bytes each: id and props
    big = Task("big", {"v": "x" * 100})
    cost = len("s0") + len(small[0].props_json())
    sizes = [len(b) for b in batches([*small[:2], big, *small[2:]], 100, max_bytes=2 * cost)]
    assert sizes == [2, 1, 2]


def test_exists_error_says_what_was_added_before_the_refused_batch() -> None:
    err = exists_error(["b", "a"], added=10, total=30, store="sqlite:///x.db")
    assert isinstance(err, TaskExists)
    assert err.ids == ("b", "a") and err.submitted == 10
    assert str(err) == ("task(s) 'a', 'b' already exist in sqlite:///x.db: their batch added "
                        "nothing; 10 of the 30 task(s) were added before it")


def test_a_long_list_of_ids_is_cut_in_the_message_but_kept_whole_on_the_error() -> None:
    ids = [f"t{i:03}" for i in range(25)]
    err = exists_error(ids, added=0, total=25, store="memory://m")
    assert "'t019' and 5 more already exist" in str(err) and "t020" not in str(err)
    assert len(err.ids) == 25
