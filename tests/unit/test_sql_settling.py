"""The PostgreSQL watch's second look at the ready values it passed (``Settling``): each
stretch is read again once it is a second old, at most twice a second, and only the rows the
ready scan never saw are offered then."""

from __future__ import annotations

from metafora.coordinators.sql.watch import Settling


def test_a_stretch_is_read_again_once_settled_and_reads_are_paced() -> None:
    s = Settling()
    s.reset(100)
    assert s.next_due is None and s.due(1000.0) is None  # nothing passed yet
    s.saw([("a", "{}", 101), ("b", "{}", 102)])
    s.mark(10.0, 102)
    s.mark(10.1, 102)  # no progress: no new mark
    assert s.next_due == 11.0
    assert s.due(10.9) is None  # not a second old yet
    s.saw([("c", "{}", 103)])
    s.mark(11.05, 103)
    assert s.due(11.0) == 102
    # rows of the stretch: a and b were seen at those values, "late" (committed behind) not
    assert s.unseen([("a", 101), ("late", 101), ("b", 102)]) == ["late"]
    s.done(102)
    assert s.settled == 102
    assert s.unseen([("c", 103)]) == []  # still remembered: above the settled value
    assert s.due(11.3) is None  # paced: the last look was 0.3 s ago
    assert s.next_due is not None and abs(s.next_due - 12.05) < 1e-9
    assert s.due(12.1) == 103
    s.done(103)
    assert s.next_due is None and s.unseen([("c", 103)]) == ["c"]  # forgotten once settled


def test_under_a_stream_the_second_look_comes_at_most_twice_a_second() -> None:
    s = Settling()
    reads = 0
    ready = 0
    t = 0.0
    while t < 10.0:  # a round every 20 ms, each passing 10 new ready values
        ready += 10
        s.mark(t, ready)
        until = s.due(t)
        if until is not None:
            reads += 1
            s.done(until)
        t += 0.02
    assert 15 <= reads <= 20, reads
