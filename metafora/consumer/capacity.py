"""How many tasks a node may run: ``max_tasks``, a default cap for thread handlers, and a
capacity reduced when a handler cannot be started.

**The default thread cap.** Each running thread handler holds a thread, and a process (a
user, a container, the machine) can start only so many: :func:`default_thread_cap` takes the
smallest of the limits it can read (``RLIMIT_NPROC``, the cgroup's ``pids.max``,
``/proc/sys/kernel/threads-max``, ``kernel.pid_max``, and ``RLIMIT_AS`` divided by a thread's
stack size), keeps a quarter of it for everything else on the machine (other consumers,
their side threads), and never exceeds :data:`THREAD_CAP_CEILING`. Async handlers share one
event loop thread and are not counted. An explicit ``max_tasks`` replaces the cap.

**A reduced capacity.** When a handler cannot be started (no thread, no memory, the event
loop gone), its task is released at once and the node's capacity becomes the number of tasks
it runs then: it claims nothing more, and logs the cause once per episode. It climbs back
one task at a time: a start that succeeds with the node at its capacity raises it by one
(so after a task ended, the node takes a task for the freed slot and then tries one more),
and every :data:`CAPACITY_RETRY` seconds without a failure it rises by one even if nothing
ended. Once it reaches the configured limit the episode ends (logged once too); a node with
no limit (async handlers, no ``max_tasks``) keeps climbing one task per start.
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Callable
from typing import Any

from metafora.consumer.running import NodeLog

__all__ = [
    "CAPACITY_RETRY",
    "THREAD_CAP_CEILING",
    "Capacity",
    "default_thread_cap",
    "thread_cap_from",
    "thread_limits",
]

THREAD_CAP_CEILING = 4096
"""The most thread handlers a node runs by default, however high the process's limits."""
THREAD_CAP_SHARE = 4
"""The default cap is at most 1 / this of the tightest thread limit (the rest is left to the
machine's other threads and processes)."""
CAPACITY_RETRY = 30.0
"""Seconds after a failed start before a node at its reduced capacity tries one more task."""
_DEFAULT_STACK = 8 * 1024 * 1024  # glibc's default thread stack when threading sets none

_PROC_LIMITS = {
    "threads-max": "/proc/sys/kernel/threads-max",
    "pid_max": "/proc/sys/kernel/pid_max",
    "pids.max": "/sys/fs/cgroup/pids.max",
}


def _read_limit(path: str) -> int | None:
    """A number in a /proc or cgroup file; None when absent, unreadable or ``max``."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _rlimit(which: int) -> int | None:
    soft, _ = resource.getrlimit(which)
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else soft


def thread_limits() -> dict[str, int]:
    """The limits on threads this process can read, by name (absent ones left out)."""
    limits: dict[str, int] = {}
    nproc = _rlimit(resource.RLIMIT_NPROC)
    if nproc is not None:
        limits["RLIMIT_NPROC"] = nproc
    address_space = _rlimit(resource.RLIMIT_AS)
    if address_space is not None:
        limits["RLIMIT_AS"] = address_space // (threading.stack_size() or _DEFAULT_STACK)
    for name, path in _PROC_LIMITS.items():
        value = _read_limit(path)
        if value is not None:
            limits[name] = value
    return limits


def thread_cap_from(limits: dict[str, int]) -> int:
    """The default thread cap for these limits (see the module docstring); at least 1."""
    if not limits:
        return THREAD_CAP_CEILING
    return max(1, min(THREAD_CAP_CEILING, min(limits.values()) // THREAD_CAP_SHARE))


def default_thread_cap() -> int:
    """The default cap on thread handlers of a node in this process."""
    return thread_cap_from(thread_limits())


class Capacity:
    """The node's bounds on running tasks; every method is called holding the consumer's lock.

    ``max_tasks`` bounds all tasks; ``thread_cap`` (when no ``max_tasks``) the handlers
    running on threads, as ``busy_threads`` counts them; ``reduced`` all tasks, after a
    failed start (see the module docstring).
    """

    def __init__(self, *, max_tasks: int | None, thread_cap: int | None,
                 busy_threads: Callable[[], int], monotonic: Callable[[], float],
                 log: NodeLog) -> None:
        self.max_tasks = max_tasks
        # An explicit max_tasks wins; thread_cap 0 turns the cap off.
        if max_tasks is not None or thread_cap == 0:
            self.thread_cap: int | None = None
        else:
            self.thread_cap = default_thread_cap() if thread_cap is None else thread_cap
        self._busy_threads = busy_threads
        self._monotonic = monotonic
        self._log = log
        self.reduced: int | None = None
        self.cause: str | None = None
        self.retry_at: float | None = None  # when a node at its reduced capacity tries one more
        self.ran_threads = False  # a thread handler started here: the thread cap applies

    def free_slots(self, running: int) -> int | None:
        """Handlers this node may still start with ``running`` tasks (None: no bound)."""
        slots: int | None = None
        if self.max_tasks is not None:
            slots = self.max_tasks - running
        if self.thread_cap is not None:
            threads = self.thread_cap - self._busy_threads()
            slots = threads if slots is None else min(slots, threads)
        if self.reduced is not None:
            slots = self.reduced - running if slots is None else min(slots, self.reduced - running)
        return slots

    def bounded(self) -> bool:
        """Whether anything bounds the tasks this node runs now (then a slot a handler frees
        may let a deferred offer in)."""
        return self.limit() is not None

    def limit(self) -> int | None:
        """The most tasks this node runs now (None: no bound). The thread cap bounds thread
        handlers only: it counts once this node started one."""
        thread_cap = self.thread_cap if self.ran_threads else None
        bounds = [b for b in (self.max_tasks, thread_cap, self.reduced) if b is not None]
        return min(bounds) if bounds else None

    def start_failed(self, running: int, kind: str, error: BaseException, task_id: str) -> None:
        """A handler could not be started: the capacity becomes ``running`` (logged once)."""
        cause = f"{type(error).__name__}: {error}"
        first = self.reduced is None
        self.reduced, self.cause = running, cause
        self.retry_at = self._monotonic() + CAPACITY_RETRY
        extra = {"action": "capacity", "capacity": running, "cause": cause, "handler": kind,
                 "task": task_id}
        if first:
            self._log.warning(
                "cannot start a %s handler (%s): released task %s; this node claims no more "
                "than the %d task(s) it runs until a start succeeds again",
                kind, cause, task_id, running, extra=extra)
        else:
            self._log.debug("cannot start a %s handler (%s): released task %s", kind, cause,
                            task_id, extra=extra)

    def started(self, running: int, kind: str) -> None:
        """A ``kind`` handler started with ``running`` tasks: a full reduced capacity rises
        by one."""
        if kind == "thread":
            self.ran_threads = True
        if self.reduced is not None and running >= self.reduced:
            self._raise()

    def retry_due(self, now: float, running: int) -> bool:
        """Whether a full reduced capacity rose because its retry time passed (then offer
        again); a node with free slots under it only waits for the next retry time."""
        if self.retry_at is None or now < self.retry_at:
            return False
        self.retry_at = now + CAPACITY_RETRY
        if self.reduced is None or running < self.reduced:
            return False
        self._raise()
        return True

    def _raise(self) -> None:
        assert self.reduced is not None
        self.reduced += 1
        ceiling = self.max_tasks if self.max_tasks is not None else self.thread_cap
        if ceiling is not None and self.reduced >= ceiling:
            self._log.info("handlers start again: capacity back to %d", ceiling,
                           extra={"action": "capacity", "capacity": ceiling, "cause": None})
            self.reduced = self.cause = self.retry_at = None

    def info(self) -> dict[str, Any]:
        """What ``/info`` shows as ``capacity``."""
        return {"limit": self.limit(),
                "max_tasks": self.max_tasks, "thread_cap": self.thread_cap,
                "reduced": self.reduced, "cause": self.cause}
