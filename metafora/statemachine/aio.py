"""Async stateful handlers: ``async def step(task, cmds) -> Message`` with ``await cmds.get()``.

The same state machine as :mod:`metafora.statemachine.handler` (same transitions, fencing,
retries and outcomes), run as an :class:`~metafora.contracts.handler.AsyncHandler` on the consumer's
event loop: a task waiting for a command (paused, sleeping, or in ``await cmds.get()``)
holds no thread, so one node can keep thousands of them. Waiting is pushed: the claim's
:class:`~metafora.statemachine.mailbox.Mailbox` wakes the coroutine through its listener
hook, and the store is read only when a command may have arrived. The machine's store calls
(load, persist, take a command, checkpoint) are short blocking calls and run on worker
threads (``asyncio.to_thread``), so they never hold the loop.

:func:`~metafora.statemachine.handler_func` (:mod:`metafora.statemachine.factory`) picks
this runner when given an ``async def``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from metafora.contracts.handler import AsyncHandler
from metafora.core.task import Task
from metafora.statemachine.handler import MachineView, StatefulTaskHandler
from metafora.statemachine.machine import Message, State, StateCode
from metafora.statemachine.mailbox import Mailbox

__all__ = ["AsyncCommands", "AsyncStatefulHandler", "AsyncStatefulTaskHandler"]


class AsyncCommands(MachineView):
    """What an :data:`AsyncStatefulHandler` gets besides its task: commands, cursor, checkpoints.

    The async twin of :class:`~metafora.statemachine.handler.Commands`; use it only from the
    handler's coroutine.
    """

    def __init__(self, runner: AsyncStatefulTaskHandler) -> None:
        super().__init__(runner.machine)
        self._runner = runner

    async def poll(self) -> Message | None:
        """The next command without waiting, or None (``release`` once stopping)."""
        if self.stopping:
            return Message.release()
        return (self._machine.risk_notice() or self._machine.handed()
                or await self._runner.receive(0.0))

    async def get(self, timeout: float | None = None) -> Message | None:
        """The next command, waiting up to ``timeout`` seconds (None: until one arrives or
        the task is stopped, which answers ``release``); None on timeout. Answers
        ``Message.checkpoint()`` once when the claim becomes at risk, as ``poll()`` does."""
        machine = self._machine
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        while True:
            if self.stopping:
                return Message.release()
            if (handed := machine.risk_notice() or machine.handed()) is not None:
                return handed
            left = None if deadline is None else max(0.0, deadline - loop.time())
            message = await self._runner.receive(left, notices=True)
            if message is not None:
                return message
            if self.stopping:
                return Message.release()
            if deadline is not None and loop.time() >= deadline:
                return machine.risk_notice()

    def on_wake(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (from any thread; it must not block) whenever a command may
        have arrived or the task is being stopped or put at risk; returns the undo.

        For a handler that also waits on work of its own: it wakes on either and then calls
        ``await poll()`` (store I/O only when a command may be there). Bridge the callback
        to the loop with ``loop.call_soon_threadsafe``.
        """
        mailbox = self._machine.mailbox
        if mailbox is None:  # not running: nothing will ring
            return lambda: None
        mailbox.add_listener(callback)
        return lambda: mailbox.remove_listener(callback)

    async def checkpoint(self, cursor: str | None = None, *, conn: Any = None) -> None:
        """Save ``cursor`` with the task's state now (a fenced write, off the loop).

        Raises ClaimLost if another owner holds the task, CoordinatorUnavailable if the
        store stayed unreachable (the machine then releases the task if you let it propagate).
        ``conn``: in the application's open (sync) transaction, as
        :meth:`Commands.checkpoint <metafora.statemachine.cmds.Commands.checkpoint>`.
        """
        if conn is None:
            await asyncio.to_thread(self._machine.checkpoint, cursor)
        else:
            await asyncio.to_thread(self._machine.checkpoint_in, cursor, conn)

    async def complete(self, *, conn: Any) -> None:
        """Complete the task in the application's open (sync) transaction ``conn``, as
        :meth:`Commands.complete <metafora.statemachine.cmds.Commands.complete>`."""
        await asyncio.to_thread(self._machine.complete_in, conn)


AsyncStatefulHandler = Callable[[Task, AsyncCommands], Awaitable[Message]]
"""The user's coroutine function: ``async (task, commands) -> Message``."""


class AsyncStatefulTaskHandler(AsyncHandler):
    """Runs one claimed task through the state machine on the event loop.

    ``machine`` is the task's :class:`~metafora.statemachine.handler.StatefulTaskHandler`: it
    keeps the state, the stores and the stop flag; this class only replaces its blocking
    waits by awaits and calls the user's coroutine. Built by ``handler_func``.
    """

    def __init__(self, machine: StatefulTaskHandler, stateful: AsyncStatefulHandler) -> None:
        self.machine = machine
        self._stateful = stateful
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop(self) -> None:
        """Ask ``run()`` to return (release) soon. Never blocks; any thread."""
        self.machine.stop()  # interrupts the mailbox, whose listener wakes the coroutine
        self._ring()

    def at_risk(self, until: datetime) -> None:
        """The claim is at risk: the next ``await cmds.get()``/``poll()`` answers
        ``Message.checkpoint()`` (once). Never blocks."""
        self.machine.at_risk(until)
        self._ring()

    def recovered(self, until: datetime) -> None:
        """A renewal got through: the claim is safe again."""
        self.machine.recovered(until)

    async def run(self) -> bool:
        """Run the machine; True when the task reached a terminal state, False to release."""
        machine = self.machine
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        mailbox = machine._channel.open(machine.task.id, machine.task.token)
        machine._mailbox = mailbox
        mailbox.add_listener(self._ring)
        try:
            return await self._run()
        finally:
            mailbox.remove_listener(self._ring)
            machine._mailbox = None
            mailbox.close()

    async def _run(self) -> bool:
        machine = self.machine
        state, result = await asyncio.to_thread(machine._begin)
        if result is not None:
            return result
        while not machine.stopping:
            message = await self._next_message(state)
            if message is None:
                break
            state, result = await asyncio.to_thread(machine._advance, message)
            if result is not None:
                return result
        return machine._released()

    async def _next_message(self, state: State) -> Message | None:
        code = state.code
        if code is StateCode.RUNNABLE:
            return self.machine.hand_over(await self._take(0.0)) or await self._call_user()
        if code is StateCode.PAUSED:
            return await self._take(None)
        if code is StateCode.SLEEPING:
            return await self._sleep(state)
        if code is StateCode.FAULT:
            return await self._take(0.0) or self.machine._handle_error(state)
        raise AssertionError(f"no step for state {code}")  # terminal states end run()

    async def _call_user(self) -> Message | None:
        machine = self.machine
        machine._checkpoint_error = None
        try:
            result = await self._stateful(machine.task, AsyncCommands(self))
        except Exception as exc:
            return machine._user_raised(exc)
        finally:
            machine.unread()
        return machine._user_returned(result)

    async def _take(self, timeout: float | None) -> Message | None:
        """A command the machine takes itself (see ``StatefulTaskHandler.take``)."""
        message = self.machine._command = await self.receive(timeout)
        return message

    async def _sleep(self, state: State) -> Message | None:
        until = state.until
        machine = self.machine
        while not machine.stopping:
            left = None if until is None else (until - machine.clock.now()).total_seconds()
            if left is not None and left <= 0:
                return Message.run()
            # The machine's clock may be a fake one: re-read it every poll_interval.
            wait = None if left is None else min(machine.poll_interval, left)
            message = await self._take(wait)
            if message is not None:
                return message
        return None

    async def receive(self, timeout: float | None, notices: bool = False) -> Message | None:
        """The next command (fenced), waiting up to ``timeout`` real seconds without a thread.

        The store is read (on a worker thread) only when the mailbox was rung, or when a
        look is due on a channel that cannot push; None on timeout or once stopping (and,
        with ``notices``, once an at-risk notice waits for the handler).
        """
        machine = self.machine
        mailbox = machine._mailbox
        wake = self._wake
        assert mailbox is not None and wake is not None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        while not machine.stopping:
            wake.clear()
            if notices and machine._risk_notice:
                return None
            if self._look_due(mailbox):
                message = await asyncio.to_thread(machine.receive, 0.0)
                if message is not None or machine.stopping:
                    return message
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            if mailbox.poll_every is not None:
                left = mailbox.poll_every if left is None else min(left, mailbox.poll_every)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), left)
        return None

    @staticmethod
    def _look_due(mailbox: Mailbox) -> bool:
        # A mailbox that cannot be pushed decides itself when a look is due.
        return mailbox.ready or mailbox.poll_every is not None

    def _ring(self) -> None:
        """The mailbox listener: wake the coroutine (from any thread)."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits any more
            loop.call_soon_threadsafe(wake.set)
