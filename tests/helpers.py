"""Shared test helpers: polling with a deadline (never a bare sleep)."""

from __future__ import annotations

import ast
import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import TypeVar

from metafora.consumer import Consumer
from metafora.coordinators.memory import MemoryCoordinator
from metafora.core.task import Task
from metafora.statemachine.machine import StateCode
from metafora.surfaces.connect import open_coordinator
from metafora.testing import LocalCluster, wait_for

T = TypeVar("T")

SUBPROCESS_DEADLINE = 120.0
"""Seconds a Python subprocess (a daemon, a worker, a spawned consumer) may take to start,
import metafora and register, or to take one step. A deadline, not a timing: on this 2-core
machine at load 17, under ``nice -n 19``, ``python -c "import metafora"`` took 9 s of wall
clock for 0.3 s of CPU, and several daemons starting at once (two xdist workers) took more
than the 30 s the acceptance tests allowed (the "daemons timed out" under xdist at load 20).
"""


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, message: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` real seconds pass."""
    return wait_for(predicate, timeout, message)


class RanIds:
    """A handler function (for ``simple_handler``) that records the ids it ran and finishes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ids: list[str] = []

    def __call__(self, task: Task, stop: threading.Event) -> bool:
        with self._lock:
            self.ids.append(task.id)
        return True


class Harness(LocalCluster):
    """A LocalCluster on a fresh memory store, with direct access to memory coordinators."""

    def coordinator(self, node: str) -> MemoryCoordinator:
        coord = open_coordinator(self.url, node_id=node)
        assert isinstance(coord, MemoryCoordinator)
        return coord


def start_stateful(cluster: LocalCluster, stateful: object, node: str, **kwargs: object) -> Consumer:
    """Start a consumer ``node`` in ``cluster`` running ``stateful`` (sync or ``async def``)
    through the state machine (``poll_interval`` 0.02 s unless given)."""
    from metafora.statemachine import handler_func

    coord = open_coordinator(cluster.url, node_id=node)
    kwargs.setdefault("poll_interval", 0.02)
    return cluster.start(Consumer(coord, handler_func(stateful, coord, **kwargs)))  # type: ignore[arg-type]


def state_cursor(cluster: LocalCluster, task_id: str = "t1") -> int:
    """The task's stored cursor as a page number (0 when none)."""
    from metafora.statemachine import get_state

    state = get_state(cluster.client, task_id)
    return int(state.cursor or 0) if state is not None else 0


def state_code(cluster: LocalCluster, task_id: str = "t1") -> StateCode | None:
    """The task's stored state code (None before a state machine ran it)."""
    from metafora.statemachine import get_state

    state = get_state(cluster.client, task_id)
    return None if state is None else state.code


def stop_processes(procs: Iterable[BaseProcess], timeout: float = 30.0) -> None:
    """Stop worker processes by pid: SIGTERM to all, join each (``timeout``), then SIGKILL."""
    procs = list(procs)
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped.

    ``kill`` only queues the signal: a thread of a busy server (etcd's are many) may still
    answer a request sent right after it, which made a test of a frozen store see an answer
    now and then on a loaded machine.
    """
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return True  # gone: nothing can answer
        for tid in threads:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in ("T", "t"):
                return False
        return True

    wait_until(stopped, timeout, f"process {pid} to stop")


def parse_source(text: str, name: str) -> ast.Module:
    """``ast.parse`` with no garbage collection inside it. On Python 3.11 a collection during
    the parse may finalise an earlier test's leftovers (a pending asyncio task logs "destroyed
    but pending" with a traceback, and traceback formatting parses source too): the nested
    parse breaks the outer one ("AST constructor recursion depth mismatch", seen in CI). The
    garbage is collected after the parse instead."""
    was = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text, name)
    finally:
        if was:
            gc.enable()
