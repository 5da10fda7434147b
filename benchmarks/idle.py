"""Idle store load of one node holding 0, 1,000 and 10,000 tasks (plain and stateful).

One consumer process at default settings claims every task of a fresh namespace and holds
them: *plain* handlers block on their stop event; *stateful* ones wait in ``cmds.get()`` for
an operator command. Once all are held (and a settling pause has passed), the node's store
traffic is counted over a window:

- PostgreSQL: ``xact_commit + xact_rollback`` of the benchmark database (pg_stat_database;
  nothing else uses that database meanwhile; backends flush these counters lazily, up to
  ~10 s late, which the long window absorbs);
- etcd: the sum of ``grpc_server_handled_total`` from the server's ``/metrics`` (every unary
  call; the watch stream's events are pushes, not requests);
- SQLite has no server: the node's own SQL statements are counted in the process (sqlite3
  trace callback, BEGIN/COMMIT not counted). Its change check (``PRAGMA data_version`` on a
  connection of its own, every 10 ms) reads the file header from shared memory and is not
  counted as a request.

Tasks are inserted in bulk (multi-row INSERT / 100-key etcd txns) so 10,000 are ready fast.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from datetime import UTC, datetime
from typing import Any

from benchmarks.common import Stores, save, table
from benchmarks.scale import _etcd_calls, _pg_xacts
from benchmarks.statements import count_sqlite_statements
from metafora import Consumer, Task, open_client, open_coordinator, simple_handler
from metafora.statemachine import Commands, Message, handler_func

SIZES = (0, 1_000, 10_000)
MODES = ("plain", "stateful")
_STACK = 256 * 1024  # bytes per handler thread (10,000 of them)


# -- the node process ----------------------------------------------------------------------


class _Marks:
    """Counts handlers that reached their wait; tells the parent once all expected have."""

    def __init__(self, expect: int, events: Any) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._expect = expect
        self._events = events
        if expect == 0:
            events.put(("held", 0))

    def mark(self) -> None:
        with self._lock:
            self._count += 1
            reached = self._count == self._expect
        if reached:
            self._events.put(("held", self._expect))


def _plain(marks: _Marks) -> Any:
    def hold(task: Task, stop: threading.Event) -> bool:
        marks.mark()
        stop.wait()
        return False

    return simple_handler(hold)


def _stateful(marks: _Marks) -> Any:
    def wait(task: Task, cmds: Commands) -> Message:
        marks.mark()
        return cmds.get() or Message.release()

    return wait




def node_main(url: str, mode: str, expect: int, events: Any, control: Any) -> None:
    """A consumer holding every task of ``url`` until SIGTERM; answers "count" on ``control``."""
    logging.basicConfig(level=os.environ.get("METAFORA_BENCH_LOG", "ERROR"))
    threading.stack_size(_STACK)
    statements = count_sqlite_statements() if url.startswith("sqlite") else [0]
    coord = open_coordinator(url, node_id="idle")
    marks = _Marks(expect, events)
    handler: Any = _plain(marks) if mode == "plain" else handler_func(_stateful(marks), coord)
    consumer = Consumer(coord, handler, shutdown_timeout=30)
    signal.signal(signal.SIGTERM, lambda *_: consumer.shutdown())

    def answer() -> None:
        while True:
            if control.get() != "count":
                return
            events.put(("count", statements[0]))

    threading.Thread(target=answer, daemon=True).start()
    consumer.run()
    events.put(("stopped",))


# -- filling a store fast -------------------------------------------------------------------


def fill(kind: str, url: str, n: int) -> None:
    """``n`` pending tasks ``b000000``... in a few statements / 100-key txns."""
    with open_client(url) as client:
        client.tasks()  # the schema
        if n == 0:
            return
        if kind == "etcd":
            _fill_etcd(client, n)
        else:
            _fill_sql(client, kind, n)


def _fill_sql(client: Any, kind: str, n: int) -> None:
    from sqlalchemy import text

    db = client._db  # the benchmark writes rows the way submit_task does, many at a time
    columns = ("INSERT INTO metafora_tasks (namespace, id, props, state, token, ready, attempts,"
               " created_at, updated_at)")
    if kind == "postgresql":
        sql = (f"{columns} SELECT :ns, 'b' || lpad(CAST(g AS text), 6, '0'), '{{}}', 'pending',"
               " 0, 0, 0, now(), now() FROM generate_series(0, :n - 1) AS g")
    else:
        now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
        sql = ("WITH RECURSIVE s(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM s WHERE x < :n - 1) "
               f"{columns} SELECT :ns, 'b' || printf('%06d', x), '{{}}', 'pending', 0, 0, 0,"
               f" {now}, {now} FROM s")
    with db.transaction() as conn:
        conn.execute(text(sql), {"ns": db.config.namespace, "n": n})


def _fill_etcd(client: Any, n: int) -> None:
    from metafora.coordinators.etcd.driver import Put

    driver, keys = client._driver, client._keys
    created = datetime.now(UTC).isoformat()
    record = json.dumps({"props": {}, "created_at": created}).encode()
    ids = [f"b{i:06d}" for i in range(n)]
    for start in range(0, n, 100):
        driver.txn([], [Put(keys.task(i).props, record) for i in ids[start:start + 100]])


# -- measuring ------------------------------------------------------------------------------


class Node:
    """One node process and its event queue."""

    def __init__(self, url: str, mode: str, expect: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.events = ctx.Queue()
        self.control = ctx.Queue()
        self.proc = ctx.Process(target=node_main, args=(url, mode, expect, self.events, self.control),
                                daemon=True)
        self.proc.start()

    def expect(self, kind: str, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.proc.is_alive():
                raise TimeoutError(f"no {kind} event from the node in {timeout:.0f}s")
            try:
                event = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if event[0] == kind:
                return tuple(event)

    def statements(self) -> int:
        self.control.put("count")
        return int(self.expect("count", 30)[1])

    def stop(self) -> None:
        # SIGKILL: stopping 10,000 handlers is the capacity benchmark's subject, not this
        # one's, and every measurement uses a fresh namespace (a dead node's claims stay there).
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(30)


def measure(stores: Stores, kind: str, mode: str, n: int, window: float, settle: float) -> dict[str, Any]:
    """Requests/s of one idle node holding ``n`` tasks, and how long taking them took."""
    url = stores.url(kind)
    fill(kind, url, n)
    started = time.monotonic()
    node = Node(url, mode, n)
    try:
        node.expect("held", timeout=600)
        took = time.monotonic() - started
        threading.Event().wait(settle)  # let the start-up traffic (claims, first looks) pass
        if kind == "postgresql":
            count = lambda: _pg_xacts(url)  # noqa: E731
            fixed = 1  # the reading of the counter itself (its own transaction)
        elif kind == "etcd":
            count = lambda: _etcd_calls(stores)  # noqa: E731
            fixed = 0
        else:
            count = node.statements
            fixed = 0
        before = count()
        threading.Event().wait(window)
        after = count()
    finally:
        node.stop()
    return {"requests_per_s": (after - before - fixed) / window, "requests": after - before - fixed,
            "window_s": window, "held": n, "seconds_to_hold": took}


def run(stores: Stores, quick: bool) -> dict[str, Any]:
    """Every store x mode x size: print the table and save the JSON."""
    window = float(os.environ.get("METAFORA_IDLE_WINDOW") or (20.0 if quick else 60.0))
    # Counters of idle PostgreSQL backends flush up to 10 s late, and autovacuum analyses the
    # fresh tables once: 20 s keeps both out of the window.
    settle = min(20.0, window)
    sizes = [int(s) for s in os.environ.get("METAFORA_IDLE_SIZES", "").split(",") if s] or SIZES
    data: dict[str, Any] = {}
    rows = []
    for kind in stores.kinds:
        for mode in MODES:
            figures = []
            for n in sizes:
                result = measure(stores, kind, mode, n, window, settle)
                data[f"{kind}/{mode}/{n}"] = result
                figures.append(result["requests_per_s"])
                print(f"{kind} {mode} {n}: {result}", flush=True)
            rows.append((kind, mode, *figures))
    unit = {"postgresql": "xacts", "etcd": "gRPC calls", "sqlite": "statements"}
    table(f"idle: store requests/s of one node holding N tasks (window {window:.0f} s; "
          + ", ".join(f"{k}: {unit[k]}" for k in stores.kinds) + ")",
          ("store", "handlers", *(f"{n:,} held" for n in sizes)), rows)
    save("idle", {"quick": quick, "window_s": window, "results": data})
    return data
