"""Stores the campaign can break: a private PostgreSQL and a 3-member etcd cluster.

Each adapter restarts (part of) its store under load, cuts it off for a while (PostgreSQL
stopped; etcd without quorum), and writes raw, malformed commands and tasks straight into
it, bypassing every check of the client.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from metafora.core.errors import MetaforaError
from tests.faults.waiting import hold, poll

__all__ = ["INVALID_IDS", "MALFORMED_PROPS", "EtcdStore", "PostgresStore", "Store"]


class Store(Protocol):
    """A store the campaign can break: restart, cut off, write raw garbage into."""

    kind: str

    def url(self, namespace: str, lease_ttl: int) -> str:
        """A URL of this store with its own namespace."""

    def restart(self, index: int) -> str:
        """Restart (part of) the store under load; returns what was done."""

    def cut(self, seconds: float) -> tuple[float, float]:
        """Make the store unreachable for ``seconds``; returns (begin, end) monotonic times."""

    def inject_command(self, namespace: str, node: str, raw: bytes) -> None:
        """Queue raw command bytes for ``node``, bypassing every check."""

    def inject_task(self, namespace: str, task_id: str, raw_props: bytes) -> None:
        """Write a pending task with raw props bytes, bypassing every check."""

    def bad_commands(self) -> list[bytes]:
        """Malformed commands this store can hold."""


_BAD_COMMANDS = [
    b"{not json",
    b"[]",
    b'{"command": 5}',
    b'{"command": "explode", "parameters": {}}',
    b'{"command": "stop_task", "parameters": {"task": 5}}',
    b'{"command": "freeze", "parameters": [], "extra": 1}',
]

MALFORMED_PROPS: dict[str, bytes] = {
    "bad-json": b"{not json",
    "bad-list": b"[1, 2]",
    "bad-launch": b'{"launch_at": "garbage"}',
}
"""Tasks with valid ids and malformed props (SQL: the props text; etcd: inside the record)."""

INVALID_IDS = ["bad\x01id", "x" * 300]
"""Raw task ids no metafora task may have (a control character; longer than 256)."""


class PostgresStore:
    """A private PostgreSQL (``TempCluster``) that may be killed and restarted."""

    kind = "postgresql"

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def url(self, namespace: str, lease_ttl: int) -> str:
        """``postgresql://...?namespace=NS&lease_ttl=TTL``."""
        return f"{self.cluster.url}?namespace={namespace}&lease_ttl={lease_ttl}"

    def restart(self, index: int) -> str:
        """Immediate shutdown (SIGQUIT to the postmaster), then start again."""
        self.cluster.kill()
        self.cluster.start()
        return "postgresql killed and restarted"

    def cut(self, seconds: float) -> tuple[float, float]:
        """Stop the server for ``seconds`` (every connection refused), then start it."""
        self.cluster.kill()
        begin = time.monotonic()
        hold(seconds)
        end = time.monotonic()
        self.cluster.start()
        return begin, end

    def _execute(self, sql: str, params: Sequence[object]) -> None:
        import psycopg

        with psycopg.connect(self.cluster.url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql, params)

    def inject_command(self, namespace: str, node: str, raw: bytes) -> None:
        """INSERT into ``metafora_commands``."""
        self._execute("INSERT INTO metafora_commands (namespace, node_id, body, created_at)"
                      " VALUES (%s, %s, %s, now())", (namespace, node, raw.decode()))

    def inject_task(self, namespace: str, task_id: str, raw_props: bytes) -> None:
        """INSERT a pending row into ``metafora_tasks``."""
        self._execute("INSERT INTO metafora_tasks (namespace, id, props, state, token, ready,"
                      " created_at, updated_at) VALUES (%s, %s, %s, 'pending', 0, 0, now(), now())",
                      (namespace, task_id, raw_props.decode()))

    def bad_commands(self) -> list[bytes]:
        """Malformed JSON and malformed commands (PostgreSQL text holds no invalid UTF-8)."""
        return list(_BAD_COMMANDS)


class EtcdStore:
    """A 3-member etcd cluster whose members may be stopped and started again."""

    kind = "etcd"

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def url(self, namespace: str, lease_ttl: int) -> str:
        """``etcd://m1,m2,m3/NS?lease_ttl=TTL&timeout=2`` (requests give up after 2 s)."""
        return f"{self.cluster.url(namespace)}?lease_ttl={lease_ttl}&timeout=2"

    def _leader(self) -> int:
        return int(poll(self._try_leader, 30, "an etcd leader") - 1)

    def _try_leader(self) -> int:
        try:
            return int(self.cluster.leader()) + 1
        except Exception:
            return 0

    def restart(self, index: int) -> str:
        """Odd faults stop a follower, even ones the leader; each is started again."""
        leader = self._leader()
        if index % 2 == 0:
            member = next(i for i in range(len(self.cluster.members)) if i != leader)
            role = "follower"
        else:
            member, role = leader, "leader"
        if index % 4 == 3:
            self.cluster.kill(member)  # SIGKILL now and then, SIGTERM otherwise
            how = "killed"
        else:
            self.cluster.stop(member)
            how = "stopped"
        self.cluster.start(member)
        return f"etcd {role} m{member} {how} and restarted"

    def cut(self, seconds: float) -> tuple[float, float]:
        """Stop the leader and one follower (no quorum) for ``seconds``, then start both."""
        leader = self._leader()
        other = next(i for i in range(len(self.cluster.members)) if i != leader)
        for i in (leader, other):
            self.cluster.stop(i)
        begin = time.monotonic()
        hold(seconds)
        end = time.monotonic()
        for i in (leader, other):
            member = self.cluster.members[i]
            member.cluster_state = "existing"
            member.start(wait=False)  # a lone member is never healthy: start both, then wait
        for i in (leader, other):
            self.cluster.members[i].wait_healthy()
        return begin, end

    def _driver(self, namespace: str) -> tuple[Any, Any]:
        from metafora.coordinators.etcd.config import EtcdConfig
        from metafora.coordinators.etcd.driver import EtcdDriver
        from metafora.coordinators.etcd.layout import Keys
        from metafora.core.config import parse_store_url

        config = EtcdConfig.from_url(parse_store_url(self.cluster.url(namespace)), {})
        driver = EtcdDriver(config.connection)
        driver.connect()
        return driver, Keys(namespace)

    def inject_command(self, namespace: str, node: str, raw: bytes) -> None:
        """Put a key under the node's command queue, on the node's lease (as the client does)."""
        from metafora.coordinators.etcd.driver import Put, Range

        driver, keys = self._driver(namespace)
        try:
            alive, _ = driver.range(Range(keys.node_alive(node)))
            if not alive:
                raise MetaforaError(f"node {node} is not live")
            key = keys.node_commands(node) + f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}".encode()
            driver.txn([], [Put(key, raw, alive[0].lease)])
        finally:
            driver.close()

    def inject_task(self, namespace: str, task_id: str, raw_props: bytes) -> None:
        """Put ``tasks/<id>/props``: the raw bytes, or ``{"props": <raw>}`` if they are JSON."""
        from metafora.coordinators.etcd.driver import Put

        try:
            json.loads(raw_props)
            value = b'{"props": ' + raw_props + b', "created_at": "2030-01-01T00:00:00+00:00"}'
        except ValueError:
            value = raw_props
        driver, keys = self._driver(namespace)
        try:
            driver.txn([], [Put(keys.task(task_id).props, value)])
        finally:
            driver.close()

    def bad_commands(self) -> list[bytes]:
        """Malformed JSON, malformed commands and bytes that are not UTF-8."""
        return [*_BAD_COMMANDS, b"\xff\xfe\x00garbage"]
