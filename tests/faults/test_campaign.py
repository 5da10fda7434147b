"""The fault campaign (issue 8): every scenario on PostgreSQL and on a 3-member etcd cluster.

Each test runs one :class:`~tests.faults.campaign.Campaign`: consumer processes on one store,
a ledger outside it, faults injected under load, then the checks (no overlapping valid runs,
no stale write accepted, nothing lost, survivors recovered without a restart). The figures
of every scenario are printed at the end of the session (``tests/fixtures/faults.py``).

The negative controls run the zombie scenario with fencing switched off on purpose
(handlers that ignore ``stop()`` and write without the fenced store): the same checks must
then find stale writes, or they prove nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.campaign import Campaign, Size
from tests.faults.stores import EtcdStore, PostgresStore, Store
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


@pytest.mark.parametrize("kind", ["postgresql", "etcd"])
def test_negative_control_finds_unfenced_zombie_writes(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """With fencing off, a zombie's writes after SIGCONT are accepted: the checks must say so."""
    store: Store = request.getfixturevalue("pg_store" if kind == "postgresql" else "etcd_store")
    size = Size(tasks=18, writes=(25, 35), faults=1, deadline=60.0)
    report = Campaign(store, "zombie", size, tmp_path, broken=True).run()
    record(report.figures())
    assert report.stale, f"the unfenced zombie's writes went unnoticed:\n{report.explain()}"
