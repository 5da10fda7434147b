"""The fault campaign (issue 8): every scenario on PostgreSQL and on a 3-member etcd cluster.

Each test runs one :class:`~tests.faults.campaign.Campaign`: consumer processes on one store,
a ledger outside it, faults injected under load, then the checks (no overlapping valid runs,
no stale write accepted, nothing lost, survivors recovered without a restart). The figures
of every scenario are printed at the end of the session (``tests/fixtures/faults.py``).

The negative controls run a scenario on a consumer broken on purpose (a flag of the test
worker, tests/faults/worker.py): each checker must then report the breakage, or it proves
nothing. Fencing off (handlers that ignore ``stop()`` and write without the fenced store): the
stale-write check; no self-fencing: the cut check; tasks reported done unrun: the lost-task
check; malformed commands dropped silently: the malformed check; a consumer that dies with its
store: the survivor check; expired claims never re-claimed: the zombie scenario's takeover check.
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
    report = Campaign(store, "zombie", size, tmp_path, broken="unfenced").run()
    record(report.figures())
    assert report.stale, f"the unfenced zombie's writes went unnoticed:\n{report.explain()}"


# (scenario, broken build, what the checker must say): one per checker of the campaign.
CONTROLS = {
    "no_self_fence": ("network_cut", "problems", "no self-fencing"),
    "lose": ("sigkill", "lost", "no run finished it"),
    "quiet_malformed": ("malformed", "problems", "malformed commands"),
    "fragile": ("store_restart", "problems", "died (exit 3)"),
    "no_takeover": ("zombie", "problems", "no zombie was made"),
}


@pytest.mark.parametrize("broken", list(CONTROLS))
def test_negative_control_each_checker_catches_its_breakage(
        broken: str, pg_store: PostgresStore, tmp_path: Path) -> None:
    """A consumer broken on purpose (tests/faults/worker.py): the checker it targets must fire."""
    scenario, field, said = CONTROLS[broken]
    size = Size(tasks=16, faults=1, deadline=45.0)
    report = Campaign(pg_store, scenario, size, tmp_path, broken=broken).run()
    record(report.figures())
    found: list[str] = getattr(report, field)
    assert any(said in line for line in found), (
        f"the {scenario} checker missed the {broken} build:\n{report.explain()}")
