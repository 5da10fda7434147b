"""Completion inside the application's transaction (River's ``JobCompleteTx``).

:func:`complete_in` marks a claimed task done on the application's own open transaction (a
SQLAlchemy ``Connection``/``Session`` or a psycopg ``Connection``, checked as ``submit(conn=)``
checks it): the business rows and the task's end commit together, or neither does. The write
is the store's ``complete_tx`` statement, fenced by the claim's token and its owner's live
lease; no row back means the claim is not current: :class:`~metafora.core.errors.ClaimLost`, with
nothing written (the application then rolls back).

The owner learns of it without a round trip per task: its own outcome for that token is
refused by the fence, and the group commit's one look at the refused claims of a batch
(``done_already``) finds the row done under the same token and settles the outcome as
written (see :class:`~metafora.coordinators.sql.claims.ClaimOutcomes`). A completion the
application rolls back leaves the claim exactly as it was: the handler's own outcome counts.
"""

from __future__ import annotations

from typing import Any

from metafora.coordinators.sql.store import Database
from metafora.coordinators.sql.submit import Steps, run_app_steps
from metafora.core.errors import ClaimLost, ConfigError
from metafora.core.task import Task

__all__ = ["complete_in", "complete_steps"]


def complete_steps(db: Database, task: Task) -> Steps[int]:
    """The completion of the claim ``task`` (its id and token) as steps: one fenced UPDATE;
    ClaimLost when it matched no row."""
    if not isinstance(task, Task):
        raise ConfigError(f"complete_task takes the claimed Task its handler got, not "
                          f"{type(task).__name__}")
    if not task.token:
        raise ClaimLost(f"task {task.id!r} carries no claim token (token 0): only a claimed "
                        "task, as its handler got it, can be completed")
    rows = yield db.sql["complete_tx"], {"ns": db.config.namespace, "id": task.id,
                                         "token": task.token}
    if not rows:
        raise ClaimLost(f"task {task.id!r} is not claimed with token {task.token} by a live node "
                        f"in {db.name}: nothing was completed (roll back)")
    return 1


def complete_in(conn: Any, db: Database, task: Task) -> None:
    """Mark the claim ``task`` done in the application's open transaction ``conn``.

    ConfigError for a connection of another kind or database (checked by identity) or in
    autocommit; ClaimLost if the claim is not current; driver errors translated (the
    transaction is the application's to roll back). It runs in a savepoint of that
    transaction (:mod:`~metafora.coordinators.sql.appconn`).
    """
    run_app_steps(conn, db, complete_steps(db, task))
