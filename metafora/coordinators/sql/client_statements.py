"""The operator client's SQL statements: submit, retry, delete, task reads and counts, purge.

Written as :mod:`~metafora.coordinators.sql.statements` writes the node's (same fragments,
filled in by the :class:`~metafora.coordinators.sql.dialect.Dialect`), and looked up through
its :class:`~metafora.coordinators.sql.statements.Statements` with them.
"""

from __future__ import annotations

__all__ = ["CLIENT_SQL", "INFO_COLUMNS", "SUBMIT_MANY", "SUBMIT_ROW"]

INFO_COLUMNS = (
    "id, props,"
    " CASE WHEN state = 'pending' AND expires_at <= {now} THEN 'expired' ELSE state END AS state,"
    " owner, token, claimed_at, error, created_at,"
    " CASE WHEN state = 'pending' AND expires_at <= {now} THEN expires_at ELSE finished_at END"
    " AS finished_at, attempts, selector, priority, placement,"
    " CASE WHEN state = 'pending' AND held_until > {now} THEN held_for END AS held_for,"
    " CASE WHEN state = 'pending' AND held_until > {now} THEN held_until END AS held_until"
)
"""The columns of a task listing (with ``{now}`` to fill in), for queries built elsewhere."""

# A retried task: pending again, its error, owner and crash count cleared (the condition on
# its current state follows).
_RETRY = (
    "UPDATE metafora_tasks SET state = 'pending', error = NULL, finished_at = NULL,"
    " owner = NULL, claimed_at = NULL, crashes = 0, ready = {next_token}, updated_at = {now}"
    " WHERE namespace = :ns AND id = :id AND "
)

CLIENT_SQL: dict[str, str] = {
    "submit": (
        "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, launch_at,"
        " expires_at, attempts, created_at, updated_at, selector, priority, placement, grp)"
        " VALUES (:ns, :id, :props, 'pending', 0, {next_token}, :launch_at, :expires_at, 0,"
        " {now}, {now}, :selector, :priority, :placement, :grp)"
        " ON CONFLICT (namespace, id) DO NOTHING"
        " RETURNING ready, {notify_task}"
    ),
    # One wake-up for a bulk submit (see submit_many), not one per task.
    "notify_batch": "SELECT {notify_batch}",
    "delete": (
        "DELETE FROM metafora_tasks WHERE namespace = :ns AND id = :id"
        " RETURNING state, owner, {notify_owner}"
    ),
    "delete_state": "DELETE FROM metafora_state WHERE namespace = :ns AND task_id = :id",
    "retry": (
        _RETRY + "(state IN ('failed', 'expired')"
        " OR (state = 'pending' AND expires_at <= {now})) RETURNING ready, {notify_task}"
    ),
    # retry_with_state(rewrite), in one transaction: read the task's state (a pending
    # task past expires_at counts as expired), its token and its state-machine state, then
    # move it from exactly the state read (a concurrent change makes the UPDATE match nothing).
    "retry_read": (
        "SELECT CASE WHEN t.state = 'pending' AND t.expires_at <= {now} THEN 'expired'"
        " ELSE t.state END, s.body, t.token FROM metafora_tasks t LEFT JOIN metafora_state s"
        " ON s.namespace = t.namespace AND s.task_id = t.id WHERE t.namespace = :ns AND t.id = :id"
    ),
    "retry_from": (
        _RETRY + "(state = :was OR (:was = 'expired'"
        " AND state = 'pending' AND expires_at <= {now})) RETURNING ready, {notify_task}"
    ),
    "state_reset": (
        "UPDATE metafora_state SET body = :body, updated_at = {now}"
        " WHERE namespace = :ns AND task_id = :id"
    ),
    "get": "SELECT " + INFO_COLUMNS + " FROM metafora_tasks WHERE namespace = :ns AND id = :id",
    "list": "SELECT " + INFO_COLUMNS + " FROM metafora_tasks WHERE namespace = :ns ORDER BY id",
    # Task counts, each on its own partial index (one GROUP BY over the table reads every row).
    "count_pending": "SELECT count(*) FROM metafora_tasks WHERE namespace = :ns AND state = 'pending'",
    "count_pending_expired": (
        "SELECT count(*) FROM metafora_tasks WHERE namespace = :ns AND state = 'pending'"
        " AND expires_at IS NOT NULL AND expires_at <= {now}"
    ),
    "count_claimed": "SELECT count(*) FROM metafora_tasks WHERE namespace = :ns AND state = 'claimed'",
    "count_finished": (
        "SELECT state, count(*) FROM metafora_tasks WHERE namespace = :ns"
        " AND state IN ('done', 'failed', 'expired') GROUP BY state"
    ),
    "list_states": (
        "SELECT " + INFO_COLUMNS + " FROM metafora_tasks WHERE namespace = :ns"
        " AND state IN :states ORDER BY id"
    ),
    "purge_state": (
        "DELETE FROM metafora_state WHERE namespace = :ns AND task_id IN (SELECT id"
        " FROM metafora_tasks WHERE namespace = :ns AND state IN ('done', 'failed', 'expired')"
        " AND finished_at <= {ts_plus_secs})"
    ),
    "purge": (
        "DELETE FROM metafora_tasks WHERE namespace = :ns"
        " AND state IN ('done', 'failed', 'expired') AND finished_at <= {ts_plus_secs}"
    ),
}

# Bulk submit: one multi-row INSERT per batch; row N binds id_N, props_N, launch_at_N,
# expires_at_N, selector_N, priority_N and placement_N (ROWNUM in the template). On SQLite
# the rows of a batch share one ready value.
SUBMIT_MANY = (
    "INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, launch_at,"
    " expires_at, attempts, created_at, updated_at, selector, priority, placement, grp)"
    " VALUES {rows}"
    " ON CONFLICT (namespace, id) DO NOTHING RETURNING id, ready"
)
SUBMIT_ROW = (
    "(:ns, :id_ROWNUM, :props_ROWNUM, 'pending', 0, {next_token}, :launch_at_ROWNUM,"
    " :expires_at_ROWNUM, 0, {now}, {now}, :selector_ROWNUM, :priority_ROWNUM,"
    " :placement_ROWNUM, :grp_ROWNUM)"
)
