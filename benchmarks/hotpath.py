"""Statements per short task, and where the worker spends its time (issue 26).

``python -m benchmarks.hotpath [--store postgresql|sqlite] [--peer] [--tasks 2000] [--profile DIR]``

Runs the throughput workload of :mod:`benchmarks.peers` (2 worker processes, max_tasks 10,
no-op async handler, tasks submitted first) with every driver statement of the workers
counted by kind (a wrapper around ``psycopg.Cursor.execute`` / the sqlite3 trace callback in
each worker process; LISTEN notifications are not statements). ``--profile DIR`` also runs
``py-spy record`` on both workers (by pid) and writes ``DIR/w0.svg``, ``DIR/w1.svg`` and a
text summary of each (``--format raw``: collapsed stacks). Prints tasks/s, statements per task
and the count of each statement kind, and where the CPU went from the workers' start to their
end: the machine's busy share of its cores, and CPU milliseconds per task of the two workers
and of the database server's processes (PostgreSQL's backends, found by name and read only).
``--peer`` runs pgqueuer's workers on the same workload, for the CPU figures side by side.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

def main() -> None:
    """Run the workload once and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotpath", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="postgresql", choices=("postgresql", "sqlite"))
    parser.add_argument("--peer", action="store_true",
                        help="run pgqueuer's worker instead (CPU figures only: asyncpg is not counted)")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--profile", default=None, help="py-spy both workers into this directory")
    args = parser.parse_args()
    from benchmarks import peers

    system = "pgqueuer" if args.peer else f"metafora-{args.store}"
    trace = Path(tempfile.mkdtemp(prefix="metafora-hotpath-"))
    os.environ["METAFORA_BENCH_STATEMENTS"] = str(trace)
    spies: list[subprocess.Popen[bytes]] = []
    if args.profile:
        _spy_on_workers(peers, Path(args.profile), spies)
    cpu = _CpuWindow(peers)
    workdir = Path(tempfile.mkdtemp(prefix="metafora-hotpath-db-"))
    with peers.fresh_database(system, workdir) as url:
        result = peers.throughput(system, url, args.tasks)
    for spy in spies:
        spy.wait(60)
    counts: collections.Counter[str] = collections.Counter()
    for path in trace.glob("*.json"):
        counts.update(json.loads(path.read_text()))
    total = sum(counts.values())
    print(f"{system}: {result.get('tasks_per_s', float('nan')):,.0f} tasks/s, {args.tasks} tasks, "
          f"{total} statements = {total / args.tasks:.2f} per task")
    for kind, n in counts.most_common():
        print(f"  {n / args.tasks:6.3f}  {n:7d}  {kind}")
    print(cpu.report(args.tasks))


class _CpuWindow:
    """CPU seconds of the workers, of the database server and of the whole machine, from the
    moment the workers are let go to the moment they are stopped (psutil; nothing is signalled)."""

    def __init__(self, peers: Any) -> None:
        self.start: dict[str, Any] = {}
        self.end: dict[str, Any] = {}
        self.pids: list[int] = []
        go, leave = peers._Workers.start_together, peers._Workers.__exit__
        window = self

        def start_together(workers: Any) -> None:
            go(workers)
            window.pids = [p.pid for p in workers.procs if p.pid is not None]
            window.start = window.sample()

        def exit_(workers: Any, *exc: object) -> None:
            window.end = window.sample()
            leave(workers, *exc)

        peers._Workers.start_together = start_together
        peers._Workers.__exit__ = exit_

    def sample(self) -> dict[str, Any]:
        """Now: wall time, machine busy and idle CPU, the workers' and the server's CPU."""
        import time

        import psutil

        def used(proc: psutil.Process) -> float:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                return float(t.user + t.system)
            return 0.0

        machine = psutil.cpu_times()
        server = {p.pid: used(p) for p in psutil.process_iter(["name"])
                  if p.info["name"] in ("postgres", "etcd")}
        workers = sum(used(psutil.Process(pid)) for pid in self.pids if psutil.pid_exists(pid))
        return {"wall": time.monotonic(), "idle": machine.idle + machine.iowait,
                "busy": sum(machine) - machine.idle - machine.iowait,
                "workers": workers, "server": server}

    def report(self, tasks: int) -> str:
        """One line: the window's length, the machine's busy share, CPU ms per task."""
        if not self.start or not self.end:
            return "cpu: no window measured"
        d = {k: self.end[k] - self.start[k] for k in self.start if k != "server"}
        # A server process that ended in the window is not counted; one born in it is, whole.
        d["server"] = sum(t - self.start["server"].get(pid, 0.0)
                          for pid, t in self.end["server"].items())
        cores = (d["busy"] + d["idle"]) / d["wall"] if d["wall"] > 0 else float("nan")
        share = d["busy"] / (d["busy"] + d["idle"]) if d["busy"] + d["idle"] > 0 else float("nan")
        return (f"cpu over {d['wall']:.2f} s: machine busy {share:.0%} of {cores:.1f} cores; "
                f"per task: workers {1000 * d['workers'] / tasks:.3f} ms, "
                f"server {1000 * d['server'] / tasks:.3f} ms, "
                f"everything {1000 * d['busy'] / tasks:.3f} ms")


def _spy_on_workers(peers: Any, out: Path, spies: list[subprocess.Popen[bytes]]) -> None:
    """Start py-spy on each worker process as soon as it says it has loaded (by pid)."""
    out.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).with_name("py-spy"))
    gil = ["--gil"] if os.environ.get("HOTPATH_GIL") else []  # only samples holding the GIL: CPU
    original = peers._Workers.start_together

    def start_together(self: Any) -> None:
        seen = 0
        while seen < len(self.procs):
            event = self.next(120)
            if event[0] == "loaded":
                seen += 1
                for fmt, ext in (("flamegraph", "svg"), ("raw", "txt")):
                    spies.append(subprocess.Popen(
                        [spy, "record", "--pid", str(event[2]), "--rate", "200", "--format", fmt, *gil,
                         "-o", str(out / f"{event[1]}.{ext}"), "--nonblocking"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.go.set()

    peers._Workers.start_together = start_together
    del original


if __name__ == "__main__":
    main()
