"""The watch cache (:mod:`metafora.coordinators.etcd.cache`): entries, what a claim is judged
on, the balancers' counts and the subscribers' marks. Pure logic; the watch that feeds it runs
against a real etcd in tests/integration/test_etcd.py."""

from __future__ import annotations

from datetime import UTC, datetime

from metafora.coordinators.etcd.cache import Entry, Outcome, Subscriber, TaskCache, offer_for
from metafora.coordinators.etcd.layout import Keys, TaskRecord, encode_json, task_record
from metafora.coordinators.etcd.ops import KeyValue
from metafora.coordinators.etcd.queries import Registration
from metafora.core.retention import Cutoffs
from metafora.core.task import Task

KEYS = Keys("ns")
DONE = Outcome(9, b'{"state":"done"}')  # a finished task's outcome


def kv(key: bytes, value: bytes, create: int = 1, mod: int = 1) -> KeyValue:
    return KeyValue(key, value, create, mod, 1, 0)


def props_kv(task: Task, mod: int = 5) -> KeyValue:
    return kv(KEYS.task(task.id).props, task_record(task, "2026-01-01T00:00:00+00:00"), mod, mod)


def test_an_entry_from_a_record_and_what_a_claim_is_fenced_on() -> None:
    task = Task("t", {"expires_at": "2026-01-02T00:00:00+00:00"}, priority=3)
    rec = TaskRecord(props=props_kv(task, 5), running=kv(b"r", b'{"crashes": 1}', 6, 6),
                     owner=kv(b"o", b"n1", 8, 8))
    entry = Entry.from_record("t", rec)
    assert (entry.owner, entry.owner_rev, entry.finished) == ("n1", 8, False)
    assert entry.expires_at == datetime(2026, 1, 2, tzinfo=UTC)
    known = entry.known()
    assert (known.props_mod, known.running_mod) == (5, 6)
    assert known.crashes() == 2  # the previous claim died: one more crash in a row
    assert known.task("t", 9) == Task("t", task.props, 9, priority=3)


def test_no_running_key_means_no_crash() -> None:
    entry = Entry.from_record("t", TaskRecord(props=props_kv(Task("t"))))
    assert entry.known().crashes() == 0
    entry.set_running(kv(b"r", b'{"crashes": 0}', 7, 7))
    assert entry.known().crashes() == 1 and entry.known().running_mod == 7


def test_damaged_props_are_offered_without_them() -> None:
    entry = Entry()
    entry.set_props(kv(b"p", b"not json", 3, 3), "t")
    assert entry.props == {} and entry.props_error is not None
    offer, valid = offer_for("t", entry)
    assert offer == Task("t") and valid is True  # the record decoded; the claim judges it
    assert offer_for("t", Entry()) == (Task("t"), False)


def test_counts_follow_owner_keys_and_members() -> None:
    cache = TaskCache()
    assert cache.counts(active=False) is None  # not ready, no watch
    assert cache.members(active=False) is None
    a, b = Entry(), Entry()
    cache.replace({"a": a, "b": b}, {"n1": Registration(weight=2.0), "n2": Registration(leaving=True)}, 10)
    cache.live = True
    assert cache.counts(active=False) == {"n1": 0, "n2": 0}
    cache.set_owner(a, kv(b"o", b"n1", 11, 11))
    cache.set_owner(b, kv(b"o", b"n2", 12, 12))
    assert cache.counts(active=False) == {"n1": 1, "n2": 1}
    assert cache.counts(active=True) == {"n1": 1}  # n2 is leaving
    assert cache.members(active=True) == {"n1": Registration(weight=2.0)}
    assert cache.seen_taken("a") and not cache.seen_taken("c")
    cache.set_owner(b, kv(b"o", b"n1", 13, 13))  # taken over by n1
    cache.set_owner(a, None)
    assert (a.owner, a.owner_rev) == (None, 0)
    assert cache.counts(active=False) == {"n1": 1, "n2": 0}
    cache.member_put("n3", Registration(frozen=True))
    cache.member_gone("n2")
    assert cache.counts(active=False) == {"n1": 1, "n3": 0}
    assert cache.members(active=False) == {"n1": Registration(weight=2.0), "n3": Registration(frozen=True)}


def test_a_re_list_counts_the_owners_it_read() -> None:
    cache = TaskCache()
    owned = Entry(owner="n1", owner_rev=3)
    cache.replace({"x": owned, "y": Entry(outcome=DONE)}, {"n1": Registration()}, 4)
    cache.live = True
    assert cache.ready and cache.revision == 4
    assert cache.counts(active=True) == {"n1": 1}
    assert cache.seen_taken("y")  # finished


def test_a_subscriber_collects_marks_and_wakes() -> None:
    sub = Subscriber(everything=False)
    sub.mark(set())
    assert not sub.event.is_set()
    sub.mark({"a"})
    sub.mark({"b"})
    assert sub.event.is_set() and sub.ids == {"a", "b"} and not sub.everything
    sub.mark(None)
    assert sub.everything


def _walked(cache: TaskCache, now: datetime) -> int:
    """The claimable count as a walk of every entry finds it (what the cache used to do)."""
    live = cache.members(active=False) or {}
    return sum(
        1 for e in cache.entries.values()
        if not e.finished and e.props is not None and (e.owner is None or e.owner not in live)
        and (e.launch_at is None or e.launch_at <= now) and (e.expires_at is None or e.expires_at > now)
    )


def test_the_claimable_count_kept_as_entries_change_equals_a_walk_of_them() -> None:
    import random

    rng = random.Random(7)
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    times = [None, "2026-01-01T11:00:00+00:00", "2026-01-01T13:00:00+00:00"]
    cache = TaskCache()
    cache.replace({}, {"n1": Registration(), "n2": Registration()}, 1)
    cache.live = True
    for step in range(3000):
        task_id = f"t{rng.randrange(40)}"
        entry = cache.entries.setdefault(task_id, Entry())
        change = rng.randrange(6)
        if change == 0:
            props = {k: v for k, v in (("launch_at", rng.choice(times)),
                                       ("expires_at", rng.choice(times))) if v is not None}
            entry.set_props(props_kv(Task(task_id, props), step + 2), task_id)
        elif change == 1:
            entry.props = None
        elif change == 2:
            entry.outcome = DONE if rng.random() < 0.5 else None
        elif change == 3:
            owner = rng.choice(["n1", "n2", "gone"])
            cache.set_owner(entry, kv(b"o", owner.encode(), step + 2, step + 2))
        elif change == 4:
            cache.set_owner(entry, None)
        elif rng.random() < 0.5:
            cache.member_gone("n2")
        else:
            cache.member_put("n2", Registration())
        if entry.props is None and entry.owner is None:
            del cache.entries[task_id]
            cache.track(task_id, None)
        else:
            cache.track(task_id, entry)
        assert cache.claimable(now) == _walked(cache, now), step
    # A re-list rebuilds what the count adds up from the entries it read.
    fresh = {k: e for k, e in cache.entries.items()}
    cache.replace(fresh, {"n1": Registration()}, 5000)
    assert cache.claimable(now) == _walked(cache, now)


def _finished(cache: TaskCache, task_id: str, state: str, at: str | None, rev: int) -> None:
    """Fold ``task_id`` finished in ``state`` at ``at`` (its state key at revision ``rev``)."""
    entry = cache.entries.get(task_id) or Entry.from_record(
        task_id, TaskRecord(props=props_kv(Task(task_id))))
    record = {"state": state, **({"finished_at": at} if at is not None else {})}
    entry.outcome = Outcome.of(kv(KEYS.task(task_id).state, encode_json(record), rev, rev))
    cache.entries[task_id] = entry
    cache.track(task_id, entry)


def test_the_pruners_candidates_oldest_first_up_to_the_first_too_new() -> None:
    """The periodic pruner's candidates come from the cache: oldest outcome first, each
    judged by what its kind may be, no further than the first finished after every cut-off."""
    cache = TaskCache()
    cache.replace({"p": Entry.from_record("p", TaskRecord(props=props_kv(Task("p"))))}, {}, 1)
    day = "2026-01-0{}T00:00:00+00:00"
    _finished(cache, "d1", "done", day.format(1), 10)
    _finished(cache, "f1", "failed", day.format(2), 11)
    _finished(cache, "x1", "expired", day.format(2), 12)
    _finished(cache, "bad", "done", None, 13)  # unreadable: no prune can take it
    _finished(cache, "d2", "done", day.format(3), 14)
    _finished(cache, "new", "failed", day.format(8), 15)  # after every cut-off: the walk ends
    _finished(cache, "late", "failed", day.format(2), 16)  # (skewed clock: the next turn)
    at = datetime(2026, 1, 5, tzinfo=UTC)
    assert cache.prunable(Cutoffs(at, at, at), 10) == ["d1", "f1", "x1", "d2"]
    assert cache.prunable(Cutoffs(at, at, at), 2) == ["d1", "f1"]
    # Done ones kept for ever, failed ones pruned: the failed ones behind them are found.
    assert cache.prunable(Cutoffs(None, at, None), 10) == ["d1", "f1", "x1", "d2"]
    assert cache.prunable(Cutoffs(None, None, at), 10) == ["d1", "d2"]  # a done one may be killed
    assert cache.prunable(Cutoffs(at, None, None), 10) == ["d1", "d2"]
    assert cache.prunable(Cutoffs(None, None, None), 10) == []
    # Finished again (resubmitted, claimed, failed): now the newest outcome.
    _finished(cache, "d1", "failed", day.format(4), 17)
    assert cache.prunable(Cutoffs(at, at, at), 10) == ["f1", "x1", "d2"]
    cache.track("f1", None)  # deleted
    entry = cache.entries["x1"]
    entry.props = None  # its props deleted: the task is going
    cache.track("x1", entry)
    assert cache.prunable(Cutoffs(at, at, at), 10) == ["d2"]


def test_a_relist_orders_the_outcomes_by_revision() -> None:
    old, new = (kv(KEYS.task(t).state, encode_json(
        {"state": "done", "finished_at": "2026-01-01T00:00:00+00:00"}), r, r)
        for t, r in (("b", 3), ("a", 9)))
    entries = {t: Entry.from_record(t, TaskRecord(props=props_kv(Task(t)), state=s))
               for t, s in (("a", new), ("b", old))}
    cache = TaskCache()
    cache.replace(entries, {}, 10)
    at = datetime(2026, 1, 2, tzinfo=UTC)
    assert cache.prunable(Cutoffs(at, at, at), 10) == ["b", "a"]
