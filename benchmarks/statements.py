"""Counting the SQL statements a benchmark process sends, by kind (its verb and first table).

:func:`count_statements` wraps psycopg's and sqlite3's drivers for the duration of a block;
the hot-path benchmark (:mod:`benchmarks.hotpath`) turns it on in the worker processes of
:mod:`benchmarks.peers` through ``METAFORA_BENCH_STATEMENTS``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["count_sqlite_statements", "count_statements"]

_WORD = re.compile(r"[A-Za-z_]+")


def _kind(sql: str) -> str:
    """A short name of one statement: its verb and first table, or its CTE's first words."""
    text = " ".join(sql.split())
    words = _WORD.findall(text)
    if not words:
        return "?"
    verb = words[0].upper()
    table = next((w for w in words if w.startswith("metafora_")), "")
    if "fin AS (UPDATE" in text:
        return "claim + done (one statement)"
    tag = ""
    for marker in ("'done'", "'failed'", "'claimed'", "'pending'", "lease_until =", "RETURNING"):
        if marker in text:
            tag = marker
            break
    return f"{verb} {table} {tag}".strip()


@contextlib.contextmanager
def count_statements(out: Path) -> Iterator[None]:
    """Count every driver statement of this process by kind; written to ``out`` at the end."""
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    kinds: dict[str, str] = {}  # the same few statement texts again and again: name each once

    def note(sql: Any) -> None:
        text = sql if isinstance(sql, str) else str(sql)
        kind = kinds.get(text)
        if kind is None:
            if len(kinds) > 10_000:  # SQLite's trace has the values bound in: keep it bounded
                kinds.clear()
            kind = kinds[text] = _kind(text)
        with lock:
            counts[kind] += 1

    import psycopg

    original = psycopg.Cursor.execute

    def execute(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        note(query)
        return original(self, query, params, **kw)

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    import sqlite3

    connect = sqlite3.connect

    def traced(*args: Any, **kw: Any) -> Any:
        conn = connect(*args, **kw)
        conn.set_trace_callback(note)
        return conn

    sqlite3.connect = sqlite3.dbapi2.connect = traced
    try:
        yield
    finally:
        psycopg.Cursor.execute = original  # type: ignore[method-assign]
        sqlite3.connect = sqlite3.dbapi2.connect = connect
        out.write_text(json.dumps(dict(counts)))


def count_sqlite_statements() -> list[int]:
    """Count every SQL statement of this process's SQLAlchemy connections (not BEGIN/COMMIT)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    count = [0]
    skip = ("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA", "SAVEPOINT", "RELEASE")

    def traced(sql: str) -> None:
        if not sql.lstrip().upper().startswith(skip):
            count[0] += 1

    @event.listens_for(Engine, "connect")
    def connected(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.set_trace_callback(traced)

    return count
