"""What every store's submit shares: the duplicate modes and the refusal of ``conn=``.

``if_exists`` (``Client.submit_task`` / ``submit_tasks``, the async client, ``metafora submit
--if-exists``):

- ``"error"`` (the default): an existing id raises :class:`~metafora.core.errors.TaskExists`;
- ``"ignore"``: an existing task is left as it is (the call says it added nothing);
- ``"replace"``: an existing *pending* task (not past its ``expires_at``) takes the new
  props, priority, launch and expiry times, selector and placement; its limit group stays the
  one it was submitted with (docs/limits.md); a claimed, finished, failed or expired one is
  left alone.

Each store decides in the same statement or txn that inserts, so two submitters of one id
never both add it.
"""

from __future__ import annotations

from typing import Literal

from metafora.core.errors import ConfigError

__all__ = ["IF_EXISTS", "IfExists", "check_if_exists", "no_completion", "no_transactions"]

IfExists = Literal["error", "ignore", "replace"]
"""What a submit does with an id that exists."""

IF_EXISTS: tuple[IfExists, ...] = ("error", "ignore", "replace")


def check_if_exists(value: object) -> IfExists:
    """``value`` as an :data:`IfExists`; ConfigError for anything else."""
    if value not in IF_EXISTS:
        raise ConfigError(f"if_exists must be one of {', '.join(map(repr, IF_EXISTS))}, "
                          f"not {value!r}")
    return value


def no_transactions(store: str) -> ConfigError:
    """The refusal of ``conn=`` on a store that cannot share the application's transaction."""
    return ConfigError(
        f"submit(conn=...) needs a SQL store (SQLite or PostgreSQL): {store} shares no "
        "transaction with your application; submit after your own transaction commits, or "
        "with if_exists='ignore' so a retried submit is harmless"
    )


def no_completion(store: str, what: str = "complete_task(task, conn=...)") -> ConfigError:
    """The refusal of ``complete_task(conn=...)`` (or of ``what``, another fenced write in the
    application's transaction) on a store that cannot share it."""
    return ConfigError(
        f"{what} needs a SQL store (SQLite or PostgreSQL): {store} shares "
        "no transaction with your application; return from the handler after your own "
        "transaction commits (and make the work idempotent: it may run again)"
    )
