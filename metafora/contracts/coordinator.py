"""The Coordinator interface (one per consumer) and what its stores share.

Every store (memory, SQL, etcd) implements it, and one conformance suite
(``tests/conformance``) holds them to the same semantics. The operator's side,
:class:`~metafora.contracts.client.Client`, has a module of its own (:mod:`metafora.contracts.client`).
"""

from __future__ import annotations

import abc
import enum
import logging
import queue
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self, TypeVar

from metafora.contracts.balancer import ClusterState
from metafora.core.commands import Command
from metafora.core.errors import CoordinatorClosed, CoordinatorUnavailable, MetaforaError
from metafora.core.masking import cut_text, scrub
from metafora.core.retention import RetentionOps
from metafora.core.schedule_model import Schedule
from metafora.core.task import Task

__all__ = [
    "DEFAULT_MAX_CRASHES", "MAX_ERROR_BYTES", "Coordinator", "CoordinatorContext", "Finish",
    "Outcome", "TaskCommandListener", "TaskSink", "as_sink", "coordinator_of", "crash_limit_error",
    "error_text", "rotated",
]

log = logging.getLogger("metafora.coordinator")  # its name before the move (users' log config names it)

T = TypeVar("T")

TaskSink = Callable[[Task], None]
"""Where ``Coordinator.watch`` delivers claimable tasks."""


def as_sink(out: TaskSink | queue.Queue[Task]) -> TaskSink:
    """Accept a callable or a queue (Go's channel) as the output of ``watch``."""
    if isinstance(out, queue.Queue):
        return out.put
    return out


def rotated(items: list[T], rng: random.Random | None = None) -> list[T]:
    """``items`` starting at a random position, wrapping around.

    Every node's watch finds the same backlog in the same order; offering it from a random
    place makes racing nodes claim in different regions of it, so fewer claims are lost to a
    race (the consumer's shuffle only mixes what one drain picked up).
    """
    if len(items) < 2:
        return items
    start = (rng or random).randrange(len(items))
    return items[start:] + items[:start]


MAX_ERROR_BYTES = 4096
"""The most of a failed task's error a store keeps (UTF-8 bytes): its type and the first
part of its message, then ``… cut, N bytes``. A handler's error may be any size; a page or
a table showing it must not cost more for that."""


def error_text(error: BaseException | str) -> str:
    """The text stored for a failed task: ``Type: message`` for exceptions, cut to
    :data:`MAX_ERROR_BYTES` (:func:`~metafora.core.masking.cut_text`) and masked.

    Every store writes its failed tasks' errors through this function, so a password in an
    exception's message (a driver naming its URL) is never stored (see :func:`~metafora.core.masking.scrub`)
    and no stored error is longer than the limit. The cut comes first, so masking costs
    little; what is left of a URL cut in its middle is masked by the same positional rule.
    """
    if isinstance(error, BaseException):
        kind = f"{type(error).__name__}: "
        return scrub(kind + cut_text(str(error), MAX_ERROR_BYTES - len(kind.encode())))
    return scrub(cut_text(str(error), MAX_ERROR_BYTES))


class TaskCommandListener(Protocol):
    """Told by a coordinator's push channel about task commands (no I/O, must not block).

    The statemachine's :class:`~metafora.statemachine.mailbox.CommandBell` is one.
    """

    def ring(self, task_id: str) -> None:
        """A command was queued for ``task_id``."""

    def recheck(self) -> None:
        """Notifications may have been missed (a reconnect, a watch restart): look once."""


class Outcome(enum.Enum):
    """How a claim ended, as the consumer records it."""

    DONE = "done"
    RELEASE = "release"
    FAIL = "fail"


@dataclass(frozen=True)
class Finish:
    """One outcome to record for a claimed task, fenced by ``task.token``.

    ``error`` is the stored error text of a :attr:`Outcome.FAIL` (see :func:`error_text`).
    """

    task: Task
    outcome: Outcome
    error: str | None = None


DEFAULT_MAX_CRASHES = 5
"""Claims in a row that may end with their node dead before the task is failed (see below)."""


def crash_limit_error(crashes: int, limit: int | None) -> str | None:
    """Why a task is failed instead of claimed again, or None.

    ``crashes`` counts the task's latest claims in a row that ended with no outcome because
    their node died (its lease expired, or it restarted under the same id): a handler that
    kills its process would otherwise take down every node of the cluster in turn, forever.
    ``limit`` None or 0 turns the check off.
    """
    if not limit or crashes < limit:
        return None
    return (
        f"process died while running it: {crashes} claims in a row ended with the node dead "
        f"and no outcome (max_crashes={limit})"
    )


class CoordinatorContext(abc.ABC):
    """What a coordinator may call back into its consumer (and an optional ``capacity``: see
    :func:`metafora.coordinators.members.context_capacity`)."""

    @abc.abstractmethod
    def lost(self, task: Task) -> None:
        """A claim this node held is gone (lease lost, task deleted): stop its handler now."""

    @property
    def logger(self) -> logging.Logger:
        """Logger for the coordinator's messages."""
        return logging.getLogger("metafora.coordinator")

    def renewed(self, seconds: float) -> None:
        """The node's lease was renewed; the renewal took ``seconds`` (for metrics)."""
        return  # optional hook: contexts that keep metrics override it

    @property
    def max_crashes(self) -> int | None:
        """A claim fails a task whose previous claims ended this many times in a row with their
        node dead (see :func:`crash_limit_error`); None or 0: never."""
        return DEFAULT_MAX_CRASHES

    @property
    def labels(self) -> Mapping[str, str]:
        """The node's placement labels, published with its registration: the coordinator's
        claim refuses a task whose selector they do not match (validated by the consumer)."""
        return {}

    @property
    def weight(self) -> float:
        """The node's weight, published with its registration (``ClusterState.node_weights``):
        its fair share of the work is proportional to it (validated by the coordinator)."""
        return 1.0


class Coordinator(ClusterState, RetentionOps, abc.ABC):
    """A consumer's view of the shared store: discover, claim and finish tasks.

    All methods are thread-safe. Claims are leases held by this node; every write about a
    claim is fenced by its token and refused with :class:`~metafora.core.errors.ClaimLost` when
    the node no longer holds it.
    """

    claim_burst: int = 32
    """At most this many offered tasks go to one :meth:`claim_many` call from the consumer (a
    store that claims a burst in one statement sets more; etcd's txn limit wants fewer)."""

    node_id_generated: bool = False
    """Whether this node's id was made up at random (``open_coordinator`` without a node id
    or ``METAFORA_NODE_ID``): a generated id never comes back, so nothing is held for it
    (``Consumer(sticky_for=)`` is ignored, see :mod:`metafora.core.holds`)."""

    backend: ClassVar[str] = ""
    """The store this coordinator belongs to: the ``name`` of its registered
    :class:`~metafora.contracts.backends.StoreBackend` (``"memory"``, ``"sql"``, ``"etcd"``): the
    features find their storage beside it there (state machine states, task commands). Empty
    for a coordinator of no registered store."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A printable name of the store (its URL without password)."""

    @property
    @abc.abstractmethod
    def node_id(self) -> str:
        """This node's id (unique among live nodes)."""

    @abc.abstractmethod
    def init(self, ctx: CoordinatorContext) -> None:
        """Register the node and start renewing its lease. Raises NodeExists if the id is live."""

    @abc.abstractmethod
    def watch(self, out: TaskSink | queue.Queue[Task]) -> None:
        """Block, feeding claimable tasks to ``out``, until ``close()``.

        A task may be offered more than once; claim() settles who gets it.
        """

    @abc.abstractmethod
    def claim(self, task: Task) -> Task | None:
        """Claim ``task``: the claimed task with its new token, or None if not claimable."""

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        """Claim up to ``limit`` of ``tasks`` (offered ones); the claimed ones, with their tokens.

        Tasks that are no longer claimable are skipped without error. A store may do this in
        one round trip (SQL), and may skip without a round trip tasks its own view already
        shows as taken (etcd's watch cache): a wrong guess costs nothing, because a task that
        becomes claimable again is offered again. The consumer claims through this method.
        """
        claimed: list[Task] = []
        for task in tasks:
            if len(claimed) >= limit:
                break
            if self.seen_taken(task):
                continue
            got = self.claim(task)
            if got is not None:
                claimed.append(got)
        return claimed

    def holds(self, task: Task) -> bool:
        """Whether this node, by its own clock (no I/O), still holds the claim ``task``.

        The consumer asks right before starting a handler, so a process paused between the
        claim and the start (SIGSTOP, a long GC) does not start work on a lease it may
        already have lost. True when unsure.
        """
        return True

    def lease_time_left(self) -> float | None:
        """Seconds until this node's lease reaches its fencing deadline by its own clock (no I/O).

        ``0.0`` while the node has no live lease (not registered yet, or renewals failing past
        the deadline); None when this store bounds nothing (memory). The consumer's readiness
        probe (``/readyz``) asks it: a node whose lease is not fresh is not ready.
        """
        return None

    def claim_time_left(self, task: Task) -> float | None:
        """Seconds this node still holds the claim ``task`` by its own clock (no I/O).

        The time until the node's lease reaches its fencing deadline (when it stops its
        handlers), ``0.0`` once the claim is lost or not held under ``task.token``; None
        when this store bounds nothing (memory). Fenced writes about the claim (task state,
        gate items) use it as their deadline: a write still waiting for the store then is
        refused as :class:`~metafora.core.errors.ClaimLost`, never left blocking past the lease.
        """
        return None

    def seen_taken(self, task: Task) -> bool:
        """Whether this coordinator's local view (no I/O) already shows ``task`` taken or finished.

        Used by :meth:`claim_many` to skip stale offers without a round trip; False when unsure.
        """
        return False

    @abc.abstractmethod
    def release(self, task: Task) -> None:
        """Give a claimed task back (pending again). Fenced by ``task.token``."""

    @abc.abstractmethod
    def done(self, task: Task) -> None:
        """Mark a claimed task done; it never runs again. Fenced by ``task.token``."""

    @abc.abstractmethod
    def fail(self, task: Task, error: BaseException | str) -> None:
        """Mark a claimed task failed with ``error``; kept, not rescheduled. Fenced."""

    def complete_task(self, task: Task, *, conn: Any) -> None:
        """Mark the claim ``task`` done inside the application's open transaction ``conn``
        (as :meth:`metafora.Client.complete_task`; what a handler's ``ctx.complete(conn=)``
        calls on its node's coordinator). ConfigError on stores that share no transaction
        with the application (the default)."""
        from metafora.core.submitting import no_completion

        raise no_completion(self.name)

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Record many outcomes, each fenced by its own task's token, in few round trips.

        Result ``i`` is None when ``finishes[i]`` was written, else the error that refused
        it (:class:`~metafora.core.errors.ClaimLost` when the claim is no longer held). Raises
        :class:`~metafora.core.errors.CoordinatorUnavailable` (or ``CoordinatorClosed``) when the
        store could not be reached: the caller retries the batch, and an outcome whose first
        answer was lost is then refused as ``ClaimLost``, as a single write would be. A store
        may group them in one statement or transaction; this default writes them one by one.
        """
        results: list[MetaforaError | None] = []
        for finish in finishes:
            try:
                if finish.outcome is Outcome.DONE:
                    self.done(finish.task)
                elif finish.outcome is Outcome.RELEASE:
                    self.release(finish.task)
                else:
                    self.fail(finish.task, finish.error or "failed")
            except (CoordinatorUnavailable, CoordinatorClosed):
                if not results:
                    raise
                # Some were written: report the rest as unreachable, the caller retries them.
                results.extend(CoordinatorUnavailable("store unreachable mid-batch")
                               for _ in range(len(finishes) - len(results)))
                return results
            except MetaforaError as exc:
                results.append(exc)
            else:
                results.append(None)
        return results

    @abc.abstractmethod
    def command(self, timeout: float | None = None) -> Command | None:
        """The next command for this node (FIFO), waiting up to ``timeout`` seconds.

        ``None`` on timeout or once the coordinator is closed; ``timeout=None`` waits until
        a command arrives or ``close()``. A malformed stored command is logged and dropped.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop watching, release what is still claimed, deregister the node. Idempotent."""

    def hold_releases(self, seconds: float) -> bool:
        """From now on, hold what this node releases for its id for ``seconds`` (0: stop).

        Every later release of this node (``release``, a RELEASE of ``finish_many``, the
        claims ``close()`` frees) leaves the task pending but claimable only by a node with
        this id until the store's clock passes the window; other nodes take it after that
        (see :mod:`metafora.core.holds`). The consumer calls it when it shuts down gracefully with
        an explicit node id. Returns False when the store cannot hold (the default): its
        releases then go to every node at once, as before.
        """
        return False

    def report_frozen(self, frozen: bool) -> None:
        """Publish whether this node is frozen, for operators' views (best effort)."""
        return  # optional: stores that keep node details override it

    def announce_leaving(self) -> None:
        """Publish that this node is shutting down: it claims nothing more and balancers of
        other nodes stop counting it (:meth:`~metafora.contracts.balancer.ClusterState.active_task_count`).

        Best effort (errors are logged, not raised); the node stays registered, holding its
        claims, until :meth:`close`. Other nodes hear it as a membership change.
        """
        return  # optional: stores that publish node details override it

    def listen_membership(self, listener: Callable[[], None]) -> bool:
        """Call ``listener`` (no I/O, must not block) when nodes may have joined, left or
        announced leaving; it may be called spuriously, and only once for a burst.

        Returns False when the store cannot tell (the consumer then balances on its timer
        only). Pushed where the store can (PostgreSQL NOTIFY, an etcd watch, memory),
        otherwise noticed by the lease renewal's existing read (SQLite).
        """
        return False

    def listen_task_commands(self, listener: TaskCommandListener) -> bool:
        """Feed ``listener`` from this node's push channel (LISTEN/NOTIFY, etcd watch...).

        Returns False when the store cannot push task commands (its channels then poll).
        """
        return False

    # -- periodic schedules (see metafora.core.schedule_model) ------------------------------------

    def schedules(self) -> list[Schedule]:
        """Every schedule of the namespace, by name (a store without schedules: none)."""
        return []

    def materialise(self, schedule: Schedule, tasks: Sequence[Task], cursor: datetime) -> bool:
        """Settle due ticks of ``schedule`` atomically: in ONE transaction, move its cursor to
        ``cursor`` if the stored row still has ``schedule.version`` (compare-and-set) and
        create each of ``tasks`` that does not exist yet (an existing id is left alone).

        True if this call moved the cursor; False if the schedule changed or is gone (another
        node won the race, or an operator paused, resumed or deleted it): nothing is written.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no schedules")

    def listen_schedules(self, wake: Callable[[], None]) -> bool:
        """Call ``wake`` (no I/O, must not block) when the schedules change; False when the
        store cannot push that (the scheduler then re-reads them more often)."""
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def coordinator_of(task: Task) -> Coordinator | None:
    """The coordinator of the node that claimed ``task`` (a Consumer hands it to the handler
    with its claim), or None for a task that came from no consumer. A handler's own fenced
    writes in the application's transaction (``ctx.complete(conn=)``) go there."""
    claim = task.__dict__.get("_claim")
    found = getattr(claim, "coordinator", None)
    return found if isinstance(found, Coordinator) else None
