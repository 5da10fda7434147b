"""Issues 25 and 34's costly requests, timed against a real ``metafora web`` on SQLite, the
dashboard's memory under a large body, and masking 1 MB.

    python -m benchmarks security [--quick]

Issue 34 (targets: ``/tasks`` under 100 ms with ten 1 MiB errors stored; the dashboard's memory
grows by less than 10 MB under a 64 MiB body):

- ``/tasks`` listing ten failed tasks whose handlers raised 1 MiB errors (the issue's hostile
  ``a://h/?%=1 `` shape, stored cut as every store does now), and ten whose 1 MiB errors were
  stored whole by an older version (hostile, and plain ``E``); each task's own page; and
  ``/tasks?state=expired`` among 100,000 pending tasks (quick: 10,000): p50 and max as below;
- the dashboard's resident memory (``VmRSS``) before and after ``POST /login`` with a 64 MiB
  chunked body (answered 413 once past the 64 KiB limit), and with ``Content-Length: 400 MiB``;

- ``/nodes?msg=`` with 60,000 letters and the page of a task whose props hold 65,000 letters
  (before the fix: 16-25 s and 6.7 s of CPU per request, a quadratic URL pattern run over the
  page): p50 and max over ``-n`` requests (20, quick: 5) after one warm-up, on one keep-alive
  connection, measured by the client (request sent to last byte read);
- :func:`metafora.core.masking.scrub` over 1 MB of letters, of hostile punctuation, of dense URLs
  (a URL with a password every 30 characters) and of URLs with ports every 8, and of the
  adversarial shapes of the unit tests (floods of ``@ : %``, ``a://`` repeated, unicode, URLs
  that each hold something to mask every 6-13 characters, one URL of 1 MB): the best of 5.

Issue 52 (the third round; one row per case, each a check that must hold and what it cost):

- ``retention 800000d``: ``set_retention`` refuses it (before: stored, then every worker
  exited 4 at its next prune turn); the time of the refusal;
- ``props 100 MB``: ``Task(id, {"blob": 100 MB})`` refused, and by how much the process's peak
  memory grew (before: 200-350 MB for the JSON text and its bytes);
- ``log line of a 1 MiB error``: the length of the plain log line (before: 82 KB);
- ``async shared write``: 24 concurrent ``submit_task`` of 900 KB props on SQLite, one row
  refused by the database: callers told something else than the truth of their own row
  (before: 18 told ``TaskExists`` for the task their own call added);
- ``look-alike ids``: how many of the Unicode blanks other than U+0020 an id accepts (before:
  all 17: the 16 spaces of category Zs other than U+0020 and U+2800).

The store kinds given to ``python -m benchmarks`` do not matter: the dashboard reads a SQLite
file of its own.
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Stores, percentile, save, table
from metafora import Task, open_client
from metafora.core.masking import mask_text
from metafora.testing import wait_for

_HOSTILE = "ab:/@?=&;#%.+-1 \t'\"\x1b\u202e"
MEGABYTE = 1_000_000
MIB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve(url: str, port: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAFORA_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    return subprocess.Popen([sys.executable, "-m", "metafora", "--url", url, "web", "--bind",
                             f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[float, int, int]:
    """(milliseconds, status, bytes) of one GET on ``conn``."""
    started = time.perf_counter()
    conn.request("GET", path)
    reply = conn.getresponse()
    body = reply.read()
    return (time.perf_counter() - started) * 1000, reply.status, len(body)


def _seed(url: str, pending: int) -> None:
    """Ten failed tasks whose handlers raised 1 MiB errors (stored as every store stores them
    now: :func:`~metafora.contracts.coordinator.error_text`), ten of each shape stored whole (as before
    issue 34), ``pending`` pending tasks and ten pending tasks past their expiry."""
    from sqlalchemy import text

    hostile = ("a://h/?%=1 " * 95_400)[:MIB]
    plain = "E" * MIB
    stamp = "2026-11-23 10:00:00.000"
    from metafora.contracts.coordinator import error_text

    rows = ([{"id": f"slow-err-{i}", "state": "failed", "error": error_text(ValueError(hostile)), "exp": None}
             for i in range(10)]
            + [{"id": f"old-err-{i}", "state": "failed", "error": f"ValueError: {hostile}", "exp": None}
               for i in range(10)]
            + [{"id": f"plain-err-{i}", "state": "failed", "error": f"ValueError: {plain}", "exp": None}
               for i in range(10)]
            + [{"id": f"p-{i:06d}", "state": "pending", "error": None, "exp": None} for i in range(pending)]
            + [{"id": f"x-{i}", "state": "pending", "error": None, "exp": "2000-01-01 00:00:00.000"}
               for i in range(10)])
    with open_client(url) as client:
        client.submit_task(Task("long-props", {"text": "m" * 65_000}))
        with client._db.write() as conn:  # type: ignore[attr-defined]
            conn.execute(text(
                "INSERT INTO metafora_tasks (namespace, id, props, state, error, expires_at, created_at,"
                " updated_at, finished_at) VALUES ('metafora', :id, '{}', :state, :error, :exp, :stamp,"
                " :stamp, :stamp)"), [{**row, "stamp": stamp} for row in rows])


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def _drain(sock: socket.socket) -> bytes:
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return got
        if not chunk:
            return got
        got += chunk


def body_memory(port: int, pid: int) -> dict[str, Any]:
    """The dashboard's VmRSS before and after a 64 MiB chunked body and a 400 MiB Content-Length."""
    import threading

    result: dict[str, Any] = {}
    head = (b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/x-www-form-urlencoded\r\n")
    before = _rss_kib(pid)
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
    replies: list[bytes] = []
    reader = threading.Thread(target=lambda: replies.append(_drain(sock)))
    reader.start()
    chunk = b"%x\r\n%s\r\n" % (MIB, b"t" * MIB)
    sent = 0
    try:
        for _ in range(64):
            sock.sendall(chunk)
            sent += 1
    except OSError:
        pass
    reader.join(60)
    sock.close()
    after = _rss_kib(pid)
    status = replies[0][:12].decode(errors="replace") if replies else "no answer"
    result["64 MiB chunked body"] = {"rss_before_kib": before, "rss_after_kib": after,
                                     "grown_mb": (after - before) / 1024, "mib_accepted": sent,
                                     "answer": status}
    before = _rss_kib(pid)
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(head + b"Content-Length: 419430400\r\n\r\n")
    answer = _drain(sock)[:12].decode(errors="replace")
    sock.close()
    after = _rss_kib(pid)
    result["Content-Length 400 MiB"] = {"rss_before_kib": before, "rss_after_kib": after,
                                        "grown_mb": (after - before) / 1024, "mib_accepted": 0,
                                        "answer": answer}
    return result


def pages(requests: int, pending: int = 100_000) -> dict[str, Any]:
    """Time the costly pages on a ``metafora web`` process, and its memory under large bodies."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/web.db"
        _seed(url, pending)
        port = _free_port()
        proc = _serve(url, port)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

            def up() -> bool:
                assert proc.poll() is None, proc.communicate()
                try:
                    return _get(conn, "/healthz")[1] == 200
                except OSError:
                    conn.close()
                    return False

            wait_for(up, 60, "metafora web to answer")
            paths = {"/nodes?msg= (60,000 letters)": "/nodes?" + urlencode({"msg": "m" * 60_000}),
                     "/task props (65,000 letters)": "/task?id=long-props",
                     "/tasks: ten 1 MiB hostile errors raised": "/tasks?prefix=slow-err-&limit=10",
                     "/tasks: ten 1 MiB hostile errors, old rows": "/tasks?prefix=old-err-&limit=10",
                     "/tasks: ten 1 MiB plain errors, old rows": "/tasks?prefix=plain-err-&limit=10",
                     "/task: one 1 MiB hostile error raised": "/task?id=slow-err-0",
                     "/task: one 1 MiB hostile error, old row": "/task?id=old-err-0",
                     f"/tasks?state=expired ({pending:,} pending)": "/tasks?state=expired&limit=50",
                     "/tasks?limit=50": "/tasks?limit=50"}
            result: dict[str, Any] = {}
            for name, path in paths.items():
                _get(conn, path)  # warm-up: templates compiled, schema checked
                runs = [_get(conn, path) for _ in range(requests)]
                assert all(status == 200 for _, status, _ in runs), runs
                times = [ms for ms, _, _ in runs]
                result[name] = {"requests": requests, "bytes": runs[0][2],
                                "p50_ms": percentile(times, 50), "max_ms": max(times)}
            conn.close()
            return {"pages": result, "memory": body_memory(port, proc.pid)}
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=30)


def _repeat(unit: str) -> str:
    return (unit * (MEGABYTE // len(unit) + 1))[:MEGABYTE]


def masking() -> dict[str, Any]:
    """The best of 5 of masking 1 MB of each kind of text."""
    rng = random.Random(25)
    inputs = {
        "letters": "m" * MEGABYTE,
        "hostile punctuation": "".join(rng.choice(_HOSTILE) for _ in range(MEGABYTE)),
        "a password URL every 30 chars": ("postgresql://a:SECRET@h/db " * (MEGABYTE // 27))[:MEGABYTE],
        "a URL with a port every 8 chars": ("a://b:1 " * (MEGABYTE // 8))[:MEGABYTE],
        # adversarial shapes (tests/unit/test_masking.py has them all)
        "prose": _repeat("lorem ipsum dolor sit amet, "),
        "harmless URLs with a query": _repeat("https://example.com/a/b?x=1&y=2 "),
        "'a://' repeated": _repeat("a://"),
        "'a:// ' repeated": _repeat("a:// "),
        "'@' flood in a URL": "a://" + "@" * MEGABYTE,
        "':' flood in a URL": "a://" + ":" * MEGABYTE,
        "'%' flood in a URL": "a://" + "%" * MEGABYTE,
        "unicode URLs with credentials": _repeat("a://ü:€@漢/😀?pässwörd=é "),
        "empty credentials every 6 chars": _repeat("a://@ "),
        "a port not a number every 8 chars": _repeat("a://h:x "),
        "one URL, 200,000 harmless options": "a://h/?" + _repeat("pas=&"),
        "one URL, 200,000 secret options": "a://h/?" + _repeat("pwd=&"),
        "a secret option every 13 chars": _repeat("a://h/?pwd=x "),
        "one URL, 250,000 odd ports": "a://" + _repeat("h:x,"),
    }
    result = {}
    for name, text in inputs.items():
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            mask_text(text)  # the algorithm, uncapped (scrub cuts a text over 64 KiB first)
            best = min(best, (time.perf_counter() - started) * 1000)
        result[name] = {"chars": len(text), "best_ms": best}
    return result


def round_three() -> dict[str, Any]:
    """Issue 52's cases (see the module docstring): each a check and its cost."""
    import asyncio
    import io
    import logging
    import resource
    import sqlite3
    import unicodedata
    from datetime import timedelta

    from metafora import open_async_client
    from metafora.core.errors import ConfigError, InvalidProps, InvalidTaskId
    from metafora.core.logs import configure
    from metafora.core.task import validate_task_id

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/r3.db"
        with open_client(url) as client:
            started = time.perf_counter()
            try:
                client.set_retention(done="800000d")
                refused = False
            except ConfigError:
                refused = True
            out["retention 800000d"] = {"holds": refused and client.retention().done == timedelta(days=7),
                                        "figure": f"{'refused' if refused else 'stored'} in "
                                                  f"{(time.perf_counter() - started) * 1000:.2f} ms"}
        blob = {"blob": "x" * 100_000_000}  # the caller's own value, before the measure
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            Task("t", blob)
            refused = False
        except InvalidProps:
            refused = True
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        out["props 100 MB"] = {"holds": refused and grown < 50, "figure": f"peak +{grown:.0f} MB"}
        stream = io.StringIO()
        configure(stream=stream)
        try:
            raise ValueError("a://h/?%=1 " * 95000)
        except ValueError as exc:
            logging.getLogger("benchmarks.security").exception("task t failed: %s", exc)
        finally:
            logging.getLogger().handlers.clear()
        line = stream.getvalue()
        out["log line of a 1 MiB error"] = {"holds": len(line) < 12_288, "figure": f"{len(line)} chars"}
        bad, ids = "big-refused", [f"big-{n:02d}" for n in range(23)]
        ids.insert(20, bad)

        async def shared() -> list[Any]:
            async with open_async_client(url) as aclient:
                await aclient.tasks()
                with sqlite3.connect(f"{tmp}/r3.db") as db:
                    db.execute("CREATE TRIGGER refuse BEFORE INSERT ON metafora_tasks WHEN NEW.id ="
                               f" '{bad}' BEGIN SELECT RAISE(ABORT, 'refused'); END")
                return await asyncio.gather(*(aclient.submit_task(Task(i, {"b": "x" * 900_000}))
                                              for i in ids), return_exceptions=True)

        started = time.perf_counter()
        got = dict(zip(ids, asyncio.run(shared()), strict=True))
        wrong = sum(1 for i, r in got.items() if (r is not True) != (i == bad))
        took = time.perf_counter() - started
        out["async shared write"] = {"holds": wrong == 0, "figure": f"{wrong} wrong of 24 in {took:.1f} s"}
    blanks = [chr(c) for c in range(0x3001) if unicodedata.category(chr(c)) == "Zs" and c != 0x20]
    blanks.append("\u2800")
    accepted = 0
    for blank in blanks:
        try:
            validate_task_id(f"task{blank}1")
            accepted += 1
        except InvalidTaskId:
            pass
    out["look-alike ids"] = {"holds": accepted == 0, "figure": f"{accepted} of {len(blanks)} accepted"}
    return out


def run(stores: Stores | None, quick: bool) -> dict[str, Any]:
    """Print the tables and save the JSON (``stores`` is not used: see the module's doc)."""
    served = pages(5 if quick else 20, 10_000 if quick else 100_000)
    data = {"pages": served["pages"], "memory": served["memory"], "masking_1mb": masking(),
            "round_three": round_three()}
    table("security: costly pages on metafora web (SQLite), client-side time",
          ["page", "requests", "bytes", "p50 ms", "max ms"],
          [[name, r["requests"], r["bytes"], r["p50_ms"], r["max_ms"]] for name, r in data["pages"].items()])
    table("security: the dashboard's memory under a large body (target: grows < 10 MB)",
          ["body", "answer", "MiB accepted", "RSS before KiB", "RSS after KiB", "grown MB"],
          [[name, r["answer"], r["mib_accepted"], r["rss_before_kib"], r["rss_after_kib"], r["grown_mb"]]
           for name, r in data["memory"].items()])
    table("security: masking 1 MB (best of 5)", ["text", "chars", "ms"],
          [[name, r["chars"], r["best_ms"]] for name, r in data["masking_1mb"].items()])
    table("security: issue 52's cases (each must hold)", ["case", "holds", "figure"],
          [[name, r["holds"], r["figure"]] for name, r in data["round_three"].items()])
    path = save("security", data)
    print(f"saved {path}")
    return data


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    run(None, args.quick)
