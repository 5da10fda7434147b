"""Stateful handlers: a state machine around a user's function, in the manner of Metafora.

The user writes a :data:`StatefulHandler` ``(task, commands) -> Message``;
:func:`handler_func` turns it into a :data:`~metafora.contracts.handler.HandlerFunc` for a Consumer.
The machine persists the task's :class:`State` (fenced by the claim token) in the
coordinator's store and reacts to :class:`Message`\\s from the handler, from operators (task
commands), from sleep timers and from the error handler. The transition table is
:data:`TRANSITIONS` (drawn in :mod:`metafora.statemachine.machine`).

Operator functions (used by the ``metafora pause|resume|kill|sleep|state`` CLI verbs):
:func:`send_task_command`, :func:`get_state` and :func:`command_message`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from metafora.contracts.backends import backend_of, default_url
from metafora.contracts.recipes import register
from metafora.core.config import parse_store_url
from metafora.core.errors import InvalidTaskState
from metafora.core.task import TaskInfo, TaskState, validate_task_id
from metafora.statemachine.aio import AsyncCommands, AsyncStatefulHandler, AsyncStatefulTaskHandler
from metafora.statemachine.errors import (
    ErrorHandler,
    ErrorPolicy,
    ExceededErrorRate,
    default_error_handler,
)
from metafora.statemachine.factory import StatefulHandlerFunc, handler_func
from metafora.statemachine.handler import Commands, StatefulHandler, StatefulTaskHandler
from metafora.statemachine.machine import (
    COMMAND_KINDS,
    IGNORE,
    TRANSITIONS,
    ErrorRecord,
    InvalidMessage,
    InvalidState,
    Message,
    MessageKind,
    State,
    StateCode,
    apply,
    validate_command,
)
from metafora.statemachine.retry import reset_and_retry
from metafora.statemachine.store import StateStore, TaskCommands, commands_for, state_store_for

__all__ = [
    "COMMAND_KINDS",
    "COMMAND_VERBS",
    "IGNORE",
    "TRANSITIONS",
    "AsyncCommands",
    "AsyncStatefulHandler",
    "AsyncStatefulTaskHandler",
    "Commands",
    "ErrorHandler",
    "ErrorPolicy",
    "ErrorRecord",
    "ExceededErrorRate",
    "InvalidMessage",
    "InvalidState",
    "Message",
    "MessageKind",
    "OperatorClient",
    "State",
    "StateCode",
    "StateStore",
    "StatefulHandler",
    "StatefulHandlerFunc",
    "StatefulTaskHandler",
    "TaskCommands",
    "apply",
    "command_message",
    "commands_for",
    "default_error_handler",
    "get_state",
    "handler_func",
    "send_task_command",
    "state_store_for",
]

COMMAND_VERBS = ("pause", "resume", "kill", "sleep", "release")
"""The CLI verbs that send a task command (``resume`` sends ``run``)."""

_FINISHED = (TaskState.DONE, TaskState.FAILED, TaskState.EXPIRED)


def command_message(verb: str, until: datetime | str | None = None) -> Message:
    """The task command for a CLI verb: ``pause``, ``resume``, ``kill``, ``release`` or
    ``sleep`` (which needs ``until``, a datetime or ISO-8601 text; naive means UTC).

    Raises InvalidMessage naming the problem (unknown verb, missing or bad ``until``).
    """
    if verb not in COMMAND_VERBS:
        raise InvalidMessage(f"unknown task command {verb!r} (known: {', '.join(COMMAND_VERBS)})")
    if verb == "sleep":
        if until is None:
            raise InvalidMessage("sleep needs --until TIME (ISO-8601, e.g. 2030-01-01T12:00:00Z)")
        return Message.sleep(until)
    if until is not None:
        raise InvalidMessage(f"--until is only for sleep, not {verb}")
    return {
        "pause": Message.pause,
        "resume": Message.run,
        "kill": Message.kill,
        "release": Message.release,
    }[verb]()


@runtime_checkable
class OperatorClient(Protocol):
    """What the operator functions need of a :class:`~metafora.contracts.client.Client` (every store's
    client has it). The state machine owns this interface and imports no client: the client
    builds on the state machine (``Client.retry_task(reset_state=True)``)."""

    def get_task(self, task_id: str) -> TaskInfo:
        """One task's info. Raises TaskNotFound."""
        ...

    def close(self) -> None:
        """Release the client's connections."""
        ...


def _with_client(target: str | OperatorClient | None,
                 options: dict[str, Any]) -> tuple[OperatorClient, bool]:
    if isinstance(target, OperatorClient):
        return target, False
    url = parse_store_url(target or default_url())  # as metafora.open_client does
    client: OperatorClient = backend_of(url).open_client(url, options)
    return client, True


def send_task_command(target: str | OperatorClient | None, task_id: str, message: Message,
                      **options: Any) -> None:
    """Queue a task command (see :func:`command_message`) for ``task_id``.

    ``target`` is a store URL (None: ``$METAFORA_URL`` or the default), or an open Client.
    The command is validated before the store is touched (InvalidMessage); the task must
    exist (TaskNotFound) and not be finished -- done, failed or expired
    (InvalidTaskState). A pending task gets the command when a consumer next claims it.
    Commands are FIFO per task and delivered once.
    """
    validate_task_id(task_id)
    validate_command(message)
    client, owned = _with_client(target, options)
    try:
        info = client.get_task(task_id)
        if info.state in _FINISHED:
            raise InvalidTaskState(
                f"task {task_id!r} is {info.state.value}; commands go to pending or claimed tasks"
            )
        channel = commands_for(client)
        try:
            channel.send(task_id, message)
        finally:
            channel.close()
    finally:
        if owned:
            client.close()


def get_state(target: str | OperatorClient | None, task_id: str, **options: Any) -> State | None:
    """The stored state of ``task_id`` (state, until, errors, cursor), for operators.

    None if the task has no state yet (never run by a state machine). Raises TaskNotFound
    if the task does not exist.
    """
    validate_task_id(task_id)
    client, owned = _with_client(target, options)
    try:
        client.get_task(task_id)
        store = state_store_for(client)
        try:
            return store.get(task_id)
        finally:
            store.close()
    finally:
        if owned:
            client.close()


# Client.retry_task(..., reset_state=True) resets a state by these rules (the client knows no
# recipe of the state machine: the state machine tells it, when it loads; metafora.contracts.recipes).
register("reset_state", reset_and_retry)
