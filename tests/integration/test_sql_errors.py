"""Bad URLs and options, unreachable stores, passwords kept out of errors and logs."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from metafora import Task, open_client, open_coordinator
from metafora.coordinators.sql import SQLCoordinator
from metafora.core.errors import ConfigError, CoordinatorUnavailable, StoreError
from metafora.testing import RecordingContext

SECRET = "s3cr3t-Pa55"


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "options", "needle"),
    [
        ("sqlite:///x.db?nope=1", {}, "unknown option"),
        ("sqlite:///x.db", {"lease_ttl": 0.5}, "lease_ttl"),
        ("sqlite:///x.db", {"lease_ttl": "soon"}, "lease_ttl"),
        ("sqlite:///x.db", {"poll_interval": 0}, "poll_interval"),
        ("sqlite:///x.db", {"namespace": "bad namespace!"}, "namespace"),
        ("sqlite:///x.db", {"connect_timeout": 3}, "unknown option"),
        ("sqlite:///:memory:", {}, "memory"),
        ("sqlite://host/x.db", {}, "no host"),
        ("postgresql://u@h:5432/db", {"busy_timeout": 1}, "unknown option"),
        ("postgresql://u@h:5432/", {}, "database name"),
        ("postgresql://u@h1,h2/db", {}, "one host"),
        ("postgresql://u@h/db?sslmode=sometimes", {}, "sslmode"),
        ("postgresql://u@h/db?pool_size=0", {}, "pool_size"),
    ],
)
def test_bad_urls_and_options_are_config_errors(url: str, options: dict[str, object],
                                                 needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        open_client(url, **options)
    with pytest.raises(ConfigError, match=needle):
        open_coordinator(url, node_id="n", **options)


def test_accepted_schemes_and_options(tmp_path: Path) -> None:
    for scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        client = open_client(f"{scheme}://u:{SECRET}@127.0.0.1:1/db?namespace=x&lease_ttl=5"
                             "&poll_interval=2&connect_timeout=2&sslmode=disable&pool_size=2")
        assert SECRET not in client.name and client.name.startswith(f"{scheme}://u:***@")
        client.close()
    coord = open_coordinator(f"sqlite:///{tmp_path}/a.db", node_id="n", lease_ttl=2,
                             busy_timeout=1, namespace="ns-1")
    assert isinstance(coord, SQLCoordinator) and coord.name == f"sqlite:///{tmp_path}/a.db"
    coord.close()


@pytest.mark.timing
def test_unreachable_postgres_is_unavailable_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"postgresql://metafora:{SECRET}@127.0.0.1:{closed_port()}/jobs?connect_timeout=2"
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        client = open_client(url)
        with pytest.raises(CoordinatorUnavailable) as info:
            client.submit_task(Task("t"))
        client.close()
        coord = open_coordinator(url, node_id="n")
        with pytest.raises(CoordinatorUnavailable) as info2:
            coord.init(RecordingContext())
        coord.close()
    assert time.monotonic() - started < 10  # prompt: a refused connection, no long retries
    for exc in (info.value, info2.value):
        text = str(exc)
        assert "127.0.0.1" in text and "metafora:***@" in text
        assert SECRET not in text and SECRET not in repr(exc)
        assert exc.__cause__ is not None and SECRET not in str(exc.__cause__)
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_unreachable_sqlite_file_is_unavailable(tmp_path: Path) -> None:
    client = open_client(f"sqlite:///{tmp_path}/no/such/dir/m.db")
    with pytest.raises(CoordinatorUnavailable, match="no/such/dir"):
        client.tasks()
    client.close()


def test_a_newer_schema_is_refused(sqlite_url: str) -> None:
    client = open_client(sqlite_url)
    client.tasks()
    client.close()
    import sqlite3

    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO metafora_schema (version, description, applied_at)"
                     " VALUES (999, 'from the future', '2030-01-01 00:00:00.000')")
    client = open_client(sqlite_url)
    with pytest.raises(StoreError, match="version 999"):
        client.tasks()
    client.close()


def test_methods_after_close(sql_url: str) -> None:
    from metafora.core.errors import CoordinatorClosed

    coord = open_coordinator(sql_url, node_id="n")
    coord.init(RecordingContext())
    coord.close()
    coord.close()
    assert coord.command(timeout=1) is None
    coord.watch(lambda task: None)  # returns at once
    with pytest.raises(CoordinatorClosed):
        coord.claim(Task("t"))
    with pytest.raises(CoordinatorClosed):
        coord.done(Task("t", {}, 1))
    with pytest.raises(CoordinatorClosed):
        coord.node_task_count()
    client = open_client(sql_url)
    client.close()
    client.close()
    with pytest.raises(CoordinatorClosed):
        client.tasks()
