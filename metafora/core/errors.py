"""The exceptions metafora raises: one root, typed subclasses.

Driver exceptions (grpc, psycopg, SQLAlchemy) are translated into these at the
coordinator boundary, with the original kept as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ClaimCompleted",
    "ClaimLost",
    "ConfigError",
    "CoordinatorClosed",
    "CoordinatorUnavailable",
    "InvalidCommand",
    "InvalidProps",
    "InvalidTaskId",
    "InvalidTaskState",
    "LimitNotFound",
    "MetaforaError",
    "NodeExists",
    "NodeNotFound",
    "RequestTooLarge",
    "ScheduleExists",
    "ScheduleNotFound",
    "SchemaNotReady",
    "StoreError",
    "TaskExists",
    "TaskNotFound",
    "WriteConflict",
]


class MetaforaError(Exception):
    """Root of every error metafora raises on purpose."""


class ConfigError(MetaforaError, ValueError):
    """A URL, option or argument is invalid (names the bad value)."""


class InvalidTaskId(MetaforaError, ValueError):
    """A task id is empty, too long or contains control characters."""


class InvalidProps(MetaforaError, ValueError):
    """Task props are not a JSON object, or a system prop has a bad value."""


class InvalidCommand(MetaforaError, ValueError):
    """A command is unknown or malformed."""


class RequestTooLarge(MetaforaError, ValueError):
    """The store refused a request as over its size limit: retrying cannot help (a usage error)."""


class TaskExists(MetaforaError):
    """A task with this id already exists."""

    def __init__(self, message: str = "", *, ids: Sequence[str] = (), submitted: int = 0) -> None:
        super().__init__(*((message,) if message else ()))
        self.ids: tuple[str, ...] = tuple(ids)
        """The ids refused (``Client.submit_tasks``: existing or repeated ones), or ()."""
        self.submitted = submitted
        """How many tasks of a ``submit_tasks`` call were added before the refused batch."""


class TaskNotFound(MetaforaError, LookupError):
    """No task with this id."""


class InvalidTaskState(MetaforaError):
    """The task is not in a state that allows this operation (e.g. retry of a running task)."""


class NodeExists(MetaforaError):
    """A live node already uses this node id."""


class NodeNotFound(MetaforaError, LookupError):
    """No live node with this id."""


class StoreError(MetaforaError):
    """The store answered with an unexpected error (a bug or a schema problem, not a network fault)."""


class SchemaNotReady(StoreError):
    """The store's schema is missing or older than this metafora needs, and its URL says
    ``migrate=false``: run ``metafora migrate --url URL`` (the release step) first."""


class WriteConflict(StoreError):
    """Concurrent writes conflicted (PostgreSQL found a deadlock or a serialization failure):
    this write was rolled back and nothing of it applied; trying it again may work. Not an
    outage: the CLI exits 1 (refused), not 3 (unavailable)."""


class CoordinatorUnavailable(MetaforaError):
    """The store cannot be reached; retryable. The message names the URL without its password."""


class CoordinatorClosed(MetaforaError):
    """The coordinator or client was used after close()."""


class ClaimLost(MetaforaError):
    """A fenced write was refused: this node no longer holds the claim (owner or token differ)."""


class ClaimCompleted(ClaimLost):
    """The claim already ended done under its own token (in the application's transaction,
    ``complete_task``): an outcome for it is moot and nothing was written. A ClaimLost (the
    claim is over), which a consumer counts and logs as done."""


class ScheduleExists(MetaforaError):
    """A schedule with this name already exists."""


class ScheduleNotFound(MetaforaError, LookupError):
    """No schedule with this name."""


class LimitNotFound(MetaforaError, LookupError):
    """No limit is set on this group."""
