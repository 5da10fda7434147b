"""Why a pending task waits: held for a stopped node's id, no live node matches its selector,
or its group is at its limit.

One place for the text that ``metafora tasks``/``show``/``top`` and the dashboard's task
pages show (``waiting: group tenant:42 at its limit (5/5)``), so they always agree. What is
read from the store is read only when a pending task needs it: the node labels when one has
a selector, the groups' usage when one has a group. The result is a read at that moment,
not a promise (docs/limits.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from metafora.core.holds import hold_note
from metafora.core.limits import GroupUsage, waiting_reason
from metafora.core.task import TaskInfo, TaskState, placement_reason

if TYPE_CHECKING:
    from metafora.contracts.client import Client

__all__ = ["group_reasons", "pending_reasons", "placement_reasons", "read_usage", "waiting_groups"]

WAITING = "waiting: "
"""What a group's reason starts with, as every listing shows it."""


def _pending(infos: Iterable[TaskInfo]) -> list[TaskInfo]:
    return [i for i in infos if i.state is TaskState.PENDING]


def read_usage(client: Client) -> dict[str, GroupUsage]:
    """Every limited group's usage (:meth:`~metafora.contracts.client.Client.group_usage`); empty
    for a store that keeps no limits."""
    try:
        return client.group_usage()
    except NotImplementedError:
        return {}


def placement_reasons(infos: Iterable[TaskInfo],
                      labels: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Task id -> why a pending task with a selector matches none of the live nodes' ``labels``."""
    reasons: dict[str, str] = {}
    for info in _pending(infos):
        if info.selector:
            reason = placement_reason(info.selector, labels)
            if reason is not None:
                reasons[info.id] = reason
    return reasons


def group_reasons(infos: Iterable[TaskInfo], usage: Mapping[str, GroupUsage]) -> dict[str, str]:
    """Task id -> ``waiting: group G at its limit (n/max)`` (or its rate limit) for each pending
    task whose group is full in ``usage``."""
    reasons: dict[str, str] = {}
    for info in _pending(infos):
        reason = waiting_reason(info.group, usage)
        if reason is not None:
            reasons[info.id] = WAITING + reason
    return reasons


def pending_reasons(client: Client, infos: list[TaskInfo]) -> dict[str, str]:
    """Task id -> why a pending task cannot be claimed now (held for a node that stopped
    gracefully: ``held for NODE until T``, see :mod:`metafora.core.holds`; no live node matches
    its selector; else its group is at its limit); the node labels are read only when a
    pending task has a selector, the limits only when one has a group."""
    pending = _pending(infos)
    reasons: dict[str, str] = {}
    now = datetime.now(UTC)
    for info in pending:
        note = hold_note(info, now)
        if note is not None:
            reasons[info.id] = note
    pending = [i for i in pending if i.id not in reasons]
    if any(i.selector for i in pending):
        reasons.update(placement_reasons(pending, list(client.node_labels().values())))
    grouped = [i for i in pending if i.group is not None and i.id not in reasons]
    if grouped:
        reasons.update(group_reasons(grouped, read_usage(client)))
    return reasons


def waiting_groups(infos: Iterable[TaskInfo], usage: Mapping[str, GroupUsage],
                   labels: Sequence[Mapping[str, str]]) -> list[tuple[GroupUsage, int]]:
    """Each group at its limit (by name) with how many of its pending ``infos`` wait on it:
    those a live node could run (a task no node matches counts under that reason, as
    :func:`pending_reasons` says). Groups with no pending task are left out."""
    grouped = [i for i in _pending(infos) if i.group is not None and i.group in usage]
    if not grouped:
        return []
    unplaceable = placement_reasons(grouped, labels)
    counts = Counter(i.group for i in grouped if i.id not in unplaceable)
    return [(usage[group], n) for group, n in sorted(counts.items())
            if group is not None and usage[group].full() is not None]
