"""A versioned schema kept apart from the coordinator's: the gates' items, the job logs.

Such a schema has its own version table (one row per applied migration) because its database
need not hold a coordinator at all. :class:`SideSchema` holds what differs between them (the
version table, the advisory lock key, the migrations, the tables' name in messages); the
version check and the migration loop are written once here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, inspect, text

from metafora.coordinators.sql.shared import Dialect, is_postgres
from metafora.core.errors import StoreError

__all__ = ["Migration", "SideSchema"]

Migration = Callable[[Connection, Dialect], None]


@dataclass(frozen=True)
class SideSchema:
    """One side schema: ``table`` (its version table), ``lock_key`` (its
    ``pg_advisory_xact_lock`` key), ``migrations`` (``i`` takes version ``i`` to ``i + 1``)
    and ``what`` (its tables, as error messages name them)."""

    table: str
    lock_key: int
    migrations: Sequence[tuple[str, Migration]]
    what: str

    @property
    def version(self) -> int:
        """The version this code brings the schema to."""
        return len(self.migrations)

    def current_version(self, conn: Connection) -> int:
        """The schema version of the database (0 if its tables were never created)."""
        if not inspect(conn).has_table(self.table):
            return 0
        version = conn.execute(text(f"SELECT max(version) FROM {self.table}")).scalar()
        return int(version or 0)

    def check_version(self, version: int, where: str) -> None:
        """Refuse a schema newer than this code understands."""
        if version > self.version:
            raise StoreError(
                f"the {self.what} of {where} are at schema version {version}, newer than this "
                f"metafora understands ({self.version}); upgrade metafora"
            )

    def migrate(self, conn: Connection, dialect: Dialect, where: str) -> int:
        """Bring the schema up to :attr:`version` inside the caller's transaction."""
        if is_postgres(dialect):
            conn.execute(text(f"SELECT pg_advisory_xact_lock({self.lock_key})"))
        ts = dialect.ddl_types()["ts"]
        conn.execute(text(
            f"CREATE TABLE IF NOT EXISTS {self.table} (version INTEGER PRIMARY KEY,"
            f" description TEXT NOT NULL, applied_at {ts} NOT NULL)"
        ))
        version = int(conn.execute(
            text(f"SELECT coalesce(max(version), 0) FROM {self.table}")).scalar_one())
        self.check_version(version, where)
        now = dialect.fragments()["now"]
        for number, (description, migration) in enumerate(
                self.migrations[version:], start=version + 1):
            migration(conn, dialect)
            conn.execute(
                text(f"INSERT INTO {self.table} (version, description, applied_at)"
                     f" VALUES (:v, :d, {now})"),
                {"v": number, "d": description},
            )
        return self.version
