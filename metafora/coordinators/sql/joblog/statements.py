"""The job logs' SQL, written once per dialect, and the steps of an append.

Each statement has the same text on every connection it runs on (the store's own, or the
application's SQLAlchemy or psycopg connection given as ``conn=``), so an append is a sequence
of ``(clause, params)`` steps (:func:`lock_steps`, :func:`append_steps`) driven by
:func:`~metafora.coordinators.sql.submit.run_steps`, as a submit is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import TextClause, text

from metafora.coordinators.sql.submit import Steps

__all__ = ["CHANNEL", "JobLogStatements", "append_steps", "lock_steps", "notify_payload"]

CHANNEL = "metafora_joblogs"
"""The PostgreSQL NOTIFY channel of every job log of a database (payload: namespace, a newline
and the log's name): one LISTEN connection per process serves every log."""

_LOG = "namespace = :ns AND name = :log"
_JOBS = "namespace = :ns AND log_name = :log"


def notify_payload(namespace: str, log: str) -> str:
    """The NOTIFY payload naming one log (names hold no control characters)."""
    return f"{namespace}\n{log}"


@dataclass(frozen=True)
class JobLogStatements:
    """Every statement of the job logs for one dialect (built once per log handle)."""

    postgres: bool
    lock: TextClause
    existing: TextClause
    insert: TextClause
    set_head: TextClause
    head: TextClause
    read: str
    """For the bare driver connection (no SQLAlchemy Row per job), positional parameters:
    namespace, log, first index, end index (excluded)."""
    index_of: TextClause
    info: TextClause
    logs: TextClause
    heads: TextClause

    @classmethod
    def build(cls, now: str, postgres: bool) -> JobLogStatements:
        """The statements with the dialect's clock fragment ``now``."""
        if postgres:
            # One look-up of the unique key index per key, whatever the plan: once psycopg
            # prepares the statement (its 6th run) the generic plan of `job_key = ANY(:keys)`
            # read every job of the log and compared each with the whole array (1,000 keys,
            # 40,000 jobs: 10 ms became 600), and a join could still hash the whole log.
            existing = (
                "SELECT key, idx FROM (SELECT k.key, (SELECT j.idx FROM metafora_joblog_jobs j"
                " WHERE j.namespace = :ns AND j.log_name = :log AND j.job_key = k.key) AS idx"
                " FROM unnest(CAST(:keys AS TEXT[])) AS k(key)) AS found WHERE idx IS NOT NULL"
            )
            rows = (
                "SELECT :ns, :log, :first + t.o - 1, t.k, t.p FROM"
                " unnest(CAST(:keys AS TEXT[]), CAST(:payloads AS TEXT[])) WITH ORDINALITY AS t(k, p, o)"
            )
            # The wake-up rides on the head's write: delivered at commit, never on a rollback.
            notify = " RETURNING pg_notify(:channel, :payload)"
        else:
            existing = (
                f"SELECT job_key, idx FROM metafora_joblog_jobs WHERE {_JOBS}"
                " AND job_key IN (SELECT value FROM json_each(:keys))"
            )
            rows = (
                "SELECT :ns, :log, :first + j.key, json_extract(j.value, '$[0]'),"
                " json_extract(j.value, '$[1]') FROM json_each(:rows) AS j"
            )
            notify = ""
        mark = "%s" if postgres else "?"  # psycopg's and sqlite3's positional placeholders
        return cls(
            postgres=postgres,
            # Creates the log's counter row or locks it (PostgreSQL: the row lock; SQLite: the
            # database's write lock) until the append's transaction ends.
            lock=text(
                "INSERT INTO metafora_joblogs (namespace, name) VALUES (:ns, :log)"
                f" ON CONFLICT (namespace, name) DO UPDATE SET updated_at = {now} RETURNING head"
            ),
            existing=text(existing),
            insert=text(
                "INSERT INTO metafora_joblog_jobs (namespace, log_name, idx, job_key, payload) " + rows
            ),
            set_head=text(
                f"UPDATE metafora_joblogs SET head = :head, updated_at = {now} WHERE {_LOG}" + notify
            ),
            head=text(f"SELECT head FROM metafora_joblogs WHERE {_LOG}"),
            read=(
                f"SELECT idx, job_key, payload FROM metafora_joblog_jobs WHERE namespace = {mark}"
                f" AND log_name = {mark} AND idx >= {mark} AND idx < {mark} ORDER BY idx"
            ),
            index_of=text(f"SELECT idx FROM metafora_joblog_jobs WHERE {_JOBS} AND job_key = :key"),
            info=text(f"SELECT name, head, created_at, updated_at FROM metafora_joblogs WHERE {_LOG}"),
            logs=text(
                "SELECT name, head, created_at, updated_at FROM metafora_joblogs WHERE namespace = :ns"
                " ORDER BY name"
            ),
            heads=text("SELECT namespace, name, head FROM metafora_joblogs"),
        )


def lock_steps(sql: JobLogStatements, namespace: str, log: str) -> Steps[int]:
    """Create or lock the log's counter row; its head (the first statement of an append)."""
    rows = yield sql.lock, {"ns": namespace, "log": log}
    return int(rows[0][0])


def append_steps(sql: JobLogStatements, namespace: str, log: str, head: int,
                 items: Sequence[tuple[str, str]]) -> Steps[list[int]]:
    """The rest of an append under the counter row's lock taken by :func:`lock_steps`
    (``head`` its answer): the indexes of ``items`` (``(key, payload JSON)`` pairs, in order).

    The keys already in the log keep their index; the others (the first of each repeated
    key) take ``head + 1``, ``head + 2``, ... in order, and the head moves to the last one.
    Nobody else can append to the log until this transaction ends, so the look-up of the
    existing keys is exact and the new indexes follow the committed head without a gap.
    """
    params = {"ns": namespace, "log": log}
    keys = list(dict.fromkeys(key for key, _ in items))
    found: dict[str, int] = {}
    if head >= 0:
        keys_param: object = keys if sql.postgres else json.dumps(keys)
        rows = yield sql.existing, {**params, "keys": keys_param}
        found = {str(key): int(index) for key, index in rows}
    fresh: dict[str, str] = {}
    for key, payload in items:
        if key not in found and key not in fresh:
            fresh[key] = payload
    if fresh:
        first = head + 1
        if sql.postgres:
            insert = {**params, "first": first, "keys": list(fresh), "payloads": list(fresh.values())}
        else:
            insert = {**params, "first": first, "rows": json.dumps(list(fresh.items()))}
        yield sql.insert, insert
        for offset, key in enumerate(fresh):
            found[key] = first + offset
        yield sql.set_head, {**params, "head": head + len(fresh), "channel": CHANNEL,
                             "payload": notify_payload(namespace, log)}
    return [found[key] for key, _ in items]
