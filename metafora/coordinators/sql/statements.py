"""Every SQL statement of the store, written once for both dialects and built once per store.

The node's statements (claims, outcomes, the lease, commands, the watch) and the nodes' reads
are here; the operator client's (submit, retry, delete, task reads and counts, purge) are in
:mod:`~metafora.coordinators.sql.client_statements`. :class:`Statements` is the one lookup of both.

``{now}``, ``{next_token}``, ``{lock}``, ``{notify_*}`` ... are filled in by the
:class:`~metafora.coordinators.sql.dialect.Dialect`; ``:name`` are bind parameters (``:ns``,
the namespace, is in every statement). The texts are compiled once and cached by SQLAlchemy,
so the hot path (claim, heartbeat, done) pays no per-call SQL construction.
"""

from __future__ import annotations

from sqlalchemy import TextClause, bindparam, text

from metafora.coordinators.sql.client_statements import (
    CLIENT_SQL,
    INFO_COLUMNS,
    SUBMIT_MANY,
    SUBMIT_ROW,
)
from metafora.coordinators.sql.dialect import Dialect
from metafora.coordinators.sql.limits import SQL as LIMIT_SQL

__all__ = ["BATCH", "INFO_COLUMNS", "Statements"]

BATCH = 500
"""Rows per watch query: offers go out in bounded, ordered batches."""

_ENDED = ("CASE WHEN EXISTS (SELECT 1 FROM metafora_tasks WHERE namespace = :ns AND state ="
          " 'pending' AND COL > :since AND COL <= {now}) THEN 1 ELSE 0 END")  # watch_state's
_CLAIMABLE_PENDING = (
    "state = 'pending' AND (launch_at IS NULL OR launch_at <= {now})"
    " AND (expires_at IS NULL OR expires_at > {now})"
)
_OWNER_DEAD = (
    "NOT EXISTS (SELECT 1 FROM metafora_nodes o WHERE o.namespace = :ns"
    " AND o.node_id = metafora_tasks.owner AND o.lease_until > {now})"
)
# A claim anyone may take over: its owner is dead, unknown or NULL (a row written around
# metafora); a NULL claimed_at must not make it unclaimable forever.
_CLAIM_STALE = "(claimed_at IS NULL OR claimed_at < {now}) AND " + _OWNER_DEAD
# Not held for another node (holds.py): a gracefully stopped node's released tasks wait for
# its id until held_until, by the database clock; folded into the claim and the watch's
# scans (:node is the claiming or watching node), never a statement of its own.
_NOT_HELD = (
    "(metafora_tasks.held_for IS NULL OR metafora_tasks.held_for = :node"
    " OR metafora_tasks.held_until <= {now})"
)
# Claimable: pending and due, or claimed by a dead owner. A CASE, not an OR of the two: the
# planner matched each branch to a partial index -- the (namespace, owner, id) one probed
# without its owner is a scan of every claim entry of the namespace, dead ones included, and
# with claims churning it grew to hundreds of ms per claim. Now the rows are found by id.
_CLAIMABLE = (
    "(CASE state WHEN 'pending' THEN (" + _CLAIMABLE_PENDING + " AND " + _NOT_HELD
    + ") WHEN 'claimed' THEN ("
    + _CLAIM_STALE + ") ELSE FALSE END)"
)
_ME_LIVE = (
    "EXISTS (SELECT 1 FROM metafora_nodes me WHERE me.namespace = :ns AND me.node_id = :node"
    " AND me.session = :session AND me.lease_until > {now})"
)
_ME_SESSION = (
    "EXISTS (SELECT 1 FROM metafora_nodes me WHERE me.namespace = :ns AND me.node_id = :node"
    " AND me.session = :session)"
)
# A claim ends any hold of its row.
_UNHOLD = "held_for = NULL, held_until = NULL, "
# A release holds the row for :held (this node, or NULL: no hold) for :secs seconds.
_HOLD = (
    "held_for = :held, held_until = CASE WHEN CAST(:held AS TEXT) IS NULL THEN NULL"
    " ELSE {ts_plus_secs} END, "
)
# A held release is offered to nobody (only its own node may take it, and that one rescans
# when it registers again): the others' watches are only woken to set their timer for the
# end of the hold, when they offer it.
_NOTIFY_UNHELD = "CASE WHEN held_for IS NULL THEN {notify_task} ELSE {notify_held} END"
# A claim taken over from a dead owner counts one more crash of the task in a row.
_CRASHED = "crashes = CASE WHEN state = 'claimed' THEN crashes + 1 ELSE crashes END"
_FENCED = "namespace = :ns AND id = :id AND owner = :node AND token = :token AND state = 'claimed'"
_FINISH_ROWS = "WITH v AS MATERIALIZED (SELECT fid, ftoken, ferror FROM {finish_rows}) "
_FENCED_MANY = (
    "namespace = :ns AND id {in_finished} AND (id, token) IN (SELECT fid, ftoken FROM v)"
    " AND owner = :node AND state = 'claimed'"
)
# What the lease's existing reads (renewal; SQLite's held-claims check) also return: a
# fingerprint of the membership (active nodes, newest start), so a change is noticed with no
# query of its own; PostgreSQL is told at once by NOTIFY as well.
_MEMBERS = (
    " (SELECT count(*) FROM metafora_nodes m WHERE m.namespace = :ns"
    " AND m.lease_until > {now} AND m.leaving IS NOT TRUE),"
    " (SELECT max(m.started_at) FROM metafora_nodes m WHERE m.namespace = :ns"
    " AND m.lease_until > {now})"
)
_SQL: dict[str, str] = {
    # -- claims (the hot path) ------------------------------------------------------------
    # One statement: the sub-select finds and locks the offered row if it is claimable
    # (pending and due, or claimed by a node whose lease the database clock says is over)
    # and this node's own lease is live; the UPDATE takes a fresh token.
    "claim": (
        "UPDATE metafora_tasks SET state = 'claimed', owner = :node, token = {next_token},"
        " claimed_at = {now}, updated_at = {now}, attempts = attempts + 1, " + _UNHOLD + _CRASHED
        + " WHERE namespace = :ns AND id = (SELECT id FROM metafora_tasks WHERE namespace = :ns"
        " AND id = :id AND grp IS NULL AND " + _CLAIMABLE + " AND {selector_ok} AND " + _ME_LIVE
        + "{lock})"
        " RETURNING token, props, crashes, selector, priority, placement"
    ),
    # Several offered tasks at once, in one statement: whichever are still claimable, up to
    # :limit, in the order offered, each with its own token; rows another node holds locked
    # are skipped, not waited for. The CTE is MATERIALIZED so the LIMIT applies once. Both
    # lookups name the ids outright ({in_picked}: PostgreSQL probes the primary key with an
    # array): a join or IN-subquery let a plan built on stale statistics (a namespace filled
    # since the last ANALYZE) scan the whole namespace once per claimed row.
    "claim_many": (
        "WITH picked AS MATERIALIZED (SELECT id, {offered_pos} AS pos FROM {offered_tasks}"
        " AND metafora_tasks.grp IS NULL AND " + _CLAIMABLE + " AND {selector_ok} AND " + _ME_LIVE
        + " ORDER BY {offered_pos} LIMIT :limit{lock})"
        " UPDATE metafora_tasks SET state = 'claimed', owner = :node, token = {next_token_at},"
        " claimed_at = {now}, updated_at = {now}, attempts = attempts + 1, " + _UNHOLD + _CRASHED
        + " WHERE namespace = :ns AND id {in_picked}"
        " RETURNING id, token, props, crashes, selector, priority, placement"
    ),
    # Which offered ids are still claimable, in the order offered: SQLite reads it without
    # the write lock before a claim likely to lose most of its offers (see claim_many).
    "claimable_ids": (
        "SELECT metafora_tasks.id FROM {offered_tasks} AND " + _CLAIMABLE
        + " AND {selector_ok} ORDER BY {offered_pos}"
    ),
    "release": (
        "UPDATE metafora_tasks SET state = 'pending', owner = NULL, claimed_at = NULL, " + _HOLD
        + "crashes = 0, ready = {next_token}, updated_at = {now} WHERE " + _FENCED
        + " RETURNING ready, " + _NOTIFY_UNHELD
    ),
    "done": (
        "UPDATE metafora_tasks SET state = 'done', owner = NULL, finished_at = {now},"
        " updated_at = {now} WHERE " + _FENCED + " RETURNING token"
    ),
    "fail": (
        "UPDATE metafora_tasks SET state = 'failed', owner = NULL, error = :error,"
        " finished_at = {now}, updated_at = {now} WHERE " + _FENCED + " RETURNING token"
    ),
    # Completion in the application's transaction (Client.complete_task): the claim under
    # :token, whoever its owner, while that owner's lease is live (the owner's own later
    # outcome for the token then finds the row done: see "done_already").
    "complete_tx": (
        "UPDATE metafora_tasks SET state = 'done', owner = NULL, finished_at = {now},"
        " updated_at = {now} WHERE namespace = :ns AND id = :id AND token = :token"
        " AND state = 'claimed' AND NOT " + _OWNER_DEAD + " RETURNING token"
    ),
    # Of refused outcomes (the :rows of a group commit), the claims that ended done under
    # their own token: completed in the application's transaction, so the outcome is moot.
    "done_already": (
        _FINISH_ROWS + "SELECT id, token FROM metafora_tasks WHERE namespace = :ns"
        " AND id {in_finished} AND (id, token) IN (SELECT fid, ftoken FROM v) AND state = 'done'"
    ),
    # Group-committed outcomes (Coordinator.finish_many): one statement per outcome kind for
    # many claims, each row fenced by its own (id, token) as the single-row statements are;
    # the rows written come back, the others were refused (ClaimLost). The outcomes are
    # materialized first so the update walks them through the primary key (SQLite would
    # otherwise re-read the JSON for every claim the node holds).
    "release_many": (
        _FINISH_ROWS + "UPDATE metafora_tasks SET state = 'pending', owner = NULL,"
        " claimed_at = NULL, " + _HOLD + "crashes = 0, ready = {next_token}, updated_at = {now}"
        " WHERE " + _FENCED_MANY + " RETURNING id, token, ready, " + _NOTIFY_UNHELD
    ),
    "done_many": (
        _FINISH_ROWS + "UPDATE metafora_tasks SET state = 'done', owner = NULL,"
        " finished_at = {now}, updated_at = {now} WHERE " + _FENCED_MANY + " RETURNING id, token"
    ),
    "fail_many": (
        _FINISH_ROWS + "UPDATE metafora_tasks SET state = 'failed', owner = NULL,"
        " error = (SELECT v.ferror FROM v WHERE v.fid = metafora_tasks.id"
        " AND v.ftoken = metafora_tasks.token), finished_at = {now}, updated_at = {now}"
        " WHERE " + _FENCED_MANY + " RETURNING id, token"
    ),
    # -- the node lease ---------------------------------------------------------------------
    # Takes over a missing or expired registration only; returns nothing if the id is live.
    "register": (
        "INSERT INTO metafora_nodes (namespace, node_id, session, lease_until, started_at,"
        " renewed_at, host, pid, task_count, frozen, labels, weight, capacity)"
        " VALUES (:ns, :node, :session, {lease_until}, {now}, {now}, :host, :pid, 0, :frozen,"
        " :labels, :weight, :capacity)"
        " ON CONFLICT (namespace, node_id) DO UPDATE SET session = excluded.session,"
        " lease_until = excluded.lease_until, started_at = excluded.started_at,"
        " renewed_at = excluded.renewed_at, host = excluded.host, pid = excluded.pid,"
        " task_count = 0, frozen = excluded.frozen, labels = excluded.labels, leaving = NULL,"
        " weight = excluded.weight, capacity = excluded.capacity"
        " WHERE metafora_nodes.lease_until <= {now}"
        " RETURNING session, {notify_members}"
    ),
    "node_leaving": (
        "UPDATE metafora_nodes SET leaving = TRUE WHERE namespace = :ns AND node_id = :node"
        " AND session = :session RETURNING {notify_members}"
    ),
    "node_frozen": (
        "UPDATE metafora_nodes SET frozen = :frozen WHERE namespace = :ns AND node_id = :node"
        " AND session = :session"
    ),
    # Claims of an earlier registration of this node id (already reported lost, or from a
    # process that died) become pending again; a restarted node may take them back.
    "free_own": (
        "UPDATE metafora_tasks SET state = 'pending', owner = NULL, claimed_at = NULL,"
        " crashes = crashes + 1, ready = {next_token}, updated_at = {now}"
        " WHERE namespace = :ns AND owner = :node AND state = 'claimed'"
        " RETURNING ready, {notify_task}"
    ),
    "drop_commands": "DELETE FROM metafora_commands WHERE namespace = :ns AND node_id = :node",
    # One UPDATE per renewal, whatever the number of tasks, and no read of the tasks: it
    # publishes the node's count and returns its pokes (bumped by a client that changed one of
    # its claims: then, and only then, the node checks its claims) and the membership.
    "heartbeat": (
        "UPDATE metafora_nodes SET lease_until = {lease_until}, renewed_at = {now},"
        " task_count = :count, capacity = :capacity"
        " WHERE namespace = :ns AND node_id = :node AND session = :session"
        " AND lease_until > {now} RETURNING pokes," + _MEMBERS
    ),
    # Between renewals: the node's pokes and the membership (one row of metafora_nodes).
    "node_pokes": (
        "SELECT pokes," + _MEMBERS + " FROM metafora_nodes"
        " WHERE namespace = :ns AND node_id = :node"
    ),
    # The node's count of claims, published as it changes (at most a few times a second).
    "publish_count": (
        "UPDATE metafora_nodes SET task_count = :count WHERE namespace = :ns AND node_id = :node"
        " AND session = :session"
    ),
    # A client changed a claim of :owner: the owner checks its claims at its next look.
    "poke_owner": (
        "UPDATE metafora_nodes SET pokes = pokes + 1 WHERE namespace = :ns AND node_id = :owner"
    ),
    "held_summary": (
        "SELECT count(*), coalesce(sum(token), 0)," + _MEMBERS + " FROM metafora_tasks"
        " WHERE namespace = :ns AND owner = :node AND state = 'claimed'"
    ),
    "held_list": (
        "SELECT id, token FROM metafora_tasks WHERE namespace = :ns AND owner = :node"
        " AND state = 'claimed'"
    ),
    "close_free": (
        "UPDATE metafora_tasks SET state = 'pending', owner = NULL, claimed_at = NULL, " + _HOLD
        + "crashes = 0, ready = {next_token}, updated_at = {now}"
        " WHERE namespace = :ns AND owner = :node AND state = 'claimed' AND " + _ME_SESSION
        + " RETURNING ready, " + _NOTIFY_UNHELD
    ),
    # metafora nodes drain: the tasks held for :node go to every node now.
    "drain_holds": (
        "UPDATE metafora_tasks SET held_for = NULL, held_until = NULL, ready = {next_token},"
        " updated_at = {now} WHERE namespace = :ns AND state = 'pending' AND held_for = :node"
        " AND held_until > {now} RETURNING ready, {notify_task}"
    ),
    "close_commands": (
        "DELETE FROM metafora_commands WHERE namespace = :ns AND node_id = :node AND "
        + _ME_SESSION
    ),
    "close_node": (
        "DELETE FROM metafora_nodes WHERE namespace = :ns AND node_id = :node AND session = :session"
        " RETURNING {notify_members}"
    ),
    # -- commands ---------------------------------------------------------------------------
    "command_peek": (
        "SELECT min(id) FROM metafora_commands WHERE namespace = :ns AND node_id = :node"
    ),
    "command_take": (
        "DELETE FROM metafora_commands WHERE id = (SELECT id FROM metafora_commands"
        " WHERE namespace = :ns AND node_id = :node ORDER BY id LIMIT 1{lock}) RETURNING id, body"
    ),
    "command_submit": (
        "INSERT INTO metafora_commands (namespace, node_id, body, created_at)"
        " SELECT :ns, :node, :body, {now} WHERE EXISTS (SELECT 1 FROM metafora_nodes"
        " WHERE namespace = :ns AND node_id = :node AND lease_until > {now})"
        " RETURNING id, {notify_cmd}"
    ),
    # -- the watch --------------------------------------------------------------------------
    # The database clock, when the next launch_at and the next lease expiry fall due, whether a
    # pending task is past expires_at, how many registrations are dead, and the highest ready
    # value of a pending row (NULL: none pending), whether a launch time, then a hold, ended in
    # (:since, now] (the launched / unheld scans run only then). Each task subquery reads one end
    # or a range of a pending index: a round reads no task row when nothing is pending.
    "watch_state": (
        "SELECT {now},"
        " (SELECT {secs_until_launch} FROM metafora_tasks WHERE namespace = :ns"
        " AND state = 'pending' AND launch_at > {now}),"
        " (SELECT {secs_until_lease} FROM metafora_nodes WHERE namespace = :ns"
        " AND lease_until > {now}),"
        " CASE WHEN (SELECT min(expires_at) FROM metafora_tasks WHERE namespace = :ns"
        " AND state = 'pending' AND expires_at IS NOT NULL) <= {now} THEN 1 ELSE 0 END,"
        " (SELECT count(*) FROM metafora_nodes WHERE namespace = :ns AND lease_until <= {now}),"
        " (SELECT max(ready) FROM metafora_tasks WHERE namespace = :ns AND state = 'pending'),"
        " (SELECT {secs_until_unhold} FROM metafora_tasks WHERE namespace = :ns"
        " AND state = 'pending' AND held_until > {now}), " + _ENDED.replace("COL", "launch_at")
        + ", " + _ENDED.replace("COL", "held_until")
    ),
    # Tasks whose hold ended in (:since, :until]: offered to every node then (one timer per
    # watch, from the soonest hold; through the pending held_until index).
    "scan_unheld": (
        "SELECT id, props, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND state = 'pending' AND held_until > :since"
        " AND held_until <= :until AND " + _CLAIMABLE_PENDING
        + " ORDER BY held_until, id LIMIT :limit"
    ),
    # Selects of offered tasks end with (selector, priority, placement): see Watch._offer.
    "scan_pending": (
        "SELECT id, props, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND priority = :priority AND id > :after AND id <= :until"
        " AND " + _CLAIMABLE_PENDING + " AND " + _NOT_HELD + " ORDER BY id LIMIT :limit"
    ),
    # The priorities of the pending rows, highest first, and how many rows each has: full
    # scans walk them in that order (through the (namespace, priority, id) pending index).
    "pending_levels": (
        "SELECT priority, count(*) FROM metafora_tasks WHERE namespace = :ns"
        " AND state = 'pending' GROUP BY priority ORDER BY priority DESC"
    ),
    # A random place in the pending rows of one priority: full scans start there and wrap
    # around, so nodes racing over one backlog claim in different regions of it.
    "pending_at": (
        "SELECT id FROM metafora_tasks WHERE namespace = :ns AND state = 'pending'"
        " AND priority = :priority ORDER BY id LIMIT 1 OFFSET :skip"
    ),
    "scan_ready": (
        "SELECT id, props, ready, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND state = 'pending'"
        " AND (ready, id) > (:ready, :after) AND " + _CLAIMABLE_PENDING + " AND " + _NOT_HELD
        + " ORDER BY ready, id LIMIT :limit"
    ),
    # The settle check (PostgreSQL): ids and ready values only (rows not seen: read by id).
    "scan_settled": (
        "SELECT id, ready FROM metafora_tasks WHERE namespace = :ns AND state = 'pending'"
        " AND (ready, id) > (:ready, :after) AND ready <= :until AND " + _CLAIMABLE_PENDING
        + " AND " + _NOT_HELD + " ORDER BY ready, id LIMIT :limit"
    ),
    "scan_launched": (
        "SELECT id, props, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND state = 'pending' AND launch_at > :since AND launch_at <= :until"
        " AND (expires_at IS NULL OR expires_at > {now}) ORDER BY launch_at, id LIMIT :limit"
    ),
    "scan_ids_hot": (
        "SELECT id, props, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND id {in_ids} AND "
        + _CLAIMABLE_PENDING + " AND " + _NOT_HELD
    ),
    "scan_ids": (
        "SELECT id, props, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND id IN :ids AND "
        + _CLAIMABLE_PENDING + " AND " + _NOT_HELD
    ),
    # Claims whose owner's registration is expired (cheap: through the dead nodes).
    "scan_dead_owners": (
        "SELECT t.id, t.props, t.token, t.owner, t.selector, t.priority, t.placement"
        " FROM metafora_nodes n JOIN metafora_tasks t"
        " ON t.namespace = n.namespace AND t.owner = n.node_id AND t.state = 'claimed'"
        " WHERE n.namespace = :ns AND n.lease_until <= {now} AND (t.owner, t.id) > (:owner, :after)"
        " ORDER BY t.owner, t.id LIMIT :limit"
    ),
    # Claims whose owner's registration is expired or missing altogether (full scans; walks
    # the claimed rows only, through the (namespace, owner, id) partial index).
    "scan_orphans": (
        "SELECT id, props, token, owner, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND state = 'claimed' AND (owner, id) > (:owner, :after) AND " + _OWNER_DEAD
        + " ORDER BY owner, id LIMIT :limit"
    ),
    # Claims with no owner at all (written around metafora): the keyset above never
    # reaches them, as (NULL, id) > (...) is never true.
    "scan_unowned": (
        "SELECT id, props, token, owner, selector, priority, placement FROM metafora_tasks"
        " WHERE namespace = :ns AND state = 'claimed' AND owner IS NULL AND id > :after"
        " ORDER BY id LIMIT :limit"
    ),
    # A task that can never run (props or id not valid, written around metafora): failed,
    # with the reason, instead of pending forever.
    "fail_invalid": (
        "UPDATE metafora_tasks SET state = 'failed', owner = NULL, error = :error,"
        " finished_at = {now}, updated_at = {now} WHERE namespace = :ns AND id = :id"
        " AND (state = 'pending' OR (state = 'claimed' AND " + _OWNER_DEAD + "))"
    ),
    "sweep_expired": (
        "UPDATE metafora_tasks SET state = 'expired', finished_at = expires_at, updated_at = {now}"
        " WHERE namespace = :ns AND state = 'pending' AND expires_at <= {now}"
    ),
    # Registrations dead for longer than :secs (negative) that hold nothing, and the
    # commands nobody will read any more.
    "clean_nodes": (
        "DELETE FROM metafora_nodes WHERE namespace = :ns AND lease_until < {ts_plus_secs}"
        " AND NOT EXISTS (SELECT 1 FROM metafora_tasks t WHERE t.namespace = :ns"
        " AND t.owner = metafora_nodes.node_id AND t.state = 'claimed')"
    ),
    "clean_commands": (
        "DELETE FROM metafora_commands WHERE namespace = :ns AND NOT EXISTS (SELECT 1"
        " FROM metafora_nodes n WHERE n.namespace = :ns AND n.node_id = metafora_commands.node_id)"
    ),
    # -- the nodes, for the client and the coordinator's balancers (nodes.NodeReads) ---------
    "nodes": (
        "SELECT node_id FROM metafora_nodes WHERE namespace = :ns AND lease_until > {now}"
        " ORDER BY node_id"
    ),
    "node_infos": (
        "SELECT n.node_id, (SELECT count(*) FROM metafora_tasks t WHERE t.namespace = :ns"
        " AND t.owner = n.node_id AND t.state = 'claimed'), n.host, n.pid, n.started_at,"
        " n.renewed_at, n.frozen, n.labels, n.weight FROM metafora_nodes n"
        " WHERE n.namespace = :ns AND n.lease_until > {now} ORDER BY n.node_id"
    ),
    "node_labels": (
        "SELECT node_id, labels FROM metafora_nodes WHERE namespace = :ns AND lease_until > {now}"
    ),
    # The counts carry each node's weight, frozen flag and capacity: a balancer asks for them
    # right after the counts, and the coordinator answers from this same read (members.py).
    "node_members": (
        "SELECT node_id, weight, frozen, capacity FROM metafora_nodes WHERE namespace = :ns"
        " AND lease_until > {now}"
    ),
    # Exact counts from the claims themselves (operators' views and tests; on demand only).
    "node_counts": (
        "SELECT n.node_id, (SELECT count(*) FROM metafora_tasks t WHERE t.namespace = :ns"
        " AND t.owner = n.node_id AND t.state = 'claimed'), n.weight, n.frozen, n.capacity"
        " FROM metafora_nodes n WHERE n.namespace = :ns AND n.lease_until > {now}"
    ),
    # The cluster's view on /metrics: the counts the active nodes published (one row per node,
    # no read of the tasks), then how many tasks are claimable, counted up to :cap rows.
    "published_counts": (
        "SELECT n.node_id, n.task_count, n.weight, n.frozen, n.capacity FROM metafora_nodes n"
        " WHERE n.namespace = :ns AND n.lease_until > {now} AND n.leaving IS NOT TRUE"
    ),
    # The balancers' read: the active nodes' counts from the claims themselves and, in a row
    # with a NULL node id, how many tasks are claimable, as of one snapshot (their sum is the
    # cluster's work, which no claim changes: counts published a moment late broke that sum,
    # and a join moved half a share too many).
    "active_counts": (
        "SELECT n.node_id, (SELECT count(*) FROM metafora_tasks t WHERE t.namespace = :ns"
        " AND t.owner = n.node_id AND t.state = 'claimed'), n.weight, n.frozen, n.capacity"
        " FROM metafora_nodes n"
        " WHERE n.namespace = :ns AND n.lease_until > {now} AND n.leaving IS NOT TRUE"
        " UNION ALL SELECT NULL, count(*), NULL, NULL, NULL FROM metafora_tasks WHERE namespace = :ns"
        " AND " + _CLAIMABLE_PENDING
    ),
    "claimable_capped": (
        "SELECT CASE WHEN (SELECT max(ready) FROM metafora_tasks WHERE namespace = :ns"
        " AND state = 'pending') IS NULL THEN 0 ELSE (SELECT count(*) FROM (SELECT 1"
        " FROM metafora_tasks WHERE namespace = :ns AND " + _CLAIMABLE_PENDING
        + " LIMIT :cap) c) END"
    ),
}


def _claim_done(claim_many: str) -> str:
    """PostgreSQL: ``done_many`` and ``claim_many`` as one statement, one round trip.

    Each part keeps its own fence: the outcomes are written where owner, token and state
    still match (``v``/``fin``, as ``done_many``), the claim takes rows only while this node's
    lease is live (``picked``/``got``, as ``claim_many``). All sub-statements see one
    snapshot, so a row finished here is not claimable here. Rows: the claimed ones (``id,
    token, props, crashes, selector, priority, placement``, FALSE) and the finished ones
    (``id, token``, NULLs, TRUE).
    """
    ctes, marker, update = claim_many.partition(" UPDATE metafora_tasks SET state = 'claimed'")
    if not marker or not ctes.startswith("WITH "):
        raise AssertionError("claim_many is no longer WITH ... UPDATE: rewrite _claim_done")
    return (
        _FINISH_ROWS.rstrip() + ", fin AS (UPDATE metafora_tasks SET state = 'done', owner = NULL,"
        " finished_at = {now}, updated_at = {now} WHERE " + _FENCED_MANY + " RETURNING id, token), "
        + ctes[len("WITH "):] + ", got AS (" + marker.lstrip() + update + ")"
        " SELECT id, token, props, crashes, selector, priority, placement, FALSE FROM got"
        " UNION ALL SELECT id, token, NULL, NULL, NULL, NULL, NULL, TRUE FROM fin"
    )


_SQL["claim_done_many"] = _claim_done(_SQL["claim_many"])

# Only the claims the update did not write are looked up (none, usually).
_MOOT = (
    " UNION ALL SELECT t.id, t.token{blanks}, TRUE FROM v JOIN metafora_tasks t"
    " ON t.namespace = :ns AND t.id = v.fid AND t.token = v.ftoken"
    " WHERE t.state = 'done' AND v.fid NOT IN (SELECT id FROM fin)"
)


def _with_moot(outcome: str, blanks: str) -> str:
    """PostgreSQL: a group-committed outcome statement that also answers, in the same round
    trip, which of its claims already ended done under their own token (completed in the
    application's transaction, ``complete_tx``): its rows and FALSE, then ``id, token``,
    ``blanks`` and TRUE for those. The second part reads the statement's snapshot, where a
    row the update writes is still claimed."""
    head, verb, update = outcome.partition("UPDATE metafora_tasks SET")
    if not verb or not head.startswith("WITH v AS"):
        raise AssertionError("an outcome statement is no longer WITH v ... UPDATE: rewrite _with_moot")
    return (head.rstrip() + ", fin AS (" + verb + update + ") SELECT *, FALSE FROM fin"
            + _MOOT.replace("{blanks}", blanks))


for _name, _blanks in (("done_many", ""), ("fail_many", ""), ("release_many", ", NULL, NULL")):
    _SQL[_name + "_moot"] = _with_moot(_SQL[_name], _blanks)

_CLAIM_SET = (
    "state = 'claimed', owner = :node, token = {next_token_at}, claimed_at = {now},"
    " updated_at = {now}, attempts = attempts + 1, " + _UNHOLD + _CRASHED
)
# Claims of tasks with a group, the limits and their log (see limits.py).
_SQL.update({
    name: sql.replace("CLAIMABLE", _CLAIMABLE).replace("ME_LIVE", _ME_LIVE)
    .replace("CLAIM_SET", _CLAIM_SET)
    for name, sql in LIMIT_SQL.items()
})

_SQL.update(CLIENT_SQL)  # the client's statements (client_statements.py): one lookup

_EXPANDING = {"scan_ids": "ids", "list_states": "states"}


class Statements:
    """The statements of one store, as compiled-once :class:`~sqlalchemy.TextClause` objects."""

    def __init__(self, dialect: Dialect) -> None:
        fragments = dialect.fragments()
        # Seconds to the soonest end of a hold: the launch time's expression, on held_until.
        fragments["secs_until_unhold"] = fragments["secs_until_launch"].replace(
            "launch_at", "held_until")
        self._row = SUBMIT_ROW.format(**fragments)
        self._many: dict[int, TextClause] = {}
        self._built: dict[str, TextClause] = {}
        for name, sql in _SQL.items():
            clause = text(sql.format(**fragments))
            if name in _EXPANDING:
                clause = clause.bindparams(bindparam(_EXPANDING[name], expanding=True))
            self._built[name] = clause

    def __getitem__(self, name: str) -> TextClause:
        return self._built[name]

    def submit_many(self, rows: int) -> TextClause:
        """The multi-row INSERT of ``rows`` tasks (built once per size; returns id, ready)."""
        clause = self._many.get(rows)
        if clause is None:
            values = ", ".join(self._row.replace("ROWNUM", str(n)) for n in range(rows))
            clause = self._many[rows] = text(SUBMIT_MANY.format(rows=values))
        return clause
