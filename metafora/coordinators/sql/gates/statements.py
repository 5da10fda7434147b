"""The item store's SQL: the owners' fenced statements and the users' and operators' ones.

Every owner statement carries the fence of the module docstring of
:mod:`metafora.coordinators.sql.gates.store`; ``{claim}`` / ``{fence}`` differ with the fencing
mode (same-database mode adds the coordinator's claim check, :func:`claim_held` of the SQL
coordinator's seam), ``{now}`` is the dialect's clock.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TextClause,
    bindparam,
    text,
)

from metafora.coordinators.sql.shared import claim_held

__all__ = ["ITEMS", "ITEM_COLUMNS", "OWNER_SQL", "USER_SQL", "owner_statements", "user_statements"]

ITEM_COLUMNS = "id, gate, status, data, attempts, error, permanent, token, created_at, updated_at"
_WHERE_P = "namespace = :ns AND partition_id = :p"
_WHERE_PS = "namespace = :ns AND partition_id IN :ps"

# The claim check of same-database mode, from the SQL coordinator's seam (its tables are
# its own to name).
_CLAIM = " AND " + claim_held(":p", owner=":node", aliases=("ft", "fn"))
_FENCE = (
    "EXISTS (SELECT 1 FROM metafora_partitions fp WHERE fp.namespace = :ns"
    " AND fp.partition_id = :p AND fp.token = :token AND fp.status = 'open'{claim})"
)

_GUARD_WHERE = " WHERE " + _WHERE_P + " AND token = :token AND status = 'open'{claim} RETURNING gate"

# The owner's statements ({claim} / {fence} differ with the fencing mode).
OWNER_SQL: dict[str, str] = {
    "ensure": (
        "INSERT INTO metafora_partitions (namespace, partition_id) VALUES (:ns, :p)"
        " ON CONFLICT (namespace, partition_id) DO NOTHING"
    ),
    # An older claim's batch record says which items it had taken: those still available
    # and without a result from it are orphans, and their attempt under it is counted.
    "orphans": (
        "UPDATE metafora_items SET taken = 1, attempts = attempts + 1 WHERE " + _WHERE_P
        + " AND status = 'available' AND taken = 0 AND EXISTS (SELECT 1 FROM metafora_partitions"
        " bp WHERE bp.namespace = :ns AND bp.partition_id = :p AND bp.batch_token <> 0"
        " AND bp.batch_token < :token AND metafora_items.gate = bp.batch_gate"
        " AND metafora_items.id BETWEEN bp.batch_first AND bp.batch_last"
        " AND metafora_items.token <> bp.batch_token)"
    ),
    "take_over": (
        "UPDATE metafora_partitions SET token = :token, batch_token = 0, updated_at = {now}"
        " WHERE " + _WHERE_P + " AND token <= :token{claim} RETURNING gate, status"
    ),
    "state": (
        "SELECT gate, status, token, CASE WHEN 1 = 1{claim} THEN 1 ELSE 0 END"
        " FROM metafora_partitions WHERE " + _WHERE_P
    ),
    # Locks the partition row for the rest of the transaction (and proves the fence).
    "guard": "UPDATE metafora_partitions SET updated_at = {now}" + _GUARD_WHERE,
    # Unfenced: it runs inside a transaction whose guard (last) proves the fence.
    "take": (
        "SELECT " + ITEM_COLUMNS + " FROM metafora_items WHERE " + _WHERE_P + " AND gate = :gate"
        " AND status = 'available' AND taken = 0 ORDER BY id LIMIT :limit"
    ),
    # The guard of a transaction that took a batch (ids first..last at gate), last in it:
    # it locks the partition row, proves the fence and records the batch, whose items'
    # attempt the next claim counts if this one dies (one statement for the three).
    "guard_record": (
        "UPDATE metafora_partitions SET updated_at = {now}, batch_token = :token,"
        " batch_gate = :gate, batch_first = :first, batch_last = :last" + _GUARD_WHERE
    ),
    "guard_unrecord": "UPDATE metafora_partitions SET updated_at = {now}, batch_token = 0" + _GUARD_WHERE,
    # An orphan this claim took on its own and never started (a clean stop came first):
    # an orphan again, its attempt and death under this claim not counted.
    "give_back": (
        "UPDATE metafora_items SET taken = 1, attempts = attempts - 1, deaths = deaths - 1"
        " WHERE " + _WHERE_P + " AND status = 'available' AND taken = 2 AND token = :token"
    ),
    # An item a dead claim had taken (an orphan) that died with it while taken on its own
    # (taken = 2), max_attempts times in a row: failed for good, never handed out again.
    "died": (
        "UPDATE metafora_items SET status = 'failed', error = :died, permanent = 1, taken = 0,"
        " deaths = deaths + 1, token = :token, updated_at = {now} WHERE " + _WHERE_P
        + " AND gate = :gate AND status = 'available' AND taken = 2"
        " AND deaths + 1 >= :max_deaths AND {fence} RETURNING " + ITEM_COLUMNS
    ),
    # One orphan, taken on its own (taken = 2) so that only its own death counts; the ones
    # that died fewest times first, so the innocent finish before a poison item fails.
    "orphan": (
        "UPDATE metafora_items SET attempts = attempts + 1, taken = 2, deaths = deaths + 1,"
        " token = :token, updated_at = {now} WHERE id = (SELECT id FROM metafora_items"
        " WHERE " + _WHERE_P + " AND gate = :gate AND status = 'available' AND taken <> 0"
        " ORDER BY deaths, id LIMIT 1) AND {fence} RETURNING " + ITEM_COLUMNS
    ),
    # The first try of an item taken on its own (taken = 2) was counted when it was taken.
    "result": (
        "UPDATE metafora_items SET status = :status, gate = :new_gate,"
        " data = CASE WHEN :keep = 1 THEN data ELSE :data END, error = :error,"
        " permanent = :permanent,"
        " attempts = attempts + :tries - CASE WHEN taken = 2 THEN 1 ELSE 0 END,"
        " taken = 0, deaths = 0, token = :token,"
        " updated_at = {now} WHERE " + _WHERE_P + " AND id = :id AND gate = :gate"
        " AND status = 'available' AND {fence}"
    ),
    "spawn": (
        "INSERT INTO metafora_items (namespace, partition_id, gate, status, data, token)"
        " SELECT :ns, :p, :new_gate, 'available', :data, :token WHERE {fence}"
    ),
    "reopen": (
        "UPDATE metafora_items SET status = 'available', updated_at = {now} WHERE " + _WHERE_P
        + " AND gate = :gate AND status = 'failed' AND permanent = 0 AND {fence}"
    ),
    "work": (
        "SELECT (SELECT min(gate) FROM metafora_items WHERE " + _WHERE_P
        + " AND status = 'available' AND gate >= :gate),"
        " (SELECT count(*) FROM metafora_items WHERE " + _WHERE_P
        + " AND status = 'failed' AND gate >= :gate)"
    ),
    "move": (
        "UPDATE metafora_partitions SET gate = :new_gate, updated_at = {now} WHERE " + _WHERE_P
        + " AND token = :token AND status = 'open'"
    ),
    "complete": (
        "UPDATE metafora_partitions SET status = 'completed', updated_at = {now} WHERE " + _WHERE_P
        + " AND token = :token AND status = 'open'"
    ),
    "failed_at": (
        "SELECT " + ITEM_COLUMNS + " FROM metafora_items WHERE " + _WHERE_P
        + " AND gate = :gate AND status = 'failed' ORDER BY id LIMIT :limit"
    ),
}

# Statements of users and operators (unfenced: they are not owners).
USER_SQL: dict[str, str] = {
    "ensure": OWNER_SQL["ensure"],
    "lock": "SELECT gate, status FROM metafora_partitions WHERE " + _WHERE_P + "{for_update}",
    "partition": "SELECT gate, status, token, updated_at FROM metafora_partitions WHERE " + _WHERE_P,
    "counts": (
        "SELECT gate, status, count(*) FROM metafora_items WHERE " + _WHERE_P + " GROUP BY gate, status"
    ),
    "item": "SELECT " + ITEM_COLUMNS + " FROM metafora_items WHERE " + _WHERE_P + " AND id = :id",
    "unfinished_below": (
        "SELECT count(*) FROM metafora_items WHERE " + _WHERE_P
        + " AND status IN ('available', 'failed') AND gate < :gate"
    ),
    "set_gate": (
        "UPDATE metafora_partitions SET gate = :gate, updated_at = {now} WHERE " + _WHERE_P
    ),
    # Reopening a completed partition: its lowest gate with unfinished items (None: none).
    "lowest_unfinished": (
        "SELECT min(gate) FROM metafora_items WHERE " + _WHERE_P
        + " AND status IN ('available', 'failed')"
    ),
    "reopen_partition": (
        "UPDATE metafora_partitions SET status = 'open', gate = :gate, batch_token = 0,"
        " updated_at = {now} WHERE " + _WHERE_P + " AND status = 'completed'"
    ),
    "retry": (
        "UPDATE metafora_items SET status = 'available', error = NULL, permanent = 0,"
        " deaths = 0, updated_at = {now} WHERE " + _WHERE_P + " AND status = 'failed'"
    ),
    "failures": (
        "SELECT count(*), coalesce(sum(permanent), 0) FROM metafora_items WHERE " + _WHERE_P
        + " AND status = 'failed'"
    ),
    "delete_items": "DELETE FROM metafora_items WHERE " + _WHERE_P,
    "delete_partition": "DELETE FROM metafora_partitions WHERE " + _WHERE_P,
    # The same over many partitions (:ps expands), for pruning whose tasks live elsewhere.
    "delete_items_in": "DELETE FROM metafora_items WHERE " + _WHERE_PS,
    "lock_in": "SELECT partition_id FROM metafora_partitions WHERE " + _WHERE_PS + "{for_update}",
    "delete_partitions_in": "DELETE FROM metafora_partitions WHERE " + _WHERE_PS,
    "notify": "SELECT pg_notify(:channel, :payload)",
}

_META = MetaData()
ITEMS = Table(
    "metafora_items", _META,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("namespace", String),
    Column("partition_id", String),
    Column("gate", Integer),
    Column("status", String),
    Column("data", LargeBinary),
    Column("attempts", Integer),
    Column("error", Text),
    Column("permanent", Integer),
    Column("token", BigInteger),
)
"""The item rows, for the bulk insert of :meth:`~metafora.coordinators.sql.gates.store.SQLItemStore.add`."""


def owner_statements(now: str, claim_fence: bool) -> dict[str, TextClause]:
    """The owner's statements, with the claim check only in same-database mode."""
    claim = _CLAIM.format(now=now) if claim_fence else ""
    fence = _FENCE.format(claim=claim)
    return {name: text(sql.format(now=now, claim=claim, fence=fence)) for name, sql in OWNER_SQL.items()}


def user_statements(now: str, postgres: bool) -> dict[str, TextClause]:
    """The statements of users and operators."""
    for_update = " FOR UPDATE" if postgres else ""
    built = {name: text(sql.format(now=now, for_update=for_update)) for name, sql in USER_SQL.items()}
    for name, stmt in built.items():
        if name.endswith("_in"):
            built[name] = stmt.bindparams(bindparam("ps", expanding=True))
    return built
