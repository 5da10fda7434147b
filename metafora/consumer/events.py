"""What the consumer's side threads tell its loop: typed events on one queue.

The watch, the command feed, the membership listener and the handlers' ends run on other
threads; they never decide anything, they post an event and the loop (one thread) acts on it.
Events are small immutable values (named tuples: one is made per offer, so they stay cheap);
those without a payload are members of :class:`Signal`.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from metafora.contracts.coordinator import Outcome
from metafora.core.commands import Command
from metafora.core.task import Task

__all__ = ["CommandArrived", "Event", "Finished", "Offer", "Signal"]


class Offer(NamedTuple):
    """The coordinator's watch offers ``task`` (claimable now, as far as it knows)."""

    task: Task


class CommandArrived(NamedTuple):
    """A command for this node (``metafora freeze``, ``stop``, ``balance``...)."""

    command: Command


class Finished(NamedTuple):
    """A handler's outcome was settled: its slot is free, deferred offers may go."""

    task: Task
    outcome: Outcome
    ran: float | None = None  # seconds the handler ran (None: it never returned)


class Signal(enum.Enum):
    """Events without a payload."""

    ROOM = "room"
    """A slot may be free while offers are deferred: try them again."""
    MEMBERS = "members"
    """The store reports that a node joined, left or announced leaving."""


Event = Offer | CommandArrived | Finished | Signal
"""Anything the loop's queue carries."""
