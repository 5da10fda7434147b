"""The self-fencing rule (:mod:`metafora.coordinators.fencing`) and the stores' margins."""

from __future__ import annotations

import pytest

from metafora.config import parse_store_url
from metafora.coordinators.fencing import ETCD_FENCING, SQL_FENCING, Fencing
from metafora.coordinators.sql.options import parse_config


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
