"""The Client interface: an operator's handle on a store (submit, inspect, retry, command).

Every store (memory, SQL, etcd) implements it beside its :class:`~metafora.contracts.coordinator.Coordinator`,
and one conformance suite (``tests/conformance``) holds them to the same semantics.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Self

from metafora.contracts.balancer import ClusterState
from metafora.contracts.recipes import verb
from metafora.core import bulk
from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.commands import Command
from metafora.core.limits import ClientLimits
from metafora.core.retention import RetentionOps
from metafora.core.schedule_model import Schedule, new_schedule
from metafora.core.submitting import IfExists, check_if_exists, no_completion, no_transactions
from metafora.core.task import Task, TaskInfo, TaskState
from metafora.core.task_retry import StateRewrite, check_retry_options

if TYPE_CHECKING:
    from metafora.streams.jobs import StreamInfo

__all__ = ["Client", "NodeInfo"]

log = logging.getLogger("metafora.client")  # its name before the move (users' log config names it)


@dataclass(frozen=True)
class NodeInfo:
    """A live node as the store sees it (fields a store does not keep are None)."""

    id: str
    tasks: int
    host: str | None = None
    pid: int | None = None
    started: datetime | None = None
    heartbeat: datetime | None = None
    frozen: bool | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    """The node's placement labels (see ``Consumer(labels=...)``)."""
    weight: float = 1.0
    """The node's weight: its fair share is proportional to it (see ``Consumer(weight=...)``)."""


class Client(ClusterState, ClientLimits, RetentionOps, abc.ABC):
    """An operator's handle on the store: submit and inspect tasks, command nodes, set
    cluster-wide limits per task group (the verbs of :class:`~metafora.core.limits.ClientLimits`)."""

    backend: ClassVar[str] = ""
    """The store this client belongs to: the ``name`` of its registered store (as
    :attr:`~metafora.contracts.coordinator.Coordinator.backend`)."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A printable name of the store (its URL without password)."""

    @abc.abstractmethod
    def submit_task(self, task: Task, *, conn: Any = None, if_exists: IfExists = "error") -> bool:
        """Add a pending task; True if it was added (or replaced), False if left as it was.

        ``if_exists`` (see :mod:`metafora.core.submitting`): ``"error"`` raises TaskExists if the id
        is taken (in any state), ``"ignore"`` leaves the existing task, ``"replace"`` gives a
        pending one the new props, priority, times, selector, placement and group (never a
        claimed or finished one). ``conn``: the application's open transaction (a SQLAlchemy
        ``Connection`` or ``Session``, or a psycopg ``Connection``) on SQLite and PostgreSQL
        stores: the task exists only if it commits (docs/submit.md); ConfigError elsewhere.
        """

    def submit_tasks(
        self, tasks: Iterable[Task], *, conn: Any = None, if_exists: IfExists = "error"
    ) -> int:
        """Add many pending tasks in batched writes (one statement or txn per batch); the
        number added or replaced.

        All-or-nothing per batch: a batch holding an id that already exists adds nothing and
        raises TaskExists naming those ids (``.ids``); the batches before it stay added
        (``.submitted`` says how many tasks). With ``if_exists="ignore"`` or ``"replace"``
        existing ids are left (or replaced, if pending) and the rest added, decided per task in
        the batch's own statement or txn. An id given twice in ``tasks`` is refused
        before anything is written, and so is a task that could never be claimed
        (``InvalidProps``, see :func:`~metafora.core.task.validate_schedule`). One wake-up per
        batch, not per task. ``conn``: as :meth:`submit_task` (every task in that transaction).
        """
        mode = check_if_exists(if_exists)
        todo = bulk.checked(tasks, self._now())
        if conn is not None:
            return self._submit_in(conn, todo, mode)
        added = 0
        for batch in bulk.batches(todo, self._batch_size, self._batch_bytes):
            left = self._submit_batch(batch, mode)
            if left and mode == "error":
                raise bulk.exists_error(left, added, len(todo), self.name)
            added += len(batch) - len(left)
        log.debug("submitted %d tasks to %s", added, self.name)
        return added

    def _submit_in(self, conn: Any, tasks: Sequence[Task], if_exists: IfExists) -> int:
        """Write ``tasks`` in the application's transaction ``conn`` (SQL stores only)."""
        raise no_transactions(self.name)

    def submit_message(self, task_id: str, message: Any, **options: Any) -> bool:
        """Submit ``message`` (a registered dataclass, pydantic model or protobuf message, see
        :mod:`metafora.messages`) as the props of task ``task_id``: ``{"@type": NAME, ...}``.

        ``options`` are :meth:`submit_task`'s (``conn``, ``if_exists``) and the task's own
        (``priority``, ``group``, ``selector``, ``prefer``, ``spread``). InvalidProps when the
        message cannot be encoded.
        """
        # the messages' own encoding, loaded when messages are used (metafora.contracts.recipes)
        task, submit = verb("message_task")(task_id, message, options)
        return self.submit_task(task, **submit)

    def complete_task(self, task: Task, *, conn: Any) -> None:
        """Mark the claimed ``task`` done inside the application's open transaction ``conn``
        (River's ``JobCompleteTx``): it is done if and only if that transaction commits.

        ``task`` is the claimed task as its handler got it (its ``token`` fences the write).
        SQL stores (a SQLAlchemy ``Connection`` or ``Session``, or a psycopg ``Connection``);
        ClaimLost (nothing written: roll back) when the claim is not current. A committed
        completion wins over whatever the handler returns afterwards. ConfigError on stores
        that share no transaction with the application (etcd, memory). See docs/submit.md.
        """
        raise no_completion(self.name)

    def _now(self) -> datetime:
        """The time a submitted task's schedule is judged by (this machine's clock; a store
        with an injected clock judges by that)."""
        return SYSTEM_CLOCK.now()

    _batch_size = 500
    """Tasks per batch of :meth:`submit_tasks` (a store's limit on one write)."""
    _batch_bytes: int | None = None
    """About how many bytes of ids and props one batch may carry (None: no limit)."""

    @abc.abstractmethod
    def _submit_batch(self, batch: Sequence[Task], if_exists: IfExists = "error") -> list[str]:
        """Add ``batch`` (ids distinct) atomically; the ids it left as they were.

        ``"error"``: add all or nothing (then return the ids that exist); ``"ignore"`` /
        ``"replace"``: add the new ones (and replace the pending ones) and return the rest."""

    @abc.abstractmethod
    def delete_task(self, task_id: str) -> None:
        """Remove a task in any state; a running one is stopped on its node. TaskNotFound."""

    def retry_task(self, task_id: str, reset_state: bool = False, keep_cursor: bool = False) -> None:
        """Make a failed or expired task pending again. TaskNotFound, InvalidTaskState.

        With ``reset_state``, also a stateful task that ended ``failed`` or ``killed`` (it
        is ``done`` in the coordinator): its stored state becomes ``runnable`` again, with no
        errors, and the cursor of its last checkpoint only with ``keep_cursor``. Atomic:
        the task and its state change together or not at all. The rules are
        :func:`metafora.statemachine.retry.plan_retry`'s (see :mod:`metafora.core.task_retry`).
        """
        check_retry_options(reset_state, keep_cursor)
        if not reset_state:
            self.retry_with_state(task_id, None)
            return
        # The rules of a reset are the state machine's (metafora.contracts.recipes).
        verb("reset_state")(self, task_id, keep_cursor)

    @abc.abstractmethod
    def retry_with_state(self, task_id: str, rewrite: StateRewrite | None) -> None:
        """Make a finished task pending again in one atomic step with ``rewrite`` of its
        stored state (see :mod:`metafora.core.task_retry`); without ``rewrite``, a plain retry
        (failed or expired tasks only; the state is not read). TaskNotFound, InvalidTaskState.
        """

    # -- streams (metafora.streams, loaded on first use: metafora.contracts.recipes) ----------------

    def stream(self, task_id: str) -> StreamInfo:
        """The stream ``task_id`` as its owner last wrote it: processed, head, in_flight,
        failing. TaskNotFound; InvalidTaskState when the task is not a stream."""
        info: StreamInfo = verb("stream")(self, task_id)
        return info

    def check_stream(self, task_id: str) -> bool:
        """Wake the stream's owner (it re-reads ``head()`` at once), pushed as a task command.
        False (nothing sent) when the stream is paused or finished. TaskNotFound;
        InvalidTaskState when the task is not a stream."""
        sent: bool = verb("check_stream")(self, task_id)
        return sent

    def retry_stream(self, task_id: str) -> None:
        """Resume a stream paused on a failing job (fresh attempts for it). TaskNotFound;
        InvalidTaskState when it is not failing."""
        verb("retry_stream")(self, task_id)

    @abc.abstractmethod
    def get_task(self, task_id: str) -> TaskInfo:
        """One task's info. Raises TaskNotFound."""

    @abc.abstractmethod
    def tasks(self, state: TaskState | str | None = None) -> list[TaskInfo]:
        """Every task (or those in ``state``), ordered by id."""

    def task_page(
        self,
        *,
        state: TaskState | str | None = None,
        owner: str | None = None,
        prefix: str = "",
        after: str | None = None,
        limit: int = 100,
        props: bool = True,
    ) -> list[TaskInfo]:
        """Up to ``limit`` tasks ordered by id, after id ``after`` (keyset paging), filtered by
        ``state``, ``owner`` and id ``prefix``. ``props=False`` lets a store leave props out
        (empty) and cut long errors (a list that does not show them).

        The default pages in memory over :meth:`tasks`; the SQL store overrides it with one
        indexed query that never reads more than one page of rows.
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        page: list[TaskInfo] = []
        for info in self.tasks(state):
            if after is not None and info.id <= after:
                continue
            if not info.id.startswith(prefix) or (owner is not None and info.owner != owner):
                continue
            page.append(info)
            if len(page) >= limit:
                break
        return page

    def task_counts(self) -> dict[TaskState, int]:
        """How many tasks are in each state (every state is a key).

        The default counts in memory over :meth:`tasks`; the SQL store counts in the database.
        """
        counts = dict.fromkeys(TaskState, 0)
        for info in self.tasks():
            counts[info.state] += 1
        return counts

    @abc.abstractmethod
    def nodes(self) -> list[str]:
        """Ids of the live nodes, sorted."""

    def node_infos(self) -> list[NodeInfo]:
        """Details of the live nodes, sorted by id (stores add host, heartbeat, frozen...)."""
        return [NodeInfo(n, c) for n, c in sorted(self.node_task_count().items())]

    def node_labels(self) -> dict[str, dict[str, str]]:
        """Live node id -> its placement labels (from :meth:`node_infos`)."""
        return {n.id: dict(n.labels) for n in self.node_infos()}

    def drain_node(self, node_id: str) -> int:
        """Hand the tasks held for ``node_id`` (a node that stopped gracefully with a stable
        id, see :mod:`metafora.core.holds`) to every node at once; returns how many were held.

        For a scale-down: the node is not coming back, so its tasks need not wait for the
        end of its window. Raises NotImplementedError on a store that keeps no holds.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no held tasks")

    @abc.abstractmethod
    def submit_command(self, node_id: str, command: Command) -> None:
        """Queue ``command`` for a live node. Raises NodeNotFound."""

    @abc.abstractmethod
    def purge(self, older_than: timedelta | None = None) -> int:
        """Delete done, failed and expired tasks finished more than ``older_than`` ago.

        Returns how many were deleted.
        """

    # -- periodic schedules (see metafora.core.schedule_model) ------------------------------------

    def add_schedule(
        self,
        name: str,
        *,
        every: str | int | timedelta | None = None,
        cron: str | None = None,
        props: dict[str, Any] | None = None,
        missed: str = "skip",
    ) -> Schedule:
        """Add a periodic task: every ``every`` (``"30s"``, ``"5m"``, ``"1h"``, ``"1d"``, seconds
        or a timedelta; at least 1 s) or at the times of the ``cron`` expression (UTC).

        Any live consumer makes each tick one task ``NAME@<tick time>`` with ``props``; ticks
        missed while no node was up follow ``missed`` (``skip``, ``once`` or ``all``). The first
        tick is the first one after now. Raises ConfigError, InvalidTaskId, InvalidProps or
        ScheduleExists.
        """
        schedule = new_schedule(name, every=every, cron=cron, props=props, missed=missed,
                                now=self._now())
        self._schedule_insert(schedule)
        log.info("added schedule %s (%s)", name, schedule.spec, extra={"action": "schedule"})
        return schedule

    def schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        raise NotImplementedError(f"{type(self).__name__} keeps no schedules")

    def delete_schedule(self, name: str) -> None:
        """Remove a schedule; tasks it already made stay. Raises ScheduleNotFound."""
        self._schedule_delete(name)
        log.info("deleted schedule %s", name, extra={"action": "schedule"})

    def pause_schedule(self, name: str) -> None:
        """Stop making tasks of a schedule until resumed (its ticks meanwhile are not made
        later). Idempotent. Raises ScheduleNotFound."""
        self._schedule_pause(name, True, self._now())

    def resume_schedule(self, name: str) -> None:
        """Make tasks of a paused schedule again, from its first tick after now. Idempotent.
        Raises ScheduleNotFound."""
        self._schedule_pause(name, False, self._now())

    def _schedule_insert(self, schedule: Schedule) -> None:
        """Store a new schedule. Raises ScheduleExists."""
        raise NotImplementedError(f"{type(self).__name__} keeps no schedules")

    def _schedule_delete(self, name: str) -> None:
        """Delete a schedule. Raises ScheduleNotFound."""
        raise NotImplementedError(f"{type(self).__name__} keeps no schedules")

    def _schedule_pause(self, name: str, paused: bool, now: datetime) -> None:
        """Set ``paused``; resuming a paused schedule moves its cursor to ``now`` (ticks while
        paused are not made). Changes the row's version. Raises ScheduleNotFound."""
        raise NotImplementedError(f"{type(self).__name__} keeps no schedules")

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
