"""Reads and small writes shared by :class:`EtcdCoordinator` and :class:`EtcdClient`."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any, NamedTuple

from metafora.contracts.client import NodeInfo
from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import (
    Keys,
    TaskRecord,
    decode_json,
    encode_json,
    gather,
    iso,
    labels_of,
    parse_iso,
)
from metafora.coordinators.etcd.ops import KeyValue, Put, Range, absent, modified_at, prefix_end
from metafora.coordinators.members import stored_capacity, stored_weight
from metafora.core.task import parse_time

__all__ = [
    "Registration",
    "expire_task",
    "fail_unclaimed",
    "launch_and_expiry",
    "live_members",
    "live_nodes",
    "member_of",
    "members",
    "newest",
    "node_infos",
    "node_labels",
    "node_task_count",
    "read_all_tasks",
    "read_members",
    "read_snapshot",
    "read_task",
    "read_task_page",
]


def launch_and_expiry(props: dict[str, Any]) -> tuple[datetime | None, datetime | None]:
    """The ``launch_at`` and ``expires_at`` of stored props (unreadable values count as unset)."""
    if "launch_at" not in props and "expires_at" not in props:
        return None, None  # most tasks: asked for every task a re-list reads
    out: list[datetime | None] = []
    for name in ("launch_at", "expires_at"):
        value = props.get(name)
        try:
            out.append(None if value is None else parse_time(value, name))
        except ValueError:
            out.append(None)
    return out[0], out[1]


def read_task(driver: EtcdDriver, keys: Keys, task_id: str) -> TaskRecord:
    """Every key of one task, read at one revision."""
    tk = keys.task(task_id)
    result = driver.txn([], [Range(tk.prefix, prefix=True), Range(tk.owner)], repeatable=True)
    records = gather(keys, result.ranges[0] + result.ranges[1])
    return records.get(task_id, TaskRecord())


def read_all_tasks(driver: EtcdDriver, keys: Keys) -> tuple[dict[str, TaskRecord], int]:
    """Every task key and owner key, read at one revision (returned too)."""
    result = driver.txn(
        [], [Range(keys.tasks, prefix=True), Range(keys.owners, prefix=True)], repeatable=True
    )
    return gather(keys, result.ranges[0] + result.ranges[1]), result.revision


def read_task_page(driver: EtcdDriver, keys: Keys, start: bytes, end: bytes,
                   max_keys: int) -> tuple[list[tuple[str, TaskRecord]], bytes | None]:
    """The tasks whose keys lie in ``[start, end)``, in key order, reading at most about
    ``max_keys`` task keys (and their owner keys, at the same revision); and where the next
    page starts, or None at the end. A task is never split between two pages."""
    kvs, revision = driver.range(Range(start, end=end, limit=max_keys))
    order: list[str] = []
    for kv in kvs:
        parsed = keys.parse(kv.key)
        if parsed is not None and parsed[0] == "task" and (not order or order[-1] != parsed[1]):
            order.append(parsed[1])
    following: bytes | None = None
    if len(kvs) >= max_keys and order:
        # The last task's keys may go on past the limit: it starts the next page instead.
        last = order.pop()
        following = keys.task(last).prefix
        kvs = [kv for kv in kvs if not kv.key.startswith(following)]
        if not order:  # cannot happen with max_keys above a task's key count
            raise ValueError("max_keys is too small for one task's keys")
    if not order:
        return [], following
    owned = sorted(keys.task(task_id).owner for task_id in order)
    owners, _ = driver.range(Range(owned[0], end=owned[-1] + b"\0"), revision=revision)
    records = gather(keys, kvs + owners)
    return [(task_id, records[task_id]) for task_id in order if task_id in records], following


def live_nodes(driver: EtcdDriver, keys: Keys) -> list[str]:
    """Ids of the nodes whose registration (leased) key exists, sorted."""
    kvs, _ = driver.range(Range(keys.nodes, prefix=True, keys_only=True))
    return sorted(_alive(keys, [kv.key for kv in kvs]))


def _alive(keys: Keys, names: list[bytes]) -> set[str]:
    nodes = set()
    for key in names:
        parsed = keys.parse(key)
        if parsed is not None and parsed[0] == "alive":
            nodes.add(parsed[1])
    return nodes


def node_task_count(driver: EtcdDriver, keys: Keys) -> dict[str, int]:
    """Live node -> number of owner keys naming it (0 included), from one consistent read."""
    result = driver.txn(
        [],
        [Range(keys.nodes, prefix=True, keys_only=True), Range(keys.owners, prefix=True)],
        repeatable=True,
    )
    nodes = _alive(keys, [kv.key for kv in result.ranges[0]])
    held = Counter(kv.value.decode(errors="replace") for kv in result.ranges[1])
    return {node: held.get(node, 0) for node in sorted(nodes)}


def node_infos(driver: EtcdDriver, keys: Keys) -> list[NodeInfo]:
    """Live nodes with their task counts, host, pid, start time, frozen flag, labels and
    weight (read in one revision), sorted by id."""
    result = driver.txn(
        [],
        [Range(keys.nodes, prefix=True), Range(keys.owners, prefix=True)],
        repeatable=True,
    )
    counts: dict[str, int] = {}
    for kv in result.ranges[1]:
        owner = kv.value.decode(errors="replace")
        counts[owner] = counts.get(owner, 0) + 1
    infos = []
    for kv in result.ranges[0]:
        parsed = keys.parse(kv.key)
        if parsed is None or parsed[0] != "alive":
            continue
        data = decode_json(kv.value) or {}
        host, pid, frozen = data.get("host"), data.get("pid"), data.get("frozen")
        infos.append(
            NodeInfo(
                parsed[1],
                counts.get(parsed[1], 0),
                host=host if isinstance(host, str) else None,
                pid=pid if isinstance(pid, int) else None,
                started=parse_iso(data.get("started_at")),
                frozen=frozen if isinstance(frozen, bool) else None,
                labels=labels_of(data, parsed[1]),
                weight=stored_weight(data.get("weight"), parsed[1]),
            )
        )
    return sorted(infos, key=lambda n: n.id)


def active_task_count(driver: EtcdDriver, keys: Keys
                      ) -> tuple[dict[str, int], dict[str, Registration], int]:
    """Like :func:`node_task_count`, without nodes whose registration says ``leaving``; what
    the registrations of those nodes say (weights, frozen), from the same read; and the newest
    revision of a key it read (see :func:`newest`)."""
    result = driver.txn(
        [], [Range(keys.nodes, prefix=True), Range(keys.owners, prefix=True)], repeatable=True
    )
    active = {node: m for node, m in members(keys, result.ranges[0]).items() if not m.leaving}
    held = Counter(kv.value.decode(errors="replace") for kv in result.ranges[1])
    return ({node: held.get(node, 0) for node in sorted(active)}, active,
            newest(*result.ranges))


def newest(*kvs: list[KeyValue]) -> int:
    """The newest mod revision among ``kvs`` (0 for none): a watch cache that has reached it
    has seen every key of that read (a store's own revision would also count other
    namespaces' writes, which no event of this one's watch ever reaches)."""
    return max((kv.mod_revision for part in kvs for kv in part), default=0)


class Registration(NamedTuple):
    """What a live node's registration record says of it to the balancers."""

    leaving: bool = False
    frozen: bool = False
    weight: float = 1.0
    capacity: int | None = None  # the most tasks it can run now (None: no bound)


def member_of(value: bytes, node_id: str) -> Registration:
    """The :class:`Registration` a registration record describes (damaged: the defaults)."""
    data = decode_json(value)
    if not isinstance(data, dict):
        return Registration()
    return Registration(bool(data.get("leaving")), data.get("frozen") is True,
                  stored_weight(data.get("weight"), node_id), stored_capacity(data.get("capacity")))


def members(keys: Keys, kvs: list[KeyValue]) -> dict[str, Registration]:
    """Live node -> what its registration says (:class:`Registration`), from keys under ``nodes/``."""
    found: dict[str, Registration] = {}
    for kv in kvs:
        parsed = keys.parse(kv.key)
        if parsed is not None and parsed[0] == "alive":
            found[parsed[1]] = member_of(kv.value, parsed[1])
    return found


def live_members(driver: EtcdDriver, keys: Keys) -> dict[str, Registration]:
    """Live node -> what its registration says, in one range read."""
    return read_members(driver, keys)[0]


def read_members(driver: EtcdDriver, keys: Keys) -> tuple[dict[str, Registration], int]:
    """:func:`live_members`, and the newest revision of a key it read (see :func:`newest`)."""
    kvs, _ = driver.range(Range(keys.nodes, prefix=True))
    return members(keys, kvs), newest(kvs)


SNAPSHOT_PAGE = 20_000
"""Keys per range read of :func:`read_snapshot` (about 3 MB of task keys)."""


def read_snapshot(driver: EtcdDriver, keys: Keys, page: int = SNAPSHOT_PAGE
                  ) -> tuple[dict[str, TaskRecord], dict[str, Registration], int]:
    """What a watch cache starts from, read at one revision (returned too): every task and
    owner key, and the live nodes with what their registrations say (:class:`Registration`).

    Read in pages of ``page`` keys pinned to the first page's revision: one read of a large
    backlog held etcd for seconds, met the request deadline while many nodes started at
    once, and every retry read it all again.
    """
    tasks, revision = _read_pages(driver, keys.tasks, prefix_end(keys.tasks), 0, page)
    # nodes/ and owners/ are neighbours in key order: one range for both, so an idle node's
    # safety-net re-list is two requests, not three (a key that sorted between them would
    # only be read and dropped by the prefix filters below).
    both, revision = _read_pages(driver, keys.nodes, prefix_end(keys.owners), revision, page)
    owners = [kv for kv in both if kv.key.startswith(keys.owners)]
    nodes = [kv for kv in both if kv.key.startswith(keys.nodes)]
    return gather(keys, tasks + owners), members(keys, nodes), revision


def _read_pages(driver: EtcdDriver, start: bytes, end: bytes, revision: int,
                page: int) -> tuple[list[KeyValue], int]:
    """Every key in [``start``, ``end``) at ``revision`` (0: now), page by page; and the
    revision."""
    out: list[KeyValue] = []
    while True:
        # One key more than the page says whether another page follows (no empty last read).
        kvs, current = driver.range(Range(start, end=end, limit=page + 1), revision=revision)
        if revision == 0:
            revision = current  # the first read was at the store's revision: pin the rest
        if len(kvs) <= page:
            return out + kvs, revision
        out += kvs[:page]
        start = kvs[page].key

def node_labels(driver: EtcdDriver, keys: Keys) -> dict[str, dict[str, str]]:
    """Live node -> the labels its registration record publishes."""
    kvs, _ = driver.range(Range(keys.nodes, prefix=True))
    labels: dict[str, dict[str, str]] = {}
    for kv in kvs:
        parsed = keys.parse(kv.key)
        if parsed is not None and parsed[0] == "alive":
            labels[parsed[1]] = labels_of(decode_json(kv.value) or {}, parsed[1])
    return labels


def expire_task(
    driver: EtcdDriver, keys: Keys, task_id: str, props_mod: int, now: datetime
) -> bool:
    """Move a pending task past its ``expires_at`` to ``expired``. True if this call did it.

    Guarded by the props key's mod revision (the same incarnation of the task), no owner and
    no finished state, so it never touches a claimed, finished or resubmitted task.
    """
    record = {"state": "expired", "finished_at": iso(now), "token": 0}
    return _finish_unclaimed(driver, keys, task_id, props_mod, record)


def fail_unclaimed(
    driver: EtcdDriver, keys: Keys, task_id: str, props_mod: int, now: datetime, error: str
) -> bool:
    """Move a pending task that can never run (its stored props are invalid) to ``failed``.

    Same guards as :func:`expire_task`. True if this call did it.
    """
    record = {"state": "failed", "error": error, "finished_at": iso(now), "token": 0}
    return _finish_unclaimed(driver, keys, task_id, props_mod, record)


def _finish_unclaimed(
    driver: EtcdDriver, keys: Keys, task_id: str, props_mod: int, record: dict[str, Any]
) -> bool:
    tk = keys.task(task_id)
    result = driver.txn(
        [absent(tk.owner), absent(tk.state), modified_at(tk.props, props_mod)],
        [Put(tk.state, encode_json(record))],
        repeatable=True,
    )
    return result.succeeded
