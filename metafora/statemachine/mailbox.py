"""Pushed task commands: one in-process dispatcher per node, a mailbox per claimed task.

A waiting stateful task must not ask the store for commands: with thousands of tasks held
that is thousands of queries a second. Instead the node's coordinator already has a push
channel (PostgreSQL LISTEN/NOTIFY, the etcd watch on its namespace, SQLite's
``PRAGMA data_version`` check) and tells a :class:`CommandBell` when a command was queued
for a task (:meth:`CommandBell.ring`) or that anything may have been missed
(:meth:`CommandBell.recheck`: a reconnect, a SQLite commit). The bell marks the task's
:class:`Mailbox` *ready*; only a ready mailbox reads the store, and it takes the command
with the same fenced, delete-once statement as before, so FIFO, once-only delivery and
fencing are the store's, unchanged.

- A mailbox starts ready: taking a claim checks once for commands queued before (a command
  sent while the task moved between nodes reaches the next owner).
- The safety net is ONE store request per bell per ``safety_interval`` (the store's
  ``pending_ids``: which tasks have queued commands), never one per task, and only while
  mailboxes are open. A recheck asks for that request at once.
- Waiters: a thread blocks in :meth:`Mailbox.receive`; other waiters (an asyncio task)
  register :meth:`Mailbox.add_listener` callbacks, called from the ringing thread whenever
  the mailbox becomes ready or is interrupted -- bridge them to a loop with
  ``loop.call_soon_threadsafe`` and then call ``receive(0)`` (which does I/O only when ready)::

      woken = asyncio.Event()
      box.add_listener(lambda: loop.call_soon_threadsafe(woken.set))
      while True:
          woken.clear()                      # before looking: a ring meanwhile is kept
          raw = await loop.run_in_executor(None, box.receive, 0)   # store I/O only if rung
          if raw is not None or stopping:
              break
          await woken.wait()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from metafora.core.clock import SYSTEM_CLOCK
from metafora.core.errors import MetaforaError

__all__ = ["CommandBell", "Mailbox", "PendingIds", "Take"]

log = logging.getLogger(__name__)

Take = Callable[[str, int | None], str | None]
"""The store's fenced take: ``(task_id, token) -> the oldest command's wire text or None``."""

PendingIds = Callable[[], set[str]]
"""The store's safety-net look: the ids of tasks with queued commands (one request)."""

_RECHECK_GAP = 0.05  # seconds: rechecks requested closer together share one store request


class Mailbox:
    """The command inbox of one claim (task id + token), fed by a :class:`CommandBell`.

    Thread-safe. ``receive`` does store I/O only while the mailbox is *ready* (a command
    may have arrived); otherwise it waits without touching the store.
    """

    def __init__(
        self,
        task_id: str,
        token: int | None,
        take: Take,
        *,
        on_close: Callable[[Mailbox], None] | None = None,
        poll_every: float | None = None,
    ) -> None:
        self.task_id = task_id
        self.token = token
        self._take_fn = take
        self._on_close = on_close
        self._poll_every = poll_every  # channels without push: look again this often
        self._looked_at = 0.0  # monotonic time of the last look in the store
        self._cond = threading.Condition()
        self._ready = True  # a new claim checks once for commands queued before it
        self._interrupted = False
        self._closed = False
        self._listeners: list[Callable[[], None]] = []

    @property
    def ready(self) -> bool:
        """Whether the next ``receive`` will look in the store."""
        with self._cond:
            return self._ready

    @property
    def poll_every(self) -> float | None:
        """Seconds between looks in the store on a channel without push (None: it pushes)."""
        return self._poll_every

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from any thread, must not block) when the mailbox becomes
        ready or is interrupted: the hook an async waiter bridges to its event loop."""
        with self._cond:
            self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        """Undo :meth:`add_listener` (no error if it was not added)."""
        with self._cond:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def ring(self) -> None:
        """A command may have been queued: the next ``receive`` looks in the store."""
        self._signal(ready=True)

    def interrupt(self) -> None:
        """Wake a blocked ``receive`` without a command (its caller is being stopped)."""
        self._signal(ready=False)

    def _signal(self, *, ready: bool) -> None:
        with self._cond:
            if ready:
                self._ready = True
            else:
                self._interrupted = True
            self._cond.notify_all()
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:  # a waiter's bug must not break the node's push channel
                log.exception("mailbox listener of task %s failed", self.task_id)

    def receive(self, timeout: float | None, cancel: threading.Event | None = None) -> str | None:
        """The next command's wire text, waiting up to ``timeout`` real seconds (None: until
        one arrives, ``cancel`` is set or :meth:`interrupt`). Raises what the store's take
        raises (ClaimLost when the claim is gone, store errors)."""
        deadline = None if timeout is None else SYSTEM_CLOCK.monotonic() + max(0.0, timeout)
        while True:
            if cancel is not None and cancel.is_set():
                return None
            if self._take_ready():
                raw = self._take()
                if raw is not None:
                    return raw
                continue
            left = None if deadline is None else deadline - SYSTEM_CLOCK.monotonic()
            if left is not None and left <= 0:
                return None
            if self._wait(left):
                return None

    def _wait(self, left: float | None) -> bool:
        """Wait until ready (or ``left`` s); True if interrupted or closed meanwhile."""
        wait = left
        if self._poll_every is not None:  # no push: until the next look is due
            due = max(0.0, self._looked_at + self._poll_every - SYSTEM_CLOCK.monotonic())
            wait = due if wait is None else min(wait, due)
        with self._cond:
            if not self._ready and not self._interrupted and not self._closed:
                self._cond.wait(wait)
            if self._interrupted or self._closed:
                self._interrupted = False
                return True
            return False

    def _take_ready(self) -> bool:
        """Whether to look in the store now (clears the flag first: a ring during the look
        is not lost). Without push, a look is due every ``poll_every`` seconds."""
        now = SYSTEM_CLOCK.monotonic()
        with self._cond:
            ready, self._ready = self._ready, False
            if self._poll_every is not None and now >= self._looked_at + self._poll_every:
                ready = True
            if ready:
                self._looked_at = now
            return ready

    def _take(self) -> str | None:
        try:
            raw = self._take_fn(self.task_id, self.token)
        except BaseException:
            self.ring()  # not looked at: look again next time
            raise
        if raw is not None:
            self.ring()  # more may be queued behind it
        return raw

    def close(self) -> None:
        """Stop receiving; wakes a blocked ``receive``. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._on_close is not None:
            self._on_close(self)


class CommandBell:
    """A node's in-process dispatcher of pushed task commands (one per coordinator).

    ``take`` is the store's fenced take; ``pending_ids`` its safety-net look. The
    coordinator calls :meth:`ring` and :meth:`recheck` (it is a
    :class:`~metafora.contracts.coordinator.TaskCommandListener`).
    """

    def __init__(self, name: str, take: Take, pending_ids: PendingIds,
                 safety_interval: float) -> None:
        self.name = name
        self.take = take
        self._pending_ids = pending_ids
        self.safety_interval = safety_interval
        self._lock = threading.Condition()
        self._boxes: dict[str, set[Mailbox]] = {}
        self._recheck = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.checks = 0  # safety-net store requests made (for tests and benchmarks)

    def new_mailbox(self, task_id: str, token: int | None) -> Mailbox:
        """A ready mailbox for the claim, rung by this bell; close it when the claim's
        handler ends (its channel's :meth:`~metafora.statemachine.store.TaskCommands.open`
        hands it out)."""
        box = Mailbox(task_id, token, self.take, on_close=self.forget)
        with self._lock:
            self._boxes.setdefault(task_id, set()).add(box)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._safety_loop, name=f"metafora-task-commands[{self.name}]",
                    daemon=True)
                self._thread.start()
        return box

    def forget(self, box: Mailbox) -> None:
        """Drop a closed mailbox (called by :meth:`Mailbox.close`)."""
        with self._lock:
            boxes = self._boxes.get(box.task_id)
            if boxes is not None:
                boxes.discard(box)
                if not boxes:
                    del self._boxes[box.task_id]
            if not self._boxes:
                self._lock.notify_all()  # the safety loop ends while nothing is open

    def open_count(self) -> int:
        """How many mailboxes are open."""
        with self._lock:
            return sum(len(b) for b in self._boxes.values())

    def ring(self, task_id: str) -> None:
        """A command was queued for ``task_id`` (a push notification). No I/O."""
        with self._lock:
            boxes = list(self._boxes.get(task_id, ()))
        for box in boxes:
            box.ring()

    def recheck(self) -> None:
        """Something may have been missed (reconnect, a SQLite commit): look once, soon."""
        with self._lock:
            self._recheck = True
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the safety net and wake every mailbox. Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            boxes = [b for group in self._boxes.values() for b in group]
        for box in boxes:
            box.interrupt()

    def _safety_loop(self) -> None:
        next_check = SYSTEM_CLOCK.monotonic() + self.safety_interval
        while True:
            with self._lock:
                while not self._closed and self._boxes and not self._recheck:
                    left = next_check - SYSTEM_CLOCK.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(left)
                if self._closed or not self._boxes:
                    self._thread = None
                    return
                self._recheck = False
            self._check()
            now = SYSTEM_CLOCK.monotonic()
            next_check = now + self.safety_interval
            quiet_until = now + _RECHECK_GAP  # a burst of rechecks (SQLite: one per commit)
            with self._lock:  # shares one request
                while not self._closed and (gap := quiet_until - SYSTEM_CLOCK.monotonic()) > 0:
                    self._lock.wait(gap)

    def _check(self) -> None:
        """One store request: ring the open mailboxes of tasks that have queued commands."""
        self.checks += 1
        try:
            ids = self._pending_ids()
        except MetaforaError as exc:
            log.warning("%s: cannot look for pending task commands: %s", self.name, exc)
            return
        for task_id in ids:
            self.ring(task_id)
