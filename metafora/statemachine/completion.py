"""The state machine's checkpoints and completion, as the user's commands ask for them.

``cmds.checkpoint(cursor)`` persists the state (fenced by the claim, retried);
``cmds.checkpoint(cursor, conn=)`` and ``cmds.complete(conn=)`` write in the application's
transaction, after which the state is read back (:meth:`Completion._settle`) before the
machine's next own write. :class:`Completion` is mixed into
:class:`~metafora.statemachine.handler.StatefulTaskHandler`, whose loop runs the machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from metafora.contracts.coordinator import coordinator_of
from metafora.core.clock import Clock
from metafora.core.errors import ClaimLost, ConfigError, CoordinatorUnavailable
from metafora.core.task import Task
from metafora.statemachine.machine import Message, State, apply
from metafora.statemachine.store import StateStore

__all__ = ["Completion", "GiveUp"]

T = TypeVar("T")


class GiveUp(Exception):
    """Store retries exhausted or the handler was stopped while retrying."""


class Completion:
    """The user's checkpoints and completion over the handler's claim and state (the
    handler's attributes; its store retries and its reaction to a lost claim)."""

    task: Task
    clock: Clock
    _states: StateStore
    _state: State | None
    _lost: bool
    _unsure: bool
    _completed: bool
    _checkpoint_error: BaseException | None

    def _retry(self, what: str, call: Callable[[], T],
               cancel: threading.Event | None = None) -> T:
        raise NotImplementedError

    def _lose(self, exc: ClaimLost) -> None:
        raise NotImplementedError

    def checkpoint_in(self, cursor: str | None, conn: Any) -> None:
        """Persist the current state with ``cursor`` in the application's transaction
        ``conn`` (see :meth:`Commands.checkpoint`); the state is read back before the
        machine's next own write (the transaction may roll back)."""
        new = self._with_cursor(cursor)
        self._states.store_in(self.task, new, conn)
        self._state, self._unsure = new, True

    def complete_in(self, conn: Any) -> None:
        """The completed state and the task's end in the application's transaction ``conn``
        (see :meth:`Commands.complete`)."""
        if self._lost:
            raise ClaimLost(f"task {self.task.id!r} was lost (token {self.task.token})")
        self._settle()
        state = self._state
        assert state is not None
        new = apply(state, Message.complete(), self.clock.now())
        if new is None:
            raise ClaimLost(f"task {self.task.id!r} cannot complete in state {state.code.value}")
        coordinator = coordinator_of(self.task)
        if coordinator is None:
            raise ConfigError(f"task {self.task.id!r} came from no consumer: cmds.complete(conn=) "
                              "completes a task its node claimed")
        # The state first: its write is fenced by the task still being claimed.
        self._states.store_in(self.task, new, conn)
        coordinator.complete_task(self.task, conn=conn)
        self._unsure = self._completed = True

    def _with_cursor(self, cursor: str | None) -> State:
        if self._lost:
            raise ClaimLost(f"task {self.task.id!r} was lost (token {self.task.token})")
        self._settle()
        return self._checkpointed(cursor)

    def _checkpointed(self, cursor: str | None) -> State:
        """The settled state with ``cursor`` checkpointed."""
        state = self._state
        assert state is not None
        new = apply(state, Message.checkpoint(cursor))
        if new is None:  # only while runnable; kept general for the table's sake
            raise ClaimLost(f"task {self.task.id!r} cannot checkpoint in state {state.code.value}")
        return new

    def _settle(self) -> None:
        """After a write in the application's transaction: the state as the store has it
        (committed or rolled back). ClaimLost when the claim is gone (a committed
        completion ends it)."""
        if not self._unsure:
            return
        try:
            self._state = self._retry("load state", lambda: self._states.load(self.task))
        except GiveUp as exc:
            raise CoordinatorUnavailable(
                f"could not read the state of task {self.task.id!r} back: {exc.__cause__}"
            ) from exc.__cause__
        self._unsure = self._completed = False

    def checkpoint(self, cursor: str | None, *, handoff: bool = False) -> None:
        """Persist the current state with ``cursor`` (see :meth:`Commands.checkpoint`).

        ``handoff``: the final checkpoint of a release, retried even though ``stop()`` was
        called (the consumer's ``handoff_timeout`` bounds it)."""
        if self._lost:
            raise ClaimLost(f"task {self.task.id!r} was lost (token {self.task.token})")
        try:
            self._settle()
        except ClaimLost as exc:
            self._lose(exc)
            raise
        new = self._checkpointed(cursor)
        try:
            self._retry("checkpoint", lambda: self._states.store(self.task, new),
                        cancel=threading.Event() if handoff else None)
        except ClaimLost as exc:
            self._lose(exc)
            raise
        except GiveUp as exc:
            error = CoordinatorUnavailable(
                f"could not checkpoint task {self.task.id!r}: {exc.__cause__ or 'stopped'}"
            )
            self._checkpoint_error = error
            raise error from exc.__cause__
        self._state = new
