"""What a message handler gets besides its message: ``fn(msg, ctx)``.

``ctx.task`` / ``ctx.token`` (the claim), ``ctx.stop`` (a ``threading.Event`` for a plain
handler, an ``asyncio.Event`` for an ``async def`` one) and ``ctx.stopping``;
``ctx.complete(conn=...)`` marks the task done inside the application's open transaction
(River's ``JobCompleteTx``); ``ctx.checkpoint(cursor, conn=None)`` saves a progress marker
fenced by the claim (in the application's transaction with ``conn``) and ``ctx.cursor``
reads the last one (from any earlier owner too).

The store is the one the claim came from: the consumer's coordinator, found through the
claimed task, unless the router was given ``store=`` (a coordinator or a client).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from metafora.contracts.coordinator import coordinator_of
from metafora.core.errors import ConfigError
from metafora.core.task import Task

__all__ = ["MessageContext"]


class MessageContext:
    """The context of one message task's run (see the module docstring)."""

    def __init__(self, task: Task, stop: threading.Event | asyncio.Event,
                 store: object | None = None) -> None:
        self.task = task
        self.stop = stop
        self._store = store
        self._cursor: str | None = None
        self._cursor_known = False
        self.completed = False
        """Whether :meth:`complete` wrote the completion (it counts once its transaction commits)."""

    @property
    def token(self) -> int:
        """The claim's fencing token."""
        return self.task.token

    @property
    def stopping(self) -> bool:
        """Whether the consumer wants the task back (return soon, ``False`` to release)."""
        return self.stop.is_set()

    def is_stopping(self) -> bool:
        """As :attr:`stopping`."""
        return self.stop.is_set()

    def store(self) -> Any:
        """The coordinator (or client) the claim is completed and checkpointed on."""
        if self._store is not None:
            return self._store
        coordinator = coordinator_of(self.task)
        if coordinator is None:
            raise ConfigError(
                f"task {self.task.id!r} came from no consumer: give the router its store "
                "(Router(store=client)) to complete or checkpoint outside a Consumer")
        return coordinator

    def complete(self, *, conn: Any) -> None:
        """Mark the task done inside the application's open transaction ``conn`` (a
        SQLAlchemy ``Connection``/``Session`` or a psycopg ``Connection``; SQL stores).

        Done if and only if that transaction commits; a committed completion wins over what
        the handler returns afterwards. ClaimLost (nothing written: roll back) when the
        claim is no longer current; ConfigError on etcd and memory. A blocking call: in an
        ``async def`` handler it holds the event loop for one statement.
        """
        self.store().complete_task(self.task, conn=conn)
        self.completed = True

    def checkpoint(self, cursor: str | None, *, conn: Any = None) -> None:
        """Save ``cursor`` for this task, fenced by the claim (ClaimLost if it is not current).

        With ``conn``, inside the application's open transaction (SQL stores; ConfigError on
        others): the cursor is saved if and only if it commits, so :attr:`cursor` reads it
        from the store again next time. Without, a write of metafora's own.
        """
        from metafora.statemachine.machine import State
        from metafora.statemachine.store import state_store_for

        states = state_store_for(self.store())
        if conn is None:
            states.store(self.task, State(cursor=cursor))
            self._cursor, self._cursor_known = cursor, True
        else:
            states.store_in(self.task, State(cursor=cursor), conn)
            self._cursor_known = False  # committed or not: the store knows

    @property
    def cursor(self) -> str | None:
        """The cursor of the last checkpoint of this task (any owner's), or None (a fenced
        read on first use)."""
        if not self._cursor_known:
            from metafora.statemachine.store import state_store_for

            state = state_store_for(self.store()).load_stored(self.task)
            self._cursor = None if state is None else state.cursor
            self._cursor_known = True
        return self._cursor
