"""Job logs in SQL (SQLite or PostgreSQL): the SQL store's ready
:class:`~metafora.streams.Jobs` for push-style producers (``metafora.streams.SQLJobLog``).

Modules: :mod:`~metafora.coordinators.sql.joblog.log` (:class:`SQLJobLog`: appends, dense
indexes, reads), :mod:`~metafora.coordinators.sql.joblog.statements` (its SQL and the steps of
an append), :mod:`~metafora.coordinators.sql.joblog.schema` (the tables, versioned apart from
the coordinator's), :mod:`~metafora.coordinators.sql.joblog.wakeups` (one push feed per
database and process).
"""

from __future__ import annotations

from metafora.coordinators.sql.joblog.log import (
    MAX_APPEND,
    MAX_APPEND_BYTES,
    MAX_KEY_LENGTH,
    MAX_PAYLOAD_BYTES,
    JobLogInfo,
    SQLJobLog,
    job_logs,
)
from metafora.coordinators.sql.joblog.schema import JOBLOG_SCHEMA_VERSION

__all__ = [
    "JOBLOG_SCHEMA_VERSION",
    "MAX_APPEND",
    "MAX_APPEND_BYTES",
    "MAX_KEY_LENGTH",
    "MAX_PAYLOAD_BYTES",
    "JobLogInfo",
    "SQLJobLog",
    "job_logs",
]
