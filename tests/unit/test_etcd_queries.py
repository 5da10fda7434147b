"""The pure parts of :mod:`metafora.coordinators.etcd.queries` (the reads and writes run
against a real etcd in tests/integration/test_etcd.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from metafora.coordinators.etcd.layout import Keys
from metafora.coordinators.etcd.ops import KeyValue
from metafora.coordinators.etcd.queries import Registration, launch_and_expiry, member_of, members


def test_launch_and_expiry_of_stored_props() -> None:
    launch, expires = launch_and_expiry({"launch_at": "2026-01-01T00:00:00+00:00",
                                         "expires_at": "2026-01-02T00:00:00+00:00"})
    assert launch == datetime(2026, 1, 1, tzinfo=UTC)
    assert expires == datetime(2026, 1, 2, tzinfo=UTC)
    assert launch_and_expiry({}) == (None, None)


def test_unreadable_times_count_as_unset() -> None:
    assert launch_and_expiry({"launch_at": "soon", "expires_at": 12}) == (None, None)


def test_members_and_what_their_registration_says() -> None:
    keys = Keys("ns")

    def alive(node: str, value: bytes) -> KeyValue:
        return KeyValue(keys.node_alive(node), value, 1, 1, 1, 7)

    kvs = [alive("a", b'{"leaving": true}'), alive("b", b'{"frozen": true, "weight": 2.5}'),
           alive("c", b"junk"), KeyValue(keys.node_commands("a") + b"x", b"{}", 1, 1, 1, 7)]
    assert members(keys, kvs) == {"a": Registration(leaving=True), "b": Registration(frozen=True, weight=2.5),
                                  "c": Registration()}
    assert member_of(b'{"leaving": 1}', "n").leaving and not member_of(b'{"leaving": false}', "n").leaving
    assert member_of(b'{"frozen": "yes"}', "n").frozen is False  # only a JSON true says frozen


def test_a_damaged_weight_counts_as_one() -> None:
    for raw in (b'{"weight": 0}', b'{"weight": -2}', b'{"weight": "3"}', b'{"weight": true}',
                b'{"weight": null}', b'{"weight": 1e999}'):
        assert member_of(raw, "n").weight == 1.0, raw
    assert member_of(b'{"weight": 3}', "n").weight == 3.0
