"""``handler_func``: the :data:`~metafora.contracts.handler.HandlerFunc` running a stateful handler.

It picks the runner: a plain ``fn(task, cmds)`` runs in the thread of a
:class:`~metafora.statemachine.handler.StatefulTaskHandler`; an ``async def`` runs on the
consumer's event loop in an :class:`~metafora.statemachine.aio.AsyncStatefulTaskHandler`
around the same machine. It sits above both, so neither imports the other's chooser.
"""

from __future__ import annotations

from metafora.contracts.coordinator import Coordinator
from metafora.contracts.handler import _is_coroutine_fn
from metafora.core.clock import Clock
from metafora.core.errors import ConfigError
from metafora.core.task import Task
from metafora.statemachine.aio import AsyncStatefulHandler, AsyncStatefulTaskHandler
from metafora.statemachine.errors import ErrorHandler, default_error_handler
from metafora.statemachine.handler import StatefulHandler, StatefulTaskHandler
from metafora.statemachine.store import StateStore, TaskCommands, commands_for, state_store_for

__all__ = ["StatefulHandlerFunc", "handler_func"]


class StatefulHandlerFunc:
    """The :data:`~metafora.contracts.handler.HandlerFunc` made by :func:`handler_func`.

    Calling it with a claimed task builds that task's :class:`StatefulTaskHandler`;
    ``state_store`` and ``task_commands`` are the stores it uses.
    """

    def __init__(
        self,
        stateful: StatefulHandler | AsyncStatefulHandler,
        state_store: StateStore,
        task_commands: TaskCommands,
        *,
        error_handler: ErrorHandler,
        clock: Clock | None,
        poll_interval: float,
        store_attempts: int,
        store_retry_delay: float,
    ) -> None:
        self.stateful = stateful
        self.state_store = state_store
        self.task_commands = task_commands
        self._error_handler = error_handler
        self._clock = clock
        self._poll_interval = poll_interval
        self._store_attempts = store_attempts
        self._store_retry_delay = store_retry_delay

    def __call__(self, task: Task) -> StatefulTaskHandler | AsyncStatefulTaskHandler:
        is_async = _is_coroutine_fn(self.stateful)
        machine = StatefulTaskHandler(
            task, self.stateful, self.state_store, self.task_commands,  # type: ignore[arg-type]
            error_handler=self._error_handler, clock=self._clock,
            poll_interval=self._poll_interval, store_attempts=self._store_attempts,
            store_retry_delay=self._store_retry_delay,
        )
        if is_async:
            return AsyncStatefulTaskHandler(machine, self.stateful)  # type: ignore[arg-type]
        return machine


def handler_func(
    stateful: StatefulHandler | AsyncStatefulHandler,
    coordinator: Coordinator | None,
    *,
    error_handler: ErrorHandler = default_error_handler,
    clock: Clock | None = None,
    state_store: StateStore | None = None,
    task_commands: TaskCommands | None = None,
    poll_interval: float = 1.0,
    store_attempts: int = 5,
    store_retry_delay: float = 0.2,
) -> StatefulHandlerFunc:
    """A HandlerFunc running ``stateful`` through the state machine.

    ``stateful`` is ``fn(task, cmds) -> Message``, run on a thread of its own per task, or
    ``async def fn(task, cmds) -> Message``, run on the consumer's event loop with
    :class:`~metafora.statemachine.aio.AsyncCommands` (``await cmds.get()``): a task waiting
    there holds no thread (see :mod:`metafora.statemachine.aio`).

    The state store and the task command channel live in the coordinator's store
    (memory, SQL, etcd); pass ``state_store`` / ``task_commands`` to use others (then
    ``coordinator`` may be None). ``error_handler`` decides what a faulted task does
    (default: :class:`~metafora.statemachine.errors.ErrorPolicy`). ``clock`` times sleeps
    and back-off. ``poll_interval`` (real seconds) bounds how long a sleeping task (or a
    ``cmds.get(timeout)``) waits between re-checks of its clock; a paused task and a
    ``cmds.get()`` without timeout wake only for a command or ``stop()``. A store call
    failing with a retryable error is tried ``store_attempts`` times, ``store_retry_delay``
    seconds apart (doubling).
    """
    if not callable(stateful):
        raise ConfigError("stateful must be callable: (task, commands) -> Message")
    if not callable(error_handler):
        raise ConfigError("error_handler must be callable: (task, state, now) -> Message")
    if not isinstance(poll_interval, int | float) or not 0 < poll_interval <= 60:
        raise ConfigError(f"poll_interval must be in (0, 60] seconds, got {poll_interval!r}")
    if not isinstance(store_attempts, int) or store_attempts < 1:
        raise ConfigError(f"store_attempts must be a positive integer, got {store_attempts!r}")
    if not isinstance(store_retry_delay, int | float) or store_retry_delay < 0:
        raise ConfigError(f"store_retry_delay must be >= 0 seconds, got {store_retry_delay!r}")
    if (state_store is None or task_commands is None) and coordinator is None:
        raise ConfigError("pass a coordinator, or both state_store and task_commands")
    return StatefulHandlerFunc(
        stateful,
        state_store if state_store is not None else state_store_for(coordinator),
        task_commands if task_commands is not None else commands_for(coordinator),
        error_handler=error_handler,
        clock=clock,
        poll_interval=float(poll_interval),
        store_attempts=store_attempts,
        store_retry_delay=float(store_retry_delay),
    )

