"""CI runs each test once (issue 53): --python-share deals the portable tests out among the
Pythons (tests/conftest.py) so that the shares of one seed cover each portable test exactly once
and every other test stays with share 0's run (the only one that selects it by its markers)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests import conftest


class _Item:
    def __init__(self, nodeid: str, *markers: str) -> None:
        self.nodeid = nodeid
        self._markers = set(markers)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self._markers else None


def _config(spec: str | None, deselected: list[Any]) -> Any:
    def pytest_deselected(items: list[Any]) -> None:
        deselected.extend(items)

    hook = SimpleNamespace(pytest_deselected=pytest_deselected)
    return SimpleNamespace(getoption=lambda name: spec, hook=hook)


ITEMS = [_Item(f"tests/unit/test_x.py::test_{i}") for i in range(60)] + [
    _Item("tests/conformance/test_y.py::test_pg[postgresql]", "postgresql"),
    _Item("tests/unit/test_z.py::test_clock", "timing"),
    _Item("tests/unit/test_p.py::test_prop", "hypothesis"),
    _Item("tests/integration/test_w.py::test_fleet"),
    _Item("tests/web/test_v.py::test_page"),
]


def _share(spec: str) -> list[str]:
    items = list(ITEMS)
    deselected: list[Any] = []
    conftest._deal_shares(_config(spec, deselected), items)
    assert sorted(i.nodeid for i in items + deselected) == sorted(i.nodeid for i in ITEMS)
    return [item.nodeid for item in items]


@pytest.mark.parametrize("seed", ["1", "2", "775"])
def test_the_shares_of_a_seed_cover_each_portable_test_once(seed: str) -> None:
    shares = [_share(f"{k}/3@{seed}") for k in range(3)]
    portable = [i.nodeid for i in ITEMS if i.nodeid.startswith("tests/unit/test_x.py")]
    dealt = [name for share in shares for name in share if name in portable]
    assert sorted(dealt) == sorted(portable)  # each once
    assert all(10 <= sum(name in portable for name in share) <= 30 for share in shares)
    others = [i.nodeid for i in ITEMS if i.nodeid not in portable]
    assert all(set(others) <= set(share) for share in shares)  # the markers choose those


def test_the_seed_moves_tests_between_shares() -> None:
    assert _share("1/3@1") != _share("1/3@2")


@pytest.mark.parametrize("spec", ["3/3@1", "1-3@1", "x/3", "-1/3@1"])
def test_a_bad_share_is_a_usage_error(spec: str) -> None:
    with pytest.raises(pytest.UsageError, match="K/N@SALT"):
        _share(spec)


def test_no_option_keeps_every_test() -> None:
    items = list(ITEMS)
    conftest._deal_shares(_config(None, []), items)
    assert items == ITEMS
