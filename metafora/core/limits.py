"""Cluster-wide limits per task group: the model every store keeps.

A :class:`Limit` on a group bounds how many of the group's tasks run at once across the
cluster (``max``) and how many are claimed per window (``rate``). The store refuses a claim
that would break it in the same transaction (SQL) or txn (etcd) as the claim itself; the
concurrency slots are the group's live claims, so a dead node's slots return with its lease.
See docs/limits.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from metafora.core.durations import format_duration
from metafora.core.errors import ConfigError
from metafora.core.task import validate_group

__all__ = [
    "MAX_LIMIT",
    "MAX_WINDOW_SECONDS",
    "ClientLimits",
    "GroupUsage",
    "Limit",
    "Rate",
    "parse_rate",
    "validate_limit",
    "waiting_reason",
]

MAX_LIMIT = 1_000_000
"""The largest ``max`` and rate count a limit may have."""
MAX_WINDOW_SECONDS = 7 * 86400
"""The longest rate window (a week)."""
NO_ROOM_CAP = 1_000_000_000
"""What a store reports as a group's room when it has no limit (more than any claim batch)."""

_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([smhd])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Rate:
    """At most ``count`` claims of a group's tasks in any window of ``window`` seconds."""

    count: int
    window: int

    def __str__(self) -> str:
        return f"{self.count}/{format_duration(self.window)}"


def parse_rate(value: object) -> Rate:
    """``"100/1m"``, ``"5/1s"``, ``"1000/1h"`` (also ``"100/m"``), or a :class:`Rate`; a clear
    :class:`ConfigError` for anything else."""
    if isinstance(value, Rate):
        rate = value
    elif isinstance(value, str):
        match = _RATE.match(value)
        if match is None:
            raise ConfigError(
                f"bad rate {value!r}: use COUNT/WINDOW, like 100/1m, 5/1s or 1000/1h"
            )
        count, size, unit = match.groups()
        rate = Rate(int(count), int(size or 1) * _UNITS[unit])
    else:
        raise ConfigError(f"a rate must be text like 100/1m, got {type(value).__name__}")
    if not 1 <= rate.count <= MAX_LIMIT:
        raise ConfigError(f"a rate's count must be between 1 and {MAX_LIMIT}, got {rate.count}")
    if not 1 <= rate.window <= MAX_WINDOW_SECONDS:
        raise ConfigError(f"a rate's window must be between 1s and 7d, got {rate.window}s")
    return rate


@dataclass(frozen=True)
class Limit:
    """The limit of one group: ``max`` concurrent claims and/or ``rate`` claims per window."""

    group: str
    max: int | None = None
    rate: Rate | None = None

    def describe(self) -> str:
        """``max 5, rate 100/1m`` as listings show it."""
        parts = []
        if self.max is not None:
            parts.append(f"max {self.max}")
        if self.rate is not None:
            parts.append(f"rate {self.rate}")
        return ", ".join(parts)


def validate_limit(group: object, max: object = None, rate: object = None) -> Limit:
    """A :class:`Limit` from user input, or :class:`ConfigError` / InvalidProps naming the
    problem: a group name like a label value, ``max`` a positive integer, ``rate`` as
    :func:`parse_rate` reads it, and at least one of the two."""
    name = validate_group(group)
    if name is None:
        raise ConfigError("a limit needs a group name")
    if max is not None:
        if not isinstance(max, int) or isinstance(max, bool):
            raise ConfigError(f"max must be a positive integer, got {max!r}")
        if not 1 <= max <= MAX_LIMIT:
            raise ConfigError(f"max must be between 1 and {MAX_LIMIT}, got {max}")
    parsed = None if rate is None else parse_rate(rate)
    if max is None and parsed is None:
        raise ConfigError(f"limit of group {name!r}: give a max, a rate or both")
    return Limit(name, max, parsed)


@dataclass(frozen=True)
class GroupUsage:
    """A limit and what its group uses now: live claims and claims in the current window."""

    limit: Limit
    running: int = 0
    recent: int = 0

    def condition(self) -> str | None:
        """What holds the group's pending tasks now, without the group's name (``at its limit
        (5/5)``, ``at its rate limit (100/100 per 1m)``); None: nothing does."""
        lim = self.limit
        if lim.max is not None and self.running >= lim.max:
            return f"at its limit ({self.running}/{lim.max})"
        if lim.rate is not None and self.recent >= lim.rate.count:
            return (f"at its rate limit ({self.recent}/{lim.rate.count}"
                    f" per {format_duration(lim.rate.window)})")
        return None

    def full(self) -> str | None:
        """Why the group's pending tasks wait now (None: they do not)."""
        condition = self.condition()
        return None if condition is None else f"group {self.limit.group} {condition}"


def waiting_reason(group: str | None, usage: Mapping[str, GroupUsage]) -> str | None:
    """Why a pending task of ``group`` waits, given every group's usage (None: it does not)."""
    if group is None:
        return None
    found = usage.get(group)
    return None if found is None else found.full()


class ClientLimits:
    """The limit verbs of :class:`~metafora.contracts.client.Client` (one of its bases); a store
    overrides :meth:`group_usage`, :meth:`_limit_put` and :meth:`_limit_delete`."""

    def set_limit(self, group: str, max: int | None = None,
                  rate: str | Rate | None = None) -> Limit:
        """Set (or replace) the limit of ``group``: at most ``max`` of its tasks running at once
        across the cluster, and/or at most ``rate`` claims of them per window (``"100/1m"``,
        ``"5/1s"``, ``"1000/1h"``). Takes effect at the next claim of every node; claims
        already made are not stopped. Raises ConfigError (InvalidProps for a bad group name)."""
        limit = validate_limit(group, max, rate)
        self._limit_put(limit)
        return limit

    def limits(self) -> list[Limit]:
        """Every group's limit, by group name."""
        return [usage.limit for _, usage in sorted(self.group_usage().items())]

    def delete_limit(self, group: str) -> None:
        """Remove the limit of ``group`` (its waiting tasks become claimable). LimitNotFound."""
        name = validate_group(group)
        if name is None:
            raise ConfigError("delete_limit needs a group name")
        self._limit_delete(name)

    def group_usage(self) -> dict[str, GroupUsage]:
        """Every limited group -> its limit, live claims and claims in the current window."""
        raise NotImplementedError(f"{type(self).__name__} keeps no limits")

    def _limit_put(self, limit: Limit) -> None:
        """Store ``limit`` (insert or replace)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no limits")

    def _limit_delete(self, group: str) -> None:
        """Delete the limit of ``group``. Raises LimitNotFound."""
        raise NotImplementedError(f"{type(self).__name__} keeps no limits")
