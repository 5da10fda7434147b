"""Claims: judging offers against the watch cache, multi-op claim txns.

One claim batch is one round trip: up to :data:`CLAIM_TXN_TASKS` tasks per txn, all txns in
flight together; a refused txn's failure branch reads its tasks back to re-judge them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TypeVar

from metafora.contracts.coordinator import crash_limit_error
from metafora.coordinators.etcd.cache import Entry, Known, TaskCache
from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import Keys, TaskRecord, encode_json, gather, iso, props_of
from metafora.coordinators.etcd.lease import NodeLease
from metafora.coordinators.etcd.limits import GroupLimits
from metafora.coordinators.etcd.node import Held, NodeState
from metafora.coordinators.etcd.ops import (
    Compare,
    LeaseNotFound,
    Op,
    Put,
    Range,
    TxnRequest,
    TxnResult,
    absent,
    modified_at,
)
from metafora.coordinators.etcd.queries import expire_task, fail_unclaimed, launch_and_expiry
from metafora.core.clock import Clock
from metafora.core.errors import InvalidProps, MetaforaError
from metafora.core.task import Task, matches

__all__ = ["CLAIM_TXN_TASKS", "Claims"]

log = logging.getLogger(__name__)

CLAIM_TXN_TASKS = 32
"""Tasks per claim txn: 4 compares, 3 puts and 4 failure reads each, within etcd's default
limit of 128 operations per txn branch."""
_ROUND_TXN_TASKS = (CLAIM_TXN_TASKS, 4, 1)  # tasks per claim txn in each round of _claim_known


_T = TypeVar("_T")


def _chunks(items: list[_T], round_: int) -> list[list[_T]]:
    """The claim txns of one round of :meth:`Claims._claim_known`.

    A multi-task txn fails whole when any one of its tasks was taken. Retried in such txns, a
    free task could lose every round to its neighbours and be left unclaimed until the watch's
    safety-net re-list (``poll_interval``, 30 s): the claims benchmark's 2-process outlier.
    Retries go in smaller txns, the last round one task each, which fails only when that task
    itself was taken or changed.
    """
    size = _ROUND_TXN_TASKS[round_]
    return [items[i:i + size] for i in range(0, len(items), size)]


class Claims:
    """Claiming tasks for this node, fenced by owner key and token, and what it holds.

    Judges offers on the watch's ``cache``; a claim is made under the node's current lease
    (``lease`` fences the node when etcd no longer knows it).
    """

    def __init__(self, driver: EtcdDriver, keys: Keys, clock: Clock, state: NodeState,
                 cache: TaskCache, lease: NodeLease, limits: GroupLimits) -> None:
        self._limits = limits
        self._driver = driver
        self._keys = keys
        self._clock = clock
        self._state = state
        self._cache = cache
        self._lease = lease

    def seen_taken(self, task: Task) -> bool:
        """Whether the watch cache saw an owner or a finish of ``task``. If that view is
        stale, the release or resubmission that follows reaches the cache and re-offers it."""
        with self._state.lock:
            return self._cache.seen_taken(task.id)

    def claim(self, task: Task) -> Task | None:
        self._state.require_init()
        with self._state.lock:
            lease = self._state.lease_id
            entry = self._cache.entries.get(task.id)
            known = entry.known() if entry is not None and entry.props is not None else None
        if lease is None:
            return None  # the lease is lost; the lease thread is re-registering
        if known is None:
            known = self._read_known(task.id)
            if known is None:
                return None
        claimed = self._claim_known([(task, known)], lease)
        return claimed[0] if claimed else None

    def _read_known(self, task_id: str) -> Known | None:
        """A task the watch cache does not know (yet): read it."""
        tk = self._keys.task(task_id)
        kvs, _ = self._driver.range(Range(tk.prefix, prefix=True))
        rec = gather(self._keys, kvs).get(task_id)
        if rec is None or rec.props is None:
            return None
        return Entry.from_record(task_id, rec).known()

    def claim_many(self, tasks: Sequence[Task], limit: int) -> list[Task]:
        """Claim offers in multi-op txns (up to :data:`CLAIM_TXN_TASKS` tasks each, all in flight at
        once); a txn refused because one of its tasks was taken meanwhile tells, in the same
        round trip, which ones to try again."""
        self._state.require_init()
        with self._state.lock:
            lease = self._state.lease_id
            batch: list[tuple[Task, Known]] = []
            single: list[Task] = []
            seen: set[str] = set()
            for task in tasks:
                if task.id in seen:
                    continue  # one claim txn may not write a key twice
                seen.add(task.id)
                entry = self._cache.entries.get(task.id)
                if entry is not None and (entry.owner is not None or entry.finished) and not (
                        entry.owner == self._state.node_id and task.id not in self._state.held):
                    continue  # seen taken: no round trip for a stale offer
                # (Owned by this node in a cache that has not seen its own release yet: tried;
                # a refused txn reads the task back and judges it again.)
                if entry is None or entry.props is None:
                    single.append(task)
                else:
                    batch.append((task, entry.known()))
        if lease is None:
            return []
        for task in single:  # not in the watch cache yet: rare (an offer the cache has not seen)
            known = self._read_known(task.id)
            if known is not None:
                batch.append((task, known))
        claimed: list[Task] = []
        while batch and len(claimed) < limit:
            take, batch = batch[: limit - len(claimed)], batch[limit - len(claimed):]
            claimed += self._claim_known(take, lease)
        return claimed

    def _claim_known(self, items: list[tuple[Task, Known]], lease: int) -> list[Task]:
        """Claim ``items`` as judged by their ``Known``: one txn per :data:`CLAIM_TXN_TASKS` of them,
        in flight together; what a refused txn's failure branch read re-judges its tasks for
        the next round (at most three rounds, as a lone claim always had)."""
        claimed: list[Task] = []
        error: MetaforaError | None = None
        for _round in range(len(_ROUND_TXN_TASKS)):
            items = [(t, k) for t, k in items if self._claimable(t.id, k)]
            if not items:
                break
            chunks = _chunks([(t, k) for t, k in items if _group(k) is None], _round)
            requests = [self._claim_request(chunk, lease) for chunk in chunks]
            slots: list[list[bytes] | None] = [None] * len(chunks)  # None: no group
            skipped: list[tuple[Task, Known]] = []  # not tried: their group's view is full
            try:
                skipped = self._grouped_requests(
                    [(t, k) for t, k in items if _group(k) is not None], lease, chunks, requests,
                    slots)
            except MetaforaError as exc:  # the groups' limits could not be read: not now
                error = exc
            if not requests:
                break
            answers = self._driver.txns(requests, repeatable=True)
            items = []
            refused: set[str] = set()  # groups a claim was refused in: read again, try again
            for chunk, answer, taken in zip(chunks, answers, slots, strict=True):
                if taken is not None:  # a claim of a limited group's task: one a txn
                    won, again = self._grouped_answer(chunk[0], answer, taken, lease)
                    claimed += won
                    if not won:
                        refused.add(_group(chunk[0][1]) or "")
                        items += again
                    continue
                if isinstance(answer, LeaseNotFound):
                    self._lease.fence("etcd refused a claim: lease not found")
                    return claimed
                if isinstance(answer, MetaforaError):
                    error = answer
                    continue
                if answer.succeeded:
                    for task, known in chunk:
                        got = self._took(known.task(task.id, answer.revision), lease)
                        if got is not None:
                            claimed.append(got)
                    continue
                for n, (task, _known) in enumerate(chunk):
                    props_kvs, state_kvs, owner_kvs, running_kvs = answer.ranges[4 * n:4 * n + 4]
                    if owner_kvs:
                        owner = owner_kvs[0]
                        if (
                            answer.retried
                            and owner.value == self._state.node_bytes
                            and owner.lease == lease
                            and props_kvs
                            and not self._state.holds_claim(task.id)
                        ):
                            # Ours but not known: the lost first attempt of this txn was
                            # applied. The owner key is on this node's lease, so no one else
                            # could have taken it meanwhile.
                            stored = props_of(props_kvs[0], task.id)
                            got = self._took(stored.task(task.id, owner.create_revision), lease)
                            if got is not None:
                                claimed.append(got)
                        continue
                    if state_kvs or not props_kvs:
                        continue
                    # Resubmitted, or its previous claim ended, since we read it: judge again.
                    rec = TaskRecord(props=props_kvs[0],
                                     running=running_kvs[0] if running_kvs else None)
                    items.append((task, Entry.from_record(task.id, rec).known()))
            items += [(t, k) for t, k in skipped if _group(k) in refused]
        if error is not None:
            if not claimed:
                raise error
            log.warning("node %s: some claims failed (%s); their tasks are offered again at the "
                        "next re-list", self._state.node_id, error, extra=self._state.extra)
        return claimed

    def _grouped_requests(self, grouped: list[tuple[Task, Known]], lease: int,
                          chunks: list[list[tuple[Task, Known]]], requests: list[TxnRequest],
                          slots: list[list[bytes] | None]) -> list[tuple[Task, Known]]:
        """One txn per task of a group (appended to ``chunks``/``requests``/``slots``): its
        claim plus the compares and puts of a free slot of its group (see limits.py). A task
        whose group the view shows full is not tried: those are returned."""
        skipped: list[tuple[Task, Known]] = []
        if not grouped:
            return skipped
        views = self._limits.views(g for _, k in grouped if (g := _group(k)) is not None)
        tried: dict[str, int] = {}
        for task, known in grouped:
            group = _group(known)
            assert group is not None
            nth = tried[group] = tried.get(group, -1) + 1
            ops = self._limits.claim_ops(known.task(task.id), views[group], lease, nth)
            if ops is None:
                skipped.append((task, known))
                continue
            compares, puts, taken = ops
            base = self._claim_request([(task, known)], lease)
            chunks.append([(task, known)])
            requests.append(([*base[0], *compares], [*base[1], *puts], base[2]))
            slots.append(taken)
        return skipped

    def _grouped_answer(self, item: tuple[Task, Known], answer: TxnResult | MetaforaError,
                        taken: list[bytes], lease: int
                        ) -> tuple[list[Task], list[tuple[Task, Known]]]:
        """The claim a grouped txn made; else nothing, and the task to try again when its own
        keys (read by the failure branch) say it is still free -- the refusal was its group's
        (its view is dropped, so the next round reads it again)."""
        task, known = item
        group = _group(known)
        assert group is not None
        if isinstance(answer, LeaseNotFound):
            self._lease.fence("etcd refused a claim: lease not found")
            return [], []
        if isinstance(answer, MetaforaError) or not answer.succeeded:
            self._limits.drop(group)
            if isinstance(answer, MetaforaError):
                return [], []
            props_kvs, state_kvs, owner_kvs, running_kvs = answer.ranges[:4]
            if owner_kvs or state_kvs or not props_kvs:
                return [], []
            rec = TaskRecord(props=props_kvs[0], running=running_kvs[0] if running_kvs else None)
            return [], [(task, Entry.from_record(task.id, rec).known())]
        made = known.task(task.id, answer.revision)
        self._limits.took(made, taken)
        got = self._took(made, lease)
        if got is None:
            self._limits.free_lost([made])
            return [], []
        return [got], []

    def _claim_request(self, chunk: list[tuple[Task, Known]], lease: int) -> TxnRequest:
        """The txn claiming every task of ``chunk``; its failure branch reads them back."""
        compares: list[Compare] = []
        puts: list[Op] = []
        reads: list[Op] = []
        record = self._claim_record()  # one clock read and encoding per txn, not per task
        for task, known in chunk:
            c, p = self._claim_ops(task.id, known, lease, record)
            compares += c
            puts += p
            tk = self._keys.task(task.id)
            reads += [Range(tk.props), Range(tk.state), Range(tk.owner), Range(tk.running)]
        return compares, puts, reads

    def _claim_record(self) -> bytes:
        """The claim key's value for claims made now."""
        return encode_json({"node": self._state.node_id, "claimed_at": iso(self._clock.now())})

    def _claim_ops(self, task_id: str, known: Known, lease: int,
                   record: bytes) -> tuple[list[Compare], list[Put]]:
        """The compares and puts of one claim: free, unfinished, as judged, and this node's."""
        tk = self._keys.task(task_id)
        compares = [
            absent(tk.owner),
            absent(tk.state),
            modified_at(tk.props, known.props_mod),
            modified_at(tk.running, known.running_mod),
        ]
        # A task held for this node: modified_at(running) above is the hold's revision, and
        # the put of the running key below ends the hold (it detaches it from the hold lease).
        puts = [
            Put(tk.owner, self._state.node_bytes, lease),
            Put(tk.claim, record),
            Put(tk.running, _running_record(known.crashes())),
        ]
        return compares, puts

    def _claimable(self, task_id: str, known: Known) -> bool:
        """Whether to try the claim; fails or expires a task that can never run."""
        try:
            if known.damage is not None:
                raise InvalidProps(known.damage)
            if not known.valid:  # checked when offered, unless read since
                Task(task_id, known.props)
        except InvalidProps as exc:
            # Written by hand or by something else than metafora: it can never run.
            self._fail_unclaimed(task_id, known.props_mod, f"invalid props: {exc}")
            return False
        if not matches(known.selector, self._state.labels):
            return False  # placement: this node's labels do not match the task's selector
        if known.held_for is not None and known.held_for != self._state.node_id:
            return False  # held for its node (holds.py): the claim's running compare fences it
        limit = self._state.ctx.max_crashes if self._state.ctx is not None else None
        verdict = crash_limit_error(known.crashes(), limit)
        if verdict is not None:
            self._fail_unclaimed(task_id, known.props_mod, verdict)
            return False
        now = self._clock.now()
        launch, expires = launch_and_expiry(known.props)
        if expires is not None and expires <= now:
            self.expire(task_id, known.props_mod)
            return False
        return launch is None or launch <= now

    def _took(self, claimed: Task, lease: int) -> Task | None:
        """Record a successful claim, unless it is already gone."""
        with self._state.lock:
            entry = self._cache.entries.get(claimed.id)
            gone = self._cache.revision >= claimed.token and (
                entry is None or entry.owner_rev != claimed.token
            )
            if self._state.lease_id != lease or self._state.closed or gone:
                # Fenced or closed meanwhile, or the watch has already seen the owner key go
                # (deleted right after the claim): the claim is not ours to run.
                return None
            self._state.held[claimed.id] = Held(claimed)
        log.debug("node %s claimed %s (token %d)", self._state.node_id, claimed.id, claimed.token,
                  extra={"node": self._state.node_id, "task": claimed.id})
        return claimed

    def _fail_unclaimed(self, task_id: str, props_mod: int, error: str) -> None:
        extra = {"node": self._state.node_id, "task": task_id}
        try:
            if fail_unclaimed(self._driver, self._keys, task_id, props_mod, self._clock.now(), error):
                log.error("task %s cannot run; marked it failed: %s", task_id, error, extra=extra)
        except MetaforaError as err:
            log.warning("could not mark task %s failed (%s): %s", task_id, error, err, extra=extra)

    def expire(self, task_id: str, props_mod: int) -> None:
        """Move a pending task past its ``expires_at`` (at props revision ``props_mod``) to
        expired; best effort (a change meanwhile wins)."""
        try:
            if expire_task(self._driver, self._keys, task_id, props_mod, self._clock.now()):
                log.info("task %s expired", task_id, extra={"node": self._state.node_id, "task": task_id})
        except MetaforaError as exc:
            log.debug("could not expire task %s: %s", task_id, exc,
                      extra={"node": self._state.node_id, "task": task_id})

    def holds(self, task: Task) -> bool:
        """Whether this node holds ``task``'s claim and its lease is short of the fence."""
        with self._state.lock:
            mine = self._state.held.get(task.id)
            live = self._state.lease_id is not None and (
                self._clock.monotonic() < self._state.renewed_at + self._lease.fence_after
            )
        return live and mine is not None and mine.task.token == task.token

    def lease_time_left(self) -> float:
        """Seconds to this node's fencing deadline while it has a lease (else 0)."""
        with self._state.lease_lock:  # the at-risk watch asks: not behind work on every task
            if self._state.lease_id is None:
                return 0.0
            return max(0.0, self._state.renewed_at + self._lease.fence_after - self._clock.monotonic())

    def claim_time_left(self, task: Task) -> float | None:
        """Seconds to the fencing deadline while this node holds ``task`` (else 0)."""
        with self._state.lock:
            mine = self._state.held.get(task.id)
            if self._state.lease_id is None or mine is None or mine.task.token != task.token:
                return 0.0
            return max(0.0, self._state.renewed_at + self._lease.fence_after - self._clock.monotonic())

    def held(self) -> list[Task]:
        """The claims this node holds now (as it believes)."""
        with self._state.lock:
            return [h.task for h in self._state.held.values()]


def _group(known: Known) -> str | None:
    """The group of a task as stored (what its claim must mind), None for none."""
    return known.stored.group if known.stored is not None else None


@functools.lru_cache(maxsize=64)
def _running_record(crashes: int) -> bytes:
    """The running key's value (a handful of distinct values: encoded once each)."""
    return encode_json({"crashes": crashes})


