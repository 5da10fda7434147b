"""A claim's fenced handle on its partition's items: the interface the step loop uses.

A store that keeps items implements it (the SQL one: :mod:`metafora.coordinators.sql.gates`).
Every write is **fenced** by the claim's token: once a newer claim opened the partition (or,
with ``claim_fence``, once the coordinator no longer shows this node holding the task),
it is refused with :class:`~metafora.core.errors.ClaimLost` and nothing is written.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from metafora.core.task import Task
from metafora.gates.model import Advance, Item, ItemResult, PartitionStatus

__all__ = ["PartitionLease"]


class PartitionLease(abc.ABC):
    """A claim's fenced access to its partition's items (built by
    :meth:`~metafora.gates.store.ItemStore.lease`)."""

    task: Task
    """The claim (its id is the partition, its token fences every write)."""

    @abc.abstractmethod
    def take_over(self) -> tuple[int, PartitionStatus]:
        """Take the partition over for this claim (raise its token to ours); its gate and
        status. The items an older claim took in its last batch and left without a result
        become orphans (see :meth:`take`), their attempt counted. ClaimLost if a newer claim
        already took it (or the claim is not held)."""

    @abc.abstractmethod
    def state(self) -> tuple[int, PartitionStatus]:
        """The partition's current gate and status, checking that this claim still holds it."""

    @abc.abstractmethod
    def take(self, gate: int, limit: int, results: Sequence[ItemResult] = (), *,
             max_deaths: int = 3) -> list[Item]:
        """Write ``results`` (as :meth:`finish`), then take up to ``limit`` available items of
        ``gate``, in id order, in one fenced write that also records the batch: the items of
        a claim that ends without their result are **orphans** for the next claim, taken one
        at a time once the rest of the gate is done; an orphan that died that way
        ``max_deaths`` claims in a row is returned **failed** ("process died while
        processing", permanent). ``attempts`` of an item returned: the attempts made before
        this one. ClaimLost (nothing written) if the claim is gone."""

    @abc.abstractmethod
    def finish(self, gate: int, outcomes: Sequence[ItemResult], *, release: bool = False) -> int:
        """Write the results of items processed at ``gate`` (and the items they spawned) in
        one fenced write; how many items were written. An item changed meanwhile is skipped
        with its spawned items, so writing again after a lost answer writes nothing twice.
        ``release``: the claim lets go of the partition cleanly (its batch record is
        dropped: no orphans). ClaimLost (nothing written) if the claim is gone."""

    @abc.abstractmethod
    def reopen_failed(self, gate: int) -> int:
        """Make the retryable failed items of ``gate`` available again (a partition retry)."""

    @abc.abstractmethod
    def failed_items(self, gate: int, limit: int = 5) -> list[Item]:
        """A few failed items of ``gate`` (for error messages)."""

    @abc.abstractmethod
    def peek(self, gate: int) -> tuple[int | None, int]:
        """The lowest gate >= ``gate`` with available items (or None), and the failed count."""

    @abc.abstractmethod
    def advance(self, gate: int, *, move: bool, close: bool) -> Advance:
        """Decide, atomically with any concurrent add, what follows an empty gate ``gate``:
        if it has work again or failed items, say so; else jump to the lowest gate with
        available items (``move``); else, with no work left, complete the partition
        (``close``) or report it idle."""
