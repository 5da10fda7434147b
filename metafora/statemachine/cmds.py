"""What a stateful handler gets besides its task: the ``cmds`` of ``fn(task, cmds)``.

:class:`Commands` reads commands (``poll``, ``get``), saves checkpoints (fenced, or in the
application's transaction with ``conn=``), hands off and completes; :class:`MachineView` is
what it shares with the async :class:`~metafora.statemachine.aio.AsyncCommands`. Both act
through the running machine, known here by what they use of it (:class:`RunningMachine`, which
:class:`~metafora.statemachine.handler.StatefulTaskHandler` is): this module imports no handler,
so the handler, which hands out ``Commands``, and its commands form no import circle.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from metafora.core.task import Task
from metafora.statemachine.machine import Message, State

if TYPE_CHECKING:
    from metafora.core.clock import Clock
    from metafora.statemachine.mailbox import Mailbox

__all__ = ["Commands", "MachineView", "RunningMachine", "StatefulHandler"]


class RunningMachine(Protocol):
    """What the commands use of a running machine
    (:class:`~metafora.statemachine.handler.StatefulTaskHandler`)."""

    @property
    def task(self) -> Task:
        """The claimed task (with its fencing token)."""

    @property
    def clock(self) -> Clock:
        """The clock the machine waits by."""

    @property
    def poll_interval(self) -> float:
        """The longest wait of one ``get()`` round."""

    @property
    def risk_until(self) -> datetime | None:
        """Until when the claim is guaranteed while it is at risk, else None."""

    @property
    def state(self) -> State | None:
        """The task's current state (None until the machine has loaded it)."""

    @property
    def stopping(self) -> bool:
        """Whether the machine was asked to stop or lost its claim."""

    @property
    def mailbox(self) -> Mailbox | None:
        """The claim's command mailbox while the machine runs."""

    def risk_notice(self) -> Message | None:
        """``Message.checkpoint()`` once per at-risk episode, else None."""

    def handed(self) -> Message | None:
        """The message of a hand-off that arrived, else None."""

    def receive(self, timeout: float | None) -> Message | None:
        """The next command, waiting up to ``timeout`` seconds."""

    def checkpoint(self, cursor: str | None, *, handoff: bool = False) -> None:
        """Save ``cursor``, fenced by the claim token."""

    def checkpoint_in(self, cursor: str | None, conn: Any) -> None:
        """Save ``cursor`` in the application's transaction ``conn``."""

    def complete_in(self, conn: Any) -> None:
        """Complete the task in the application's transaction ``conn``."""


class MachineView:
    """The task, state and cursor of a running machine, as its handler sees them (the
    base of :class:`Commands` and of :class:`~metafora.statemachine.aio.AsyncCommands`)."""

    def __init__(self, machine: RunningMachine) -> None:
        self._machine = machine

    @property
    def task(self) -> Task:
        """The claimed task (with its fencing token)."""
        return self._machine.task

    @property
    def state(self) -> State:
        """The task's current state (runnable while the handler runs)."""
        state = self._machine.state
        assert state is not None
        return state

    @property
    def cursor(self) -> str | None:
        """The cursor of the last checkpoint (from any earlier owner too), or None."""
        return self.state.cursor

    @property
    def stopping(self) -> bool:
        """Whether the consumer asked the task to stop (``poll()`` then answers ``release``)."""
        return self._machine.stopping

    @property
    def at_risk(self) -> datetime | None:
        """While the claim is at risk (the node's lease renewals are failing), until when it
        is guaranteed (UTC); None while it is safe. ``poll()``/``get()`` answer
        ``Message.checkpoint()`` once when it becomes at risk (see docs/claim-at-risk.md)."""
        return self._machine.risk_until


class Commands(MachineView):
    """What a :data:`StatefulHandler` gets besides its task: commands, cursor, checkpoints.

    ``task``, ``state``, ``cursor`` and ``stopping`` describe the running machine. Use it only
    from the thread that called the handler.
    """

    def poll(self) -> Message | None:
        """The next command without waiting, or None.

        Returns ``Message.release()`` once the consumer has called ``stop()`` (shutdown,
        rebalancing, a lost claim), and ``Message.checkpoint()`` once when the claim becomes
        at risk (:attr:`at_risk`): save your position (``cmds.checkpoint(cursor)`` and go
        on, or ``return Message.checkpoint(cursor)`` to be called again from it). Return the
        message you get (or another one) to obey it.
        """
        if self._machine.stopping:
            return Message.release()
        return (self._machine.risk_notice() or self._machine.handed()
                or self._machine.receive(0.0))

    def get(self, timeout: float | None = None) -> Message | None:
        """The next command, waiting up to ``timeout`` seconds of the machine's clock.

        ``None`` waits until a command arrives or ``stop()``; returns None on timeout. Like
        :meth:`poll`, answers ``Message.checkpoint()`` once when the claim becomes at risk.
        """
        machine = self._machine
        deadline = None if timeout is None else machine.clock.monotonic() + max(0.0, timeout)
        while True:
            if machine.stopping:
                return Message.release()
            if (handed := machine.risk_notice() or machine.handed()) is not None:
                return handed
            # Without a deadline, block until the mailbox is rung or stop() interrupts it
            # (10,000 waiting tasks must not wake up every second); with one, re-read the
            # machine's clock every poll_interval (it may be a fake one).
            wait: float | None = None
            if deadline is not None:
                left = deadline - machine.clock.monotonic()
                if left <= 0:
                    return None
                wait = min(machine.poll_interval, left)
            message = machine.receive(wait)
            if message is not None:
                return message

    def handoff(self, cursor: str | None = None) -> Message:
        """Answer a release with a final checkpoint: save ``cursor``, return ``release``.

        When ``poll()`` or ``get()`` answers ``Message.release()`` (the balancer, ``metafora
        stop`` or a shutdown asked for the task), ``return cmds.handoff(cursor)`` saves the
        exact position reached (a fenced state write) before the claim moves, so the next
        owner's ``cmds.cursor`` resumes right there. The consumer's ``handoff_timeout``
        bounds how long this may take. If the write is refused (the claim was lost) or the
        store stays unreachable, the error propagates and the task is still released: the
        next owner resumes from the previous checkpoint. Unlike other store calls after
        ``stop()``, this write is retried (``store_attempts``): stopping is why it is made.
        """
        self._machine.checkpoint(cursor, handoff=True)
        return Message.release()

    def checkpoint(self, cursor: str | None = None, *, conn: Any = None) -> None:
        """Save ``cursor`` with the task's state now (a fenced write).

        Raises ClaimLost if another owner holds the task (return at once: the machine stops
        anyway), CoordinatorUnavailable if the store stayed unreachable (the machine then
        releases the task if you let it propagate).

        With ``conn`` (SQL stores): the write joins the application's open transaction (a
        SQLAlchemy ``Connection``/``Session`` or a psycopg ``Connection``), so the cursor
        moves if and only if the business rows commit; ClaimLost means nothing was written
        (roll back). Before its next own write the machine reads the state back from the
        store, so a rolled-back cursor is never written later. ConfigError on etcd and memory.
        """
        if conn is None:
            self._machine.checkpoint(cursor)
        else:
            self._machine.checkpoint_in(cursor, conn)

    def complete(self, *, conn: Any) -> None:
        """Complete the task inside the application's open transaction ``conn``: its state
        becomes ``completed`` and the task done, both if and only if ``conn`` commits
        (River's ``JobCompleteTx``; SQL stores). A committed completion wins over what the
        handler returns afterwards; after a rollback the machine goes on as if this was not
        called. ClaimLost (nothing written: roll back) when the claim is not current.
        """
        self._machine.complete_in(conn)


StatefulHandler = Callable[[Task, Commands], Message]
"""The user's function: ``(task, commands) -> Message`` (see :mod:`metafora.statemachine.handler`)."""
