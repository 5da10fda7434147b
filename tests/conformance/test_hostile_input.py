"""Hostile and damaged input never stops the cluster (issue 13, item 4), on every store.

- Through the API: ids with SQL metacharacters and unicode run like any other; ids over the
  limit, props over the size limit and props nested deeper than the limit are refused on
  submit with a typed error (never a bare RecursionError, never "store unavailable").
- Written around metafora (by hand, by another program sharing the store): a task whose stored
  props are not JSON, nested absurdly deep, or not an object fails that one task with an error
  naming the damage; the listing shows it; the consumers keep running and the other tasks
  complete.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import create_engine, text

from metafora import Task, TaskState, simple_handler
from metafora.core.config import DEFAULT_NAMESPACE
from metafora.core.errors import InvalidProps, InvalidTaskId
from metafora.core.task import MAX_PROPS_BYTES, MAX_PROPS_DEPTH, MAX_TASK_ID_LENGTH
from metafora.testing import LocalCluster

HOSTILE_IDS = [
    "x'; DROP TABLE metafora_tasks; --",
    'r"); DELETE FROM metafora_nodes; --',
    "50% off_ [a-z]* \\ ?#&=",
    "タスク/🚀 %2F ../..",
    "a" * MAX_TASK_ID_LENGTH,
]

DEEP_TEXT = '{"a":' * 1500 + "1" + "}" * 1500


def nested(depth: int) -> dict[str, Any]:
    """Props that nest exactly ``depth`` levels (the props object itself is level 1)."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def _recorder() -> tuple[list[str], Any]:
    """A handler function recording the ids it ran, and that list."""
    ran: list[str] = []
    lock = threading.Lock()

    def work(task: Task, stop: threading.Event) -> bool:
        with lock:
            ran.append(task.id)
        return True

    return ran, simple_handler(work)


def test_hostile_ids_run_like_any_other(store_url: str) -> None:
    ran, handler = _recorder()
    with LocalCluster(store_url) as cluster:
        for task_id in HOSTILE_IDS:
            cluster.client.submit_task(Task(task_id, {"id": task_id}))
        for node in ("a", "b"):
            cluster.add(handler, node_id=node)
        for task_id in HOSTILE_IDS:
            cluster.wait_for_state(task_id, TaskState.DONE, timeout=30)
        assert sorted(ran) == sorted(HOSTILE_IDS)
        infos = {i.id: i for i in cluster.client.tasks()}
        assert set(infos) == set(HOSTILE_IDS)
        assert all(infos[i].props == {"id": i} for i in HOSTILE_IDS)
        assert cluster.errors == []


def test_over_limit_input_is_refused_on_submit(store_url: str) -> None:
    with LocalCluster(store_url) as cluster:
        client = cluster.client
        with pytest.raises(InvalidTaskId, match="limit is 256"):
            client.submit_task(Task("b" * (MAX_TASK_ID_LENGTH + 1)))
        with pytest.raises(InvalidProps, match=f"limit is {MAX_PROPS_BYTES}"):
            client.submit_task(Task("big", {"blob": "x" * 10_000_000}))
        with pytest.raises(InvalidProps, match=f"deeper than {MAX_PROPS_DEPTH} levels"):
            client.submit_task(Task("deep", {"x": nested(1000)}))
        with pytest.raises(InvalidProps, match=f"deeper than {MAX_PROPS_DEPTH} levels"):
            client.submit_task(Task("deep", nested(MAX_PROPS_DEPTH + 1)))
        # At the limits exactly: accepted, stored and read back whole.
        client.submit_task(Task("deepest", nested(MAX_PROPS_DEPTH)))
        client.submit_task(Task("largest", {"blob": "y" * (MAX_PROPS_BYTES - 20)}))
        assert client.get_task("deepest").props == nested(MAX_PROPS_DEPTH)
        assert len(client.get_task("largest").props["blob"]) == MAX_PROPS_BYTES - 20
        assert {i.id for i in client.tasks()} == {"deepest", "largest"}


# -- damaged data written around metafora ---------------------------------------------------------


def _sql_damage(url: str, damaged: dict[str, str]) -> None:
    """Overwrite the stored props of tasks as another program sharing the database might."""
    base = url.split("?", 1)[0]
    if base.startswith("postgresql://"):
        base = "postgresql+psycopg://" + base[len("postgresql://"):]
    namespace = parse_qs(urlsplit(url).query).get("namespace", [DEFAULT_NAMESPACE])[0]
    engine = create_engine(base)
    try:
        with engine.begin() as conn:
            for task_id, props in damaged.items():
                done = conn.execute(
                    text("UPDATE metafora_tasks SET props = :p WHERE id = :id AND namespace = :ns"),
                    {"p": props, "id": task_id, "ns": namespace},
                )
                assert done.rowcount == 1, f"no row for {task_id} in namespace {namespace}"
    finally:
        engine.dispose()


def _etcd_damage(url: str, damaged: dict[str, str]) -> None:
    from metafora.coordinators.etcd.config import EtcdConfig
    from metafora.coordinators.etcd.driver import EtcdDriver, Put
    from metafora.coordinators.etcd.layout import Keys
    from metafora.core.config import parse_store_url

    config = EtcdConfig.from_url(parse_store_url(url), {})
    keys = Keys(config.namespace)
    driver = EtcdDriver(config.connection)
    driver.connect()
    try:
        for task_id, props in damaged.items():
            if props == "BYTES":
                record = b'{"props": {"a": "\xff\xfe"}}'
            else:
                    record = props.removeprefix("RAW:").encode() if props.startswith("RAW:") else (
                    b'{"props": ' + props.encode() + b"}"
                )
            driver.txn([], [Put(keys.task(task_id).props, record)])
    finally:
        driver.close()


DAMAGE = {
    "deep": DEEP_TEXT,
    "not-json": '{"a": 1',
    "a-list": "[1, 2, 3]",
    "a-string": '"text"',
    "bad-launch": '{"launch_at": "garbage"}',
}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "etcd"])
def test_damaged_stored_props_fail_one_task_and_nothing_else(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = str(request.getfixturevalue({"sqlite": "sqlite_url", "postgresql": "postgres_url",
                                       "etcd": "etcd_url"}[kind]))
    tag = uuid.uuid4().hex[:6]
    damaged = {f"{name}-{tag}": props for name, props in DAMAGE.items()}
    if kind == "etcd":  # etcd values are bytes: also invalid UTF-8 and a record without props
        damaged[f"no-props-{tag}"] = 'RAW:{"created_at": "2026-01-01T00:00:00+00:00"}'
        damaged[f"bad-utf8-{tag}"] = "BYTES"
    good = [f"good-{i}-{tag}" for i in range(24)]
    ran, handler = _recorder()
    with LocalCluster(url) as cluster:
        for task_id in good:
            cluster.client.submit_task(Task(task_id))
        if kind == "etcd":
            _etcd_damage(url, damaged)
        else:
            for task_id in damaged:
                cluster.client.submit_task(Task(task_id))
            _sql_damage(url, damaged)
        # Before any consumer runs, listing already shows the damaged tasks.
        listed = {i.id: i for i in cluster.client.tasks()}
        assert set(damaged) <= set(listed)
        assert all(listed[t].props == {} for t in damaged if not t.startswith("bad-launch"))
        for node in ("a", "b"):
            cluster.add(handler, node_id=node)
        for task_id in good:
            cluster.wait_for_state(task_id, TaskState.DONE, timeout=60)
        for task_id in damaged:
            cluster.wait_for_state(task_id, TaskState.FAILED, timeout=60)
        assert sorted(ran) == sorted(good), "a damaged task ran"
        infos = {i.id: i for i in cluster.client.tasks()}  # the listing works
        assert set(infos) == set(good) | set(damaged)
        for task_id in damaged:
            error = infos[task_id].error or ""
            assert error.startswith("invalid props:"), (task_id, error)
        assert "nested deeper than" in (infos[f"deep-{tag}"].error or "")
        assert "not valid JSON" in (infos[f"not-json-{tag}"].error or "")
        assert "must be a JSON object, not list" in (infos[f"a-list-{tag}"].error or "")
        assert cluster.errors == []
        assert all(c.healthy() for c in cluster.consumers)
        cluster.client.submit_task(Task(f"after-{tag}"))  # still serving
        cluster.wait_for_state(f"after-{tag}", TaskState.DONE, timeout=30)


def test_an_over_limit_etcd_request_is_a_usage_error_not_an_outage(etcd_url: str) -> None:
    from metafora.coordinators.etcd.config import EtcdConfig
    from metafora.coordinators.etcd.driver import EtcdDriver, Put
    from metafora.coordinators.etcd.layout import Keys
    from metafora.core.config import parse_store_url
    from metafora.core.errors import CoordinatorUnavailable, RequestTooLarge

    config = EtcdConfig.from_url(parse_store_url(etcd_url), {})
    driver = EtcdDriver(config.connection)
    driver.connect()
    try:
        with pytest.raises(RequestTooLarge, match="too large") as caught:
            driver.txn([], [Put(Keys(config.namespace).root + b"big", b"x" * 10_000_000)])
        assert not isinstance(caught.value, CoordinatorUnavailable)
        assert isinstance(caught.value, ValueError)  # the CLI reports it as a usage error (exit 2)
    finally:
        driver.close()
