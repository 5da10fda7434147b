"""Limits per task group on etcd: numbered slot keys taken in the claim's own txn.

A group with ``max N`` has slots ``slots/<group>/0`` .. ``N-1``. A claim of one of its tasks
names a slot it believes free and adds to its txn: the slot key is absent, the limit key is
at the revision the claimer read, and a put of the slot key **on the claimer's lease**. So
two claims can never hold one slot, at most N claims hold slots, a dead node's slots vanish
with its lease, and an outcome (release, done, fail) deletes its slot in the outcome's txn.
A rate limit ``count/window`` works the same way with ``rates/<group>/0`` .. ``count-1``, put
on a **rate lease** whose TTL outlives the window: a rate slot is free again only after its
lease ran out, at least ``window`` after the claim that took it. etcd grants no lease shorter
than its minimum TTL (a few seconds with default election settings), so short windows are
enforced as if they were that long: the limit holds, more strictly than asked.

The claimer reads the limits and slots of a claim batch's groups in one range txn before
the claim txns (a second round trip, for batches with a limited group only); that a group
has no limit is trusted for :data:`VIEW_FRESH` seconds and costs one compare (the limit key
is absent).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import Keys, decode_json, encode_json, escape, unescape
from metafora.coordinators.etcd.ops import (
    Compare,
    Delete,
    KeyValue,
    Op,
    Put,
    Range,
    absent,
    modified_at,
    value_is,
)
from metafora.core.clock import Clock
from metafora.core.errors import LimitNotFound, MetaforaError
from metafora.core.limits import GroupUsage, Limit, Rate
from metafora.core.task import Task

__all__ = ["EXTRA_TRIES", "VIEW_FRESH", "GroupLimits", "GroupView", "delete_limit", "group_usage",
           "put_limit"]

log = logging.getLogger(__name__)

VIEW_FRESH = 0.25
"""Seconds a claimer trusts its read that a group has no limit (a compare checks it)."""
EXTRA_TRIES = 3
"""Claims of one group per batch beyond its free slots, racing for them (see claim_ops)."""


def limit_key(keys: Keys, group: str) -> bytes:
    """The key of a group's limit."""
    return keys.limits + escape(group).encode()


def slot_prefix(keys: Keys, group: str) -> bytes:
    """The prefix of a group's concurrency slots."""
    return keys.slots + escape(group).encode() + b"/"


def rate_prefix(keys: Keys, group: str) -> bytes:
    """The prefix of a group's rate slots."""
    return keys.rates + escape(group).encode() + b"/"


def decode_limit(group: str, kv: KeyValue) -> Limit | None:
    """The limit a limit key holds (None when damaged: then no limit, logged)."""
    data = decode_json(kv.value) or {}
    try:
        rate = data.get("rate")
        return Limit(group, data.get("max"), None if rate is None else Rate(int(rate[0]), int(rate[1])))
    except (TypeError, ValueError, IndexError) as exc:
        log.warning("damaged limit of group %s ignored: %s", group, exc)
        return None


def _indexes(kvs: list[KeyValue], prefix: bytes) -> set[int]:
    taken = set()
    for kv in kvs:
        tail = kv.key[len(prefix):]
        if tail.isdigit():
            taken.add(int(tail))
    return taken


@dataclass
class GroupView:
    """What a claimer knows of one group: its limit (and the limit key's revision, 0 when
    absent) and which slots are taken."""

    limit: Limit | None
    limit_rev: int
    slots: set[int] = field(default_factory=set)
    rates: set[int] = field(default_factory=set)
    read_at: float = 0.0


def _pick(free: list[int], nth: int) -> int | None:
    """The slot the ``nth`` claim of a batch takes (see :meth:`GroupLimits.claim_ops`)."""
    if not free or nth >= len(free) + EXTRA_TRIES:
        return None
    return free[nth % len(free)]


class GroupLimits:
    """The limit side of one node's claims: group views, slot ops, the rate lease."""

    def __init__(self, driver: EtcdDriver, keys: Keys, clock: Clock) -> None:
        self._driver = driver
        self._keys = keys
        self._clock = clock
        self._lock = threading.Lock()
        self._views: dict[str, GroupView] = {}
        self._rate_lease: dict[int, tuple[int, float]] = {}  # window -> (lease id, usable until)
        self.slots: dict[tuple[str, int], list[bytes]] = {}  # (task id, token) -> its slot keys

    def views(self, groups: Iterable[str]) -> dict[str, GroupView]:
        """A fresh enough view of each group (one range txn for all the stale ones)."""
        groups = set(groups)
        now = self._clock.monotonic()
        with self._lock:
            # Only "no limit" is trusted for a while (a compare checks it); a limited group's
            # slots are read for every claim batch, so a refusal comes from the store, not
            # from an old read.
            found = {g: v for g in groups if (v := self._views.get(g)) is not None
                     and v.limit is None and now - v.read_at < VIEW_FRESH}
        stale = sorted(groups - set(found))
        if stale:
            reads: list[Op] = []
            for group in stale:
                reads += [Range(limit_key(self._keys, group)),
                          Range(slot_prefix(self._keys, group), prefix=True),
                          Range(rate_prefix(self._keys, group), prefix=True)]
            answer = self._driver.txn([], reads, repeatable=True)
            with self._lock:
                for n, group in enumerate(stale):
                    lim, slots, rates = answer.ranges[3 * n:3 * n + 3]
                    limit = decode_limit(group, lim[0]) if lim else None
                    view = GroupView(limit, lim[0].mod_revision if lim else 0,
                                     _indexes(slots, slot_prefix(self._keys, group)),
                                     _indexes(rates, rate_prefix(self._keys, group)), now)
                    self._views[group] = found[group] = view
        return found

    def drop(self, group: str) -> None:
        """Forget the view of ``group`` (a claim was refused: read it again next time)."""
        with self._lock:
            self._views.pop(group, None)

    def claim_ops(self, task: Task, view: GroupView, lease: int,
                  nth: int) -> tuple[list[Compare], list[Put], list[bytes]] | None:
        """The compares and puts a claim of ``task`` adds, and the slot keys it takes; None
        when the view says the group is full.

        ``nth``: how many claims of the group this batch tried before. The ``nth`` takes the
        ``nth`` free slot; past the free ones, up to :data:`EXTRA_TRIES` more race for them
        again (only one claim can take a slot): an offer the claimer's view wrongly thinks
        free (taken or finished meanwhile) then does not cost the batch its slot.
        """
        group = task.group
        assert group is not None
        key = limit_key(self._keys, group)
        limit = view.limit
        if limit is None:
            return [absent(key)], [], []
        compares = [modified_at(key, view.limit_rev)]
        puts: list[Put] = []
        taken: list[bytes] = []
        value = task.id.encode()
        if limit.max is not None:
            free = _pick([i for i in range(limit.max) if i not in view.slots], nth)
            if free is None:
                return None
            slot = slot_prefix(self._keys, group) + str(free).encode()
            compares.append(absent(slot))
            puts.append(Put(slot, value, lease))
            taken.append(slot)
        if limit.rate is not None:
            free = _pick([j for j in range(limit.rate.count) if j not in view.rates], nth)
            if free is None:
                return None
            rate_lease = self._lease_for(limit.rate.window)
            slot = rate_prefix(self._keys, group) + str(free).encode()
            compares.append(absent(slot))
            puts.append(Put(slot, value, rate_lease))
        return compares, puts, taken

    def _lease_for(self, window: int) -> int:
        """A lease that outlives ``window`` seconds from now (granted anew every second or so)."""
        now = self._clock.monotonic()
        with self._lock:
            held = self._rate_lease.get(window)
            if held is not None and now < held[1]:
                return held[0]
        lease, ttl = self._driver.grant(window + 2)
        # Usable while a put now + window still ends before the lease does (a second of slack
        # for the grant's own round trip).
        usable = now + max(0.0, ttl - window - 1.0)
        with self._lock:
            self._rate_lease[window] = (lease, usable)
        return lease

    def held_slots(self, task: Task) -> list[bytes]:
        """The slot keys the claim ``task`` holds (forgotten by this call)."""
        with self._lock:
            return self.slots.pop((task.id, task.token), [])

    def took(self, task: Task, slots: list[bytes]) -> None:
        """Remember the slot keys of a claim made."""
        if slots:
            with self._lock:
                self.slots[(task.id, task.token)] = slots

    def free_lost_later(self, tasks: list[Task]) -> None:
        """:meth:`free_lost` on a thread of its own (the caller must not wait on etcd)."""
        if not any(self.slots.get((t.id, t.token)) for t in tasks):
            return
        threading.Thread(target=self.free_lost, args=(list(tasks),), daemon=True,
                         name="metafora-etcd-free-slots").start()

    def peek_slots(self, task: Task) -> list[bytes]:
        """The slot keys the claim ``task`` holds (kept)."""
        with self._lock:
            return list(self.slots.get((task.id, task.token), ()))

    def free_lost(self, tasks: Iterable[Task]) -> None:
        """Delete the slots of claims this node lost (a task deleted under it): they are on the
        node's lease and would otherwise be held until the lease ends. Best effort."""
        for task in tasks:
            for slot in self.held_slots(task):
                try:
                    self._driver.txn([value_is(slot, task.id.encode())], [Delete(slot)])
                except MetaforaError as exc:
                    log.warning("could not free slot %r of lost task %s: %s", slot, task.id, exc)


# -- the client ---------------------------------------------------------------------------

def put_limit(driver: EtcdDriver, keys: Keys, limit: Limit) -> None:
    """Set ``limit`` (its slots above a lowered max stay until their claims end)."""
    record: dict[str, object] = {}
    if limit.max is not None:
        record["max"] = limit.max
    if limit.rate is not None:
        record["rate"] = [limit.rate.count, limit.rate.window]
    driver.txn([], [Put(limit_key(keys, limit.group), encode_json(record))])


def delete_limit(driver: EtcdDriver, keys: Keys, group: str) -> None:
    """Delete a group's limit. Raises LimitNotFound."""
    key = limit_key(keys, group)
    answer = driver.txn([absent(key)], [], [Delete(key)])
    if answer.succeeded:
        raise LimitNotFound(f"no limit is set on group {group!r}")


def group_usage(driver: EtcdDriver, keys: Keys) -> dict[str, GroupUsage]:
    """Every limit, with its held slots and live rate slots (one range txn)."""
    answer = driver.txn([], [Range(keys.limits, prefix=True), Range(keys.slots, prefix=True),
                             Range(keys.rates, prefix=True)])
    limits_kvs, slot_kvs, rate_kvs = answer.ranges

    def per_group(kvs: list[KeyValue], root: bytes) -> dict[str, int]:
        counts: dict[str, int] = {}
        for kv in kvs:
            segment = kv.key[len(root):].split(b"/", 1)[0].decode(errors="replace")
            counts[unescape(segment)] = counts.get(unescape(segment), 0) + 1
        return counts

    running, recent = per_group(slot_kvs, keys.slots), per_group(rate_kvs, keys.rates)
    usage = {}
    for kv in limits_kvs:
        group = unescape(kv.key[len(keys.limits):].decode(errors="replace"))
        limit = decode_limit(group, kv)
        if limit is not None:
            usage[group] = GroupUsage(limit, running.get(group, 0), recent.get(group, 0))
    return usage


