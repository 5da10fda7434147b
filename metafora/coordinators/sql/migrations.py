"""Applying every schema migration of a SQL store at once: what ``metafora migrate`` runs.

A store opened with ``migrate=false`` never creates or alters its tables (a production
database whose schema is changed by a release step); this applies, in that step, what the
store would otherwise apply on first use: the coordinator's migrations
(:mod:`~metafora.coordinators.sql.schema`), the state machine's task command table
(:mod:`~metafora.coordinators.sql.states`) and the gated partitions' item tables
(:mod:`~metafora.coordinators.sql.gates.schema`, versioned apart). Each runs in its own
transaction under its lock, so two runs at once are safe, and a second run changes nothing.
The job logs' tables (:mod:`~metafora.coordinators.sql.joblog.schema`, versioned apart too)
are applied with the item tables.
"""

from __future__ import annotations

import dataclasses

from metafora.contracts.backends import Migrated
from metafora.coordinators.sql import schema
from metafora.coordinators.sql.gates import schema as gates_schema
from metafora.coordinators.sql.joblog import schema as joblog_schema
from metafora.coordinators.sql.options import PG_SCHEMES, parse_config
from metafora.coordinators.sql.states import ensure_command_table
from metafora.coordinators.sql.store import Database
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError

__all__ = ["migrate_store"]


def migrate_store(url: str, *, items: bool = True) -> list[Migrated]:
    """Bring every schema of the SQL store ``url`` up to date (``items``: the item tables
    too); what each was before and is now. ConfigError for a store that has no schema (etcd,
    memory); the URL's own ``migrate=false``, if any, is what this step is for, so it is
    ignored here."""
    parsed = parse_store_url(url)
    if parsed.scheme != "sqlite" and parsed.scheme not in PG_SCHEMES:
        raise ConfigError(
            f"{parsed} has no schema to migrate: only SQL stores (sqlite:///PATH.db, "
            "postgresql://...) have one"
        )
    config = dataclasses.replace(parse_config(parsed, {}), migrate=True)
    db = Database(config)
    try:
        with db.read() as conn:
            before = schema.current_version(conn)
        db.ensure_schema()  # the coordinator's migrations, under its lock
        ensure_command_table(db)
        with db.read() as conn:
            done = [Migrated("tasks", before, schema.current_version(conn))]
        if items:
            for label, side in (("items", gates_schema.SCHEMA), ("job logs", joblog_schema.SCHEMA)):
                with db.read() as conn:
                    before = side.current_version(conn)
                side.check_version(before, db.name)
                if before < side.version:
                    with db.transaction() as conn:
                        side.migrate(conn, db.dialect, db.name)
                with db.read() as conn:
                    done.append(Migrated(label, before, side.current_version(conn)))
        return done
    finally:
        db.close()
