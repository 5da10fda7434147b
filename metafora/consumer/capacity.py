"""How many tasks a node may run: ``max_tasks``, a default cap for thread handlers, and a
capacity reduced when a handler cannot be started.

**The default thread cap.** Each running thread handler holds a thread, and a process (a
user, a container, the machine) can start only so many: :func:`default_thread_cap` takes the
smallest of the limits it can read (``RLIMIT_NPROC``, the cgroup's ``pids.max``,
``/proc/sys/kernel/threads-max``, ``kernel.pid_max``, and ``RLIMIT_AS`` divided by a thread's
stack size), keeps a quarter of it for everything else on the machine (other consumers,
their side threads), and never exceeds :data:`THREAD_CAP_CEILING`. Async handlers share one
event loop thread and are not counted. An explicit ``max_tasks`` replaces the cap.

**What the machine has left.** Several nodes on one host each see the same kernel limits, so
each cap alone could add up to more than the machine has. :class:`MachineThreads` reads the
threads in use on the whole machine (``/proc/loadavg``) and in the cgroup (``pids.current``)
against their limits, and a node starts a thread handler only while a quarter of the tighter
limit is still free: together the nodes of a host stop there, each with what it got, and the
capacity they publish says so (the shares follow). Read at most every half second.

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
    "MachineThreads",
    "default_thread_cap",
    "machine_threads",
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

_MACHINE_TTL = 0.5  # seconds a reading of the machine's threads in use is kept

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


def machine_threads() -> list[tuple[int, int]]:
    """(threads in use, limit) of the machine (``/proc/loadavg`` against the kernel's
    ``threads-max`` and ``pid_max``) and of the cgroup (``pids.current`` against ``pids.max``),
    for those this process can read."""
    found: list[tuple[int, int]] = []
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            in_use = int(f.read().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        in_use = None
    kernel = [v for v in (_read_limit(_PROC_LIMITS["threads-max"]),
                          _read_limit(_PROC_LIMITS["pid_max"])) if v is not None]
    if in_use is not None and kernel:
        found.append((in_use, min(kernel)))
    cgroup_max = _read_limit(_PROC_LIMITS["pids.max"])
    cgroup_now = _read_limit("/sys/fs/cgroup/pids.current")
    if cgroup_max is not None and cgroup_now is not None:
        found.append((cgroup_now, cgroup_max))
    return found


class MachineThreads:
    """How many more threads this node may start before the machine (or its cgroup) has
    only a quarter of its limit left; read at most every :data:`_MACHINE_TTL` seconds."""

    def __init__(self, monotonic: Callable[[], float],
                 read: Callable[[], list[tuple[int, int]]] = machine_threads) -> None:
        self._monotonic = monotonic
        self._read = read
        self._at = -_MACHINE_TTL
        self._left: int | None = None

    def left(self) -> int | None:
        """Threads that may still start (None: nothing to read)."""
        now = self._monotonic()
        if now - self._at >= _MACHINE_TTL:
            self._at = now
            readings = self._read()
            self._left = (min(limit - limit // THREAD_CAP_SHARE - used for used, limit in readings)
                          if readings else None)
        return None if self._left is None else max(0, self._left)

    def took(self, n: int = 1) -> None:
        """``n`` threads started since the last reading (so a burst does not overshoot)."""
        if self._left is not None:
            self._left -= n


class Capacity:
    """The node's bounds on running tasks; every method is called holding the consumer's lock.

    ``max_tasks`` bounds all tasks; ``thread_cap`` (when no ``max_tasks``) the handlers
    running on threads, as ``busy_threads`` counts them; ``reduced`` all tasks, after a
    failed start (see the module docstring).
    """

    def __init__(self, *, max_tasks: int | None, thread_cap: int | None,
                 busy_threads: Callable[[], int], monotonic: Callable[[], float],
                 log: NodeLog, machine: MachineThreads | None = None) -> None:
        self.max_tasks = max_tasks
        # An explicit max_tasks wins; thread_cap 0 turns the cap off.
        if max_tasks is not None or thread_cap == 0:
            self.thread_cap: int | None = None
        else:
            self.thread_cap = default_thread_cap() if thread_cap is None else thread_cap
        self._busy_threads = busy_threads
        self._monotonic = monotonic
        self._machine = (machine if machine is not None else MachineThreads(monotonic)) \
            if self.thread_cap is not None else None
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
            threads = self._thread_room()
            slots = threads if slots is None else min(slots, threads)
        if self.reduced is not None:
            slots = self.reduced - running if slots is None else min(slots, self.reduced - running)
        return slots

    def bounded(self) -> bool:
        """Whether anything bounds the tasks this node runs now (then a slot a handler frees
        may let a deferred offer in): whether :meth:`limit` is not None, without counting
        (asked at every handler's end)."""
        return (self.max_tasks is not None or self.reduced is not None
                or (self.thread_cap is not None and self.ran_threads))

    def limit(self) -> int | None:
        """The most tasks this node runs now (None: no bound). The thread cap bounds thread
        handlers only: it counts once this node started one."""
        thread_cap = None
        if self.thread_cap is not None and self.ran_threads:
            thread_cap = self._busy_threads() + self._thread_room()
        bounds = [b for b in (self.max_tasks, thread_cap, self.reduced) if b is not None]
        return min(bounds) if bounds else None

    def _thread_room(self) -> int:
        """Thread handlers this node may still start: under its cap and what the machine
        has left (see the module docstring)."""
        assert self.thread_cap is not None
        room = self.thread_cap - self._busy_threads()
        left = self._machine.left() if self._machine is not None else None
        return room if left is None else min(room, left)

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
            if self._machine is not None:
                self._machine.took()
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
