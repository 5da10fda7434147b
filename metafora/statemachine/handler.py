"""The state machine as a :class:`~metafora.contracts.handler.Handler`: runs a user's stateful handler.

``handler_func(stateful, coordinator)`` (:mod:`metafora.statemachine.factory`) returns a
:data:`~metafora.contracts.handler.HandlerFunc`. Each claimed task gets a
:class:`StatefulTaskHandler` whose ``run()``:

1. loads the task's :class:`State` (fenced by the claim token);
2. loops: *runnable* -> a pending command, else the user's function (a pending ``run``,
   which changes nothing here, is handed to the function's first ``poll()``/``get()``, or
   logged as applied if it does not read it); *paused* -> waits for
   a command (keeping the claim); *sleeping* -> waits until ``until`` or a command;
   *fault* -> a pending command, else the error handler;
3. applies the message through :data:`~metafora.statemachine.machine.TRANSITIONS` and
   persists the new state (fenced) when it changed (always on a checkpoint);
4. returns ``True`` (done: the coordinator marks the task done) when the state becomes
   terminal -- ``completed``, ``failed`` or ``killed``; the stored state says which and why --
   and ``False`` (release) on a ``release`` message or after ``stop()``.

Commands reach the machine through a :class:`~metafora.statemachine.mailbox.Mailbox` the
handler opens for its claim: pushed by the node's coordinator, so ``Commands.poll()`` and
``Commands.get()`` do no store I/O while nothing arrived (see
:mod:`metafora.statemachine.mailbox`).

Failures: a fenced write refused (ClaimLost) stops the handler at once; a store that is
unreachable is retried (``store_attempts``) and then the task is *released* -- never
completed or deleted; a malformed stored state raises (the task is marked failed, with
the reason, and kept for the operator).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from metafora.contracts.handler import Handler
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.errors import ClaimLost, CoordinatorUnavailable, StoreError
from metafora.core.task import Task
from metafora.statemachine.cmds import Commands, MachineView, StatefulHandler
from metafora.statemachine.completion import Completion, GiveUp
from metafora.statemachine.errors import ErrorHandler, default_error_handler
from metafora.statemachine.machine import (
    IGNORE,
    TRANSITIONS,
    Message,
    MessageKind,
    State,
    StateCode,
    apply,
)
from metafora.statemachine.mailbox import Mailbox
from metafora.statemachine.store import StateStore, TaskCommands

__all__ = ["Commands", "MachineView", "StatefulHandler", "StatefulTaskHandler"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_RETRY_MAX = 5.0  # seconds: the longest pause between store retries


class StatefulTaskHandler(Completion, Handler):
    """Runs one claimed task through the state machine. Built by :func:`handler_func`."""

    def __init__(
        self,
        task: Task,
        stateful: StatefulHandler,
        state_store: StateStore,
        task_commands: TaskCommands,
        *,
        error_handler: ErrorHandler = default_error_handler,
        clock: Clock | None = None,
        poll_interval: float = 1.0,
        store_attempts: int = 5,
        store_retry_delay: float = 0.2,
    ) -> None:
        self.task = task
        self.clock = clock or SYSTEM_CLOCK
        self.poll_interval = poll_interval
        self._stateful = stateful
        self._states = state_store
        self._channel = task_commands
        self._error_handler = error_handler
        self._attempts = store_attempts
        self._retry_delay = store_retry_delay
        self._stop = threading.Event()
        self._mailbox: Mailbox | None = None  # open while run() runs
        self._lost = False
        self._state: State | None = None
        self._checkpoint_error: BaseException | None = None
        self._command: Message | None = None  # the last command the machine itself took
        self._handed: Message | None = None  # a `run` kept for the handler's first read
        self.risk_until: datetime | None = None  # set while the claim is at risk
        self._risk_notice = False  # a checkpoint request for the handler's next read
        # A write in the application's transaction happened: read the state back before the
        # next own write (_settle); _completed: it was a completion (cmds.complete).
        self._unsure = False
        self._completed = False
        self._extra = {"task": task.id, "token": task.token}

    # -- Handler --------------------------------------------------------------------------

    @property
    def state(self) -> State | None:
        """The task's current state (None until ``run()`` has loaded it)."""
        return self._state

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` was called or the claim was lost."""
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask ``run()`` to return (release) soon. Never blocks."""
        self._stop.set()
        mailbox = self._mailbox
        if mailbox is not None:
            mailbox.interrupt()

    def at_risk(self, until: datetime) -> None:
        """The claim is at risk until ``until``: the handler's next ``poll()``/``get()``
        answers ``Message.checkpoint()`` (once). Never blocks."""
        self.risk_until = until
        self._risk_notice = True
        mailbox = self._mailbox
        if mailbox is not None:
            mailbox.interrupt()  # a waiting get() looks again

    def recovered(self, until: datetime) -> None:
        """A renewal got through: the claim is safe again (guaranteed until ``until``)."""
        self._risk_notice = False
        self.risk_until = None

    def risk_notice(self) -> Message | None:
        """``Message.checkpoint()`` once per at-risk episode while it is on, else None."""
        if not self._risk_notice or self.risk_until is None:
            return None
        self._risk_notice = False
        log.info("task %s: claim at risk (guaranteed until %s); asking the handler for a "
                 "checkpoint", self.task.id, self.risk_until.isoformat(),
                 extra={**self._extra, "action": "at_risk"})
        return Message.checkpoint()

    @property
    def mailbox(self) -> Mailbox | None:
        """The claim's command mailbox while ``run()`` runs (an async waiter's hook:
        :meth:`~metafora.statemachine.mailbox.Mailbox.add_listener`)."""
        return self._mailbox

    def run(self) -> bool:
        """Run the machine; True when the task reached a terminal state, False to release."""
        self._mailbox = self._channel.open(self.task.id, self.task.token)
        try:
            return self._run()
        finally:
            mailbox, self._mailbox = self._mailbox, None
            mailbox.close()

    def _run(self) -> bool:
        state, result = self._begin()
        if result is not None:
            return result
        while not self._stop.is_set():
            message = self._next_message(state)
            if message is None:
                break
            state, result = self._advance(message)
            if result is not None:
                return result
        return self._released()

    def _advance(self, message: Message) -> tuple[State, bool | None]:
        """Apply ``message`` to the current state and persist the change (fenced).

        Returns the state now and the run's result when it ends here: True at a terminal
        state, False when the task is to be released (a release message, or a write that
        failed); None to go on. Shared by the sync loop and the async one (which calls it
        on a worker thread: it does store I/O).
        """
        task = self.task
        try:
            self._settle()
        except ClaimLost as exc:
            self._lose(exc)
            return State(), False
        except CoordinatorUnavailable as exc:
            log.error("task %s: %s; releasing it", task.id, exc,
                      extra={**self._extra, "action": "release"})
            return State(), False
        assert self._state is not None
        state = self._state  # the handler's checkpoints may have moved the cursor
        new = apply(state, message, self.clock.now())
        if new is None:
            # A check meeting a paused task is an ordinary race (it woke nothing, as meant).
            level = logging.INFO if message.kind is MessageKind.CHECK else logging.WARNING
            log.log(level, "task %s: ignoring %s in state %s", task.id, message, state.code.value,
                    extra={**self._extra, "action": "ignore"})
            return state, None
        if (new != state or message.kind is MessageKind.CHECKPOINT) and not self._persist(new):
            return state, False
        if new.code is not state.code:
            log.info("task %s: %s --%s--> %s", task.id, state.code.value, message, new,
                     extra={**self._extra, "action": "transition"})
        elif message is self._command and message.kind is not MessageKind.RELEASE:
            log.info("task %s: command %s applied; still %s", task.id, message, new,
                     extra={**self._extra, "action": "command"})
        state = self._state = new
        if state.code.terminal:
            level = logging.INFO if state.code is StateCode.COMPLETED else logging.WARNING
            log.log(level, "task %s finished: %s", task.id, state,
                    extra={**self._extra, "action": state.code.value})
            return state, True
        if message.kind is MessageKind.RELEASE:
            return state, self._released()
        return state, None

    def _released(self) -> bool:
        state = self._state
        log.info("task %s released in state %s", self.task.id,
                 state.code.value if state is not None else "unknown",
                 extra={**self._extra, "action": "release"})
        return False

    def _begin(self) -> tuple[State, bool | None]:
        """Load the task's state (and store a fresh one); the run's result if it ends here."""
        task = self.task
        loaded = self._load()
        if loaded is None:
            return State(), False
        state, stored = loaded
        # A fresh task's state is stored at once: operators (`metafora pause`, `state`) can
        # then tell a task a state machine runs from one no state machine would ever read.
        # A stored state is not written again (every move would pay a fenced write for
        # nothing): the load was fenced like a write -- refused unless the task is claimed
        # under this token by a live node and no newer token wrote the state -- and the
        # first take of commands, before the user's function runs, is fenced again.
        if not stored and not self._persist(state):
            return state, False
        self._state = state
        if state.code.terminal:
            log.info("task %s is already %s; nothing to run", task.id, state,
                     extra={**self._extra, "action": "terminal"})
            return state, True
        return state, None

    # -- one step -------------------------------------------------------------------------

    def _next_message(self, state: State) -> Message | None:
        """The message that moves ``state`` on; None when stopped or the claim is lost."""
        code = state.code
        if code is StateCode.RUNNABLE:
            return self.hand_over(self.take(0.0)) or self._call_user()
        if code is StateCode.PAUSED:
            return self._wait(None)
        if code is StateCode.SLEEPING:
            return self._wait(state)
        if code is StateCode.FAULT:
            return self.take(0.0) or self._handle_error(state)
        raise AssertionError(f"no step for state {code}")  # terminal states end run()

    def _call_user(self) -> Message | None:
        self._checkpoint_error = None
        try:
            result = self._stateful(self.task, Commands(self))
        except Exception as exc:
            return self._user_raised(exc)
        finally:
            self.unread()
        return self._user_returned(result)

    # -- commands the machine takes ---------------------------------------------------------

    def take(self, timeout: float | None) -> Message | None:
        """A command taken by the machine itself (not by the handler's poll/get): applied
        by :meth:`_advance`, which logs it even when it changes nothing."""
        message = self._command = self.receive(timeout)
        return message

    def hand_over(self, command: Message | None) -> Message | None:
        """A command taken before the handler of a runnable task is called: returned to be
        applied now, or None (call the handler) for a ``run``, which changes nothing for
        the machine and is handed to the handler instead -- its first ``poll()``/``get()``
        answers it, as Metafora hands every command of a runnable task to its handler.
        A ``check`` is handed over the same way."""
        if command is not None and command.kind in (MessageKind.RUN, MessageKind.CHECK):
            self._handed = command
            return None
        return command

    def handed(self) -> Message | None:
        """The command kept for the handler (once), or None."""
        handed, self._handed = self._handed, None
        return handed

    def unread(self) -> None:
        """After the handler returned: a kept command it did not read is logged as applied
        (it is: a ``run`` leaves a runnable task runnable), never dropped silently."""
        handed = self.handed()
        if handed is not None:
            log.info("task %s: command %s applied; still runnable (the handler did not read it)",
                     self.task.id, handed, extra={**self._extra, "action": "command"})

    def _user_raised(self, exc: Exception) -> Message | None:
        """The message for a user's step that raised (None: stop, the claim is lost or the
        store could not take a checkpoint)."""
        if isinstance(exc, ClaimLost):
            self._lose(exc)
            return None
        if exc is self._checkpoint_error:
            log.error("task %s: could not checkpoint; releasing it: %s", self.task.id, exc,
                      extra={**self._extra, "action": "release"})
            return None
        log.warning("task %s: handler raised %s: %s", self.task.id, type(exc).__name__, exc,
                    exc_info=exc, extra={**self._extra, "action": "error"})
        return Message.error(exc)

    def _user_returned(self, result: object) -> Message | None:
        if self._lost:
            return None
        if not isinstance(result, Message):
            return Message.error(TypeError(
                f"the stateful handler returned {type(result).__name__}, not a Message"
            ))
        return result

    def _wait(self, sleeping: State | None) -> Message | None:
        """Wait for a command (paused), or for ``until`` or a command (sleeping)."""
        until = None if sleeping is None else sleeping.until
        while not self._stop.is_set():
            wait: float | None = None  # paused: until a command or stop() (no wake-ups)
            if until is not None:
                left = (until - self.clock.now()).total_seconds()
                if left <= 0:
                    return Message.run()
                wait = min(self.poll_interval, left)
            message = self.take(wait)
            if message is not None:
                return message
        return None

    def _handle_error(self, state: State) -> Message:
        now = self.clock.now()
        try:
            message = self._error_handler(self.task, state, now)
            if not isinstance(message, Message):
                raise TypeError(f"the error handler returned {type(message).__name__}, not a Message")
            if TRANSITIONS[(state.code, message.kind)] == IGNORE:
                raise ValueError(f"the error handler returned {message}, which a fault ignores")
        except Exception as exc:
            log.error("task %s: error handler failed (%s); using the default policy", self.task.id,
                      exc, exc_info=exc, extra={**self._extra, "action": "error_handler"})
            message = default_error_handler(self.task, state, now)
        return message

    # -- store access ---------------------------------------------------------------------

    def receive(self, timeout: float | None) -> Message | None:
        """The next command for this task (fenced), waiting up to ``timeout`` real seconds.

        Reads the store only when the mailbox was rung (or once after the claim)."""
        mailbox = self._mailbox
        try:
            if mailbox is None:  # not running: the stateless (polling) read
                return self._channel.receive(self.task.id, timeout, token=self.task.token,
                                             cancel=self._stop)
            return self._channel.receive_from(mailbox, timeout, self._stop)
        except ClaimLost as exc:
            self._lose(exc)
        except (CoordinatorUnavailable, StoreError) as exc:
            log.warning("task %s: cannot read commands: %s", self.task.id, exc,
                        extra={**self._extra, "action": "command"})
            self._stop.wait(self.poll_interval if timeout is None else min(timeout, self.poll_interval))
        return None

    def _load(self) -> tuple[State, bool] | None:
        """(the task's state, whether one was stored); None when the run must end."""
        try:
            state = self._retry("load state", lambda: self._states.load_stored(self.task))
            return (State(), False) if state is None else (state, True)
        except ClaimLost as exc:
            self._lose(exc)
        except GiveUp as exc:
            log.error("task %s: cannot load its state; releasing it: %s", self.task.id,
                      exc.__cause__, extra={**self._extra, "action": "release"})
        return None

    def _persist(self, state: State) -> bool:
        try:
            self._retry("store state", lambda: self._states.store(self.task, state))
            return True
        except ClaimLost as exc:
            self._lose(exc)
        except GiveUp as exc:
            log.error("task %s: cannot store state %s; releasing it: %s", self.task.id,
                      state.code.value, exc.__cause__, extra={**self._extra, "action": "release"})
        return False

    def _retry(self, what: str, call: Callable[[], T],
               cancel: threading.Event | None = None) -> T:
        """``call()``, retried on retryable errors; a set ``cancel`` (default: stop()) ends
        the retries early."""
        cancel = self._stop if cancel is None else cancel
        delay = self._retry_delay
        for attempt in range(1, self._attempts + 1):
            try:
                return call()
            except (CoordinatorUnavailable, StoreError) as exc:
                if attempt >= self._attempts:
                    raise GiveUp(what) from exc
                log.warning("task %s: %s failed (attempt %d of %d), retrying: %s", self.task.id,
                            what, attempt, self._attempts, exc,
                            extra={**self._extra, "action": "retry"})
                if self.clock.wait(cancel, delay):
                    raise GiveUp(what) from exc
                delay = min(delay * 2, _RETRY_MAX)
        raise AssertionError("unreachable")

    def _lose(self, exc: ClaimLost) -> None:
        if not self._lost and self._completed:
            # Expected: the application's transaction completed it (cmds.complete).
            log.info("task %s: completed in the application's transaction; stopping",
                     self.task.id, extra={**self._extra, "action": "completed"})
        elif not self._lost:
            log.warning("task %s: claim lost (%s); stopping", self.task.id, exc,
                        extra={**self._extra, "action": "lost"})
        self._lost = True
        self.stop()
