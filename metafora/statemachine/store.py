"""Where stateful tasks keep their :class:`State`, and how commands reach a running task.

- :class:`StateStore`: one state per task id. Every write (and the owner's first read) is
  **fenced** by the claim token: a store refuses it with :class:`~metafora.core.errors.ClaimLost`
  when the task is no longer claimed under that token, so a zombie owner cannot commit.
- :class:`TaskCommands`: a per-task command channel (FIFO, each command delivered once).
  Operators ``send``; the machine running the task ``open``\\s a
  :class:`~metafora.statemachine.mailbox.Mailbox` for its claim and receives from it: on a
  channel built from a coordinator, commands are pushed (no store I/O while none arrived).

:func:`state_store_for` and :func:`commands_for` give the implementation that lives in the
same store as a coordinator or client (memory, SQL, etcd): each store package owns it
(``metafora/coordinators/<store>/states.py``), and its backend object
(:mod:`metafora.contracts.backends`) names it.
"""

from __future__ import annotations

import abc
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from metafora.contracts.backends import implementation, store_of
from metafora.contracts.coordinator import Coordinator
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import ClaimLost, ConfigError, CoordinatorUnavailable, StoreError
from metafora.core.task import Task, validate_task_id
from metafora.statemachine.machine import (
    InvalidMessage,
    InvalidState,
    Message,
    State,
    validate_command,
)
from metafora.statemachine.mailbox import CommandBell, Mailbox, PendingIds

__all__ = [
    "LeaseBound",
    "StateStore",
    "TaskCommands",
    "TimeLeft",
    "commands_for",
    "lease_bound_of",
    "parsed_page",
    "state_store_for",
]

log = logging.getLogger(__name__)

_FALLBACK_POLL = 0.5  # real seconds between looks of a mailbox on a channel without push

T = TypeVar("T")

TimeLeft = Callable[[Task], "float | None"]
"""``task -> seconds``: how long this node still holds the claim (see
:meth:`~metafora.contracts.coordinator.Coordinator.claim_time_left`); None: unbounded."""


class LeaseBound:
    """Runs fenced store calls with the node's remaining lease time as their deadline.

    A call is given ``timeout`` = the seconds this node still holds the claim (None when
    unbounded, e.g. a store opened from a client). With no time left it is refused as
    :class:`~metafora.core.errors.ClaimLost` without I/O; a call that fails (a store timeout, an
    unreachable store) once the time has run out is reported as ClaimLost too, since by
    then the claim may belong to another node -- so a fenced write never blocks past the
    lease (etcd: gRPC deadline; PostgreSQL: statement timeout; SQLite: busy timeout).
    """

    def __init__(self, time_left: TimeLeft | None = None) -> None:
        self._time_left = time_left

    def left(self, task: Task) -> float | None:
        """Seconds this node still holds ``task`` (None: unbounded)."""
        return None if self._time_left is None else self._time_left(task)

    @contextmanager
    def bounding(self, task: Task, what: str) -> Iterator[float | None]:
        """Around one fenced store call for the claim ``task``: yields its timeout (the
        seconds left, None: unbounded) and turns a failure past the lease into ClaimLost."""
        left = self.left(task)
        if left is not None and left <= 0:
            raise ClaimLost(f"task {task.id!r}: the lease of token {task.token} has run out; "
                            f"{what} refused")
        try:
            yield left
        except (CoordinatorUnavailable, StoreError) as exc:
            after = self.left(task)
            if after is not None and after <= 0:
                raise ClaimLost(f"task {task.id!r}: {what} did not finish before the lease of "
                                f"token {task.token} ran out: {exc}") from exc
            raise

    def call(self, task: Task, what: str, fn: Callable[[float | None], T]) -> T:
        """``fn(timeout)`` for the claim ``task``, bounded as the class docstring says."""
        with self.bounding(task, what) as timeout:
            return fn(timeout)


def lease_bound_of(coordinator_or_client: object) -> LeaseBound:
    """The lease bound of a coordinator's claims; unbounded for a client (operators)."""
    if isinstance(coordinator_or_client, Coordinator):
        return LeaseBound(coordinator_or_client.claim_time_left)
    return LeaseBound()


class StateStore(abc.ABC):
    """Persists each task's :class:`State`. Thread-safe; one instance serves every task."""

    @abc.abstractmethod
    def load(self, task: Task) -> State:
        """The task's state (``State()``, runnable, if none was stored), read by its owner.

        Fenced: raises ClaimLost if the task is not claimed under ``task.token`` or the
        store holds a state written under a higher token.
        """

    def load_stored(self, task: Task) -> State | None:
        """Like :meth:`load` (fenced the same way), but None when no state is stored yet.

        A machine's start uses it to store a fresh task's state once, and only then: a
        task that moves keeps its stored state, and writing it again at every claim would
        be one fenced write per move for nothing. The built-in stores answer in the one
        fenced read of :meth:`load`; this default (for other stores) asks :meth:`get`
        only when ``load`` answered the fresh state, which it cannot tell from none.
        """
        state = self.load(task)
        if state == State() and self.get(task.id) is None:
            return None
        return state

    @abc.abstractmethod
    def store(self, task: Task, state: State) -> None:
        """Write ``state`` for the claim ``task.token``.

        Raises ClaimLost if the task is not claimed under that token (another owner, a
        newer claim, deleted) or the store holds a state written under a higher token.
        Raises CoordinatorUnavailable on a (retryable) connection problem.
        """

    def store_in(self, task: Task, state: State, conn: Any) -> None:
        """Write ``state`` for the claim ``task.token`` inside the application's open
        transaction ``conn`` (fenced as :meth:`store`: ClaimLost, nothing written). SQL
        stores only; this default (etcd, memory) raises ConfigError."""
        from metafora.core.submitting import no_completion

        raise no_completion(type(self).__name__, "checkpoint(cursor, conn=...)")

    @abc.abstractmethod
    def get(self, task_id: str) -> State | None:
        """The stored state for operators (unfenced); None if the task has none yet."""

    def page(self, *, prefix: str = "", after: str | None = None,
             limit: int = 100) -> list[tuple[str, State]] | None:
        """Up to ``limit`` stored states as ``(task id, state)``, in the store's key order
        after task id ``after``, of the ids that start with ``prefix`` (operators' listings,
        unfenced; a damaged state is left out). It reads only tasks that have a state, never
        every task. The built-in stores answer; this default answers None (this store cannot
        list its states: a listing then reads each task's state in turn)."""
        return None

    def decode_stored(self, task_id: str, body: str | bytes, token: int) -> tuple[int, State | str | bytes]:
        """(token, state) of a stored body as a retry reads it (``Client.retry_with_state``):
        ``token`` is the task's last claim token, to use when the body carries none. A
        damaged body is passed on as it is (the retry's rules replace it, or name the damage
        when its cursor was to be kept). Here: the body is the state's JSON text."""
        return token, body

    def encode_stored(self, token: int, state: State) -> str | bytes:
        """The body that stores ``state`` as written under claim ``token`` (for a retry's
        reset; the inverse of :meth:`decode_stored`). Here: the state's JSON text."""
        return state.to_json()

    def close(self) -> None:
        """Release what the store holds (connections it opened itself). Idempotent."""
        return


class TaskCommands(abc.ABC):
    """A command channel per task: FIFO, each command delivered once.

    ``send`` validates (only :data:`~metafora.statemachine.machine.COMMAND_KINDS`); a
    malformed stored command is logged with a warning and dropped by ``receive``, never
    delivered.
    """

    def send(self, task_id: str, message: Message) -> None:
        """Queue ``message`` for the task (client side). Raises InvalidMessage if it is not a command."""
        validate_task_id(task_id)
        self._push(task_id, validate_command(message).to_json())

    def receive(
        self,
        task_id: str,
        timeout: float | None = 0.0,
        *,
        token: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Message | None:
        """The next command for the task, waiting up to ``timeout`` real seconds.

        ``timeout=0`` does not wait; ``None`` waits until a command or ``cancel``. Returns
        None on timeout or as soon as ``cancel`` is set. With ``token``, the command is
        taken only while the task is claimed under that token (else ClaimLost): a zombie
        cannot swallow its successor's commands.
        """
        return _decoded(task_id, timeout, lambda left: self._pop(task_id, left, token, cancel))

    def open(self, task_id: str, token: int | None) -> Mailbox:
        """The mailbox of the claim ``token`` of the task: close it when the claim's run ends.

        On a channel built from a coordinator that pushes (SQL, etcd, memory), the mailbox
        reads the store only when a command may have arrived (and once at first, for
        commands queued before the claim); otherwise it looks every 0.5 s.
        """
        bell = self.bell()
        if bell is not None:
            return bell.new_mailbox(task_id, token)
        return Mailbox(task_id, token, self._take_now, poll_every=_FALLBACK_POLL)

    def receive_from(self, mailbox: Mailbox, timeout: float | None = 0.0,
                     cancel: threading.Event | None = None) -> Message | None:
        """Like :meth:`receive`, from a mailbox opened with :meth:`open` (same token)."""
        return _decoded(mailbox.task_id, timeout, lambda left: mailbox.receive(left, cancel))

    def bell(self) -> CommandBell | None:
        """The node's push dispatcher feeding this channel's mailboxes; None if it polls."""
        return None

    def _take_now(self, task_id: str, token: int | None) -> str | None:
        return self._pop(task_id, 0.0, token, None)

    @abc.abstractmethod
    def _push(self, task_id: str, raw: str) -> None:
        """Append one command's wire text to the task's queue."""

    @abc.abstractmethod
    def _pop(self, task_id: str, timeout: float | None, token: int | None,
             cancel: threading.Event | None) -> str | None:
        """Take the oldest command's wire text, waiting up to ``timeout`` (None: forever).

        Returns None on timeout or once ``cancel`` is set. Fenced by ``token`` if given.
        """

    @abc.abstractmethod
    def pending(self, task_id: str) -> int:
        """How many commands wait for the task (for operators and tests)."""

    def close(self) -> None:
        """Release what the channel holds. Idempotent."""
        return


def parsed_page(rows: Iterable[tuple[str, T]],
                decode: Callable[[str, T], State] | None = None) -> list[tuple[str, State]]:
    """The states of a page of stored ``(task id, body)`` rows (for :meth:`StateStore.page`):
    ``decode(task_id, body)`` (default: the body is the state's JSON); a damaged body is left
    out with a warning, as a listing must not fail on one task."""
    page: list[tuple[str, State]] = []
    for task_id, body in rows:
        try:
            state = State.from_json(body) if decode is None else decode(task_id, body)  # type: ignore[arg-type]
        except InvalidState as exc:
            log.warning("task %s: leaving a damaged state out of a listing: %s", task_id, exc)
            continue
        page.append((task_id, state))
    return page


def state_store_for(coordinator_or_client: object) -> StateStore:
    """The state store in the same store as a coordinator or client (memory, SQL, etcd): the
    store package's own, named by its backend object (:mod:`metafora.contracts.backends`)."""
    store = _implementation(coordinator_or_client, "state_store").of(coordinator_or_client)
    assert isinstance(store, StateStore)
    return store


def commands_for(coordinator_or_client: object) -> TaskCommands:
    """The task command channel in the same store as a coordinator or client (the store
    package's own, as :func:`state_store_for`)."""
    channel = _implementation(coordinator_or_client, "task_commands").of(coordinator_or_client)
    assert isinstance(channel, TaskCommands)
    return channel


def _implementation(owner: object, feature: str) -> Any:
    try:
        kind = implementation(store_of(owner), feature)
    except ConfigError:
        kind = None
    if kind is None:
        raise ConfigError(
            f"no state store for {type(owner).__name__}; pass state_store= and task_commands= "
            "to metafora.statemachine.handler_func"
        )
    return kind


def _decoded(task_id: str, timeout: float | None,
             pop: Callable[[float | None], str | None]) -> Message | None:
    """The next well-formed command from ``pop(seconds left)``; malformed ones are dropped."""
    deadline = None if timeout is None else SYSTEM_CLOCK.monotonic() + max(0.0, timeout)
    while True:
        left = None if deadline is None else max(0.0, deadline - SYSTEM_CLOCK.monotonic())
        raw = pop(left)
        if raw is None:
            return None
        try:
            return validate_command(Message.from_json(raw))
        except InvalidMessage as exc:
            log.warning("dropping malformed command for task %s: %s", task_id, exc)
        # Each pass consumed a command, so this loop ends when the queue is empty.


_BELLS: weakref.WeakKeyDictionary[object, CommandBell | None] = weakref.WeakKeyDictionary()
_BELLS_LOCK = threading.Lock()


def bell_for(owner: object, take: Callable[[str, int | None], str | None],
             pending_ids: PendingIds, safety_interval: float) -> CommandBell | None:
    """The push dispatcher of a coordinator (one per coordinator, made on first use).

    None when ``owner`` is not a coordinator that pushes task commands (a client: its
    channel only sends) -- mailboxes then poll.
    """
    if not isinstance(owner, Coordinator):
        return None
    with _BELLS_LOCK:
        if owner in _BELLS:
            return _BELLS[owner]
        bell: CommandBell | None = CommandBell(owner.node_id, take, pending_ids, safety_interval)
        assert bell is not None
        if not owner.listen_task_commands(bell):
            bell = None
        _BELLS[owner] = bell
        return bell


def poll_take(
    take: Callable[[], str | None],
    timeout: float | None,
    cancel: threading.Event | None,
    interval: float,
) -> str | None:
    """Call ``take`` every ``interval`` s until it returns a command, ``timeout`` or ``cancel``.

    The stores' stateless :meth:`TaskCommands.receive` shares this wait (mailboxes are pushed).
    """
    deadline = None if timeout is None else SYSTEM_CLOCK.monotonic() + timeout
    gate = cancel or threading.Event()
    while True:
        if gate.is_set():
            return None
        raw = take()
        if raw is not None:
            return raw
        left = None if deadline is None else deadline - SYSTEM_CLOCK.monotonic()
        if left is not None and left <= 0:
            return None
        gate.wait(interval if left is None else min(interval, left))
