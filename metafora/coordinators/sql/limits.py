"""Limits per task group on a SQL store: the claim-time check and the client's statements
(SQL text only: :class:`~metafora.coordinators.sql.client.SQLClient` runs the statements).

A claim of a task with a group goes through the ``*_grouped`` claim statements (tasks with no
group keep the plain ones, which only gain ``grp IS NULL``): each offered group's **room** --
its ``max_running`` minus its live claims (claimed rows whose owner's lease the database
clock says is live), and its ``rate_count`` minus its claims in the last ``rate_secs`` -- is
computed inside the claim's own statement, and the offers of a group are ranked so that no
more than its room are claimed.

Atomicity:

- SQLite: every write holds the database's write lock (``BEGIN IMMEDIATE``), so the counts a
  claim reads cannot change under it; the claim times of rate-limited groups are logged by a
  second statement of the same transaction.
- PostgreSQL: ``metafora_group_room(ns, grp)`` (plpgsql, VOLATILE) takes the group's limit
  row ``FOR UPDATE`` -- claims of one limited group queue on it, in group order, so two
  claim statements never wait on each other in a cycle -- and then counts. A VOLATILE
  function's queries see a fresh snapshot, so the count includes every claim committed by
  the previous holder of the row lock (each claim statement commits before its lock is
  released). Outcomes never take that lock: a claim ending meanwhile can only make the count
  look higher than it is, which refuses a claim that would have fitted, never the reverse.
  Claim times are logged by a data-modifying CTE of the claim statement itself.

A group with no limit row gets a room of :data:`~metafora.core.limits.NO_ROOM_CAP`; tasks with no
group pay nothing but the ``grp IS NULL`` test.
"""

from __future__ import annotations

from metafora.core.limits import NO_ROOM_CAP

__all__ = ["PG_ROOM_FUNCTION", "SQL", "pg_fragments", "sqlite_fragments"]

PG_ROOM_FUNCTION = f"""CREATE OR REPLACE FUNCTION metafora_group_room(p_ns text, p_grp text)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  lim record;
  room bigint := {NO_ROOM_CAP};
  used bigint;
BEGIN
  SELECT max_running, rate_count, rate_secs INTO lim FROM metafora_limits
   WHERE namespace = p_ns AND grp = p_grp FOR UPDATE;
  IF NOT FOUND THEN
    RETURN room;
  END IF;
  IF lim.max_running IS NOT NULL THEN
    SELECT count(*) INTO used FROM metafora_tasks t
     WHERE t.namespace = p_ns AND t.grp = p_grp AND t.state = 'claimed'
       AND EXISTS (SELECT 1 FROM metafora_nodes o WHERE o.namespace = p_ns
                   AND o.node_id = t.owner AND o.lease_until > now());
    room := least(room, lim.max_running - used);
  END IF;
  IF lim.rate_count IS NOT NULL THEN
    DELETE FROM metafora_rate_log WHERE namespace = p_ns AND grp = p_grp
       AND at <= clock_timestamp() - make_interval(secs => lim.rate_secs);
    SELECT count(*) INTO used FROM metafora_rate_log WHERE namespace = p_ns AND grp = p_grp;
    room := least(room, lim.rate_count - used);
  END IF;
  RETURN room;
END $$"""

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_SQLITE_AGO = "strftime('%Y-%m-%d %H:%M:%f', 'now', printf('-%d seconds', l.rate_secs))"

# The room of the group named by GRP (SQLite: one scalar sub-select; every write holds the
# database lock, so nothing changes between this count and the claim).
_SQLITE_ROOM = (
    f"coalesce((SELECT min(CASE WHEN l.max_running IS NULL THEN {NO_ROOM_CAP} ELSE l.max_running"
    " - (SELECT count(*) FROM metafora_tasks g WHERE g.namespace = :ns AND g.grp = l.grp"
    " AND g.state = 'claimed' AND EXISTS (SELECT 1 FROM metafora_nodes o"
    f" WHERE o.namespace = :ns AND o.node_id = g.owner AND o.lease_until > {_SQLITE_NOW})) END,"
    f" CASE WHEN l.rate_count IS NULL THEN {NO_ROOM_CAP} ELSE l.rate_count - (SELECT count(*)"
    f" FROM metafora_rate_log r WHERE r.namespace = :ns AND r.grp = l.grp AND r.at > {_SQLITE_AGO}) END)"
    f" FROM metafora_limits l WHERE l.namespace = :ns AND l.grp = GRP), {NO_ROOM_CAP})"
)


def pg_fragments() -> dict[str, str]:
    """The limit fragments of PostgreSQL (see :meth:`Dialect.fragments`)."""
    return {
        "group_room": "metafora_group_room(:ns, d.grp)",
        "rate_edge": "(now() - make_interval(secs => l.rate_secs))",
        # The claim's own statement logs the claim times of rate-limited groups.
        "claimed_open": ", claimed AS (",
        "claimed_grp": ", grp",
        "claimed_close": (
            "), logged AS (INSERT INTO metafora_rate_log (namespace, grp, at)"
            " SELECT :ns, c.grp, clock_timestamp() FROM claimed c JOIN metafora_limits l"
            " ON l.namespace = :ns AND l.grp = c.grp WHERE l.rate_count IS NOT NULL)"
            " SELECT id, token, props, crashes, selector, priority, placement FROM claimed"
        ),
    }


def sqlite_fragments() -> dict[str, str]:
    """The limit fragments of SQLite (the claim times are logged by ``rate_log_add``)."""
    return {"group_room": _SQLITE_ROOM.replace("GRP", "d.grp"), "rate_edge": _SQLITE_AGO,
            "claimed_open": " ", "claimed_grp": "", "claimed_close": ""}


# The rows a grouped claim considers: claimable offers (locked on PostgreSQL), each group's
# room (groups in name order: the order their limit rows are locked in), the offers ranked
# within their group, and the picked ones: every offer without a group, and a group's first
# `room` offers, in the order offered, up to :limit.
_GROUPED_PICK = (
    "WITH cand AS MATERIALIZED (SELECT metafora_tasks.id AS id, metafora_tasks.grp AS grp,"
    " {offered_pos} AS pos FROM {offered_tasks} AND CLAIMABLE AND {selector_ok} AND ME_LIVE"
    " ORDER BY {offered_pos}{lock}),"
    " rooms AS MATERIALIZED (SELECT d.grp AS grp, {group_room} AS room"
    " FROM (SELECT DISTINCT grp FROM cand WHERE grp IS NOT NULL ORDER BY grp) d),"
    " ranked AS MATERIALIZED (SELECT c.id AS id, c.pos AS pos, c.grp AS grp,"
    " row_number() OVER (PARTITION BY c.grp ORDER BY c.pos) AS rn FROM cand c),"
    " picked AS MATERIALIZED (SELECT r.id AS id, r.pos AS pos FROM ranked r"
    " LEFT JOIN rooms m ON m.grp = r.grp WHERE r.grp IS NULL OR r.rn <= m.room"
    " ORDER BY r.pos LIMIT :limit)"
)

SQL: dict[str, str] = {
    # CLAIMABLE, ME_LIVE and CLAIM_SET are filled in by the statements module.
    "claim_many_grouped": (
        _GROUPED_PICK + "{claimed_open}UPDATE metafora_tasks SET CLAIM_SET"
        " WHERE namespace = :ns AND id {in_picked}"
        " RETURNING id, token, props, crashes, selector, priority, placement{claimed_grp}"
        "{claimed_close}"
    ),
    # SQLite: log the claim times of the claimed tasks of rate-limited groups, and drop the
    # log rows that left their window (same transaction as the claim).
    "rate_log_add": (
        "INSERT INTO metafora_rate_log (namespace, grp, at) SELECT :ns, l.grp, {now}"
        " FROM json_each(:groups) j JOIN metafora_limits l ON l.namespace = :ns"
        " AND l.grp = j.value WHERE l.rate_count IS NOT NULL"
    ),
    "rate_log_prune": (
        "DELETE FROM metafora_rate_log WHERE namespace = :ns AND grp IN (SELECT value FROM"
        " json_each(:groups)) AND at <= (SELECT " + _SQLITE_AGO + " FROM metafora_limits l"
        " WHERE l.namespace = :ns AND l.grp = metafora_rate_log.grp)"
    ),
    # -- the client -------------------------------------------------------------------------
    "limit_put": (
        "INSERT INTO metafora_limits (namespace, grp, max_running, rate_count, rate_secs,"
        " updated_at) VALUES (:ns, :grp, :max, :rate_count, :rate_secs, {now})"
        " ON CONFLICT (namespace, grp) DO UPDATE SET max_running = excluded.max_running,"
        " rate_count = excluded.rate_count, rate_secs = excluded.rate_secs,"
        " updated_at = excluded.updated_at"
    ),
    "limit_delete": (
        "DELETE FROM metafora_limits WHERE namespace = :ns AND grp = :grp RETURNING grp"
    ),
    "limit_log_clear": "DELETE FROM metafora_rate_log WHERE namespace = :ns AND grp = :grp",
    # Every limit with its group's live claims and its claims inside the window.
    "limit_usage": (
        "SELECT l.grp, l.max_running, l.rate_count, l.rate_secs,"
        " (SELECT count(*) FROM metafora_tasks g WHERE g.namespace = :ns AND g.grp = l.grp"
        " AND g.state = 'claimed' AND EXISTS (SELECT 1 FROM metafora_nodes o"
        " WHERE o.namespace = :ns AND o.node_id = g.owner AND o.lease_until > {now})),"
        " (SELECT count(*) FROM metafora_rate_log r WHERE r.namespace = :ns AND r.grp = l.grp"
        " AND r.at > {rate_edge}) FROM metafora_limits l WHERE l.namespace = :ns ORDER BY l.grp"
    ),
}
