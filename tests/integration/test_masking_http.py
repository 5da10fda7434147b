"""Issue 16 on a real PostgreSQL: a consumer with a random password shows it nowhere.

The server trusts loopback connections, so any password works: the consumer really runs,
and ``/info``, ``/metrics`` and its log records (DEBUG) are checked for every marker of
the generated password. ``/info`` names the store by scheme, host and database only.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metafora import Task, simple_handler
from metafora.testing import LocalCluster, wait_for
from tests.unit.test_masking import all_records, leaks, passwords


def _get(addr: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as resp:
        return str(resp.read().decode())


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(password=passwords(), encoded=st.booleans())
def test_info_metrics_and_logs_never_show_the_password(postgres_database_url: str, password: str,
                                                       encoded: bool) -> None:
    if "://postgres@" not in postgres_database_url:
        pytest.skip("the test server URL is not postgres@... (cannot add a password)")
    secret = quote(password, safe="") if encoded else password  # raw: '/', '@', '%' unencoded
    sep = "&" if "?" in postgres_database_url else "?"
    url = postgres_database_url.replace("://postgres@", f"://postgres:{secret}@", 1) + (
        f"{sep}namespace=m{uuid.uuid4().hex[:10]}"
    )
    with all_records() as records, LocalCluster(url) as cluster:
        consumer = cluster.add(simple_handler(lambda task, stop: True), "masked",
                               http_addr="127.0.0.1:0")
        cluster.client.submit_task(Task("t"))
        cluster.wait_for_state("t", "done", timeout=30)
        addr = wait_for(lambda: consumer.http_address, what="http server")
        info, metrics = _get(addr, "/info"), _get(addr, "/metrics")
    store = json.loads(info)["store"]
    assert store.startswith("postgresql://127.0.0.1:") and "@" not in store and "?" not in store
    texts = [info, metrics, cluster.client.name, *records.texts]
    assert [(text, leaks(text)) for text in texts if leaks(text)] == []
