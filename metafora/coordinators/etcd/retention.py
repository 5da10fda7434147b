"""Retention on etcd (see :mod:`metafora.core.retention`), shared by the etcd client and coordinator.

Keys (under the namespace's root):

- ``retention``: the policy, ``{"done": secs|null, "failed": ..., "killed": ...}`` (absent:
  :data:`~metafora.core.retention.DEFAULT_RETENTION`);
- ``retention-turn``: the ISO time before which no node takes the prune turn. A node takes
  the turn with a txn comparing the key's ``mod_revision`` (or its absence) to what it read:
  of nodes racing, one txn succeeds -- the compare-and-set a schedule's tick takes.

A client's prune batch (``prune``, ``purge``) reads the tasks (one range) and the
state-machine states. A coordinator's periodic pruner reads only the finished tasks its watch
cache names, oldest first, up to the first one finished after the latest cut-off: every
interval, on the node that has the turn, a read of the tasks it may prune, never of every task
held (at 100,000 tasks that read was half a million keys a minute on an idle cluster). Each
chosen task is deleted in a txn of its own, guarded by the task's state key
revision and the absence of an owner: its prefix, its state-machine state and its command
queue go together or not at all, so a node dying mid-batch leaves whole tasks.

Gate items live in a SQL database of their own with an etcd coordinator: what
:meth:`~metafora.core.retention.RetentionOps.prune_also` registered (the gate handler registers its
item store's ``delete_partitions``) deletes them. When anything is registered, each task's txn
also puts ``pruned/<id>``; once the batch's registered functions returned, those keys are
deleted. A node dying in between leaves the keys, and the next batch of any node with
something registered calls it for them first (deleting items is idempotent). A task submitted
again under a pruned id before that next batch would lose the items added for it meanwhile:
prune turns are an interval apart and a crash is rare, but such an id had better be new.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta

from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import (
    Keys,
    TaskRecord,
    escape,
    gather,
    iso,
    parse_iso,
    task_info,
    unescape,
)
from metafora.coordinators.etcd.ops import (
    Delete,
    KeyValue,
    Op,
    Put,
    Range,
    TxnRequest,
    absent,
    exists,
    modified_at,
)
from metafora.coordinators.etcd.queries import live_members, read_all_tasks
from metafora.core.clock import Clock
from metafora.core.errors import MetaforaError
from metafora.core.retention import (
    DEFAULT_RETENTION,
    Cutoffs,
    PruneAlso,
    Retention,
    RetentionOps,
    prunable,
)

__all__ = ["EtcdRetention"]

_IN_FLIGHT = 100  # txns of one batch sent at once


def _policy_key(keys: Keys) -> bytes:
    return keys.root + b"retention"


def _turn_key(keys: Keys) -> bytes:
    return keys.root + b"retention-turn"


def _pruned(keys: Keys) -> bytes:
    """The prefix of the ids pruned whose outside keys (gate items) are not deleted yet."""
    return keys.root + b"pruned/"


def _also(driver: EtcdDriver, keys: Keys, ids: list[str], also: Sequence[PruneAlso]) -> None:
    """Call ``also`` with ``ids``, then drop their ``pruned/`` keys."""
    for delete in also:
        delete(ids)
    keys_done = [Delete(_pruned(keys) + escape(i).encode()) for i in ids]
    # etcd takes at most 128 operations a txn (--max-txn-ops): 100 keys each, sent together
    done: list[TxnRequest] = [([], keys_done[k:k + _IN_FLIGHT], [])
                              for k in range(0, len(keys_done), _IN_FLIGHT)]
    for result in driver.txns(done):
        if isinstance(result, MetaforaError):
            raise result


def _left_over(driver: EtcdDriver, keys: Keys, limit: int,
               also: Sequence[PruneAlso]) -> None:
    """What a node that died mid-batch left: ``also`` for the ids it recorded."""
    kvs = driver.txn([], [Range(_pruned(keys), prefix=True, keys_only=True, limit=limit)]).ranges[0]
    if kvs:
        start = len(_pruned(keys))
        _also(driver, keys, [unescape(kv.key[start:].decode()) for kv in kvs], also)


_READ_TASKS_PER_TXN = 40  # 3 ranges a task, within etcd's 128 operations a txn


def _read_candidates(driver: EtcdDriver, keys: Keys, candidates: Sequence[str]
                     ) -> tuple[dict[str, TaskRecord], dict[bytes, str]]:
    """The keys of ``candidates`` and their state-machine states, in txns sent together."""
    if not candidates:
        return {}, {}
    reads: list[TxnRequest] = []
    for start in range(0, len(candidates), _READ_TASKS_PER_TXN):
        ops: list[Op] = []
        for task_id in candidates[start:start + _READ_TASKS_PER_TXN]:
            tk = keys.task(task_id)
            ops += [Range(tk.prefix, prefix=True), Range(tk.owner), Range(tk.machine)]
        reads.append(([], ops, []))
    found: list[KeyValue] = []
    machines: dict[bytes, str] = {}
    for result in driver.txns(reads, repeatable=True):
        if isinstance(result, MetaforaError):
            raise result
        for n, kvs in enumerate(result.ranges):
            if n % 3 == 2:
                machines.update((kv.key, kv.value.decode(errors="replace")) for kv in kvs)
            else:
                found += kvs
    return gather(keys, found), machines


def get(driver: EtcdDriver, keys: Keys) -> Retention:
    """The stored policy (the default when none)."""
    kvs = driver.txn([], [Range(_policy_key(keys))]).ranges[0]
    if not kvs:
        return DEFAULT_RETENTION
    raw = json.loads(kvs[0].value)
    return Retention.from_seconds(raw.get("done"), raw.get("failed"), raw.get("killed"))


def put(driver: EtcdDriver, keys: Keys, policy: Retention) -> None:
    """Store the policy."""
    body = json.dumps(policy.to_json(), sort_keys=True).encode()
    driver.txn([], [Put(_policy_key(keys), body)])


def turn(driver: EtcdDriver, keys: Keys, clock: Clock,
         interval: float) -> tuple[Retention, Cutoffs] | None:
    """Take the prune turn, or None (another node has it within ``interval``)."""
    key = _turn_key(keys)
    result = driver.txn([], [Range(key), Range(_policy_key(keys))], repeatable=True)
    now = clock.now()
    found = result.ranges[0]
    if found:
        due = parse_iso(found[0].value.decode())
        if due is not None and due > now:
            return None
        guard = modified_at(key, found[0].mod_revision)
    else:
        guard = absent(key)
    nxt = iso(now + timedelta(seconds=interval)).encode()
    if not driver.txn([guard], [Put(key, nxt)]).succeeded:
        return None
    policy = get(driver, keys)
    return policy, Cutoffs.at(policy, now)


def prune_batch(driver: EtcdDriver, keys: Keys, cutoffs: Cutoffs, limit: int,
                also: Sequence[PruneAlso] = (), candidates: Sequence[str] | None = None) -> int:
    """Delete up to ``limit`` finished tasks past ``cutoffs``, a txn per task, then call each
    of ``also`` with their ids (see the module docstring); how many.

    ``candidates``: the tasks to consider, oldest first (a coordinator's watch cache names
    them); None reads every task and state-machine state (a client's prune or purge).
    """
    if cutoffs.oldest() is None:
        return 0
    if also:
        _left_over(driver, keys, limit, also)
    if candidates is None:
        records, _ = read_all_tasks(driver, keys)
        machines = {kv.key: kv.value.decode(errors="replace")
                    for kv in driver.txn([], [Range(keys.states, prefix=True)]).ranges[0]}
        order = sorted(records)
    else:
        records, machines = _read_candidates(driver, keys, candidates)
        order = [task_id for task_id in candidates if task_id in records]
    requests: list[TxnRequest] = []
    ids: list[str] = []
    for task_id in order:
        rec = records[task_id]
        info = task_info(task_id, rec)
        if info is None or rec.state is None or rec.owner is not None:
            continue
        tk = keys.task(task_id)
        if not prunable(info, machines.get(tk.machine), cutoffs):
            continue
        ops: list[Delete | Put] = [Delete(tk.prefix, prefix=True), Delete(tk.machine),
                                   Delete(tk.commands, prefix=True)]
        if also:
            ops.append(Put(_pruned(keys) + escape(task_id).encode(), b""))
        requests.append((
            [modified_at(tk.state, rec.state.mod_revision), exists(tk.state), absent(tk.owner)],
            ops, [],
        ))
        ids.append(task_id)
        if len(requests) >= limit:
            break
    deleted: list[str] = []
    for start in range(0, len(requests), _IN_FLIGHT):
        results = driver.txns(requests[start:start + _IN_FLIGHT])
        for task_id, result in zip(ids[start:start + _IN_FLIGHT], results, strict=True):
            if isinstance(result, MetaforaError):
                raise result
            if result.succeeded:
                deleted.append(task_id)
    if deleted and also:
        _also(driver, keys, deleted, also)
    return len(deleted)


class EtcdRetention(RetentionOps):
    """The retention hooks of the etcd client and coordinator."""

    def _retention_parts(self) -> tuple[EtcdDriver, Keys, Clock]:
        raise NotImplementedError

    def _retention_get(self) -> Retention:
        driver, keys, _ = self._retention_parts()
        return get(driver, keys)

    def _retention_put(self, policy: Retention) -> None:
        driver, keys, _ = self._retention_parts()
        put(driver, keys, policy)

    def _prune_now(self) -> datetime:
        return self._retention_parts()[2].now()

    def _prune_turn(self, interval: float) -> tuple[Retention, Cutoffs] | None:
        driver, keys, clock = self._retention_parts()
        return turn(driver, keys, clock, interval)

    def _prune_batch(self, cutoffs: Cutoffs, limit: int) -> int:
        driver, keys, _ = self._retention_parts()
        return prune_batch(driver, keys, cutoffs, limit, self._prune_extras())

    def node_capacities(self) -> dict[str, int]:
        """Live node -> its published capacity (the client's read)."""
        driver, keys, _ = self._retention_parts()
        return {node: m.capacity for node, m in live_members(driver, keys).items()
                if m.capacity is not None}

    def namespace_label(self) -> str:
        return self._retention_parts()[1].namespace

    def pending_count(self) -> int:
        driver, keys, _ = self._retention_parts()
        records, _ = read_all_tasks(driver, keys)
        return sum(1 for task_id, rec in records.items()
                   if (info := task_info(task_id, rec)) is not None and info.state.value == "pending")
