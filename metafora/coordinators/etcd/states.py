"""State store and task commands for ``etcd://`` coordinators.

Keys (under the coordinator's namespace root ``/metafora/<namespace>/``):

- ``state/<id>`` -- ``{"token": N, "state": {...}}``: the task's state (the key the etcd
  layout reserves; ``delete_task`` and ``purge`` remove it with the task).
- ``taskcmds/<id>/<time>-<random>`` -- one task command (its JSON wire form), taken in
  create-revision order and deleted when taken.

Commands are pushed: the owner's coordinator watches the whole namespace, so a put under
``taskcmds/<id>/`` rings the task's :class:`~metafora.statemachine.mailbox.Mailbox` and a
waiting task reads etcd only when something arrived. The safety net is one keys-only
range of ``taskcmds/`` per node per ``poll_interval`` (and after every watch re-list).

Fencing: the claim's token is the create revision of the owner key ``owners/<id>``. A state
write is one transaction comparing that create revision with ``task.token``: it applies only
while this very claim exists, so a zombie owner (its lease expired, the task re-claimed) is
refused with ClaimLost. The owner's first read and every command take are fenced the same way.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from metafora.coordinators.etcd.driver import (
    Delete,
    EtcdDriver,
    Put,
    Range,
    TxnResult,
    created_at,
    exists,
    modified_at,
    prefix_end,
)
from metafora.coordinators.etcd.layout import Keys, escape, unescape
from metafora.core.errors import ClaimLost, ConfigError
from metafora.core.jsontext import load_object
from metafora.core.task import Task
from metafora.statemachine.machine import InvalidState, State
from metafora.statemachine.mailbox import CommandBell
from metafora.statemachine.store import (
    LeaseBound,
    StateStore,
    TaskCommands,
    bell_for,
    lease_bound_of,
    parsed_page,
    poll_take,
)

__all__ = [
    "EtcdStateStore",
    "EtcdTaskCommands",
    "decode_state",
    "encode_state",
]

log = logging.getLogger(__name__)

_POLL = 0.5  # real seconds between looks of the stateless receive() (mailboxes are pushed)
_SAFETY_DEFAULT = 30.0  # seconds between safety-net looks when the owner has no poll_interval
_TAKE_RACES = 10  # attempts to take the oldest command when others take it first


def _parts(obj: object) -> tuple[EtcdDriver, Keys]:
    """The driver and key layout of an etcd coordinator or client.

    Hook wanted: public ``driver`` and ``keys`` attributes (or a ``state_store()`` method)
    on EtcdCoordinator and EtcdClient. Until then the private ones are read here, sharing
    the coordinator's connection instead of opening another.
    """
    driver = getattr(obj, "_driver", None)
    keys = getattr(obj, "_keys", None)
    if not isinstance(driver, EtcdDriver) or not isinstance(keys, Keys):
        raise ConfigError(f"{type(obj).__name__} is not an etcd coordinator or client")
    return driver, keys


def _lost(task: Task) -> ClaimLost:
    return ClaimLost(f"task {task.id!r} is no longer claimed with token {task.token}")


def encode_state(token: int, state: State) -> bytes:
    """The stored value of a state written under claim ``token``."""
    return json.dumps({"token": token, "state": state.to_dict()},
                      separators=(",", ":"), sort_keys=True).encode()


def decode_state(task_id: str, raw: bytes) -> tuple[int, State]:
    """(token, state) of a stored value; InvalidState naming the problem if it is damaged."""
    data = load_object(raw, f"stored state of task {task_id!r}", InvalidState)
    if set(data) != {"token", "state"} or not isinstance(
        data["token"], int
    ):
        raise InvalidState(f"stored state of task {task_id!r} is not {{'token', 'state'}}")
    return data["token"], State.from_json(data["state"])


class EtcdStateStore(StateStore):
    """Task states in etcd, fenced by the owner key's create revision (the claim token)."""

    def __init__(self, driver: EtcdDriver, keys: Keys, bound: LeaseBound | None = None) -> None:
        self._driver = driver
        self._keys = keys
        self._bound = bound or LeaseBound()

    @classmethod
    def of(cls, coordinator_or_client: object) -> EtcdStateStore:
        """The state store on an etcd coordinator's or client's connection (a coordinator's
        bounds every fenced call by the node's lease)."""
        return cls(*_parts(coordinator_or_client), lease_bound_of(coordinator_or_client))

    def load(self, task: Task) -> State:
        return self.load_stored(task) or State()

    def load_stored(self, task: Task) -> State | None:
        tk = self._keys.task(task.id)
        result = self._bound.call(task, "state load", lambda timeout: self._driver.txn(
            [created_at(tk.owner, task.token)], [Range(tk.machine)], repeatable=True,
            timeout=timeout,
        ))
        if not result.succeeded:
            raise _lost(task)
        kvs = result.ranges[0]
        if not kvs:
            return None
        token, state = decode_state(task.id, kvs[0].value)
        if token > task.token:
            raise ClaimLost(f"task {task.id!r}: state was written under token {token} > {task.token}")
        return state

    def store(self, task: Task, state: State) -> None:
        tk = self._keys.task(task.id)
        value = encode_state(task.token, state)
        # Repeatable: a retried put under the same unchanged owner key writes the same value.
        result = self._bound.call(task, "state write", lambda timeout: self._driver.txn(
            [created_at(tk.owner, task.token)], [Put(tk.machine, value)], repeatable=True,
            timeout=timeout,
        ))
        if not result.succeeded:
            raise _lost(task)

    def get(self, task_id: str) -> State | None:
        kvs, _ = self._driver.range(Range(self._keys.task(task_id).machine))
        return None if not kvs else decode_state(task_id, kvs[0].value)[1]

    def page(self, *, prefix: str = "", after: str | None = None,
             limit: int = 100) -> list[tuple[str, State]] | None:
        """One range over the ``state/`` keys (key order: the percent-encoded ids, as
        ``task_page``), ``limit`` keys at most: the states it returns, no task."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        base = self._keys.states + escape(prefix).encode()
        start = base
        if after is not None:
            start = max(base, self._keys.task(after).machine + b"\x00")
        kvs, _ = self._driver.range(Range(start, end=prefix_end(base), limit=limit))
        root = len(self._keys.states)
        rows = ((unescape(kv.key[root:].decode()), kv.value) for kv in kvs)
        return parsed_page(rows, lambda task_id, raw: decode_state(task_id, raw)[1])

    def token_of(self, task_id: str) -> int | None:
        """The claim token the task's state was last written under (for tests)."""
        kvs, _ = self._driver.range(Range(self._keys.task(task_id).machine))
        return None if not kvs else decode_state(task_id, kvs[0].value)[0]

    def decode_stored(self, task_id: str, body: str | bytes, token: int) -> tuple[int, State | str | bytes]:
        """The value's own token and state; a damaged value is passed on raw, with ``token``."""
        try:
            return decode_state(task_id, body.encode() if isinstance(body, str) else body)
        except InvalidState:
            return token, body

    def encode_stored(self, token: int, state: State) -> str | bytes:
        return encode_state(token, state)


class EtcdTaskCommands(TaskCommands):
    """Per-task command queues in etcd (``taskcmds/<id>/``)."""

    def __init__(self, driver: EtcdDriver, keys: Keys, owner: object = None) -> None:
        self._driver = driver
        self._keys = keys
        self._root = keys.task_commands
        config = getattr(owner, "config", None)
        safety = float(getattr(config, "poll_interval", _SAFETY_DEFAULT))
        self._bell = bell_for(owner, self._take, self._pending_ids, safety)
        # A fenced take is bounded by the claim's lease like a state write (client: unbounded).
        self._bound = lease_bound_of(owner)

    @classmethod
    def of(cls, coordinator_or_client: object) -> EtcdTaskCommands:
        """The command channel on an etcd coordinator's or client's connection (pushed to
        mailboxes when built from a coordinator)."""
        return cls(*_parts(coordinator_or_client), coordinator_or_client)

    def bell(self) -> CommandBell | None:
        return self._bell

    def _pending_ids(self) -> set[str]:
        kvs, _ = self._driver.range(Range(self._root, prefix=True, keys_only=True))
        ids: set[str] = set()
        for kv in kvs:
            parsed = self._keys.parse(kv.key)
            if parsed is not None and parsed[0] == "taskcmd":
                ids.add(parsed[1])
        return ids

    def _prefix(self, task_id: str) -> bytes:
        return self._root + escape(task_id).encode() + b"/"

    def _push(self, task_id: str, raw: str) -> None:
        name = f"{time.time_ns():020d}-{os.urandom(4).hex()}".encode()
        self._driver.txn([], [Put(self._prefix(task_id) + name, raw.encode())])

    def inject_raw(self, task_id: str, raw: str) -> None:
        """Queue raw (possibly malformed) command text, bypassing validation (fault tests)."""
        self._push(task_id, raw)

    def _take(self, task_id: str, token: int | None) -> str | None:
        """Take the oldest current command now (None if there is none)."""
        prefix = self._prefix(task_id)
        tk = self._keys.task(task_id)
        for _ in range(_TAKE_RACES):
            look = self._fenced_txn(
                task_id, token,
                [], [Range(tk.props), Range(tk.owner), Range(prefix, prefix=True, limit=1, by_create=True)],
                repeatable=True,
            )
            props, owner, oldest = look.ranges
            if token is not None and (not owner or owner[0].create_revision != token):
                raise ClaimLost(f"task {task_id!r} is no longer claimed with token {token}")
            if not oldest or not props:
                return None
            kv = oldest[0]
            if kv.create_revision < props[0].create_revision:
                # Queued for an earlier task of this id (deleted, then submitted again).
                self._driver.txn([modified_at(kv.key, kv.mod_revision)], [Delete(kv.key)])
                log.info("dropped a command queued for an earlier task %s", task_id)
                continue
            fence = [] if token is None else [created_at(tk.owner, token)]
            result = self._fenced_txn(
                task_id, token,
                [*fence, exists(kv.key), modified_at(kv.key, kv.mod_revision)],
                [Delete(kv.key)],
                [Range(tk.owner)],
            )
            if result.succeeded:
                return kv.value.decode(errors="replace")
            if token is not None:
                held = result.ranges[0]
                if not held or held[0].create_revision != token:
                    raise ClaimLost(f"task {task_id!r} is no longer claimed with token {token}")
            # Someone else took that command first: look again.
        return None

    def _fenced_txn(self, task_id: str, token: int | None, *args: Any, **kwargs: Any) -> TxnResult:
        """A txn of a take: for the owner (``token``), bounded by the time its lease has left."""
        if token is None:
            return self._driver.txn(*args, **kwargs)
        return self._bound.call(Task(task_id, token=token), "command take",
                                lambda timeout: self._driver.txn(*args, timeout=timeout, **kwargs))

    def _pop(self, task_id: str, timeout: float | None, token: int | None,
             cancel: threading.Event | None) -> str | None:
        return poll_take(lambda: self._take(task_id, token), timeout, cancel, _POLL)

    def pending(self, task_id: str) -> int:
        look = self._driver.txn(
            [], [Range(self._keys.task(task_id).props),
                 Range(self._prefix(task_id), prefix=True, keys_only=True)],
            repeatable=True,
        )
        props, queued = look.ranges
        since = props[0].create_revision if props else 0
        return sum(1 for kv in queued if kv.create_revision > since)

    def clear(self, task_id: str) -> None:
        """Drop every queued command of the task (e.g. after deleting it)."""
        self._driver.txn([], [Delete(self._prefix(task_id), prefix=True)])
