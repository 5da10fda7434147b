"""Outcomes (done, release, fail) written many per etcd txn, each fenced by its own claim.

One outcome is the txn the coordinator always wrote (compares: the owner key holds this
node's id and was created at the claim's token; success: the state record if any, delete
the owner and running keys; failure: read the state, claim and owner keys). Many outcomes
are those ops side by side in one txn, up to :data:`ITEMS_PER_TXN` (etcd's default
``--max-txn-ops`` is 128 per branch) and :data:`TXN_BYTES`, and the txns of one batch are
in flight together (:meth:`~metafora.coordinators.etcd.driver.EtcdDriver.txns`): :class:`EtcdOutcomeBatcher`.

A txn is all or nothing: when one of its claims is stale, nothing is written, and the
failure branch tells which claims still hold (their owner key is as fenced), so those are
written again without the stale ones; a stale one whose txn was retried after a lost answer
is judged by what the lost attempt left (:func:`applied_before`), as a single write is.

:class:`~metafora.core.groupcommit.GroupCommit` lets threads that each record one outcome (the
consumer's handler threads calling ``done``) share those txns: the first caller writes at
once; callers that arrive while a write is in flight are written together by the next one.
:class:`ClaimOutcomes` is the coordinator's part that does both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metafora.contracts.coordinator import Finish, Outcome, error_text
from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import Keys, decode_json, encode_json, iso
from metafora.coordinators.etcd.limits import GroupLimits
from metafora.coordinators.etcd.node import NodeState
from metafora.coordinators.etcd.ops import (
    Compare,
    Delete,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    Range,
    TxnRequest,
    TxnResult,
    created_at,
    value_is,
)
from metafora.core.clock import Clock
from metafora.core.errors import (
    ClaimLost,
    CoordinatorClosed,
    CoordinatorUnavailable,
    MetaforaError,
    RequestTooLarge,
    StoreError,
)
from metafora.core.groupcommit import GroupCommit
from metafora.core.task import Task

__all__ = [
    "COMMIT_BATCH",
    "ITEMS_PER_TXN",
    "TXN_BYTES",
    "ClaimOutcomes",
    "EtcdOutcomeBatcher",
    "applied_before",
]

log = logging.getLogger(__name__)

ITEMS_PER_TXN = 42
"""Outcomes per txn: 2 compares, up to 3 writes and 3 reads each, within 128 ops a branch."""

TXN_BYTES = 512 * 1024
"""About how many bytes of keys and values one txn may carry (etcd refuses 1.5 MiB)."""

COMMIT_BATCH = 4 * ITEMS_PER_TXN
"""Outcomes of concurrent done/release/fail calls written together at most (4 txns in flight)."""

_STATE = {Outcome.DONE: "done", Outcome.FAIL: "failed", Outcome.RELEASE: "release"}



def applied_before(finish: Finish, ranges: Sequence[list[KeyValue]]) -> bool:
    """After a retried txn failed: did the lost first attempt record ``finish``?

    ``ranges`` are the state, claim and owner reads of the failure branch.
    """
    state_kvs, claim_kvs, owner_kvs = ranges
    task = finish.task
    if finish.outcome is Outcome.RELEASE:
        return (
            not owner_kvs
            and not state_kvs
            and bool(claim_kvs)
            and claim_kvs[0].mod_revision == task.token
        )
    if not state_kvs:
        return False
    data = decode_json(state_kvs[0].value) or {}
    return data.get("state") == _STATE[finish.outcome] and data.get("token") == task.token


@dataclass
class _Item:
    """One outcome being written: its ops and, once known, its result."""

    index: int
    finish: Finish
    compares: list[Compare]
    writes: list[Op]
    reads: list[Op]
    size: int


class EtcdOutcomeBatcher:
    """Writes outcomes of this node's claims, many per etcd txn (several txns in flight), each
    fenced by its claim's owner key and token."""

    def __init__(self, driver: EtcdDriver, keys: Keys, node_id: str, clock: Clock,
                 slots_of: Callable[[Task], list[bytes]] = lambda task: []) -> None:
        self._slots_of = slots_of
        self._driver = driver
        self._keys = keys
        self._node_bytes = node_id.encode()
        self._clock = clock
        # (running key's value, hold lease): releases hold their task for this node (holds.py).
        self.hold: tuple[bytes, int] | None = None

    def _item(self, index: int, finish: Finish) -> _Item:
        task = finish.task
        tk = self._keys.task(task.id)
        writes: list[Op] = []
        size = 3 * len(tk.owner) + len(self._node_bytes)
        if finish.outcome is not Outcome.RELEASE:
            record = {"state": _STATE[finish.outcome], "finished_at": iso(self._clock.now()),
                      "token": task.token}
            if finish.outcome is Outcome.FAIL:
                record["error"] = finish.error or "failed"
            value = encode_json(record)
            writes.append(Put(tk.state, value))
            size += len(tk.state) + len(value)
        hold = self.hold if finish.outcome is Outcome.RELEASE else None
        # An outcome: no crash (a held release's running key says so, see holds.py).
        writes += [Delete(tk.owner),
                   Delete(tk.running) if hold is None else Put(tk.running, hold[0], hold[1])]
        writes += [Delete(slot) for slot in self._slots_of(task)]  # its group's slot is free
        return _Item(
            index,
            finish,
            [value_is(tk.owner, self._node_bytes), created_at(tk.owner, task.token)],
            writes,
            [Range(tk.state), Range(tk.claim), Range(tk.owner)],
            size,
        )

    def write(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Record ``finishes``; result ``i`` is None when ``finishes[i]`` was written, else why
        not (``ClaimLost``; ``CoordinatorUnavailable`` when etcd could not be reached). Never
        raises a :class:`~metafora.core.errors.MetaforaError`."""
        results: list[MetaforaError | None] = [None] * len(finishes)
        pending: list[_Item] = []
        seen: set[tuple[str, int]] = set()
        for i, finish in enumerate(finishes):
            claim = (finish.task.id, finish.task.token)
            if claim in seen:  # the same claim twice in one batch: the first outcome counts
                results[i] = ClaimLost(
                    f"node {self._node_bytes.decode()!r} no longer holds task "
                    f"{finish.task.id!r} with token {finish.task.token} (finished earlier in "
                    "this batch)")
                continue
            seen.add(claim)
            pending.append(self._item(i, finish))
        # Each round writes every pending outcome; a txn refused for a stale claim sends its
        # fresh ones to the next round. Each such round drops at least one stale outcome.
        while pending:
            chunks = _chunks(pending)
            answers = self._driver.txns([_request(c) for c in chunks], repeatable=True)
            pending = []
            for chunk, answer in zip(chunks, answers, strict=True):
                if isinstance(answer, RequestTooLarge) and len(chunk) > 1:
                    pending += chunk  # split finer in the next round (one a txn at worst)
                    for item in chunk:
                        item.size = TXN_BYTES
                    continue
                if isinstance(answer, LeaseNotFound) and self._hold_gone(chunk):
                    # The hold lease expired (the window ended while handlers were still
                    # stopping) or was revoked (``nodes drain``): the hold is over, so the
                    # chunk is written again with plain releases, its other outcomes with it.
                    pending += [self._item(item.index, item.finish) for item in chunk]
                    continue
                if isinstance(answer, MetaforaError):
                    for item in chunk:
                        results[item.index] = _copy(answer)
                    continue
                pending += self._sort(chunk, answer, results)
        return results

    def _hold_gone(self, chunk: list[_Item]) -> bool:
        """Whether ``chunk`` carried a held release (on the hold lease etcd no longer has);
        if so, no later release is held (the window is over by etcd's clock)."""
        if self.hold is None or not any(i.finish.outcome is Outcome.RELEASE for i in chunk):
            return False
        log.info("node %s: its hold lease is gone (window over, or drained): releases are "
                 "no longer held", self._node_bytes.decode(), extra={"node": self._node_bytes.decode()})
        self.hold = None
        return True

    def running_keys(self, tasks: Sequence[Task]) -> list[Op]:
        """Writes that clear the running keys of ``tasks`` as a release does: held for this
        node while a hold is on (holds.py), else deleted."""
        hold = self.hold
        if hold is not None:
            return [Put(self._keys.task(t.id).running, hold[0], hold[1]) for t in tasks]
        return [Delete(self._keys.task(t.id).running) for t in tasks]

    def _sort(self, chunk: list[_Item], answer: TxnResult,
              results: list[MetaforaError | None]) -> list[_Item]:
        """Settle the outcomes of one answered txn; the ones to write again."""
        if answer.succeeded:
            return []
        again: list[_Item] = []
        for n, item in enumerate(chunk):
            state_kvs, claim_kvs, owner_kvs = answer.ranges[3 * n:3 * n + 3]
            task = item.finish.task
            owner = owner_kvs[0] if owner_kvs else None
            if (
                owner is not None
                and owner.value == self._node_bytes
                and owner.create_revision == task.token
            ):
                again.append(item)  # still held: refused only for another one's sake
            elif not (answer.retried and applied_before(item.finish,
                                                        [state_kvs, claim_kvs, owner_kvs])):
                results[item.index] = ClaimLost(
                    f"node {self._node_bytes.decode()!r} no longer holds task {task.id!r} "
                    f"with token {task.token}"
                )
        if len(again) == len(chunk):
            # Every claim read as held, yet a compare failed: cannot happen within one txn;
            # report rather than loop.
            for item in again:
                results[item.index] = StoreError(
                    f"etcd refused the outcome of task {item.finish.task.id!r} for no reason "
                    "it could read back"
                )
            return []
        return again


def _chunks(items: list[_Item]) -> list[list[_Item]]:
    """Txns of at most :data:`ITEMS_PER_TXN` items and about :data:`TXN_BYTES`, never two
    outcomes of one task in a txn (etcd refuses a txn writing a key twice)."""
    chunks: list[list[_Item]] = []
    current: list[_Item] = []
    ids: set[str] = set()
    size = 0
    for item in items:
        task_id = item.finish.task.id
        if current and (len(current) >= ITEMS_PER_TXN or size + item.size > TXN_BYTES
                        or task_id in ids):
            chunks.append(current)
            current, size = [], 0
            ids = set()
        current.append(item)
        ids.add(task_id)
        size += item.size
    if current:
        chunks.append(current)
    return chunks


def _request(chunk: list[_Item]) -> TxnRequest:
    compares: list[Compare] = []
    writes: list[Op] = []
    reads: list[Op] = []
    for item in chunk:
        compares += item.compares
        writes += item.writes
        reads += item.reads
    return compares, writes, reads


def _copy(error: MetaforaError) -> MetaforaError:
    """A separate exception per outcome (each may be raised in its own thread)."""
    if isinstance(error, CoordinatorClosed):
        return CoordinatorClosed(str(error))
    if isinstance(error, CoordinatorUnavailable):
        return CoordinatorUnavailable(str(error))
    if isinstance(error, RequestTooLarge):
        return RequestTooLarge(str(error))
    return StoreError(str(error))


class ClaimOutcomes:
    """done, release and fail of this node's claims: each written by an
    :class:`EtcdOutcomeBatcher`, concurrent single ones group-committed
    (:class:`~metafora.core.groupcommit.GroupCommit`),
    and the claims held (in the shared :class:`~.node.NodeState`) kept in step."""

    def __init__(self, driver: EtcdDriver, keys: Keys, clock: Clock, state: NodeState,
                 limits: GroupLimits) -> None:
        self._state = state
        self._limits = limits
        self._batcher = EtcdOutcomeBatcher(driver, keys, state.node_id, clock, limits.peek_slots)
        self._commit: GroupCommit[Finish, MetaforaError | None] = GroupCommit(
            self._batcher.write, COMMIT_BATCH
        )

    def hold_releases(self, hold: tuple[bytes, int] | None) -> None:
        """Hold the tasks released from now on as ``hold`` says: (the running key's value,
        the hold lease), or None for no hold."""
        self._batcher.hold = hold

    def running_keys(self, tasks: Sequence[Task]) -> list[Op]:
        """Writes that clear the running keys of ``tasks`` as a release does (held or not)."""
        return self._batcher.running_keys(tasks)

    def drop_hold(self) -> bool:
        """The hold lease is gone (etcd said so): hold no release from now on. Whether a hold
        was on (if not, the lease etcd missed was another one)."""
        held, self._batcher.hold = self._batcher.hold is not None, None
        return held

    def release(self, task: Task) -> None:
        """Give the claim back (fenced by owner and token)."""
        self._finish_one(Finish(task, Outcome.RELEASE))

    def done(self, task: Task) -> None:
        """Record the task done (fenced by owner and token)."""
        self._finish_one(Finish(task, Outcome.DONE))

    def fail(self, task: Task, error: BaseException | str) -> None:
        """Record the task failed with ``error`` (fenced by owner and token)."""
        self._finish_one(Finish(task, Outcome.FAIL, error_text(error)))

    def _finish_one(self, finish: Finish) -> None:
        """One fenced outcome, group-committed with those other threads write meanwhile."""
        self._state.check_open()
        self._finishing([finish])
        error = self._commit.submit(finish)
        self._finished([finish], [error])
        if error is not None:
            raise error

    def finish_many(self, finishes: Sequence[Finish]) -> list[MetaforaError | None]:
        """Record many outcomes in multi-op txns (up to 42 outcomes each, several in flight),
        each fenced by its own claim's owner key and token exactly as a single write is."""
        self._state.check_open()
        finishes = list(finishes)
        if not finishes:
            return []
        self._finishing(finishes)
        results = self._batcher.write(finishes)
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
        with self._state.lock:
            for finish in finishes:
                held = self._state.held.get(finish.task.id)
                if held is not None and held.task.token == finish.task.token:
                    held.finishing = True

    def _finished(self, finishes: list[Finish], results: list[MetaforaError | None]) -> None:
        """Forget the claims whose outcome was written, or refused (kept while etcd could not
        be reached: the caller retries)."""
        lost = []
        for finish, error in zip(finishes, results, strict=True):
            if not isinstance(error, CoordinatorUnavailable | CoordinatorClosed):
                if error is None:
                    self._limits.held_slots(finish.task)  # deleted by the outcome's txn
                else:
                    lost.append(finish.task)
        if lost:
            self._limits.free_lost_later(lost)
        with self._state.lock:
            for finish, error in zip(finishes, results, strict=True):
                if isinstance(error, CoordinatorUnavailable | CoordinatorClosed):
                    continue
                held = self._state.held.get(finish.task.id)
                if held is not None and held.task.token == finish.task.token:
                    del self._state.held[finish.task.id]
        for finish, error in zip(finishes, results, strict=True):
            if error is None:
                task = finish.task
                log.debug("node %s: %s %s (token %d)", self._state.node_id, finish.outcome.value,
                          task.id, task.token, extra={"node": self._state.node_id, "task": task.id})
