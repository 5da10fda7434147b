"""Stores for the fault campaign, one per module, that scenarios may break and repair.

- ``pg_store``: a private PostgreSQL (``TempCluster``: initdb/pg_ctl on a free port) that
  scenarios kill and restart; never the shared server on 5432.
- ``etcd_store``: a 3-member etcd cluster on loopback whose members scenarios stop and start.
- ``size``: the short form (CI) or, with ``--long``, the long one.

Each scenario uses its own namespace, so one store serves every scenario of a module; a
scenario that breaks the store brings it back before it returns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.faults.campaign import Size
from tests.faults.stores import EtcdStore, PostgresStore
from tests.fixtures.etcd import find_etcd, start_cluster
from tests.fixtures.faults import is_long
from tests.fixtures.postgres import TempCluster, pg_bin


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the fault campaign needs {what} in CI")
    pytest.skip(f"the fault campaign needs {what}")


@pytest.fixture(scope="module")
def pg_store() -> Iterator[PostgresStore]:
    """A private, restartable PostgreSQL for this module's scenarios."""
    if pg_bin("initdb") is None or pg_bin("pg_ctl") is None:
        _missing("initdb and pg_ctl")
    cluster = TempCluster()
    try:
        yield PostgresStore(cluster)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def etcd_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdStore]:
    """A 3-member etcd cluster for this module's scenarios (members stopped by pid after)."""
    binary = find_etcd()
    if binary is None:
        _missing("an etcd binary")
        raise AssertionError("unreachable")
    cluster = start_cluster(binary, tmp_path_factory.mktemp("faults-etcd"))
    try:
        yield EtcdStore(cluster)
    finally:
        cluster.stop_all()


@pytest.fixture(scope="session")
def size(request: pytest.FixtureRequest) -> Size:
    """How big each scenario is: short (default, CI) or long (``--long``)."""
    return Size.long() if is_long(request.config) else Size.short()
