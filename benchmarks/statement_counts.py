"""What each benchmark node asks its SQL store, by statement (a diagnostic, not a figure).

``METAFORA_BENCH_COUNT=DIR`` makes every consumer process of :mod:`benchmarks.worker` count
the statements its SQL store runs (by name, hot-path ones prefixed ``hot:``), the rows its
watch's scans returned, and the connections it opened by kind (``read``: autocommit reads, one
PostgreSQL transaction per statement; ``write``, ``hot``, ``transaction``, ``bounded``), and
write them to ``DIR/<node>-<pid>.json`` every second and at exit. ``python -m
benchmarks.statement_counts DIR`` sums them: how the herd's 10-node statements differ from its
2-node ones was read this way (docs/benchmarks/herd.md). Observation only: it wraps methods.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

ENV = "METAFORA_BENCH_COUNT"


def install(node: str, out: str) -> None:
    """Count this process's statements and write them to ``out`` (see the module docstring)."""
    from metafora.coordinators.sql.store import Database, HotCursor
    from metafora.coordinators.sql.watch import Watch

    stmts: collections.Counter[str] = collections.Counter()
    rows: collections.Counter[str] = collections.Counter()
    txns: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    execute, hot_all, hot_one, query = Database.execute, HotCursor.all, HotCursor.one, Watch._query

    def counted_execute(self: Database, conn: Any, name: str, params: dict[str, Any]) -> Any:
        with lock:
            stmts[name] += 1
        return execute(self, conn, name, params)

    def counted_all(self: HotCursor, name: str, params: dict[str, Any]) -> Any:
        got = hot_all(self, name, params)
        with lock:
            stmts["hot:" + name] += 1
            rows["hot:" + name] += len(got)
        return got

    def counted_one(self: HotCursor, name: str, params: dict[str, Any]) -> Any:
        got = hot_one(self, name, params)
        with lock:
            stmts["hot:" + name] += 1
            rows["hot:" + name] += got is not None
        return got

    def counted_query(self: Watch, name: str, params: dict[str, Any]) -> Any:
        got = query(self, name, params)
        with lock:
            rows[name] += len(got)
        return got

    Database.execute = counted_execute  # type: ignore[method-assign]
    HotCursor.all = counted_all  # type: ignore[method-assign]
    HotCursor.one = counted_one  # type: ignore[method-assign]
    Watch._query = counted_query  # type: ignore[method-assign]
    for kind in ("read", "write", "hot", "transaction", "bounded"):
        setattr(Database, kind, _counting(getattr(Database, kind), kind, txns, lock))

    def dump() -> None:
        with lock:
            data = {"stmts": dict(stmts), "rows": dict(rows), "txns": dict(txns)}
        Path(out, f"{node}-{os.getpid()}.json").write_text(json.dumps(data))

    def every_second() -> None:
        while not threading.Event().wait(1.0):
            dump()

    threading.Thread(target=every_second, name="statement-counts", daemon=True).start()
    atexit.register(dump)


def _counting(opened: Any, kind: str, txns: collections.Counter[str],
              lock: threading.Lock) -> Any:
    @contextmanager
    def counted(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with lock:
            txns[kind] += 1
        cm: AbstractContextManager[Any] = opened(self, *args, **kwargs)
        with cm as conn:
            yield conn

    return counted


def summed(directory: str) -> dict[str, Any]:
    """The sums of one run's files: processes, statements, rows and connections by kind."""
    stmts: collections.Counter[str] = collections.Counter()
    rows: collections.Counter[str] = collections.Counter()
    txns: collections.Counter[str] = collections.Counter()
    files = sorted(Path(directory).glob("*.json"))
    for f in files:
        data = json.loads(f.read_text())
        stmts.update(data["stmts"])
        rows.update(data["rows"])
        txns.update(data["txns"])
    return {"processes": len(files), "stmts": dict(stmts), "rows": dict(rows), "txns": dict(txns)}


def main(args: list[str]) -> None:
    """Print the sums of each directory's files, most frequent statements first; with
    ``--save NAME`` first, also save them as ``benchmarks/results/NAME.json`` (by processes)."""
    name = None
    if args[:1] == ["--save"]:
        name, args = args[1], args[2:]
    runs = {}
    for directory in args:
        run = summed(directory)
        runs[str(run["processes"])] = run
        txns = run["txns"]
        print(f"{directory}: {run['processes']} processes; connections {txns}, "
              f"{sum(txns.values())} in all")
        for stmt, count in sorted(run["stmts"].items(), key=lambda kv: -kv[1]):
            rows = run["rows"].get(stmt)
            print(f"  {stmt:32s} {count:8d}" + (f"  rows {rows}" if rows is not None else ""))
    if name is not None:
        from benchmarks.common import save

        save(name, {"tasks": int(os.environ.get("METAFORA_HERD_TASKS", "10000")), "runs": runs,
                    "load_at_save": os.getloadavg()[0]})


if __name__ == "__main__":
    main(sys.argv[1:])
