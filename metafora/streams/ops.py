"""What operators do with streams, through any client: see them, check them, retry them.

A stream is a task whose state-machine cursor is a stream's progress
(:mod:`metafora.streams.progress`); these functions read it through the state store of the
client's own store (:func:`~metafora.statemachine.store.state_store_for`) and reach the
owner through the task command channel (:func:`~metafora.statemachine.store.commands_for`),
which the owner's store pushes (PostgreSQL NOTIFY, the etcd watch, SQLite's data_version).

A check is the state machine's ``check`` command: the handler of a runnable stream gets it
(the owner re-reads ``head()`` at once); a paused, sleeping or finished machine drops it, so
a check racing the stream's pause on a failing job never resumes it. A retry is the
machine's ``run`` (a resume), sent only to a stream that is failing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from metafora.contracts.client import Client
from metafora.core.errors import InvalidTaskState, TaskNotFound
from metafora.core.task import TaskInfo, validate_task_id
from metafora.statemachine.machine import Message, State, StateCode
from metafora.statemachine.store import StateStore, commands_for, state_store_for
from metafora.streams.jobs import StreamFailing, StreamInfo
from metafora.streams.progress import InvalidProgress, Progress

__all__ = ["StreamRow", "check_stream", "info_dict", "retry_stream", "stream_info", "stream_rows",
           "stream_state"]

_EXCEEDED = "ExceededErrorRate:"
_T = TypeVar("_T")

_PAGE = 200  # states (or, without StateStore.page, tasks) read per page while looking for streams
_TROUBLED = frozenset({StateCode.FAULT, StateCode.SLEEPING, StateCode.FAILED})


@dataclass(frozen=True)
class StreamRow:
    """One line of ``metafora streams``: the task, its owner and state, and the stream."""

    id: str
    owner: str | None
    task_state: str
    state: str
    info: StreamInfo

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (``metafora streams --json``)."""
        return {"id": self.id, "owner": self.owner, "task_state": self.task_state,
                "state": self.state, **info_dict(self.info)}


def info_dict(info: StreamInfo) -> dict[str, object]:
    """A StreamInfo as a JSON-ready dict (lag included)."""
    failing = None
    if info.failing is not None:
        failing = {"index": info.failing.index, "error": info.failing.error,
                   "attempts": info.failing.attempts}
    return {"processed": info.processed, "head": info.head, "lag": info.lag,
            "in_flight": info.in_flight, "failing": failing}


def _info_of(state: State) -> StreamInfo | None:
    """The stream in ``state``; None when its cursor is not a stream's progress."""
    try:
        progress = Progress.from_cursor(state.cursor, 0) if state.cursor is not None else None
    except InvalidProgress:
        return None
    if progress is None:
        # A stream whose state exists but that wrote no progress yet (it could not start):
        # its start is not known here; -1 is "nothing processed" from index 0.
        progress = Progress.fresh(0)
    if progress.failing is None and state.errors and state.code in _TROUBLED:
        # The stream could not run at all (its factory raised, ...): the reason is the
        # machine's last error that is not the policy's "giving up".
        errors = [e for e in state.errors if not e.text.startswith(_EXCEEDED)] or list(state.errors)
        progress = replace(progress, failing=StreamFailing(progress.processed + 1, errors[-1].text,
                                                           len(state.errors)))
    if state.code.terminal or state.code is StateCode.PAUSED:
        progress = replace(progress, in_flight=0)
    return progress.info()


def _state(client: Client, task_id: str) -> State | None:
    validate_task_id(task_id)
    return state_store_for(client).get(task_id)


def stream_info(client: Client, task_id: str) -> StreamInfo:
    """The stream ``task_id`` as its owner last wrote it. TaskNotFound when no such task;
    InvalidTaskState when the task is not a stream."""
    client.get_task(task_id)  # TaskNotFound first
    state = _state(client, task_id)
    if state is None:
        return Progress.fresh(0).info()  # submitted, never started: nothing is known yet
    info = _info_of(state)
    if info is None:
        raise InvalidTaskState(f"task {task_id!r} is not a stream (its cursor is not a "
                               "stream's progress)")
    return info


def stream_state(client: Client, task_id: str) -> State | None:
    """The state machine's state of the stream (None before its first run)."""
    return _state(client, task_id)


def stream_rows(client: Client, *, after: str | None = None, limit: int | None = None,
                prefix: str = "") -> list[StreamRow]:
    """Streams (tasks whose stored state is a stream's progress) ordered by id, after id
    ``after``, at most ``limit`` (None: all).

    The stored states are read a page at a time (:meth:`StateStore.page`: only tasks run by
    a state machine have one, so plain tasks cost nothing), then one task read per stream
    (its owner and task state). A store that cannot list its states falls back to reading
    every task's state."""
    store = state_store_for(client)
    rows = _paged(lambda cursor: store.page(prefix=prefix, after=cursor, limit=_PAGE),
                  lambda item: _row(client, item[0], item[1]), lambda item: item[0], after, limit)
    if rows is None:
        return _rows_by_task(client, store, after, limit, prefix)
    return rows


def _paged(fetch: Callable[[str | None], Sequence[_T] | None], row_of: Callable[[_T], StreamRow | None],
           key: Callable[[_T], str], after: str | None, limit: int | None) -> list[StreamRow] | None:
    """The rows of ``fetch(cursor)``'s pages (ordered by ``key``) after ``after``, at most
    ``limit``; None as soon as a page is None (the store cannot list)."""
    rows: list[StreamRow] = []
    cursor = after
    while limit is None or len(rows) < limit:
        page = fetch(cursor)
        if page is None:
            return None
        for item in page:
            row = row_of(item)
            if row is not None:
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
        if len(page) < _PAGE:
            break
        cursor = key(page[-1])
    return rows


def _row(client: Client, task_id: str, state: State, task: TaskInfo | None = None) -> StreamRow | None:
    """The listing's row of a task with ``state``; None when it is not a stream (or gone)."""
    info = None if state.cursor is None else _info_of(state)
    if info is None:
        return None
    if task is None:
        try:
            task = client.get_task(task_id)
        except TaskNotFound:  # deleted since its state was read
            return None
    return StreamRow(task_id, task.owner, task.state.value, state.code.value, info)


def _rows_by_task(client: Client, store: StateStore, after: str | None, limit: int | None,
                  prefix: str) -> list[StreamRow]:
    """The fallback: tasks a page at a time, one state read per task."""

    def row_of(task: TaskInfo) -> StreamRow | None:
        state = store.get(task.id)
        return None if state is None else _row(client, task.id, state, task)

    rows = _paged(lambda cursor: client.task_page(prefix=prefix, after=cursor, limit=_PAGE, props=False),
                  row_of, lambda task: task.id, after, limit)
    return [] if rows is None else rows  # task pages are never None


def check_stream(client: Client, task_id: str) -> bool:
    """Wake the stream's owner: it re-reads ``head()`` at once. Pushed through the task
    command channel; True when sent, False when the stream is paused (failing or by an
    operator: it would drop the check) or finished. TaskNotFound when no such task;
    InvalidTaskState when the task is not a stream."""
    info: TaskInfo = client.get_task(task_id)
    state = _state(client, task_id)
    shown = None if state is None else _info_of(state)
    if state is not None and state.cursor is not None and shown is None:
        raise InvalidTaskState(f"task {task_id!r} is not a stream (its cursor is not a "
                               "stream's progress); nothing sent")
    if state is not None and state.code is not StateCode.RUNNABLE:
        return False
    if shown is not None and shown.failing is not None:
        return False  # failing, about to pause: a check would be dropped
    if info.state.value in ("done", "failed", "expired"):
        return False
    channel = commands_for(client)
    # Coalesced: a command still queued wakes the owner anyway (each check would otherwise
    # add a row, or a key, that the owner must take).
    if channel.pending(task_id) == 0:
        # `check`, never `run`: should the stream pause meanwhile, a `run` would resume it.
        channel.send(task_id, Message.check())
    return True


def retry_stream(client: Client, task_id: str) -> None:
    """Resume a stream paused on a failing job: the job gets fresh attempts. TaskNotFound;
    InvalidTaskState when the stream is not failing."""
    client.get_task(task_id)
    state = _state(client, task_id)
    info = None if state is None else _info_of(state)
    if state is None or info is None or state.code is not StateCode.PAUSED or info.failing is None:
        what = "not a stream" if info is None else f"{state.code.value if state else 'new'}, not failing"
        raise InvalidTaskState(f"stream {task_id!r} is {what}; only a failing stream is retried "
                               "(a failed one: metafora retry --reset-state --keep-cursor)")
    commands_for(client).send(task_id, Message.run())
