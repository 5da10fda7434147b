"""Node commands: queued under ``nodes/<id>/commands/``, read when the watch saw one."""

from __future__ import annotations

import logging
import threading
import uuid

from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.etcd.driver import EtcdDriver
from metafora.coordinators.etcd.layout import Keys
from metafora.coordinators.etcd.node import NodeState
from metafora.coordinators.etcd.ops import Delete, Put, Range, created_at
from metafora.core.clock import SYSTEM_CLOCK, Clock
from metafora.core.commands import Command
from metafora.core.errors import CoordinatorClosed, InvalidCommand, MetaforaError, NodeNotFound

__all__ = ["NodeCommands", "new_command_name"]

log = logging.getLogger(__name__)


class NodeCommands:
    """Taking the node's commands, oldest first, one at a time.

    :meth:`ring` (the watch saw one queued, or re-listed) wakes :meth:`command`; its state is
    guarded by the node's lock, which its condition shares.
    """

    def __init__(self, driver: EtcdDriver, keys: Keys, config: EtcdConfig, clock: Clock,
                 state: NodeState) -> None:
        self._driver = driver
        self._keys = keys
        self._cfg = config
        self._clock = clock
        self._state = state
        self._cond = threading.Condition(state.lock)
        self._seq = 0  # bumped by every ring
        self._seen_seq = -1  # the _seq of the last look at the node's commands
        self._check_at = 0.0  # monotonic: next safety-net look at the node's commands
        self._failing = False

    def ring(self) -> None:
        """A command may be queued: look at the next :meth:`command`."""
        with self._cond:
            self._seq += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiting :meth:`command` (it sees the node closed)."""
        with self._cond:
            self._cond.notify_all()

    def command(self, timeout: float | None = None) -> Command | None:
        """The next node command: etcd is read only after the watch saw one queued (or
        re-listed), or once per ``poll_interval`` as a safety net -- not on every call."""
        deadline = None if timeout is None else self._clock.monotonic() + timeout
        while True:
            with self._state.lock:
                if self._state.closed:
                    return None
                seq = self._seq
                due = self._state.ctx is not None and (
                    seq != self._seen_seq or self._clock.monotonic() >= self._check_at
                )
                if due:  # marked before the look: a wake-up during it is kept
                    self._seen_seq = seq
                    self._check_at = self._clock.monotonic() + self._cfg.poll_interval
            if due:
                command, more = self._look_for_command()
                if command is not None or more:
                    with self._state.lock:
                        self._seen_seq = -1  # more may be queued behind it
                if command is not None:
                    return command
                if more:
                    continue
            left = None if deadline is None else deadline - self._clock.monotonic()
            if left is not None and left <= 0:
                return None
            with self._state.lock:
                wait = max(0.0, self._check_at - self._clock.monotonic())
                if left is not None:
                    wait = min(wait, left)
                if self._seq == seq and not self._state.closed:
                    self._cond.wait(wait)

    def _look_for_command(self) -> tuple[Command | None, bool]:
        """:meth:`_take_command`, with store errors logged: (command, look again soon)."""
        try:
            found = self._take_command()
            self._failing = False
            return found
        except MetaforaError as exc:
            if isinstance(exc, CoordinatorClosed) or self._state.closed:
                return None, False
            level = logging.DEBUG if self._failing else logging.WARNING
            self._failing = True
            log.log(level, "node %s: reading commands failed: %s", self._state.node_id, exc,
                    extra=self._state.extra)
            with self._state.lock:  # retry within a second, not a whole poll_interval
                self._check_at = min(self._check_at, self._clock.monotonic() + 1.0)
            return None, False

    def _take_command(self) -> tuple[Command | None, bool]:
        """(the oldest command, whether to look again at once)."""
        prefix = self._keys.node_commands(self._state.node_id)
        kvs, _ = self._driver.range(Range(prefix, prefix=True, limit=1, by_create=True))
        if not kvs:
            return None, False
        kv = kvs[0]
        taken = self._driver.txn([created_at(kv.key, kv.create_revision)], [Delete(kv.key)])
        if not taken.succeeded:
            return None, True  # taken by another thread of ours
        try:
            return Command.from_json(kv.value), False
        except InvalidCommand as exc:
            log.warning("node %s: dropping malformed command %r: %s", self._state.node_id,
                        kv.value[:200], exc, extra=self._state.extra)
            return None, True

    def inject_raw_command(self, raw: str | bytes) -> None:
        """Queue raw (possibly malformed) command text for this node, for fault tests."""
        self._state.require_init()
        alive = self._keys.node_alive(self._state.node_id)
        kvs, _ = self._driver.range(Range(alive))
        if not kvs:
            raise NodeNotFound(f"node {self._state.node_id!r} is not live")
        key = self._keys.node_commands(self._state.node_id) + new_command_name().encode()
        data = raw.encode() if isinstance(raw, str) else raw
        result = self._driver.txn(
            [created_at(alive, kvs[0].create_revision)], [Put(key, data, kvs[0].lease)]
        )
        if not result.succeeded:
            raise NodeNotFound(f"node {self._state.node_id!r} is not live")


def new_command_name() -> str:
    """A unique command key segment (time-ordered; the queue order is the create revision)."""
    return f"{SYSTEM_CLOCK.now().timestamp() * 1e9:020.0f}-{uuid.uuid4().hex[:12]}"

