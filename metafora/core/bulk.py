"""What every store's ``Client.submit_tasks`` shares: input checks, batching, the refusal."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime

from metafora.core.errors import ConfigError, InvalidProps, TaskExists
from metafora.core.task import Task, validate_schedule

__all__ = ["batches", "checked", "exists_error"]

_NAMED = 20  # ids named in a message; the exception's ``ids`` holds them all


def checked(tasks: Iterable[Task], now: datetime) -> list[Task]:
    """``tasks`` as a list of Tasks with distinct ids, each claimable some time after ``now``.

    TaskExists names any id given twice; InvalidProps names a task that could never be
    claimed. Nothing is written before every task passed.
    """
    if isinstance(tasks, (str, bytes, Task)) or not isinstance(tasks, Iterable):
        raise ConfigError(f"submit_tasks takes an iterable of Task, got {type(tasks).__name__}")
    todo = list(tasks)
    for number, task in enumerate(todo, 1):
        if not isinstance(task, Task):
            raise ConfigError(f"submit_tasks: item {number} is a {type(task).__name__}, not a Task")
        try:
            validate_schedule(task, now)
        except InvalidProps as exc:
            raise InvalidProps(f"submit_tasks: task {task.id!r} (item {number}): {exc}") from None
    repeated = [task_id for task_id, n in Counter(t.id for t in todo).items() if n > 1]
    if repeated:
        raise TaskExists(f"task id(s) {_names(repeated)} given more than once; nothing was added",
                         ids=repeated)
    return todo


def batches(tasks: Sequence[Task], size: int, max_bytes: int | None = None) -> Iterator[Sequence[Task]]:
    """``tasks`` in consecutive slices of at most ``size`` tasks and about ``max_bytes`` of ids
    and props (a store's request limit; a task larger than that goes alone)."""
    start, weight = 0, 0
    for end, task in enumerate(tasks):
        cost = len(task.id) + len(task.props_json()) if max_bytes is not None else 0
        if end > start and (end - start >= size or (max_bytes is not None and weight + cost > max_bytes)):
            yield tasks[start:end]
            start, weight = end, 0
        weight += cost
    if start < len(tasks):
        yield tasks[start:]


def exists_error(existing: Sequence[str], added: int, total: int, store: str) -> TaskExists:
    """The refusal of a batch: which ids exist, and what the call added before it."""
    return TaskExists(
        f"task(s) {_names(existing)} already exist in {store}: their batch added nothing;"
        f" {added} of the {total} task(s) were added before it",
        ids=existing, submitted=added,
    )


def _names(ids: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in sorted(ids)[:_NAMED])
    more = len(ids) - _NAMED
    return f"{shown} and {more} more" if more > 0 else shown
