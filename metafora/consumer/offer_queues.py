"""What waits in a node's offer pipeline (:mod:`metafora.consumer.offers`): offers deferred
for a free slot (:class:`Deferred`), offers ignored until a deadline (:class:`Ignores`), the
moving share of offers lost to other nodes that sizes a claim (:class:`Spares`), the offers
waiting on a limit group (:class:`GroupWaits`), and the order offers go in
(:func:`by_priority`)."""

from __future__ import annotations

import collections
import heapq
from collections.abc import Container, Sequence

from metafora.core.task import Task

__all__ = ["DEFER_AFTER", "DEFER_LOSS", "LOSS_MEMORY", "OVERFETCH", "Deferred", "GroupWaits", "Ignores",
           "Spares", "by_priority"]

# With max_tasks, one claim_many gets up to this many offers per free slot (and a limit of the
# free slots): offers another node took meanwhile are skipped inside the statement instead of
# costing a round trip each. How many it gets follows the share of offers recently lost to
# other nodes (see OfferRouter.extra_offers): uncontended, each spare offer is only taken from
# the waiting ones, judged, and put back.
OVERFETCH = 4
LOSS_MEMORY = 0.8  # weight of the past in the moving share of offers lost to other nodes
# From this moving share lost (after a few claims), a chunk of a long fresh list is put off
# for a moment instead of tried: see OfferRouter.offer.
DEFER_LOSS = 0.5
DEFER_AFTER = 3  # claims noted before the share lost is trusted (it starts at 1.0)


def by_priority(task: Task) -> int:
    """Sort key: higher ``Task.priority`` first."""
    return -task.priority


class Deferred:
    """Offers waiting for a free slot: highest priority first; within one, this node's own
    offers first (those it ranks first for: :mod:`metafora.consumer.first_offer`), then oldest
    first.

    Taking ``n`` costs O(n + priority levels), not a walk of the whole backlog, so a node far
    over ``max_tasks`` does not re-sort it after every finished task. Own offers first: when
    every node is full, each drains its own share and the nodes race only for what is left at
    the tail.
    """

    def __init__(self) -> None:
        # OrderedDict: taking the oldest is O(1) (a dict's front fills with holes as it is
        # taken from, and each walk from the front skips them all). Level: (priority, own).
        self._levels: dict[tuple[int, bool], collections.OrderedDict[str, Task]] = {}
        self._level_of: dict[str, tuple[int, bool]] = {}

    def __len__(self) -> int:
        return len(self._level_of)

    def put(self, task: Task, *, replace: bool = True, own: bool = True) -> None:
        """Defer ``task`` (a newer offer of a deferred id replaces it unless ``replace`` is
        off); ``own``: this node ranks first for it."""
        level = self._level_of.get(task.id)
        if level is not None:
            if not replace:
                return
            del self._levels[level][task.id]
            if not self._levels[level]:
                del self._levels[level]
        level = (task.priority, own)
        self._levels.setdefault(level, collections.OrderedDict())[task.id] = task
        self._level_of[task.id] = level

    def behind_own(self, due: Sequence[Task], running: Container[str]) -> bool:
        """Defer ``due`` (offers that waited their hold for the node ranked first for them) as
        other nodes' behind this node's own waiting offers, if any wait (then True; False:
        none wait, try ``due`` now).

        With a backlog every node is full: the node ranked first for an offer is busy with
        the offers before it, not dead, so the offer is still open when its hold ends. Tried
        then, at each free slot, every node took other nodes' shares ahead of its own (a read
        to check them, a claim, and the first node's claims lost to the races that followed:
        the work of a claim grew with the nodes again). A node whose own offers wait gives
        its free slots to those first, and reaches these after them at the same priority
        (checked a chunk at a time); one with none waiting (idle, or its share done) still
        tries due offers at once, so a dead, frozen or full first node's tasks are taken as
        soon as some node has nothing of its own to do.
        """
        if not any(own for _, own in self._levels):
            return False
        for task in due:
            if task.id not in running:
                self.put(task, replace=False, own=False)
        return True

    def take(self, count: int | None, *, own: bool | None = None) -> list[Task]:
        """Remove and return up to ``count`` (None: all) deferred tasks, in order (``own``
        given: only this node's own offers, or only the others')."""
        taken: list[Task] = []
        for level in sorted(self._levels, reverse=True):
            if own is not None and level[1] != own:
                continue
            tasks = self._levels[level]
            want = len(tasks) if count is None else min(len(tasks), count - len(taken))
            for _ in range(want):
                task_id, task = tasks.popitem(last=False)
                taken.append(task)
                del self._level_of[task_id]
            if not tasks:
                del self._levels[level]
            if count is not None and len(taken) >= count:
                break
        return taken


class Spares:
    """How many offers to try for the free slots: one spare, plus as many as the moving share
    of tried offers recently lost to other nodes says will be lost, up to ``OVERFETCH`` per
    slot (it assumes contention until the first claim tells)."""

    def __init__(self) -> None:
        self.loss = 1.0
        self.noted = 0  # claims noted

    def offers_for(self, slots: int) -> int:
        """Offers to try for ``slots`` free slots."""
        return min(slots * OVERFETCH, slots + 1 + int(slots * OVERFETCH * self.loss))

    def note(self, tasks: list[Task], claimed: list[Task], limit: int) -> None:
        """After a claim: of the offers it tried (all of them, or, when it stopped at
        ``limit``, those up to the last one it won), the share lost."""
        if not tasks:
            return
        if len(claimed) < limit:
            tried = len(tasks)
        else:
            won = {t.id for t in claimed}
            tried = 1 + max(i for i, t in enumerate(tasks) if t.id in won)
        share = max(0.0, (tried - len(claimed)) / tried if tried else 0.0)
        # The first claim replaces the assumption: decayed from 1.0, an uncontended node's
        # share stayed above FRESH_LOSS for its first seven claims, each paying a read of its
        # offers first (most of a 5,000-task cold start's claims, since one node per offer
        # leaves each node its own share of a backlog).
        self.loss = share if not self.noted else LOSS_MEMORY * self.loss + (1 - LOSS_MEMORY) * share
        self.noted += 1

    def contested(self) -> bool:
        """Whether most recent claims were lost to other nodes (after a few claims)."""
        return self.noted >= DEFER_AFTER and self.loss >= DEFER_LOSS


class Ignores:
    """Offers ignored until a deadline (refused by the balancer, released, held back for
    placement): the earliest deadline and the expired ones without a walk of them all (a
    node refusing a storm's offers ignores tens of thousands).
    """

    def __init__(self) -> None:
        self._due: dict[str, tuple[float, Task]] = {}
        self._heap: list[tuple[float, str]] = []  # may hold stale entries: checked on pop

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._due

    def get(self, task_id: str) -> tuple[float, Task] | None:
        """The deadline and newest offer of an ignored task, or None."""
        return self._due.get(task_id)

    def items(self) -> list[tuple[str, tuple[float, Task]]]:
        """Every ignored task: id -> (deadline, newest offer)."""
        return list(self._due.items())

    def put(self, task: Task, due: float) -> None:
        """Ignore ``task`` until ``due`` (a newer deadline replaces an older one)."""
        old = self._due.get(task.id)
        self._due[task.id] = (due, task)
        if old is None or old[0] != due:
            heapq.heappush(self._heap, (due, task.id))
        if len(self._heap) > 2 * len(self._due) + 1024:  # too many stale entries: rebuild
            self._heap = [(d, i) for i, (d, _) in self._due.items()]
            heapq.heapify(self._heap)

    def keep_offer(self, task: Task) -> None:
        """Keep the newest offer of an ignored task (same deadline)."""
        self._due[task.id] = (self._due[task.id][0], task)

    def next_due(self) -> float | None:
        """The earliest deadline, or None when nothing is ignored."""
        while self._heap:
            due, task_id = self._heap[0]
            entry = self._due.get(task_id)
            if entry is not None and entry[0] == due:
                return due
            heapq.heappop(self._heap)  # stale
        return None

    def pop_due(self, now: float) -> list[Task]:
        """Remove and return the tasks whose deadline has passed."""
        out: list[Task] = []
        while self._heap and self._heap[0][0] <= now:
            due, task_id = heapq.heappop(self._heap)
            entry = self._due.get(task_id)
            if entry is not None and entry[0] == due:
                del self._due[task_id]
                out.append(entry[1])
        return out


class GroupWaits:
    """Offers of a limit group a claim did not win, each with its group.

    The store refuses a claim of a group at its limit without a word, and the watch offers
    the task again only when it changes: so the node keeps it (as an ignored offer, not in
    the way of other groups' offers) and retries it after ``refuse_retry``, or as soon as a
    task of the group ends here. Offers someone else took drop out at that retry. The caller
    holds the consumer's lock.
    """

    def __init__(self) -> None:
        self._grouped: dict[str, str] = {}  # task id -> group

    def note(self, tasks: list[Task], claimed: list[Task]) -> list[Task]:
        """Remember the offers of ``tasks`` with a group that were not won: those offers."""
        won = {t.id for t in claimed}
        waiting = [t for t in tasks if t.group is not None and t.id not in won]
        for task in waiting:
            self._grouped[task.id] = task.group or ""
        return waiting

    def forget(self, due: list[Task]) -> int:
        """The ``due`` offers are tried again: forget them; how many waited on a group."""
        if not self._grouped:
            return 0
        return sum(self._grouped.pop(t.id, None) is not None for t in due)

    def freed(self, group: str, ignores: Ignores, now: float) -> None:
        """A task of ``group`` ended: its waiting offers still ignored are due at ``now``."""
        for task_id, waiting_group in list(self._grouped.items()):
            entry = ignores.get(task_id)
            if waiting_group == group and entry is not None:
                ignores.put(entry[1], now)
