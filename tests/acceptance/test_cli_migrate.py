"""Issue 50 point 4: the ``migrate=false`` URL option and ``metafora migrate --url URL``, on
SQLite and PostgreSQL (each a database of its own: the schema is per database).

With ``migrate=false`` a store never creates or alters its tables: a missing or older schema
is SchemaNotReady naming ``metafora migrate``, and nothing is written. ``metafora migrate``
(a subprocess, as a release step runs it) applies every migration, exits 0, and a second run
changes nothing; the store then works with ``migrate=false``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

import metafora
from metafora import Consumer, Task, TaskState, open_client, open_coordinator, simple_handler
from metafora.core.errors import ConfigError, SchemaNotReady
from metafora.gates import ItemStore, NewItem
from metafora.streams import SQLJobLog
from metafora.testing import wait_for
from metafora.testing.servers.postgres import postgres_database
from tests.helpers import SUBPROCESS_DEADLINE

REPO = Path(metafora.__file__).resolve().parents[1]


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database no metafora ever touched (PostgreSQL: created for this test)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/fresh.db"
        return
    server = str(request.getfixturevalue("postgres_server_url"))
    with postgres_database(server, "metafora_migrate") as url:
        yield url


def _with(url: str, option: str) -> str:
    return url + ("&" if "?" in url else "?") + option


def _tables(url: str) -> set[str]:
    plain = url.split("?", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    engine = create_engine(plain)
    try:
        with engine.connect() as conn:
            return {t for t in inspect(conn).get_table_names() if t.startswith("metafora")}
    finally:
        engine.dispose()


def _migrate(url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("METAFORA_URL", None)
    return subprocess.run([sys.executable, "-m", "metafora", "migrate", "--url", url],
                          check=False, capture_output=True, text=True,
                          timeout=SUBPROCESS_DEADLINE, env=env)


def test_migrate_false_never_touches_a_missing_schema(fresh_url: str) -> None:
    url = _with(fresh_url, "migrate=false")
    with open_client(url) as client, pytest.raises(SchemaNotReady, match="metafora migrate"):
        client.submit_task(Task("t"))
    with pytest.raises(SchemaNotReady, match="metafora migrate"), ItemStore(url) as items:
        items.add("p", [NewItem(0, b"x")])
    with pytest.raises(SchemaNotReady, match="metafora migrate"), SQLJobLog(url, "blocks") as joblog:
        joblog.append([("b1", None)])
    assert _tables(fresh_url) == set()  # nothing created


def test_migrate_false_refuses_an_older_schema(fresh_url: str) -> None:
    with open_client(fresh_url) as client:  # migrations applied on first use (the default)
        client.submit_task(Task("t"))
    plain = fresh_url.split("?", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    engine = create_engine(plain)
    try:
        with engine.begin() as conn:  # as a database left by an older release
            conn.execute(text("DELETE FROM metafora_schema WHERE version > 5"))
    finally:
        engine.dispose()
    with open_client(_with(fresh_url, "migrate=false")) as client, \
            pytest.raises(SchemaNotReady, match=r"at version 5.*metafora migrate"):
        client.get_task("t")


def test_metafora_migrate_applies_everything_once_then_the_store_runs_without_migrating(
    fresh_url: str,
) -> None:
    first = _migrate(fresh_url)
    assert first.returncode == 0, first.stderr
    assert "tasks schema version 0 ->" in first.stdout
    assert "items schema version 0 ->" in first.stdout
    assert "job logs schema version 0 ->" in first.stdout
    created = _tables(fresh_url)
    assert {"metafora_tasks", "metafora_schema", "metafora_task_commands",
            "metafora_items", "metafora_gates_schema", "metafora_joblog_schema",
            "metafora_joblog_jobs"} <= created
    second = _migrate(_with(fresh_url, "migrate=false"))  # idempotent; the option is ignored
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("up to date") == 3
    assert _tables(fresh_url) == created

    url = _with(fresh_url, "migrate=false")
    ran = threading.Event()

    def work(task: Task, stop: threading.Event) -> bool:
        ran.set()
        return True

    coord = open_coordinator(url, node_id="n1")
    consumer = Consumer(coord, simple_handler(work))
    runner = threading.Thread(target=consumer.run, daemon=True)
    runner.start()
    try:
        with open_client(url) as client:
            client.submit_task(Task("t1"))
            wait_for(lambda: client.get_task("t1").state is TaskState.DONE, 60, "t1 done")
    finally:
        consumer.shutdown()
        runner.join(60)
    assert ran.is_set()
    with ItemStore(url) as items:
        assert items.add("p", [NewItem(0, b"x")]) == [1]
    with SQLJobLog(url, "blocks") as joblog:
        assert joblog.append([("b1", None), ("b2", None)]) == [0, 1]


def test_migrate_refuses_stores_without_a_schema_and_bad_values(tmp_path: Path) -> None:
    done = _migrate("memory://nothing")
    assert done.returncode == 2
    assert "no schema to migrate" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(ConfigError, match="migrate"):
        open_client(f"sqlite:///{tmp_path}/x.db?migrate=maybe")
