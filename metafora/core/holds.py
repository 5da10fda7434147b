"""Sticky return: a gracefully stopped node's tasks held for its id for a short window.

A node with an explicit, stable id (a StatefulSet pod, a systemd unit: see docs/deploys.md)
that shuts down gracefully releases its tasks *held* for its id (``Consumer(sticky_for=)``):
each released task is stored pending with ``held_for`` (the node id) and ``held_until``
(the store's clock plus the window). Until then only a node registering with that id claims
it (it takes its tasks back and nothing moves); other nodes take it once the window ends.
A crash is unchanged (the claims move after the lease), and ``Consumer.shutdown(leaving=True)``
or ``metafora nodes drain ID`` (:meth:`~metafora.contracts.client.Client.drain_node`) hand the tasks
off at once (a scale-down).

Each store keeps the hold in its own rows or keys and judges it by its own clock inside its
claim (the SQL claim statement, the etcd claim txn); what does not depend on the store lives
here: the bounds of the window, the rule, and how operators' views show a hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime

from metafora.core.errors import ConfigError
from metafora.core.task import TaskInfo, TaskState

__all__ = [
    "DEFAULT_STICKY_FOR",
    "STICKY_FOR_MAX",
    "check_sticky_for",
    "held_against",
    "held_by_node",
    "hold_note",
    "is_held",
]

DEFAULT_STICKY_FOR = 0.0
"""Off by default: a graceful shutdown releases at once (guarantee 4), as it always did; a
deploy whose nodes come back under their ids (a StatefulSet, systemd units) opts in."""

STICKY_FOR_MAX = 3600.0
"""The longest hold (an hour): a node that does not come back must not strand its work."""


def check_sticky_for(value: object, name: str = "sticky_for") -> float:
    """``value`` as seconds in ``[0, STICKY_FOR_MAX]`` (0: no hold); ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    if not 0 <= value <= STICKY_FOR_MAX:
        raise ConfigError(f"{name} must be between 0 and {STICKY_FOR_MAX:g} seconds, got {value!r}")
    return float(value)


def held_against(held_for: str | None, held_until: datetime | None, node_id: str,
                 now: datetime) -> bool:
    """Whether a pending task held for ``held_for`` until ``held_until`` is refused to
    ``node_id`` at ``now`` (the store's clock): held for another node, window not over."""
    return (held_for is not None and held_for != node_id
            and held_until is not None and now < held_until)


def is_held(info: TaskInfo, now: datetime) -> bool:
    """Whether ``info`` (as a client listed it) is a pending task still held for a node."""
    return (info.state is TaskState.PENDING and info.held_for is not None
            and info.held_until is not None and now < info.held_until)


def hold_note(info: TaskInfo, now: datetime) -> str | None:
    """``held for NODE until HH:MM:SS`` for a held task (operators' views), else None."""
    if not is_held(info, now) or info.held_until is None:
        return None
    return f"held for {info.held_for} until {info.held_until.strftime('%H:%M:%S')}"


def held_by_node(infos: Iterable[TaskInfo], now: datetime) -> dict[str, tuple[int, datetime]]:
    """Node -> (how many of ``infos`` are held for it, when its last hold ends), by node id."""
    held: dict[str, tuple[int, datetime]] = {}
    for info in infos:
        if is_held(info, now) and info.held_for is not None and info.held_until is not None:
            count, until = held.get(info.held_for, (0, info.held_until))
            held[info.held_for] = (count + 1, max(until, info.held_until))
    return dict(sorted(held.items()))
