"""The fault campaign (issue 8): every scenario on PostgreSQL and on a 3-member etcd cluster.

Each test runs one :class:`~tests.faults.campaign.Campaign`: consumer processes on one store,
a ledger outside it, faults injected under load, then the checks (no overlapping valid runs,
no stale write accepted, nothing lost, survivors recovered without a restart). The figures
of every scenario are printed at the end of the session (``tests/fixtures/faults.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.campaign import Campaign, EtcdStore, PostgresStore, Size, Store
from tests.fixtures.faults import record

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(store: Store, scenario: str, size: Size, tmp_path: Path) -> None:
    report = Campaign(store, scenario, size, tmp_path).run()
    record(report.figures())
    assert report.ok, f"{store.kind}/{scenario}:\n{report.explain()}"


@pytest.mark.parametrize("scenario", Campaign.SCENARIOS)
def test_postgresql(scenario: str, pg_store: PostgresStore, size: Size, tmp_path: Path) -> None:
    """The scenario on a private PostgreSQL."""
    _run(pg_store, scenario, size, tmp_path)


@pytest.mark.parametrize("scenario", Campaign.SCENARIOS)
def test_etcd(scenario: str, etcd_store: EtcdStore, size: Size, tmp_path: Path) -> None:
    """The scenario on a 3-member etcd cluster."""
    _run(etcd_store, scenario, size, tmp_path)
