"""Re-running a finished stateful task: what ``Client.retry_task`` does with its state.

:func:`retry_task` takes a client and the state store beside it: in the client's one atomic
step (``Client.retry_with_state``: one transaction on SQL, one etcd txn, or under the memory
store's lock) it reads the task's coordinator state and its stored state-machine state, asks
:func:`plan_retry` what to do, and makes the task pending with the state :func:`plan_retry`
returned. ``Client.retry_task(id, reset_state=True, keep_cursor=...)`` calls
:func:`reset_and_retry` explicitly, importing this module only then (see
:mod:`metafora.core.task_retry`): the coordinators never import the state machine. The rules
live here once, so the stores cannot drift apart:

- without ``reset_state`` (the historical behaviour): a *failed* or *expired* task becomes
  pending; its stored state, if any, is kept as it is (a gated partition revives itself;
  a plain stateful task whose state is terminal would end at once -- the CLI checks that
  with :func:`retry_advice` and says so);
- with ``reset_state``: also a *done* task whose stored state is ``failed`` or ``killed``
  (a stateful task ends as ``done`` in the coordinator whatever its terminal state); its
  state becomes ``runnable`` with no errors, keeping the cursor only with ``keep_cursor``.
  A ``completed`` task is refused: its work is finished (delete and submit it to redo it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from metafora.core.errors import InvalidTaskState
from metafora.core.task import TaskState, validate_task_id
from metafora.core.task_retry import (
    RETRYABLE,
    RetryClient,
    RetrySnapshot,
    check_retry_options,
    check_retryable,
)
from metafora.statemachine.machine import InvalidState, State, StateCode
from metafora.statemachine.store import StateStore, state_store_for

__all__ = [
    "RERUNNABLE",
    "check_retry_options",
    "plan_retry",
    "reset_and_retry",
    "retry_advice",
    "retry_task",
    "would_end_at_once",
]

RERUNNABLE: Final = frozenset({StateCode.FAILED, StateCode.KILLED})
"""Terminal states a ``done`` task may be re-run from with ``reset_state``."""

Stored = str | bytes | Mapping[str, Any] | State | None
"""A stored state as a store has it: wire text, a parsed mapping, a State, or None (none)."""


def _parse(task_id: str, stored: Stored) -> State | None:
    if stored is None or isinstance(stored, State):
        return stored
    try:
        return State.from_json(stored)
    except InvalidState as exc:
        raise InvalidState(f"task {task_id!r} has a damaged stored state: {exc}") from None


def plan_retry(
    task_id: str,
    task_state: TaskState,
    stored: Stored,
    *,
    reset_state: bool = False,
    keep_cursor: bool = False,
) -> State | None:
    """Check that the task may be retried; the state to store with it (None: keep it).

    Raises :class:`~metafora.core.errors.InvalidTaskState` naming why the task cannot be
    retried, :class:`~metafora.core.errors.ConfigError` for ``keep_cursor`` without
    ``reset_state``, and :class:`~metafora.statemachine.InvalidState` when the cursor of a
    damaged stored state was asked to be kept (without ``keep_cursor`` a damaged state is
    simply replaced).
    """
    check_retry_options(reset_state, keep_cursor)
    if not reset_state:
        check_retryable(task_id, task_state)
        return None
    if task_state in RETRYABLE:
        if stored is None:
            return None
        return _fresh(task_id, stored, keep_cursor)
    if task_state is not TaskState.DONE:
        raise InvalidTaskState(
            f"task {task_id!r} is {task_state.value}; only finished tasks can be retried"
        )
    try:
        state = _parse(task_id, stored)
    except InvalidState as exc:
        raise InvalidTaskState(f"task {task_id!r} is done, and {exc}") from None
    if state is None or state.code not in RERUNNABLE:
        what = "has no state-machine state" if state is None else f"ended {state.code.value}"
        raise InvalidTaskState(
            f"task {task_id!r} is done and {what}; only a stateful task that ended failed "
            "or killed can be re-run (delete and submit it again to redo finished work)"
        )
    return State(cursor=state.cursor if keep_cursor else None)


def _fresh(task_id: str, stored: Stored, keep_cursor: bool) -> State:
    if not keep_cursor:
        return State()
    state = _parse(task_id, stored)
    return State(cursor=None if state is None else state.cursor)


def retry_task(client: RetryClient, states: StateStore, task_id: str, *,
               reset_state: bool = False, keep_cursor: bool = False) -> None:
    """``Client.retry_task`` with the task's state kept in ``states`` (the state store beside
    ``client``): the task is made pending and its state reset (or kept) atomically, by the
    rules of :func:`plan_retry`. TaskNotFound, InvalidTaskState, ConfigError, InvalidState.
    """
    check_retry_options(reset_state, keep_cursor)
    if not reset_state:
        client.retry_with_state(task_id, None)
        return

    def rewrite(found: RetrySnapshot) -> str | bytes | None:
        token, stored = found.token, None
        if found.body is not None:
            token, stored = states.decode_stored(task_id, found.body, token)
        new = plan_retry(task_id, found.state, stored, reset_state=True, keep_cursor=keep_cursor)
        return None if new is None else states.encode_stored(token, new)

    client.retry_with_state(task_id, rewrite)


def reset_and_retry(client: RetryClient, task_id: str, keep_cursor: bool) -> None:
    """``client.retry_task(task_id, reset_state=True, keep_cursor=...)``: :func:`retry_task`
    on the state store beside the client."""
    states = state_store_for(client)
    try:
        retry_task(client, states, task_id, reset_state=True, keep_cursor=keep_cursor)
    finally:
        states.close()


def would_end_at_once(state: State | None) -> bool:
    """Whether a task pending again with this stored state would end as soon as it runs."""
    return state is not None and state.code.terminal


def retry_advice(client: RetryClient, task_id: str) -> str | None:
    """Why a plain ``retry_task(task_id)`` would end the task at once, and what to do
    instead (None when it would run). Reads the task and its stored state (TaskNotFound).

    The ``metafora retry`` CLI refuses with this text instead of retrying a task its
    handler would finish on its first step.
    """
    validate_task_id(task_id)
    task_state = client.get_task(task_id).state
    if task_state not in RETRYABLE and task_state is not TaskState.DONE:
        return None  # not finished: retry_task itself says why it cannot be retried
    store = state_store_for(client)
    try:
        stored = store.get(task_id)
    except InvalidState as exc:
        return (f"task {task_id!r} has a damaged stored state ({exc}): retried as it is, it "
                f"would fail again at once; run 'metafora retry {task_id} --reset-state' to "
                "replace it with a runnable state")
    finally:
        store.close()
    if not would_end_at_once(stored):
        return None
    assert stored is not None
    try:
        plan_retry(task_id, task_state, stored, reset_state=True)
    except InvalidTaskState:
        hint = "delete it and submit it again to redo its work"
    else:
        hint = (f"run 'metafora retry {task_id} --reset-state' to run it again from a "
                "runnable state")
        if stored.cursor is not None:
            hint += " (add --keep-cursor to resume from its last checkpoint)"
    return (f"task {task_id!r} ended {stored.code.value} (its stored state): retried as it "
            f"is, its handler would end it at once; {hint}")
