"""Retention of finished tasks: the policy every store keeps, and the leaderless pruner.

A namespace's :class:`Retention` says how long a finished task is kept, per kind of end:

- **done**: the coordinator state ``done`` -- except a stateful task whose stored
  state-machine state is ``killed`` or ``failed`` (a state-machine task always ends ``done``
  in the coordinator; its stored state says how);
- **failed**: the coordinator state ``failed`` (the handler raised, or too many crashes) or
  ``expired`` (never claimed before its ``expires_at``), and a ``done`` task whose stored
  state-machine state is ``failed``;
- **killed**: a ``done`` task whose stored state-machine state is ``killed`` (``metafora
  kill ID`` or ``Message.kill()``): the state machine stores its state in the store's state
  record of the task (SQL ``metafora_state.body``, etcd ``state/<id>``, the memory store's
  ``task_states``) as ``{"state": "killed", ...}``.

Each is a :class:`~datetime.timedelta` (a task finished longer ago than that is deleted) or
``None`` (never). Pending, claimed and sleeping tasks (a sleeping state-machine task is
claimed, or pending again after a release) are never pruned: only the three finished states
are candidates.

The default (:data:`DEFAULT_RETENTION`): done 7 days, failed and killed 30 days. A finished
task is an operator's evidence -- what ran, when, with which error -- and failures are the
ones looked at days later (after a weekend, in a post-mortem), so they stay a month; the
successes are the bulk of the rows (a cluster of short tasks adds millions a week) and are
rarely read after a few days, so a week bounds the tables without losing what anyone needs.

Pruning needs no leader: every consumer runs a :class:`Pruner`; once per ``interval`` one of
them wins the store's compare-and-set on the namespace's retention record (the same kind of
step that settles a schedule's tick exactly once) and deletes what the policy allows, in
batches of at most :data:`PRUNE_BATCH` tasks. Each batch deletes its tasks with their
state, commands and gate items in one transaction (SQL) or one txn per task (etcd), so a
node dying mid-prune leaves whole tasks or none.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Final

from metafora.core.clock import Clock
from metafora.core.durations import MAX_DURATION, format_duration, whole_seconds
from metafora.core.errors import ConfigError, CoordinatorClosed, MetaforaError

if TYPE_CHECKING:
    from metafora.core.task import TaskInfo

__all__ = [
    "DEFAULT_RETENTION",
    "FAILED_MARKS",
    "KILLED_MARKS",
    "MAX_KEEP",
    "PRUNE_BATCH",
    "PRUNE_INTERVAL",
    "UNCHANGED",
    "Cutoffs",
    "PruneAlso",
    "Pruner",
    "Retention",
    "RetentionOps",
    "kind_of",
    "parse_keep",
    "prunable",
    "purge_policy",
]

log = logging.getLogger(__name__)

PRUNE_BATCH: Final = 1000
"""Most tasks one prune statement (SQL) or one round of txns (etcd) deletes."""
PRUNE_INTERVAL: Final = 60.0
"""Seconds between two prune runs of a namespace (whichever node wins the turn)."""

PruneAlso = Callable[[list[str]], object]
"""A function :meth:`RetentionOps.prune_also` registers: given the ids of pruned tasks."""

MAX_KEEP: Final = MAX_DURATION
"""The longest retention a kind may have (100 years): every setter refuses more, and a stored
value above it (written by another tool) is an error of the read, never of the date arithmetic
(``now - 800000d`` is before year 1, and once stopped every worker's prune loop)."""

KILLED_MARKS: Final = ('"state":"killed"', '"state": "killed"')
"""How a stored state-machine state says ``killed`` in its JSON text (canonical, spaced)."""
FAILED_MARKS: Final = ('"state":"failed"', '"state": "failed"')


class _Unchanged:
    """The default of :meth:`RetentionOps.set_retention`: keep the current value."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()


@dataclass(frozen=True)
class Retention:
    """How long finished tasks are kept, per kind of end (None: for ever)."""

    done: timedelta | None = timedelta(days=7)
    failed: timedelta | None = timedelta(days=30)
    killed: timedelta | None = timedelta(days=30)

    def describe(self) -> str:
        """``done 7d, failed 30d, killed never`` as ``top`` and ``retention show`` print it."""
        return ", ".join(f"{name} {_text(getattr(self, name))}" for name in ("done", "failed", "killed"))

    def seconds(self) -> tuple[int | None, int | None, int | None]:
        """(done, failed, killed) in whole seconds, None for never (as the stores keep it)."""
        return (_secs(self.done), _secs(self.failed), _secs(self.killed))

    @classmethod
    def from_seconds(cls, done: object, failed: object, killed: object) -> Retention:
        """From stored seconds (None: never). ConfigError for a stored value out of range
        (not 1 s to :data:`MAX_KEEP`): the store holds a policy no setter writes."""
        values: list[timedelta | None] = []
        for name, value in (("done", done), ("failed", failed), ("killed", killed)):
            if value is None:
                values.append(None)
                continue
            try:
                secs = int(value)  # type: ignore[call-overload]
            except (TypeError, ValueError, OverflowError):
                secs = -1
            if not 1 <= secs <= MAX_KEEP.total_seconds():
                raise ConfigError(
                    f"the stored retention of {name} tasks is out of range ({str(value)[:40]} s; "
                    f"1s to {format_duration(int(MAX_KEEP.total_seconds()))}): set it again with "
                    f"'metafora retention set --{name} DURATION|never'")
            values.append(timedelta(seconds=secs))
        return cls(*values)

    def to_json(self) -> dict[str, int | None]:
        """``{"done": secs|null, "failed": ..., "killed": ...}``."""
        done, failed, killed = self.seconds()
        return {"done": done, "failed": failed, "killed": killed}


DEFAULT_RETENTION: Final = Retention()
"""done 7 days, failed 30 days, killed 30 days (see the module docstring for why)."""


def _secs(value: timedelta | None) -> int | None:
    return None if value is None else int(value.total_seconds())


def _text(value: timedelta | None) -> str:
    return "never" if value is None else format_duration(int(value.total_seconds()))


def purge_policy(older_than: timedelta | None) -> Retention:
    """``metafora purge --older-than``: every finished kind kept ``older_than`` (0: none)."""
    keep = older_than or timedelta(0)
    return Retention(keep, keep, keep)


def parse_keep(value: object, what: str = "retention") -> timedelta | None:
    """A retention value: ``"never"``/None (keep for ever), a duration (``"1s"``, ``"7d"``,
    seconds, a :class:`~datetime.timedelta` of whole seconds, at least 1 s). ConfigError."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "never"):
        return None
    try:  # whole_seconds bounds it: at most MAX_KEEP (MAX_DURATION)
        return timedelta(seconds=whole_seconds(value, "a duration"))
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc} (or 'never')") from None


@dataclass(frozen=True)
class Cutoffs:
    """The finish times at or before which a task of each kind is pruned (None: never)."""

    done: datetime | None
    failed: datetime | None
    killed: datetime | None

    @classmethod
    def at(cls, policy: Retention, now: datetime) -> Cutoffs:
        """The cut-offs of ``policy`` at ``now``; a cut-off before the first representable
        date is None (no task finished that long ago)."""
        return cls(*(None if keep is None else _minus(now, keep)
                     for keep in (policy.done, policy.failed, policy.killed)))

    def oldest(self) -> datetime | None:
        """The latest of the cut-offs (no task finished after it is pruned); None: none."""
        given = [c for c in (self.done, self.failed, self.killed) if c is not None]
        return max(given) if given else None

    def latest_for(self, state: str) -> datetime | None:
        """The latest cut-off at which a task finished in coordinator state ``state`` may be
        pruned, its state machine unknown (a done task may count as killed or failed: see
        :func:`kind_of`); None: never."""
        if state in ("failed", "expired"):
            return self.failed
        if state != "done":
            return None
        return self.oldest()  # any kind: done, or killed or failed by its state machine

    def of(self, kind: str) -> datetime | None:
        """The cut-off of ``done``, ``failed`` or ``killed``."""
        found: datetime | None = getattr(self, kind)
        return found


def _minus(now: datetime, keep: timedelta) -> datetime | None:
    try:
        return now - keep
    except OverflowError:
        return None


def kind_of(state: str, machine_state: str | None) -> str | None:
    """``done``, ``failed`` or ``killed`` for a finished task (coordinator ``state`` and the
    stored state-machine state's JSON text, if any); None for a task that is not finished."""
    if state in ("failed", "expired"):
        return "failed"
    if state != "done":
        return None
    if machine_state is not None:
        if any(mark in machine_state for mark in KILLED_MARKS):
            return "killed"
        if any(mark in machine_state for mark in FAILED_MARKS):
            return "failed"
    return "done"


def prunable(info: TaskInfo, machine_state: str | None, cutoffs: Cutoffs) -> bool:
    """Whether the finished task ``info`` is past its kind's cut-off."""
    kind = kind_of(info.state.value, machine_state)
    if kind is None or info.finished_at is None:
        return False
    cut = cutoffs.of(kind)
    return cut is not None and info.finished_at <= cut


class RetentionOps:
    """The retention verbs of clients and coordinators (one of their bases); a store overrides
    :meth:`_retention_get`, :meth:`_retention_put`, :meth:`_prune_turn` and
    :meth:`_prune_batch`."""

    def retention(self) -> Retention:
        """The namespace's retention policy (:data:`DEFAULT_RETENTION` until one is set)."""
        return self._retention_get()

    def set_retention(
        self,
        done: timedelta | str | _Unchanged | None = UNCHANGED,
        failed: timedelta | str | _Unchanged | None = UNCHANGED,
        killed: timedelta | str | _Unchanged | None = UNCHANGED,
    ) -> Retention:
        """Set how long finished tasks are kept: a :class:`~datetime.timedelta` (or ``"7d"``)
        or None for never; a kind not given keeps its current value. Every node's next prune
        run uses it. Returns the new policy. ConfigError."""
        given_all = (("done", done), ("failed", failed), ("killed", killed))
        values = [None if isinstance(given, _Unchanged) else parse_keep(given, f"retention of {name} tasks")
                  for name, given in given_all]
        if any(isinstance(given, _Unchanged) for _, given in given_all):
            # Read only when a kind keeps its value: a stored policy out of range (another
            # tool wrote it) can still be replaced by giving all three.
            current = self._retention_get()
            values = [getattr(current, name) if isinstance(given, _Unchanged) else value
                      for (name, given), value in zip(given_all, values, strict=True)]
        policy = Retention(*values)
        self._retention_put(policy)
        log.info("retention set: %s", policy.describe(), extra={"action": "retention"})
        return policy

    def prune_also(self, delete: PruneAlso) -> None:
        """Also delete what is keyed by a pruned task outside this store: ``delete(ids)`` is
        called with the ids of every batch of tasks a prune (or purge) of this object deleted,
        after they were deleted. :func:`metafora.gates.handler_func` registers its item
        store's :meth:`~metafora.gates.ItemStore.delete_partitions` when the items live in
        another database than the tasks (an etcd coordinator's gate items live in SQL).

        On etcd the batch's ids are recorded in the txns that delete the tasks and dropped
        once ``delete`` returned, so a node dying in between leaves them to the next batch
        of any node that has ``delete`` registered; an error of ``delete`` ends the run (the
        next interval tries again). Registering the same function twice registers it once."""
        hooks: list[PruneAlso] = self.__dict__.setdefault("_prune_also", [])
        if delete not in hooks:
            hooks.append(delete)

    def _prune_extras(self) -> list[PruneAlso]:
        """What :meth:`prune_also` registered."""
        found: list[PruneAlso] = self.__dict__.get("_prune_also", [])
        return found

    def prune(self, policy: Retention | None = None, batch: int = PRUNE_BATCH) -> int:
        """Delete every finished task ``policy`` (default: the stored one) allows now, in
        batches of ``batch``; how many were deleted. No turn is taken (:class:`Pruner` does)."""
        if policy is None:
            policy = self._retention_get()
        cutoffs = Cutoffs.at(policy, self._prune_now())
        total = 0
        pause = threading.Event()
        while True:
            started = time.monotonic()
            count = self._prune_batch(cutoffs, batch)
            total += count
            if count < batch:
                return total
            pause.wait(self._prune_pause(time.monotonic() - started))

    def _prune_pause(self, elapsed: float) -> float:
        """Seconds to rest after a full batch that took ``elapsed``: the share of the store's
        time a prune may take (SQLite: one writer at a time, so claims wait while a batch
        runs; see ``coordinators/sql/retention.py`` for the factors)."""
        return 0.0

    def _retention_get(self) -> Retention:
        """The stored policy (the default if none)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no retention policy")

    def _retention_put(self, policy: Retention) -> None:
        """Store ``policy``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no retention policy")

    def _prune_now(self) -> datetime:
        """The store's clock (the database's, for SQL), which finish times are compared to."""
        raise NotImplementedError(f"{type(self).__name__} keeps no retention policy")

    def _prune_turn(self, interval: float) -> tuple[Retention, Cutoffs] | None:
        """Take the namespace's prune turn if the last one is ``interval`` seconds old (one
        atomic compare-and-set in the store: of the nodes racing, one wins); the policy and
        its cut-offs at the store's now, or None (another node had the turn)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no retention policy")

    def _prune_batch(self, cutoffs: Cutoffs, limit: int) -> int:
        """Delete up to ``limit`` finished tasks past ``cutoffs`` with everything keyed by them
        (atomically per task at least); how many."""
        raise NotImplementedError(f"{type(self).__name__} keeps no retention policy")

    def _pruner_batch(self, cutoffs: Cutoffs, limit: int) -> int:
        """:meth:`_prune_batch` as the periodic :class:`Pruner` asks it: a store may find the
        candidates in what it already follows rather than read every task each interval
        (etcd's coordinator: its watch cache). Explicit prunes and purges read the store."""
        return self._prune_batch(cutoffs, limit)

    def namespace_label(self) -> str:
        """The namespace, as the ``namespace`` label of the cluster metrics."""
        return "default"

    def pending_count(self) -> int:
        """How many tasks are pending (due or not): the backlog the cluster metrics show."""
        raise NotImplementedError(f"{type(self).__name__} does not count pending tasks")


class Pruner:
    """A consumer's side loop: every ``interval`` it tries to take the prune turn and, if it
    won, prunes in batches, counting into ``on_pruned`` and logging once per run."""

    def __init__(
        self,
        store: RetentionOps,
        clock: Clock,
        *,
        interval: float = PRUNE_INTERVAL,
        batch: int = PRUNE_BATCH,
        on_pruned: Callable[[int], None] | None = None,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._on_error = on_error  # counts an error of the loop (``prune``) for /metrics
        self._clock = clock
        self.interval = interval
        self._batch = batch
        self._on_pruned = on_pruned
        self._log = logger or log
        self._stop = threading.Event()
        self.pruned = 0
        """Tasks this node pruned (final once :meth:`run` returned)."""
        self.runs = 0
        """Prune runs this node won."""

    def stop(self) -> None:
        """End :meth:`run` soon (between two batches)."""
        self._stop.set()

    def run(self) -> None:
        """Loop until :meth:`stop`; an error (of the store, or of a stored policy out of range)
        is logged with its cause, counted and tried again next interval: it never ends the loop."""
        while not self._stop.is_set():
            try:
                self.step()
            except CoordinatorClosed:
                return
            except NotImplementedError:
                return  # a store without retention: nothing to do
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._log.warning("prune: %s (trying again in %.0fs)", exc, self.interval,
                                  exc_info=None if isinstance(exc, MetaforaError) else exc,
                                  extra={"action": "prune"})
                if self._on_error is not None:
                    self._on_error("prune")
            self._clock.wait(self._stop, self.interval)

    def step(self) -> int | None:
        """One try: take the turn and prune; how many were pruned (None: not our turn)."""
        taken = self._store._prune_turn(self.interval)
        if taken is None:
            return None
        policy, cutoffs = taken
        self.runs += 1
        total = 0
        started = self._clock.monotonic()
        while not self._stop.is_set():
            batch_started = self._clock.monotonic()
            count = self._store._pruner_batch(cutoffs, self._batch)
            total += count
            self.pruned += count
            if count and self._on_pruned is not None:
                self._on_pruned(count)
            if count < self._batch:
                break
            self._clock.wait(self._stop, self._store._prune_pause(self._clock.monotonic() - batch_started))
        self._log.log(logging.INFO if total else logging.DEBUG,
                      "pruned %d finished task(s) in %.1fs (%s)", total,
                      self._clock.monotonic() - started, policy.describe(),
                      extra={"action": "prune"})
        return total
