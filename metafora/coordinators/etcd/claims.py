"""Claims: judging offers against the watch cache, multi-op claim txns, outcomes.

One claim batch is one round trip: up to :data:`_BATCH` tasks per txn, all txns in flight
together; a refused txn's failure branch reads its tasks back to re-judge them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from metafora.coordinator import Finish, Outcome, crash_limit_error, error_text
from metafora.coordinators.etcd.cache import Entry, Known
from metafora.coordinators.etcd.driver import (
    Compare,
    LeaseNotFound,
    Op,
    Put,
    Range,
    TxnRequest,
    absent,
    modified_at,
)
from metafora.coordinators.etcd.layout import TaskRecord, encode_json, gather, iso, props_of
from metafora.coordinators.etcd.node import Held, NodeBase
from metafora.coordinators.etcd.queries import expire_task, fail_unclaimed, launch_and_expiry
from metafora.errors import CoordinatorClosed, CoordinatorUnavailable, InvalidProps, MetaforaError
from metafora.task import Task, matches

__all__ = ["ClaimsMixin"]

log = logging.getLogger(__name__)

_BATCH = 32
"""Tasks per claim txn: 4 compares, 3 puts and 4 failure reads each, within etcd's default
limit of 128 operations per txn branch."""


class ClaimsMixin(NodeBase):
    """Claiming tasks and writing their outcomes, fenced by owner key and token."""

    claim_burst = _BATCH
    """Offers the consumer hands to one :meth:`claim_many` (one txn).

    256 (8 txns in flight) kept the txns fuller when most offers of a storm were stale, but
    did not pay: the 10,000-task / 4-node storm took 32.5 s against 5.1 s with 32, and the
    100,000 / 10 one on 3 members 120.5 s against 113.4 s.
    """

    def seen_taken(self, task: Task) -> bool:
        # The watch cache saw an owner or a finish. If that view is stale, the release or
        # resubmission that follows reaches the cache and re-offers the task.
        with self._lock:
            entry = self._cache.get(task.id)
            return entry is not None and (entry.owner is not None or entry.finished)

    def claim(self, task: Task) -> Task | None:
        self._require_init()
        with self._lock:
            lease = self._lease_id
            entry = self._cache.get(task.id)
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
        """Claim offers in multi-op txns (up to :data:`_BATCH` tasks each, all in flight at
        once); a txn refused because one of its tasks was taken meanwhile tells, in the same
        round trip, which ones to try again."""
        self._require_init()
        with self._lock:
            lease = self._lease_id
            batch: list[tuple[Task, Known]] = []
            single: list[Task] = []
            seen: set[str] = set()
            for task in tasks:
                if task.id in seen:
                    continue  # one claim txn may not write a key twice
                seen.add(task.id)
                entry = self._cache.get(task.id)
                if entry is not None and (entry.owner is not None or entry.finished):
                    continue  # seen taken: no round trip for a stale offer
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
        """Claim ``items`` as judged by their ``Known``: one txn per :data:`_BATCH` of them,
        in flight together; what a refused txn's failure branch read re-judges its tasks for
        the next round (at most three rounds, as a lone claim always had)."""
        claimed: list[Task] = []
        error: MetaforaError | None = None
        for _round in range(3):
            items = [(t, k) for t, k in items if self._claimable(t.id, k)]
            if not items:
                break
            chunks = [items[i:i + _BATCH] for i in range(0, len(items), _BATCH)]
            requests = [self._claim_request(chunk, lease) for chunk in chunks]
            answers = self._driver.txns(requests, repeatable=True)
            items = []
            for chunk, answer in zip(chunks, answers, strict=True):
                if isinstance(answer, LeaseNotFound):
                    self._fence("etcd refused a claim: lease not found")
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
                            and owner.value == self._node_bytes
                            and owner.lease == lease
                            and props_kvs
                            and not self.holds_claim(task.id)
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
        if error is not None:
            if not claimed:
                raise error
            log.warning("node %s: some claims failed (%s); their tasks are offered again at the "
                        "next re-list", self._node_id, error, extra=self._extra)
        return claimed

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
        return encode_json({"node": self._node_id, "claimed_at": iso(self._clock.now())})

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
        puts = [
            Put(tk.owner, self._node_bytes, lease),
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
        if not matches(known.selector, self._labels):
            return False  # placement: this node's labels do not match the task's selector
        limit = self._ctx.max_crashes if self._ctx is not None else None
        verdict = crash_limit_error(known.crashes(), limit)
        if verdict is not None:
            self._fail_unclaimed(task_id, known.props_mod, verdict)
            return False
        now = self._clock.now()
        launch, expires = launch_and_expiry(known.props)
        if expires is not None and expires <= now:
            self._expire(task_id, known.props_mod)
            return False
        return launch is None or launch <= now

    def _took(self, claimed: Task, lease: int) -> Task | None:
        """Record a successful claim, unless it is already gone."""
        with self._lock:
            entry = self._cache.get(claimed.id)
            gone = self._cache_rev >= claimed.token and (
                entry is None or entry.owner_rev != claimed.token
            )
            if self._lease_id != lease or self._closed or gone:
                # Fenced or closed meanwhile, or the watch has already seen the owner key go
                # (deleted right after the claim): the claim is not ours to run.
                return None
            self._held[claimed.id] = Held(claimed)
        log.debug("node %s claimed %s (token %d)", self._node_id, claimed.id, claimed.token,
                  extra={"node": self._node_id, "task": claimed.id})
        return claimed

    def _fail_unclaimed(self, task_id: str, props_mod: int, error: str) -> None:
        extra = {"node": self._node_id, "task": task_id}
        try:
            if fail_unclaimed(self._driver, self._keys, task_id, props_mod, self._clock.now(), error):
                log.error("task %s cannot run; marked it failed: %s", task_id, error, extra=extra)
        except MetaforaError as err:
            log.warning("could not mark task %s failed (%s): %s", task_id, error, err, extra=extra)

    def _expire(self, task_id: str, props_mod: int) -> None:
        try:
            if expire_task(self._driver, self._keys, task_id, props_mod, self._clock.now()):
                log.info("task %s expired", task_id, extra={"node": self._node_id, "task": task_id})
        except MetaforaError as exc:
            log.debug("could not expire task %s: %s", task_id, exc,
                      extra={"node": self._node_id, "task": task_id})

    def release(self, task: Task) -> None:
        self._finish_one(Finish(task, Outcome.RELEASE))

    def done(self, task: Task) -> None:
        self._finish_one(Finish(task, Outcome.DONE))

    def fail(self, task: Task, error: BaseException | str) -> None:
        self._finish_one(Finish(task, Outcome.FAIL, error_text(error)))

    def _finish_one(self, finish: Finish) -> None:
        """One fenced outcome, group-committed with those other threads write meanwhile."""
        self._check_open()
        self._finishing([finish])
        error = self._commit.submit(finish)
        self._finished([finish], [error])
        if error is not None:
            raise error

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Record many outcomes in multi-op txns (up to 42 outcomes each, several in flight),
        each fenced by its own claim's owner key and token exactly as a single write is."""
        self._check_open()
        finishes = list(finishes)
        if not finishes:
            return []
        self._finishing(finishes)
        results = self._outcomes.write(finishes)
        self._finished(finishes, results)
        if all(isinstance(r, CoordinatorUnavailable | CoordinatorClosed) for r in results):
            # Nothing written: the caller retries the batch (an outcome whose lost first
            # answer was applied is then refused as ClaimLost, as a single write is).
            error = results[0]
            assert error is not None
            raise error
        return results

    def _finishing(self, finishes: list[Finish]) -> None:
        """Mark the claims whose outcome is being written (their owner key's delete is not a
        lost claim)."""
        with self._lock:
            for finish in finishes:
                held = self._held.get(finish.task.id)
                if held is not None and held.task.token == finish.task.token:
                    held.finishing = True

    def _finished(self, finishes: list[Finish], results: list[MetaforaError | None]) -> None:
        """Forget the claims whose outcome was written, or refused (kept while etcd could not
        be reached: the caller retries)."""
        with self._lock:
            for finish, error in zip(finishes, results, strict=True):
                if isinstance(error, CoordinatorUnavailable | CoordinatorClosed):
                    continue
                held = self._held.get(finish.task.id)
                if held is not None and held.task.token == finish.task.token:
                    del self._held[finish.task.id]
        for finish, error in zip(finishes, results, strict=True):
            if error is None:
                task = finish.task
                log.debug("node %s: %s %s (token %d)", self._node_id, finish.outcome.value,
                          task.id, task.token, extra={"node": self._node_id, "task": task.id})

    def holds(self, task: Task) -> bool:
        with self._lock:
            mine = self._held.get(task.id)
            live = self._lease_id is not None and (
                self._clock.monotonic() < self._renewed_at + self._fence_after
            )
        return live and mine is not None and mine.task.token == task.token

    def claim_time_left(self, task: Task) -> float | None:
        with self._lock:
            mine = self._held.get(task.id)
            if self._lease_id is None or mine is None or mine.task.token != task.token:
                return 0.0
            return max(0.0, self._renewed_at + self._fence_after - self._clock.monotonic())

    def held(self) -> list[Task]:
        """The claims this node holds now (as it believes)."""
        with self._lock:
            return [h.task for h in self._held.values()]


@functools.lru_cache(maxsize=64)
def _running_record(crashes: int) -> bytes:
    """The running key's value (a handful of distinct values: encoded once each)."""
    return encode_json({"crashes": crashes})


