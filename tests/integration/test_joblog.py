"""Issue 49, the SQL job log on real SQLite and PostgreSQL: dense indexes under concurrent
appenders (threads and processes), unique keys, appends in the application's transaction
(commit, rollback, autocommit refused), the push wake-up, and bad input."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from metafora.coordinators.sql.joblog import MAX_APPEND, MAX_KEY_LENGTH, MAX_PAYLOAD_BYTES, job_logs
from metafora.core.errors import ConfigError, StoreError
from metafora.core.jsontext import load_value
from metafora.streams import Job, SQLJobLog
from metafora.testing import wait_for
from tests.conformance.test_submit_in_transaction import conninfo, namespace, sqlalchemy_url
from tests.helpers import stop_processes

pytestmark = pytest.mark.integration

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def joblog(sql_url: str) -> Iterator[SQLJobLog]:
    log = SQLJobLog(sql_url, f"log-{uuid.uuid4().hex[:6]}")
    try:
        yield log
    finally:
        log.close()


def _assert_dense(log: SQLJobLog, keys: set[str]) -> None:
    """Every index 0..head holds one job, each key of ``keys`` exactly once."""
    head = log.head()
    jobs = [log.at_index(i) for i in range(head + 1)]
    assert all(job is not None and job.index == i for i, job in enumerate(jobs))
    seen = [job.id for job in jobs if job is not None]
    assert sorted(seen) == sorted(keys)
    assert log.at_index(head + 1) is None


# -- appending and reading ---------------------------------------------------------------


def test_indexes_are_dense_and_a_known_key_keeps_its_index(joblog: SQLJobLog, sql_url: str) -> None:
    assert joblog.head() == -1
    assert joblog.at_index(0) is None
    assert joblog.append([("a", 1), ("b", {"x": [1, 2]}), ("a", "dup in one call")]) == [0, 1, 0]
    assert joblog.append([("c", None), ("b", "again"), ("d", "é")]) == [2, 1, 3]
    assert joblog.append([("a", 0), ("d", 0)]) == [0, 3]  # nothing new: the head stays
    assert joblog.append([]) == []
    assert joblog.head() == 3
    assert joblog.at_index(1) == Job(1, "b", {"x": [1, 2]})  # the first payload stays
    assert joblog.at_index(0) == Job(0, "a", 1)
    assert joblog.at_index(3) == Job(3, "d", "é")
    assert joblog.at_index(-1) is None
    assert joblog.index_of("c") == 2 and joblog.index_of("zz") is None
    info = joblog.info()
    assert (info.name, info.head, info.size) == (joblog.name, 3, 4)
    assert [(i.name, i.size) for i in job_logs(sql_url) if i.name == joblog.name] == [(joblog.name, 4)]


def test_at_range_reads_a_range_in_one_go_and_none_past_the_head(joblog: SQLJobLog,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from metafora.coordinators.sql.joblog import log as log_module

    joblog.append([(f"k{i}", {"n": i}) for i in range(5)])
    assert joblog.at_range(3, 8) == [Job(3, "k3", {"n": 3}), Job(4, "k4", {"n": 4}), None, None, None]
    assert joblog.at_range(-2, 1) == [None, None, Job(0, "k0", {"n": 0})]
    assert joblog.at_range(2, 2) == [] and joblog.at_range(4, 1) == []
    monkeypatch.setattr(log_module, "MAX_RANGE", 2)  # a long range takes several queries
    assert [job.index for job in joblog.at_range(0, 5) if job is not None] == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="must be an integer"):
        joblog.at_range(0, "5")  # type: ignore[arg-type]


_STORED = [
    ' {"a": 1} ',  # padded: the bounded decode takes it
    "[" * 100 + "]" * 100,  # deeper than MAX_DEPTH
    '{"a": 1} x',  # extra data
    "NaN",  # json.loads takes it, so does the bounded decode
    '{"s": "' + "x" * 300 + '"}',  # long and shallow
    "[" * 60 + "]" * 60,  # deep, within the limit
    "[" * 30 + '"' + "{" * 100 + '"' + "]" * 30,  # many brackets, in a string
    "{",  # not JSON
    '"caf\u00e9"',
]


def test_stored_payloads_decode_as_the_bounded_decode_does(joblog: SQLJobLog, sql_url: str) -> None:
    """Rows written by another program: what the reads' fast decode takes, load_value takes
    alike; what it refuses, the reads refuse naming the job."""
    joblog.append([(f"k{i}", i) for i in range(len(_STORED))])
    engine = create_engine(sqlalchemy_url(sql_url))
    try:
        with engine.begin() as conn:
            for index, raw in enumerate(_STORED):
                conn.execute(text("UPDATE metafora_joblog_jobs SET payload = :p WHERE log_name = :log"
                                  " AND idx = :i"), {"p": raw, "log": joblog.name, "i": index})
    finally:
        engine.dispose()
    for index, raw in enumerate(_STORED):
        try:
            expected: Any = load_value(raw, "", StoreError)
        except StoreError:
            with pytest.raises(StoreError, match=f"payload of job 'k{index}'"):
                joblog.at_range(index, index + 1)
            continue
        got = joblog.at_range(index, index + 1)[0]
        assert got is not None and (got.index, got.id) == (index, f"k{index}")
        assert repr(got.payload) == repr(expected)  # (NaN is not equal to itself)


def test_a_read_past_the_head_sees_later_appends(joblog: SQLJobLog) -> None:
    joblog.append([(f"k{i}", i) for i in range(3)])
    assert joblog.at_index(2) == Job(2, "k2", 2)  # reads ahead and keeps 0..2
    assert joblog.at_index(3) is None
    joblog.append([("k3", 3)])
    assert joblog.at_index(3) == Job(3, "k3", 3)


def test_two_handles_of_one_log_agree(sql_url: str) -> None:
    one, two = SQLJobLog(sql_url, "shared"), SQLJobLog(sql_url, "shared")
    other = SQLJobLog(sql_url, "other")
    try:
        assert one.append([("x", 1)]) == [0]
        assert two.append([("x", 2), ("y", 3)]) == [0, 1]
        assert other.append([("x", 9)]) == [0]  # logs are apart
        assert one.head() == two.head() == 1 and other.head() == 0
        # One small pool per URL in a process, whatever the number of logs and streams.
        assert one._db is two._db is other._db and one._db.config.pool_size == 2
    finally:
        for log in (one, two, other):
            log.close()


def test_concurrent_appenders_in_threads_leave_no_gap(joblog: SQLJobLog, sql_url: str) -> None:
    threads, rounds = 6, 15
    results: dict[str, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def appender(number: int) -> None:
        log = SQLJobLog(sql_url, joblog.name)
        try:
            for r in range(rounds):
                # Overlapping keys: every thread also appends a key the next one appends.
                items = [(f"t{number}/r{r}/{i}", i) for i in range(3)]
                items.append((f"shared/{(number + r) % 4}/{r}", 0))
                got = log.append(items)
                with lock:
                    for (key, _), index in zip(items, got, strict=True):
                        assert results.setdefault(key, index) == index
        except BaseException as exc:
            errors.append(exc)
        finally:
            log.close()

    workers = [threading.Thread(target=appender, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not errors, errors
    _assert_dense(joblog, set(results))
    assert all(joblog.index_of(key) == index for key, index in results.items())


def _append_process(url: str, name: str, prefix: str, rounds: int, out: Any) -> None:
    log = SQLJobLog(url, name)
    got: dict[str, int] = {}
    for r in range(rounds):
        items = [(f"{prefix}/{r}/{i}", i) for i in range(4)] + [(f"both/{r}", r)]
        got.update(zip([k for k, _ in items], log.append(items), strict=True))
    log.close()
    out.put(got)


def test_appenders_in_two_processes_leave_no_gap(joblog: SQLJobLog, sql_url: str) -> None:
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=_append_process, args=(sql_url, joblog.name, p, 25, out))
             for p in ("p", "q")]
    for proc in procs:
        proc.start()
    try:
        first, second = out.get(timeout=120), out.get(timeout=120)
    finally:
        stop_processes(procs)
    shared = {k for k in first if k.startswith("both/")}
    assert all(first[k] == second[k] for k in shared)  # a key appended by both: one index
    _assert_dense(joblog, set(first) | set(second))


# -- in the application's transaction ------------------------------------------------------


def _kinds(url: str) -> list[str]:
    return ["connection", "session"] + (["psycopg"] if url.startswith("postgresql") else [])


class _App:
    """The application: its own table, and its transactions of each kind."""

    def __init__(self, url: str) -> None:
        self.url = url
        # The store exists first (as in real use: a SQLite store file is in WAL mode).
        _touch(url)
        self.engine = create_engine(sqlalchemy_url(url))
        self.table = f"app_{uuid.uuid4().hex[:8]}"
        with self.engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {self.table} (id TEXT PRIMARY KEY)"))

    def txn(self, kind: str) -> Any:
        """A context manager yielding (conn, run one SQL statement of the application)."""
        from contextlib import contextmanager

        @contextmanager
        def cm() -> Iterator[tuple[Any, Any]]:
            insert = f"INSERT INTO {self.table} (id) VALUES "
            if kind == "connection":
                with self.engine.begin() as conn:
                    yield conn, lambda v: conn.execute(text(insert + "(:v)"), {"v": v})
            elif kind == "session":
                with Session(self.engine) as session, session.begin():
                    yield session, lambda v: session.execute(text(insert + "(:v)"), {"v": v})
            else:
                with psycopg.connect(conninfo(self.url)) as pconn, pconn.transaction():
                    yield pconn, lambda v: pconn.execute(insert + "(%s)", (v,))
        return cm()

    def rows(self) -> list[str]:
        with self.engine.connect() as conn:
            return [str(r[0]) for r in conn.execute(text(f"SELECT id FROM {self.table} ORDER BY id"))]


def _touch(url: str) -> None:
    log = SQLJobLog(url, "setup")
    try:
        log.head()
    finally:
        log.close()


class _Rollback(Exception):
    pass


def test_append_in_the_applications_transaction_commits_or_rolls_back(
        joblog: SQLJobLog, sql_url: str) -> None:
    app = _App(sql_url)
    try:
        for expected, kind in enumerate(_kinds(sql_url)):
            with pytest.raises(_Rollback), app.txn(kind) as (conn, sql):
                sql(f"{kind}-gone")
                assert joblog.append([(f"{kind}-gone", 1), (f"{kind}-gone-2", 2)], conn=conn) == [
                    expected, expected + 1]
                assert joblog.head() == expected - 1  # not visible before the commit
                raise _Rollback
            assert joblog.head() == expected - 1 and joblog.index_of(f"{kind}-gone") is None
            with app.txn(kind) as (conn, sql):
                sql(f"{kind}-kept")
                # The rolled-back indexes are reused: no gap.
                assert joblog.append([(f"{kind}-kept", kind)], conn=conn) == [expected]
            assert joblog.head() == expected
            assert joblog.at_index(expected) == Job(expected, f"{kind}-kept", kind)
        assert app.rows() == sorted(f"{k}-kept" for k in _kinds(sql_url))
        _assert_dense(joblog, {f"{k}-kept" for k in _kinds(sql_url)})
    finally:
        app.engine.dispose()


def test_an_uncommitted_append_holds_the_next_appender_and_hides_its_index(
        joblog: SQLJobLog, sql_url: str) -> None:
    joblog.append([("first", 0)])
    app = _App(sql_url)
    started, got = threading.Event(), []

    def other() -> None:
        started.set()
        got.append(joblog.append([("other", 0)]))

    try:
        with app.txn("connection") as (conn, _sql):
            assert joblog.append([("mine", 0)], conn=conn) == [1]
            thread = threading.Thread(target=other)
            thread.start()
            started.wait(10)
            assert joblog.head() == 0 and joblog.at_index(1) is None  # nothing shown above it
            assert not got
        thread.join(30)
        assert got == [[2]]  # it waited for the counter row and followed the committed head
        _assert_dense(joblog, {"first", "mine", "other"})
    finally:
        app.engine.dispose()


def test_an_autocommit_connection_is_refused(joblog: SQLJobLog, sql_url: str) -> None:
    engine = create_engine(sqlalchemy_url(sql_url), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn, pytest.raises(ConfigError, match="autocommit"):
            joblog.append([("a", 1)], conn=conn)
        if sql_url.startswith("postgresql"):
            with psycopg.connect(conninfo(sql_url), autocommit=True) as pconn, \
                    pytest.raises(ConfigError, match="autocommit"):
                joblog.append([("a", 1)], conn=pconn)
        assert joblog.head() == -1
    finally:
        engine.dispose()


def test_a_connection_to_another_kind_of_database_is_refused(joblog: SQLJobLog, sql_url: str,
                                                             tmp_path: Any) -> None:
    other = "postgresql+psycopg://x@127.0.0.1:1/x" if sql_url.startswith("sqlite") else f"sqlite:///{tmp_path}/o.db"
    engine = create_engine(other)
    try:
        if sql_url.startswith("postgresql"):
            with engine.begin() as conn, pytest.raises(ConfigError, match="sqlite connection"):
                joblog.append([("a", 1)], conn=conn)
        with pytest.raises(ConfigError, match="takes a SQLAlchemy Connection"):
            joblog.append([("a", 1)], conn=object())
    finally:
        engine.dispose()


# -- wake-ups --------------------------------------------------------------------------------


def test_a_committed_append_wakes_the_listeners_of_its_log_only(sql_url: str) -> None:
    """PostgreSQL: the NOTIFY sent in the append's transaction; SQLite: the head's move seen
    through data_version. The appends run in the application's transaction on another
    connection, so no in-process shortcut wakes anyone."""
    ns = uuid.uuid4().hex[:6]
    reader_a, reader_b = SQLJobLog(sql_url, f"a{ns}"), SQLJobLog(sql_url, f"b{ns}")
    writer_a, writer_b = SQLJobLog(sql_url, f"a{ns}"), SQLJobLog(sql_url, f"b{ns}")
    woke_a, woke_b = threading.Event(), threading.Event()
    app = _App(sql_url)
    kind = "psycopg" if sql_url.startswith("postgresql") else "connection"
    try:
        writer_a.append([("warm", 0)])
        assert reader_a.listen(woke_a.set) and reader_b.listen(woke_b.set)
        assert reader_a.wait_listening(10)
        with app.txn(kind) as (conn, _sql):
            writer_b.append([("b0", 0)], conn=conn)
        assert woke_b.wait(10)
        woke_a.clear()
        woke_b.clear()
        with pytest.raises(_Rollback), app.txn(kind) as (conn, _sql):
            writer_a.append([("rolled back", 0)], conn=conn)
            raise _Rollback
        with app.txn(kind) as (conn, _sql):
            writer_b.append([("b1", 0)], conn=conn)
        assert woke_b.wait(10)  # delivered in commit order: a's would have come first
        assert not woke_a.is_set()
        with app.txn(kind) as (conn, _sql):
            writer_a.append([("a1", 0)], conn=conn)
        assert woke_a.wait(10)
        assert reader_a.head() == 1
    finally:
        for log in (reader_a, reader_b, writer_a, writer_b):
            log.close()
        app.engine.dispose()


def test_one_push_connection_per_process_serves_every_log(postgres_url: str) -> None:
    logs = [SQLJobLog(postgres_url, f"many-{i}") for i in range(5)]
    events = [threading.Event() for _ in logs]
    try:
        for log, event in zip(logs, events, strict=True):
            log.listen(event.set)
        assert logs[0].wait_listening(10)
        listeners = [t for t in threading.enumerate() if t.name == "metafora-sql-listen-joblogs"]
        assert len(listeners) == 1
        SQLJobLog(postgres_url, "many-3").append([("x", 1)], conn=None)
        assert events[3].wait(10)
    finally:
        for log in logs:
            log.close()
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "metafora-sql-listen-joblogs"],
             what="the shared listener to stop with its last log")


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(("items", "message"), [
    ([("k" * (MAX_KEY_LENGTH + 1), 1)], f"characters long; the limit is {MAX_KEY_LENGTH}"),
    ([("", 1)], "must not be empty"),
    ([(7, 1)], "must be a string"),
    ([("a\nb", 1)], "control character"),
    ([("a",)], "must be a \\(key, payload\\) pair"),
    (["ab"], "must be a \\(key, payload\\) pair"),
    ("ab", "list of \\(key, payload\\) pairs"),
    ([("ok", 1), ("bad", object())], "payload of job 'bad' is not JSON-serialisable"),
    ([("nan", float("nan"))], "not JSON-serialisable"),
    ([("big", "x" * MAX_PAYLOAD_BYTES)], f"the limit is {MAX_PAYLOAD_BYTES}"),
    ([(f"k{i}", 0) for i in range(MAX_APPEND + 1)], f"at most {MAX_APPEND} items"),
])
def test_bad_items_are_refused_and_nothing_is_written(joblog: SQLJobLog, items: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        joblog.append(items)
    assert joblog.head() == -1


def test_bad_names_urls_and_indexes_are_refused(sql_url: str, etcd_url: str) -> None:
    with pytest.raises(ConfigError, match="job log name must not be empty"):
        SQLJobLog(sql_url, "")
    with pytest.raises(ConfigError, match="needs a SQL store URL"):
        SQLJobLog(etcd_url, "log")
    log = SQLJobLog(sql_url, "log")
    try:
        with pytest.raises(ConfigError, match="must be an integer"):
            log.at_index("1")  # type: ignore[arg-type]
    finally:
        log.close()
    with pytest.raises(Exception, match="closed"):
        log.append([("a", 1)])


def test_importing_streams_does_not_import_sqlalchemy() -> None:
    code = ("import sys, metafora.streams; assert 'sqlalchemy' not in sys.modules;"
            " from metafora.streams import SQLJobLog; assert 'sqlalchemy' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_existing_key_lookup_reads_only_its_keys_under_a_generic_plan(postgres_url: str) -> None:
    """An append looks its keys up by key, whatever plan PostgreSQL caches: psycopg prepares
    a statement on its 6th run, and the generic plan of `job_key = ANY(:keys)` read every job
    of the log and compared each with the whole array (a 1,000-key append to a 40,000-job log
    went from 10 ms to 600). The join on the keys reads one index entry per key."""
    from metafora.coordinators.sql.joblog.statements import JobLogStatements

    log = SQLJobLog(postgres_url, f"plan-{uuid.uuid4().hex[:6]}")
    try:
        for batch in range(4):
            log.append([(f"k{batch}-{i}", i) for i in range(500)])
    finally:
        log.close()
    query = JobLogStatements.build("now()", postgres=True).existing.text
    for name in ("keys", "ns", "log"):
        query = query.replace(f":{name}", f"%({name})s")
    keys = [f"k3-{i}" for i in range(100)] + [f"new-{i}" for i in range(100)]
    with psycopg.connect(conninfo(postgres_url), autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        params = {"keys": keys, "ns": namespace(postgres_url), "log": log.name}
        got = conn.execute(query, params, prepare=True).fetchall()
        assert sorted(str(k) for k, _ in got) == sorted(keys[:100])
        (plan,), = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query, params,
                                prepare=True).fetchall()

    def read(node: dict[str, Any]) -> int:
        """Rows the plan's scans of the jobs table read (returned or filtered out)."""
        own = 0
        if node.get("Relation Name") == "metafora_joblog_jobs":
            own = int(node.get("Actual Rows", 0)) * int(node.get("Actual Loops", 1))
            own += int(node.get("Rows Removed by Filter", 0))
            own += int(node.get("Rows Removed by Index Recheck", 0))
        return own + sum(read(child) for child in node.get("Plans", []))

    assert read(plan[0]["Plan"]) <= len(keys), plan
