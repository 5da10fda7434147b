"""Retrying a finished task: what every store's client shares.

``Client.retry_task(id)`` makes a failed or expired task pending again. With
``reset_state=True`` it also re-runs a stateful task whose state machine ended ``failed`` or
``killed``, resetting that state in the same atomic step. The rules of such a reset belong
to the state machine (:mod:`metafora.statemachine.retry`), which sits above the
coordinators; the coordinators only offer the atomic step:
``Client.retry_with_state(task_id, rewrite)`` reads the task and its stored state (opaque
text or bytes here: a :class:`RetrySnapshot`), calls ``rewrite``, and writes the task and
the state ``rewrite`` returned together -- one SQL transaction, one etcd txn, or under the
memory store's lock -- or nothing at all when ``rewrite`` raises.

``Client.retry_task(..., reset_state=True)`` calls
:func:`metafora.statemachine.retry.reset_and_retry`, which the state machine registers as the
client's verb ``reset_state`` (:mod:`metafora.contracts.recipes`), loaded only then: neither the client
nor a coordinator imports the state machine, and ``import metafora`` loads none of it.
:class:`RetryClient` is what the state machine's retry needs of a client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from metafora.core.errors import ConfigError, InvalidTaskState
from metafora.core.task import TaskInfo, TaskState

__all__ = [
    "RETRYABLE",
    "RetryClient",
    "RetrySnapshot",
    "StateRewrite",
    "check_retry_options",
    "check_retryable",
]

RETRYABLE: Final = frozenset({TaskState.FAILED, TaskState.EXPIRED})
"""The task states a plain retry accepts."""


@dataclass(frozen=True)
class RetrySnapshot:
    """A task as a retry reads it, inside the atomic step that makes it pending again.

    ``state``: the task's state (a pending task past its ``expires_at`` counts as expired);
    ``token``: its last claim token; ``body``: its stored state-machine state as the store
    keeps it (text or bytes, opaque to the coordinator), None when it has none.
    """

    task_id: str
    state: TaskState
    token: int
    body: str | bytes | None


StateRewrite = Callable[[RetrySnapshot], "str | bytes | None"]
"""Decides a retry: raises to refuse it (nothing is written), or returns the state body to
store (None: keep the stored state; a task without one keeps none)."""


class RetryClient(Protocol):
    """What a retry needs of a :class:`~metafora.contracts.client.Client` (every store's client has it)."""

    def get_task(self, task_id: str) -> TaskInfo:
        """One task's info. Raises TaskNotFound."""
        ...

    def retry_with_state(self, task_id: str, rewrite: StateRewrite | None) -> None:
        """Make a finished task pending again with ``rewrite`` of its stored state, atomically."""
        ...


def check_retry_options(reset_state: bool, keep_cursor: bool) -> None:
    """ConfigError for ``keep_cursor`` without ``reset_state`` (checked before any I/O)."""
    if keep_cursor and not reset_state:
        raise ConfigError("keep_cursor only applies with reset_state (the cursor of a reset state)")


def check_retryable(task_id: str, state: TaskState) -> None:
    """InvalidTaskState unless a plain retry accepts a task in ``state``."""
    if state not in RETRYABLE:
        raise InvalidTaskState(
            f"task {task_id!r} is {state.value}; only failed or expired tasks can be "
            "retried (stateful tasks that ended failed or killed: with reset_state)"
        )
