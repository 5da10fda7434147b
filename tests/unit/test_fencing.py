"""The self-fencing rule (:mod:`metafora.core.leases`) and the stores' margins (each store's own)."""

from __future__ import annotations

import pytest

from metafora.contracts.backends import backend_of_store
from metafora.coordinators.etcd.config import ETCD_FENCING
from metafora.coordinators.sql.options import SQL_FENCING, parse_config
from metafora.core.config import parse_store_url
from metafora.core.leases import Fencing


def test_the_rule_is_the_ttl_less_the_margin() -> None:
    rule = Fencing(share=0.25, floor=1.0)
    assert rule.margin(8) == 2.0 and rule.fence_after(8) == 6.0
    assert rule.margin(2) == 1.0 and rule.fence_after(2) == 1.0  # the floor


@pytest.mark.parametrize("ttl", [2, 3, 4, 10, 30, 600])
def test_etcd_keeps_a_quarter_and_at_least_half_a_second(ttl: int) -> None:
    assert ETCD_FENCING.fence_after(ttl) == ttl - max(0.5, ttl / 4)


@pytest.mark.parametrize("ttl", [1.0, 1.5, 3.0, 7.3, 30.0, 86400.0])
def test_sql_keeps_a_third(ttl: float) -> None:
    assert SQL_FENCING.fence_after(ttl) == pytest.approx(ttl * 2 / 3, rel=1e-12)
    cfg = parse_config(parse_store_url(f"sqlite:///x.db?lease_ttl={ttl}"), {})
    assert cfg.fence_after == SQL_FENCING.fence_after(ttl)


def test_handlers_get_time_to_stop_before_the_lease_can_expire() -> None:
    for rule, ttls in ((ETCD_FENCING, range(2, 120)), (SQL_FENCING, range(1, 120))):
        for ttl in ttls:
            assert 0 < rule.fence_after(ttl) < ttl


def test_every_store_reads_lease_ttl_by_one_rule_with_its_bounds() -> None:
    from metafora.core.config import OptionReader, parse_store_url
    from metafora.core.errors import ConfigError
    from metafora.core.leases import read_lease_ttl, renew_every

    def read(store: str, value: object) -> float:
        reader = OptionReader(parse_store_url("memory://x"), {"lease_ttl": value})
        return read_lease_ttl(reader, backend_of_store(store).lease_ttl, store)

    assert renew_every(30) == 10.0
    bounds = {s: backend_of_store(s).lease_ttl for s in ("sql", "etcd", "memory")}
    assert {s: (b.minimum, b.maximum, b.whole) for s, b in bounds.items()} == {
        "sql": (1.0, 86400.0, False), "etcd": (2.0, None, True), "memory": (0.1, None, False)}
    assert read("sql", 1.5) == 1.5 and read("etcd", 3) == 3 and read("memory", 0.1) == 0.1
    with pytest.raises(ConfigError, match="must be >= 1"):
        read("sql", 0.5)
    with pytest.raises(ConfigError, match="must be <= 86400"):
        read("sql", 86401)
    with pytest.raises(ConfigError, match=r"whole number of seconds for etcd, got 2\.5"):
        read("etcd", 2.5)
    with pytest.raises(ConfigError, match="must be >= 2"):
        read("etcd", 1)


def test_each_store_states_its_fencing_on_its_backend_object() -> None:
    assert backend_of_store("sql").fencing is SQL_FENCING
    assert backend_of_store("etcd").fencing is ETCD_FENCING
    assert backend_of_store("memory").fencing is None  # no lease expires by the clock
