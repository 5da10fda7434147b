"""Claims and their outcomes on a SQL store: the statements of
:mod:`~metafora.coordinators.sql.statements`, run for one node and kept in step with its
:class:`~metafora.coordinators.sql.lease.Lease` (which tracks the claims held).

A claim is one statement: it takes a new token from the store-wide counter and is valid
while this node's lease is. Every outcome is fenced by owner and token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from metafora.contracts.coordinator import (
    CoordinatorContext,
    Finish,
    Outcome,
    crash_limit_error,
    error_text,
)
from metafora.coordinators.sql.lease import Lease, release_untracked
from metafora.coordinators.sql.shapes import OfferShapes
from metafora.coordinators.sql.statements import BATCH
from metafora.coordinators.sql.store import Database, HotCursor
from metafora.core.errors import ClaimCompleted, ClaimLost, MetaforaError
from metafora.core.task import Task

__all__ = ["ClaimOutcomes", "Claims", "FusedClaim"]

FusedClaim = Callable[["HotCursor", "str | None"], "list[tuple[Any, ...]]"]
"""The claim half of :meth:`Claims.with_outcomes`, run by :meth:`ClaimOutcomes.finish_many` on
its connection: given the done outcomes' ``:rows`` JSON (PostgreSQL, one statement) or None."""

log = logging.getLogger(__name__)

_CLAIM_MANY_MAX = 100  # ids per claim_many statement (SQLite: its token of a row is a walk of picked)
# PostgreSQL: a whole claim burst (SQLCoordinator.claim_burst) in one statement. At 100 a burst
# of 256 was three round trips, each waiting its turn on a busy server: a third of a cold
# start's claim time; array_position over 256 ids costs the server far less than a round trip.
_CLAIM_MANY_MAX_PG = 256
# SQLite: after a claim_many that lost more than this share of its offers, the next one first
# reads which offers are still claimable (no write lock), and takes the lock only for those.
_CONTENDED = 0.5
_FINISH_MANY_MAX = 500  # outcomes per finish_many statement
# Statement order of a group commit: a claim finished twice in one batch keeps its first kind.
_FINISH_STATEMENTS = ((Outcome.DONE, "done_many"), (Outcome.FAIL, "fail_many"),
                      (Outcome.RELEASE, "release_many"))


class Claims:
    """Claiming tasks for one node.

    ``context`` returns the node's context, raising CoordinatorClosed when the coordinator
    is closed or not initialised (a claim needs both its lease and its ``max_crashes``).
    """

    def __init__(self, db: Database, node_id: str, lease: Lease,
                 context: Callable[[], CoordinatorContext]) -> None:
        self._db = db
        self._node_id = node_id
        self._lease = lease
        self._context = context
        self._extra = {"node": node_id}
        self._contended = False  # the last claim_many lost most of its offers (SQLite)
        self._shapes = OfferShapes()  # claimed rows shaped alike are validated once

    def claim(self, task: Task) -> Task | None:
        """Claim one task (one statement); None when it is not claimable by this node.

        The statement that minds group limits, whatever ``task.group`` says: a task built
        by hand may not carry its stored group."""
        got = self._claim([task.id], 1, {task.id: task.group or ""})
        return got[0] if got else None

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        """Claim up to ``limit`` of ``tasks`` in one transaction (one statement per 256 on
        PostgreSQL, per 100 on SQLite), in the order offered.

        Offers of tasks this node already holds are skipped without a round trip. SQLite,
        after a claim that lost most of its offers to other nodes: first one read (no write
        lock, which every node's claims queue for) of which offers are still claimable; the
        claim then names only those, and is not made at all when none are.
        """
        ids = list(dict.fromkeys(t.id for t in tasks if not self.seen_taken(t)))
        if limit <= 0 or not ids:
            self._context()
            return []
        offered = len(ids)
        if self._contended and len(ids) > 1 and self._db.config.kind == "sqlite":
            ids = self._still_claimable(ids)
            if not ids:
                return []
        groups: dict[str, str | None] = {t.id: t.group for t in tasks if t.group is not None}
        claimed = self._claim(ids, limit, groups or None)
        self._contended = len(claimed) < min(limit, offered) * (1 - _CONTENDED)
        return claimed

    def claimable(self, tasks: Sequence[Task]) -> list[Task]:
        """Those of ``tasks`` that are still claimable by this node, in order: one read per
        500 (no write lock). The consumer asks before it tries offers it held back for their
        preferred node (see :mod:`metafora.consumer.preference`): most were taken meanwhile.
        """
        by_id = {t.id: t for t in tasks if not self.seen_taken(t)}
        ids = list(by_id)
        still: list[str] = []
        for start in range(0, len(ids), BATCH):
            still += self._still_claimable(ids[start:start + BATCH])
        return [by_id[task_id] for task_id in still]

    def _still_claimable(self, ids: list[str]) -> list[str]:
        self._context()
        params = {"ids": self._db.dialect.ids_param(ids), "node": self._node_id,
                  "labels": self._lease.row.labels_json() or "{}"}
        with self._db.read() as conn:
            rows = self._db.execute(conn, "claimable_ids", params).fetchall()
        return [str(r[0]) for r in rows]

    def seen_taken(self, task: Task) -> bool:
        """Whether this node holds ``task`` already (no I/O)."""
        return self._lease.holds(task.id)

    def _claim(self, ids: list[str], limit: int,
               groups: dict[str, str | None] | None = None) -> list[Task]:
        """Claim up to ``limit`` of ``ids`` in one transaction (one: the single-row
        statement; more: ``claim_many``, 256 ids per statement on PostgreSQL, 100 on SQLite).
        ``groups`` (offered task id -> its group) given: the statements that mind the groups'
        limits (see limits.py)."""
        max_crashes = self._context().max_crashes
        started = self._lease.begin_claim(ids)
        if started is None:
            log.debug("node %s is not live; not claiming %s", self._node_id, ", ".join(ids),
                      extra=self._extra)
            return []
        epoch, session = started
        claimed: list[Task] = []
        failed = True  # until the statement answered: it may have claimed without saying
        try:
            params = self._params(session)
            with self._db.hot() as cur:
                rows, _ = self._claim_rows(cur, ids, limit, params, None, groups)
            claimed = self._parse_rows(ids, rows, max_crashes)
            failed = False
        finally:
            kept = self._lease.end_claim(ids, epoch, claimed, failed)
        return self._kept(claimed, kept)

    def with_outcomes(self, outcomes: ClaimOutcomes, finishes: Sequence[Finish],
                      tasks: Sequence[Task], limit: int,
                      ) -> tuple[list[MetaforaError | None], list[Task]]:
        """Write ``finishes`` and claim up to ``limit`` of ``tasks`` in one request: on
        PostgreSQL the done outcomes and the first 256 offers in one statement
        (``claim_done_many``), on SQLite everything in one transaction. Each part is fenced
        as on its own (see :meth:`ClaimOutcomes.finish_many` and :meth:`claim_many`)."""
        ids = list(dict.fromkeys(t.id for t in tasks if not self.seen_taken(t)))
        if limit <= 0 or not ids:
            self._context()
            return outcomes.finish_many(finishes), []
        groups: dict[str, str | None] = {t.id: t.group for t in tasks if t.group is not None}
        max_crashes = self._context().max_crashes
        started = self._lease.begin_claim(ids)
        if started is None:
            log.debug("node %s is not live; not claiming %s", self._node_id, ", ".join(ids),
                      extra=self._extra)
            return outcomes.finish_many(finishes), []
        epoch, session = started
        params = self._params(session)
        rows: list[tuple[Any, ...]] = []
        claimed: list[Task] = []

        def claim(cur: HotCursor, done_rows: str | None) -> list[tuple[Any, ...]]:
            nonlocal rows
            rows, done = self._claim_rows(cur, ids, limit, params, done_rows, groups or None)
            return done

        failed = True
        try:
            results = outcomes.finish_many(finishes, claim)
            claimed = self._parse_rows(ids, rows, max_crashes)
            failed = False
        finally:
            kept = self._lease.end_claim(ids, epoch, claimed, failed)
        return results, self._kept(claimed, kept)

    def _params(self, session: str) -> dict[str, Any]:
        return {"node": self._node_id, "session": session,
                "labels": self._lease.row.labels_json() or "{}"}

    def _claim_rows(self, cur: HotCursor, ids: list[str], limit: int, params: dict[str, Any],
                    done_rows: str | None, groups: dict[str, str | None] | None,
                    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """The claim statements (one: the single-row statement; more: ``claim_many``, 256 ids
        per statement, SQLite 100; ``groups`` (offered task id -> its group) given: the statements that
        mind the groups' limits, see limits.py): the claimed rows, and with ``done_rows``
        (PostgreSQL) the rows recorded done -- by the first claim statement
        (``claim_done_many``), or with groups by ``done_many`` just before."""
        rows: list[tuple[Any, ...]] = []
        done: list[tuple[Any, ...]] = []
        if len(ids) == 1 and done_rows is None and groups is None:
            row = cur.one("claim", dict(params, id=ids[0]))
            rows = [] if row is None else [(ids[0], *row)]
            if rows:
                cur.token_used(int(rows[0][1]))
            return rows, done
        if done_rows is not None and groups is not None:
            done = cur.all("done_many", {"node": self._node_id, "rows": done_rows})
            done_rows = None
        many = "claim_many" if groups is None else "claim_many_grouped"
        step = _CLAIM_MANY_MAX_PG if self._db.dialect.name == "postgresql" else _CLAIM_MANY_MAX
        for start in range(0, len(ids), step):
            if len(rows) >= limit:
                break
            chunk = dict(params, ids=self._db.dialect.ids_param(ids[start:start + step]),
                         limit=limit - len(rows))
            got: list[tuple[Any, ...]]
            if done_rows is not None:
                got = []
                for row in cur.all("claim_done_many", dict(chunk, rows=done_rows)):
                    (done if row[-1] else got).append(row[:-1])
                done_rows = None
            else:
                got = cur.all(many, chunk)
            if got:
                # SQLite: the next chunk's tokens are counted from the counter row.
                cur.token_used(max(int(r[1]) for r in got))
                if groups is not None and self._db.dialect.name == "sqlite":
                    self._log_rates(cur, [groups.get(str(r[0])) for r in got])
            rows += got
        return rows, done

    def _parse_rows(self, ids: list[str], rows: list[tuple[Any, ...]],
                    max_crashes: int | None) -> list[Task]:
        """The claimed tasks of ``rows``, in the order offered (``ids``)."""
        claimed: list[Task] = []
        place = {task_id: i for i, task_id in enumerate(ids)}
        for task_id, token, props_text, crashes, *placed in sorted(
                rows, key=lambda r: place[str(r[0])]):
            task = self._parse_claimed(str(task_id), str(props_text), int(token), int(crashes),
                                       max_crashes, *placed)
            if task is not None:
                claimed.append(task)
        return claimed

    def _kept(self, claimed: list[Task], kept: bool) -> list[Task]:
        if claimed and not kept:
            # The lease was lost (or the node closed) while the claim was in flight.
            for task in claimed:
                release_untracked(self._db, self._node_id, task.id, task.token)
            return []
        return claimed

    @staticmethod
    def _log_rates(cur: HotCursor, groups: list[str | None]) -> None:
        """SQLite: log the claims of rate-limited groups in the claim's transaction (PostgreSQL
        logs them in the claim statement itself)."""
        named = [g for g in groups if g]
        if named:
            text = json.dumps(named)
            cur.all("rate_log_prune", {"groups": text})
            cur.all("rate_log_add", {"groups": text})

    def _parse_claimed(self, task_id: str, props_text: str, token: int, crashes: int,
                       max_crashes: int | None, selector: str | None = None,
                       priority: int | None = 0,
                       placement: str | None = None) -> Task | None:
        """The claimed task, or None after failing it: it can never run, or it keeps killing nodes."""
        try:
            task = self._shapes.task(task_id, props_text, selector, priority, placement, token)
        except MetaforaError as exc:
            error = f"invalid props: {exc}"
        else:
            verdict = crash_limit_error(crashes, max_crashes)
            if verdict is None:
                return task
            error = verdict
        log.error("task %s cannot run; marking it failed: %s", task_id, error,
                  extra={"node": self._node_id, "task": task_id})
        with self._db.hot() as cur:
            cur.one("fail", {"id": task_id, "node": self._node_id, "token": token, "error": error})
        return None


class ClaimOutcomes:
    """done, release and fail of one node's claims, one at a time or group-committed.

    ``check_open`` raises CoordinatorClosed once the coordinator is closed.
    """

    def __init__(self, db: Database, node_id: str, lease: Lease,
                 check_open: Callable[[], None]) -> None:
        self._db = db
        self._node_id = node_id
        self._lease = lease
        self._check_open = check_open
        self.hold: dict[str, Any] = {"held": None, "secs": 0.0}  # see Coordinator.hold_releases

    def hold_releases(self, seconds: float) -> None:
        """Hold this node's releases from now on for its id for ``seconds`` (0: no hold)."""
        self.hold = {"held": self._node_id if seconds else None, "secs": float(seconds)}

    def release(self, task: Task) -> None:
        """Give the claim back (fenced by owner and token; ClaimLost if no longer held)."""
        self._fenced("release", task, dict(self.hold))

    def done(self, task: Task) -> None:
        """Record the task done (fenced by owner and token; ClaimLost if no longer held)."""
        self._fenced("done", task, {})

    def fail(self, task: Task, error: BaseException | str) -> None:
        """Record the task failed with ``error`` (fenced by owner and token)."""
        self._fenced("fail", task, {"error": error_text(error)})

    def _fenced(self, name: str, task: Task, params: dict[str, Any]) -> None:
        self._check_open()
        params.update(id=task.id, node=self._node_id, token=task.token)
        self._lease.begin_finish(task.id)
        settled = False
        try:
            with self._db.hot() as cur:
                row = cur.one(name, params)
                if row is not None and name == "release":
                    cur.token_used(int(row[0]))
                done = row is None and bool(self._completed(cur, [task]))
            settled = True
        finally:
            self._lease.end_finish(task, settled)
        if done:
            raise _already_done(task)  # nothing written: its claim ended done
        if row is None:
            raise self._claim_lost(task)

    def finish_many(self, finishes: Sequence[Finish],
                    claim: FusedClaim | None = None) -> list[MetaforaError | None]:
        """Group commit: one fenced statement per outcome kind (and per 500 outcomes).

        PostgreSQL runs each statement in autocommit, SQLite all of them in one transaction.
        A second finish of the same claim in one batch is refused as ``ClaimLost``, as it
        would be if it came after the first. ``claim`` (see :meth:`Claims.with_outcomes`)
        runs the claim statements on the same connection after the outcomes: in the same
        transaction (SQLite), or (PostgreSQL) in one statement with up to 500 done outcomes,
        which it is given as the ``:rows`` JSON and answers the rows recorded done.
        """
        self._check_open()
        if claim is not None and not finishes:
            with self._db.hot() as cur:
                claim(cur, None)
            return []
        results: list[MetaforaError | None] = [None] * len(finishes)
        first: dict[tuple[str, int], int] = {}
        for i, finish in enumerate(finishes):
            key = (finish.task.id, finish.task.token)
            if key in first:
                results[i] = self._claim_lost(finish.task)
            else:
                first[key] = i
        if not first:
            return results
        unique = [finishes[i] for i in first.values()]
        written: set[tuple[str, int]] = set()
        completed: set[tuple[str, int]] = set()
        for finish in unique:
            self._lease.begin_finish(finish.task.id)
        settled = False
        # PostgreSQL: up to 500 done outcomes go in the claim's statement, and the outcome
        # statements say which claims ended done already (the *_moot variants).
        fuse = self._db.config.kind == "postgresql"
        try:
            with self._db.hot() as cur:
                for outcome, name in _FINISH_STATEMENTS:
                    group = [f for f in unique if f.outcome is outcome]
                    for start in range(0, len(group), _FINISH_MANY_MAX):
                        rows = json.dumps([
                            {"fid": f.task.id, "ftoken": f.task.token, "ferror": f.error or "failed"}
                            for f in group[start:start + _FINISH_MANY_MAX]
                        ])
                        if claim is not None and fuse and outcome is Outcome.DONE:
                            got, claim = claim(cur, rows), None
                        elif fuse:  # the same statement says which claims ended done already
                            got = cur.all(name + "_moot",
                                          {"node": self._node_id, "rows": rows, **self.hold})
                            completed.update((str(r[0]), int(r[1])) for r in got if r[-1])
                            got = [r[:-1] for r in got if not r[-1]]
                        else:
                            got = cur.all(name, {"node": self._node_id, "rows": rows, **self.hold})
                        if got and outcome is Outcome.RELEASE:
                            cur.token_used(max(int(r[2]) for r in got))
                        written.update((str(r[0]), int(r[1])) for r in got)
                answered = written | completed
                refused = [f.task for f in unique if (f.task.id, f.task.token) not in answered]
                if refused:  # SQLite (in-process), or PostgreSQL's fused claim or a race:
                    # one look for the batch, none while every outcome is answered
                    completed.update((t.id, t.token) for t in self._completed(cur, refused))
                if claim is not None:
                    claim(cur, None)
            settled = True
        finally:
            for finish in unique:
                self._lease.end_finish(finish.task, settled)
        for key, i in first.items():
            if key in completed:
                results[i] = _already_done(finishes[i].task)
            elif key not in written:
                results[i] = self._claim_lost(finishes[i].task)
        return results

    def _completed(self, cur: HotCursor, refused: Sequence[Task]) -> list[Task]:
        """Of claims whose outcome was refused, those that ended done under their own token:
        completed in the application's transaction (``Client.complete_task``), which wins
        over the handler's outcome, so it is settled with nothing written (not lost)."""
        done: list[Task] = []
        for start in range(0, len(refused), _FINISH_MANY_MAX):
            part = refused[start:start + _FINISH_MANY_MAX]
            rows = json.dumps([{"fid": t.id, "ftoken": t.token, "ferror": None} for t in part])
            found = {(str(r[0]), int(r[1])) for r in cur.all("done_already", {"rows": rows})}
            done += [t for t in part if (t.id, t.token) in found]
        for task in done:
            log.debug("task %s (token %d) was completed in the application's transaction; "
                      "its outcome is moot", task.id, task.token, extra={"task": task.id})
        return done

    def _claim_lost(self, task: Task) -> ClaimLost:
        return ClaimLost(
            f"node {self._node_id!r} no longer holds task {task.id!r} with token {task.token}"
        )


def _already_done(task: Task) -> ClaimCompleted:
    return ClaimCompleted(f"task {task.id!r} is already done under token {task.token} (completed "
                          "in the application's transaction): nothing to record")
