"""Bounded PostgreSQL transactions (fenced writes that must not outlive a lease): every
statement waits at most the allowance (a transaction-local ``statement_timeout``, sent with
the driver's ``BEGIN`` in one round trip); plain transactions keep the server's default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, text

from metafora.coordinators.sql.options import parse_config
from metafora.coordinators.sql.store import Database
from metafora.core.config import parse_store_url
from metafora.core.errors import CoordinatorUnavailable, StoreError


@pytest.fixture
def db(postgres_url: str) -> Iterator[Database]:
    database = Database(parse_config(parse_store_url(postgres_url), {"pool_size": 1}))
    yield database
    database.close()


def _timeout_ms(conn: Connection) -> int:
    shown = str(conn.execute(text("SELECT current_setting('statement_timeout')")).scalar())
    for unit, factor in (("ms", 1), ("s", 1000), ("min", 60_000)):
        if shown.endswith(unit) and shown[: -len(unit)].isdigit():
            return int(shown[: -len(unit)]) * factor
    return int(shown)


def test_bounded_transactions_wait_at_most_their_allowance(db: Database) -> None:
    with db.transaction() as conn:
        default = _timeout_ms(conn)
    for allowance in (4.0, 0.25, 29.5):
        with db.bounded(allowance) as conn:
            assert _timeout_ms(conn) == round(allowance * 1000)
            assert conn.execute(text("SELECT 41 + 1")).scalar() == 42
        with db.transaction() as conn:
            assert _timeout_ms(conn) == default


def test_a_statement_past_the_allowance_is_cut(db: Database) -> None:
    with pytest.raises(CoordinatorUnavailable), db.bounded(0.2) as conn:
        conn.execute(text("SELECT pg_sleep(30)"))
    with db.transaction() as conn:  # and the connection is usable, with the default again
        conn.execute(text("SELECT pg_sleep(0.3)"))


def test_a_failed_bounded_transaction_leaves_the_connection_clean(db: Database) -> None:
    with pytest.raises(StoreError), db.bounded(5.0) as conn:
        conn.execute(text("SELECT * FROM no_such_table"))
    with db.bounded(3.0) as conn:
        assert _timeout_ms(conn) == 3000
    with pytest.raises(RuntimeError), db.bounded(5.0) as conn:
        raise RuntimeError("the caller's own error: the transaction rolls back")
    with db.bounded(2.0) as conn:
        assert _timeout_ms(conn) == 2000
