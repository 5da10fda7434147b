"""Issue 35: the runnable examples of submitting in the application's transaction --
FastAPI (SQLAlchemy async session) and Django (``transaction.atomic()`` on Django's psycopg
connection): a rolled-back request leaves no order and no task, a committed one's task runs
on a consumer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from metafora import simple_handler
from metafora.testing import LocalCluster
from tests.conformance.test_submit_in_transaction import conninfo, sqlalchemy_url
from tests.helpers import RanIds

pytest.importorskip("fastapi")
pytest.importorskip("django")

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def _shipped(store_url: str, committed: str, rolled_back: str) -> None:
    ran = RanIds()
    with LocalCluster(store_url) as cluster:
        assert [i.id for i in cluster.client.tasks()] == [committed]
        cluster.add(simple_handler(ran), "shipper")
        cluster.wait_for_state(committed, "done", 30)
        assert ran.ids == [committed] and rolled_back not in ran.ids


@pytest.mark.parametrize("store", ["postgresql", "sqlite"])
def test_fastapi_order_and_task_commit_together(store: str, metafora_store_url: Callable[[str], str]) -> None:
    import httpx

    from examples.transactional.fastapi_app import create_app

    url = metafora_store_url(store)
    db_url = sqlalchemy_url(url).replace("sqlite:", "sqlite+aiosqlite:", 1)
    app = create_app(db_url, url)

    async def requests() -> None:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://shop"
        ) as http:
            assert (await http.post("/orders/o1")).json() == {"order": "o1", "task": "ship-o1"}
            assert (await http.post("/orders/o2", params={"fail": "true"})).status_code == 402
            assert (await http.get("/orders/o1")).json() == {"order": "o1", "shipping": "pending"}

    asyncio.run(requests())
    _shipped(url, "ship-o1", "ship-o2")


_DJANGO = textwrap.dedent("""
    import sys
    from django.test import Client
    from examples.transactional import django_app
    django_app.configure(sys.argv[1], sys.argv[2])
    http = Client()
    ok = http.post("/orders/d1")
    assert ok.status_code == 200 and ok.json()["task"] == "ship-d1", ok.content
    failed = http.post("/orders/d2?fail=1")
    assert failed.status_code == 402, failed.content
    from django.db import connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM example_django_orders ORDER BY id")
        print(",".join(r[0] for r in cursor.fetchall()))
""")


def test_django_order_and_task_commit_together(metafora_store_url: Callable[[str], str]) -> None:
    url = metafora_store_url("postgresql")
    # Its own process: Django's settings are process-wide.
    done = subprocess.run([sys.executable, "-c", _DJANGO, conninfo(url), url], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "d1"
    _shipped(url, "ship-d1", "ship-d2")
