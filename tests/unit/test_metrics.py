"""metafora.core.metrics: the consumer's counters and latency histograms."""

from __future__ import annotations

import threading

import pytest

from metafora.core.metrics import DEFAULT_BUCKETS, ConsumerStats, Histogram


def test_a_new_histogram_has_every_bucket_empty() -> None:
    snap = Histogram().snapshot()
    assert [bound for bound, _ in snap.buckets] == [*DEFAULT_BUCKETS, float("inf")]
    assert all(count == 0 for _, count in snap.buckets)
    assert (snap.count, snap.total) == (0, 0.0)


def test_counts_are_cumulative_and_a_value_on_a_bound_counts_in_its_bucket() -> None:
    hist = Histogram((1.0, 0.1))  # given unsorted: bounds are sorted
    for seconds in (0.05, 0.1, 0.5, 1.0, 3.0):
        hist.observe(seconds)
    snap = hist.snapshot()
    assert snap.buckets == ((0.1, 2), (1.0, 4), (float("inf"), 5))  # "le", as Prometheus means it
    assert snap.count == 5
    assert snap.total == pytest.approx(4.65)


def test_observations_from_many_threads_are_all_counted() -> None:
    hist = Histogram((0.5,))
    start = threading.Barrier(4)

    def observe() -> None:
        start.wait(10)
        for _ in range(1000):
            hist.observe(0.25)

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    snap = hist.snapshot()
    assert snap.buckets == ((0.5, 4000), (float("inf"), 4000))
    assert snap.total == pytest.approx(1000.0)


def test_consumer_stats_count_by_name_and_copy_consistently() -> None:
    stats = ConsumerStats()
    stats.incr("claims")
    stats.incr("claims", 2)
    stats.incr("races_lost")
    counters = stats.counters()
    assert counters == {"claims": 3, "releases": 0, "done": 0, "failed": 0, "lost": 0,
                        "races_lost": 1}
    stats.incr("done")
    assert counters["done"] == 0 and stats.done == 1  # a copy, not a view
    stats.claim_latency.observe(0.002)
    assert stats.claim_latency.snapshot().count == 1
    assert stats.renewal_latency.snapshot().count == 0


def test_each_consumer_gets_histograms_of_its_own() -> None:
    one, two = ConsumerStats(), ConsumerStats()
    one.claim_latency.observe(0.01)
    assert two.claim_latency.snapshot().count == 0
