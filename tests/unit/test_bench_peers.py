"""The pure parts of benchmarks/peers.py: run order, statistics, ratios, tables.

None of this needs pgqueuer or procrastinate (CI does not install the ``bench`` extra).
"""

from __future__ import annotations

import math

import pytest

from benchmarks import peers
from benchmarks.peers import Spread


def test_rounds_interleave_every_system_once_per_round_and_rotate() -> None:
    order = peers.rounds_order(["A", "B", "C", "D"], 3)
    assert order == [
        (1, "A"), (1, "B"), (1, "C"), (1, "D"),
        (2, "B"), (2, "C"), (2, "D"), (2, "A"),
        (3, "C"), (3, "D"), (3, "A"), (3, "B"),
    ]


def test_rounds_wrap_around_when_more_rounds_than_systems() -> None:
    order = peers.rounds_order(["A", "B"], 3)
    assert [s for _, s in order] == ["A", "B", "B", "A", "A", "B"]


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        peers.rounds_order(["A"], 0)


def test_spread_is_median_and_range_ignoring_failed_runs() -> None:
    assert Spread.of([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0)
    assert Spread.of([4.0, float("nan"), 2.0]) == Spread(3.0, 2.0, 4.0)
    empty = Spread.of([float("nan")])
    assert math.isnan(empty.median) and math.isnan(empty.low) and math.isnan(empty.high)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert peers.percentile(values, 50) == 51.0
    assert peers.percentile(values, 99) == 99.0
    assert math.isnan(peers.percentile([], 50))


def _runs() -> list[dict[str, object]]:
    return [
        {"round": 1, "system": "metafora-postgresql", "tasks_per_s": 1000.0, "p50_ms": 4.0, "p99_ms": 10.0},
        {"round": 1, "system": "pgqueuer", "tasks_per_s": 2000.0, "p50_ms": 2.0, "p99_ms": 8.0},
        {"round": 2, "system": "pgqueuer", "tasks_per_s": 2400.0, "p50_ms": 4.0, "p99_ms": 12.0},
        {"round": 2, "system": "metafora-postgresql", "tasks_per_s": 1200.0, "p50_ms": 6.0, "p99_ms": 20.0},
        {"round": 3, "system": "metafora-postgresql", "error": "boom"},
        {"round": 3, "system": "pgqueuer", "tasks_per_s": 2200.0, "p50_ms": 3.0, "p99_ms": 10.0},
    ]


def test_summarize_per_system_keeps_run_order_of_first_appearance() -> None:
    summary = peers.summarize(_runs())
    assert list(summary) == ["metafora-postgresql", "pgqueuer"]
    assert summary["metafora-postgresql"]["tasks_per_s"] == Spread(1100.0, 1000.0, 1200.0)
    assert summary["pgqueuer"]["tasks_per_s"] == Spread(2200.0, 2000.0, 2400.0)
    assert summary["pgqueuer"]["p99_ms"] == Spread(10.0, 8.0, 12.0)


def test_ratios_are_metafora_over_each_peer() -> None:
    rows = peers.ratio_rows(peers.summarize(_runs()))
    assert len(rows) == 1
    ours, theirs, tput, p50, p99 = rows[0]
    assert (ours, theirs) == ("metafora-postgresql", "pgqueuer")
    assert tput == pytest.approx(0.5)
    assert p50 == pytest.approx(5.0 / 3.0)
    assert p99 == pytest.approx(1.5)


def test_ratio_of_missing_figures_is_nan() -> None:
    assert math.isnan(peers.ratio(float("nan"), 1.0))
    assert math.isnan(peers.ratio(1.0, 0.0))
    assert peers.ratio(3.0, 2.0) == 1.5


def test_markdown_table_and_ratio_rows() -> None:
    summary = peers.summarize(_runs())
    labels = peers.labels_for(["metafora-postgresql", "pgqueuer"], {"pgqueuer": "1.6.0"})
    text = peers.markdown(summary, labels, 3, 5000, 200)
    lines = text.splitlines()
    assert lines[0].startswith("| system | tasks/s, 5,000 tasks (median of 3; range) |")
    assert ("| metafora, PostgreSQL, defaults | 1,100 (1,000 - 1,200) | 5.00 (4.00 - 6.00) |"
            " 15.0 (10.0 - 20.0) |" in lines)
    assert ("| pgqueuer 1.6.0, capped at 10, extra | 2,200 (2,000 - 2,400) | 3.00 (2.00 - 4.00) |"
            " 10.0 (8.00 - 12.0) |" in lines)
    assert "| metafora-postgresql ÷ pgqueuer | 0.50x | 1.67x | 1.50x |" in lines
    assert "published ratio" not in text  # the capped row alone is no peer at its best


def test_the_published_ratio_is_the_lowest_against_any_pgqueuer_row() -> None:
    runs = [*_runs(), {"round": 1, "system": "pgqueuer-recommended", "tasks_per_s": 4400.0},
            {"round": 1, "system": "pgqueuer-default", "tasks_per_s": 3000.0},
            {"round": 1, "system": "procrastinate", "tasks_per_s": 9000.0},  # not a pgqueuer row
            {"round": 1, "system": "metafora-sqlite", "tasks_per_s": 2200.0}]
    assert peers.published(peers.summarize(runs)) == [
        ("metafora-postgresql", "pgqueuer-recommended", pytest.approx(0.25)),
        ("metafora-sqlite", "pgqueuer-recommended", pytest.approx(0.5))]
    labels = peers.labels_for(peers.SYSTEMS, {s: "1.6.0" for s in peers.SYSTEMS if s.startswith("pgq")})
    assert labels["pgqueuer-recommended"] == "pgqueuer 1.6.0, recommended"
    assert labels["pgqueuer-default"] == "pgqueuer 1.6.0, defaults (pgq run)"
    assert labels["metafora-sqlite"] == "metafora, SQLite, defaults"
    assert len(set(labels.values())) == len(peers.SYSTEMS)  # every row told apart by its label


def test_markdown_adds_the_first_start_columns_when_measured() -> None:
    runs = [{"system": "metafora-postgresql", "tasks_per_s": 1.0, "spawn_to_first_s": 0.5,
             "go_to_first_s": 0.25}]
    lines = peers.markdown(peers.summarize(runs), {}, 1, 5000, 200).splitlines()
    assert lines[0].endswith("| spawn→first start s | imports done→first start s |")
    assert lines[2].endswith("| 0.50 (0.50 - 0.50) | 0.25 (0.25 - 0.25) |")


def test_markdown_adds_the_crash_column_when_measured() -> None:
    runs = [*_runs(), {"round": 1, "system": "pgqueuer", "recovery_s": 3.2},
            {"round": 1, "system": "metafora-postgresql", "recovery_s": 2.4}]
    summary = peers.summarize(runs)
    assert summary["pgqueuer"]["recovery_s"] == Spread(3.2, 3.2, 3.2)
    lines = peers.markdown(summary, {}, 1, 5000, 200).splitlines()
    assert lines[0].endswith("| crash recovery s (3 s detection) |")
    assert lines[1] == "|---|---|---|---|---|"
    assert lines[2].endswith("| 2.40 (2.40 - 2.40) |")


def test_markdown_without_peers_has_no_ratio_table_and_dashes_for_failures() -> None:
    summary = peers.summarize([{"system": "metafora-sqlite", "error": "x"}])
    text = peers.markdown(summary, peers.labels_for(["metafora-sqlite"], {}), 1, 1000, 50)
    assert "| metafora, SQLite, defaults | - | - | - |" in text
    assert "ratio" not in text
    assert "crash" not in text


def test_readme_text_from_saved_results() -> None:
    summary = peers.summarize(_runs())
    data = {
        "rounds": 3, "processes": 2, "tasks": 5000, "submits": 200,
        "labels": peers.labels_for(["metafora-postgresql", "pgqueuer"], {"pgqueuer": "1.6.0"}),
        "settings": {s: peers.SETTINGS[s] for s in ("metafora-postgresql", "pgqueuer")},
        "summary": {s: {k: vars(v) for k, v in f.items()} for s, f in summary.items()},
    }
    text = peers.readme_text(data)
    assert "3 interleaved rounds" in text
    assert "| metafora-postgresql ÷ pgqueuer | 0.50x |" in text
    assert "- pgqueuer 1.6.0, capped at 10, extra: extra row, the one published before issue 51:" in text


def test_parse_systems() -> None:
    assert peers.parse_systems(None) == list(peers.DEFAULT_SYSTEMS)  # the Consumer's defaults
    assert "metafora-postgresql-dumb" not in peers.DEFAULT_SYSTEMS  # an extra, asked for by name
    assert peers.parse_systems("metafora-sqlite-dumb") == ["metafora-sqlite-dumb"]
    assert "DumbBalancer, extra" in peers.labels_for(["metafora-sqlite-dumb"], {})["metafora-sqlite-dumb"]
    assert peers.parse_systems(" pgqueuer , metafora-sqlite") == ["pgqueuer", "metafora-sqlite"]
    with pytest.raises(SystemExit, match="unknown system"):
        peers.parse_systems("celery")
    with pytest.raises(SystemExit, match="unknown system"):
        peers.parse_systems(",")
