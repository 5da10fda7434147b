"""Every results file records the commit it ran at, clean (issue 53).

``benchmarks.common.save`` records the commit and refuses a checkout with uncommitted changes
(``METAFORA_BENCH_ALLOW_DIRTY=1`` saves it marked ``+dirty``); the tables say when a file's
commit is not recorded or dirty. The files below were saved before that and are kept as they
are (re-running them is not cheap): their tables say so. No new file may join them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import common, tables

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SAVED_BEFORE_THE_CHECK = {
    "ab_claims",  # commit not recorded
    "ab_final_gates",  # +dirty
    "ab_final_gates_pg",  # +dirty
    "ab_final_peers",  # +dirty
    "ab_final_storm",  # +dirty
    "ab_moves_claims",  # +dirty
    "ab_moves_claims_sqlite",  # +dirty
    "ab_moves_gates_sqlite_quiet",  # +dirty
    "ab_moves_peers",  # +dirty
    "ab_moves_storm",  # +dirty
    "ab_peers",  # commit not recorded
    "ab_peers_checkpoints",  # +dirty
    "ab_storm_etcd3",  # +dirty
    "ab_storm_gc_sql",  # +dirty
    "at_risk",  # commit not recorded
    "capacity",  # commit not recorded
    "claims",  # +dirty
    "failover",  # commit not recorded
    "gates",  # commit not recorded
    "gates_ab",  # commit not recorded
    "idle",  # commit not recorded
    "idle_cluster",  # +dirty
    "limits",  # commit not recorded
    "peers",  # commit not recorded
    "peers_short",  # +dirty
    "placement",  # commit not recorded
    "rebalance",  # commit not recorded
    "restart_quick_2026-11-29_eighth",  # +dirty
    "scale",  # commit not recorded
    "schedules",  # commit not recorded
    "simulate",  # commit not recorded
    "sql_raw",  # commit not recorded
    "storm_2026-11-29",  # +dirty
    "submit",  # +dirty
}


def _unclean(data: dict[str, object]) -> bool:
    commit = str(data.get("commit") or "")
    return not commit or commit.endswith("+dirty") or commit == "unknown"


def test_every_new_results_file_records_a_clean_commit() -> None:
    unclean = {p.stem for p in RESULTS.glob("*.json") if _unclean(json.loads(p.read_text()))}
    assert unclean - SAVED_BEFORE_THE_CHECK == set(), "commit the code, then run the benchmark again"


def test_save_refuses_a_dirty_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "commit", lambda: "0123456789+dirty")
    monkeypatch.delenv(common.ALLOW_DIRTY, raising=False)
    with pytest.raises(common.DirtyCheckout, match="uncommitted changes") as refused:
        common.save("planted", {"figure": 1})
    assert not (tmp_path / "planted.json").exists()
    kept = Path(str(refused.value).split("(kept in ")[1].split(")")[0])
    assert json.loads(kept.read_text())["figure"] == 1  # the figures are not lost
    kept.unlink()
    monkeypatch.setenv(common.ALLOW_DIRTY, "1")
    saved = json.loads(common.save("planted", {"figure": 1}).read_text())
    assert saved["commit"] == "0123456789+dirty"


def test_a_dirty_or_unrecorded_commit_is_said_under_its_table() -> None:
    spec = tables.TableSpec("x", "x", "python -m benchmarks x", lambda data: [])
    dirty = tables.provenance(spec, {"commit": "0123456789+dirty"})
    assert "no commit reproduces these figures" in dirty
    assert "commit not recorded" in tables.provenance(spec, {})
    assert "commit 0123456789," in tables.provenance(spec, {"commit": "0123456789"})
