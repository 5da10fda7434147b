"""The defaults the docs name are the code's (issue 50, point 5; issue 53).

The docs said ``DumbBalancer`` was the consumer's default long after the code's became
``FairBalancer()``. This reads every page of docs/ (and the balancers' docstrings) for the two
shapes a default is written in, a setting with its value (```balance_every` (60 s by
default)``, ``default `lease_ttl` of 30 s``, ```max_attempts` (default 3)``) and a balancer
called the default, and compares each with the code. A setting the docs give a default for must
be in :data:`CODE` (or in :data:`NOT_CHECKED`, with why), so a new one cannot slip past.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from metafora import Consumer, Task, open_coordinator, simple_handler
from metafora.balancers.fair import DEFAULT_FAIR_THRESHOLD
from metafora.consumer import options
from metafora.contracts.aio import DEFAULT_THREADS
from metafora.contracts.backends import stores
from metafora.contracts.coordinator import DEFAULT_MAX_CRASHES
from metafora.coordinators.etcd.config import EtcdConfig
from metafora.coordinators.sql.options import parse_config
from metafora.core.config import parse_store_url
from metafora.gates.handler import handler_func
from metafora.streams.handler import stream_handler

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"(\d[\d,]*(?:\.\d+)?)"
# A setting and its default, in the shapes the docs use.
SETTING_PATTERNS = [
    re.compile(rf"`(\w+)`(?: seconds)?,? \(?{NUMBER} ?(?:s )?by default"),
    re.compile(rf"`(\w+)`[^.;()`]{{0,30}}, {NUMBER} ?(?:s )?by default"),
    re.compile(rf"default `(\w+)` of {NUMBER}"),
    re.compile(rf"`(\w+)`(?: seconds)? \((?:seconds, )?default {NUMBER}"),
    re.compile(rf"`(\w+)` \({NUMBER}; "),  # a list of settings: `threshold` (1.1; 1.0-10.0, ...)
]
# A balancer called the default.
BALANCER_PATTERNS = [
    re.compile(r"`?(\w+Balancer)`?(?:\]\[[\w.]+\])?[^.;]{0,80}?\((?:the default|the consumer's default)\)"),
    re.compile(r"`?(\w+Balancer)`?(?:\]\[[\w.]+\])?,? is the `?[Cc]onsumer`?'s default"),
]


def _sql(url: str, name: str) -> float:
    return float(getattr(parse_config(parse_store_url(url), {}), name))


ETCD_POLL_INTERVAL = float(EtcdConfig.from_url(parse_store_url("etcd://127.0.0.1:2379"), {}).poll_interval)


def _gate_default(name: str) -> float:
    return float(inspect.signature(handler_func).parameters[name].default)


def _stream_default(name: str) -> float:
    return float(inspect.signature(stream_handler).parameters[name].default)


CODE: dict[str, set[float]] = {
    "balance_every": {options.DEFAULT_BALANCE_EVERY},
    "rebalance_window": {options.DEFAULT_REBALANCE_WINDOW},
    "release_backoff": {options.DEFAULT_RELEASE_BACKOFF},
    "release_backoff_max": {options.DEFAULT_RELEASE_BACKOFF_MAX},
    "refuse_retry": {options.DEFAULT_REFUSE_RETRY},
    "sticky_for": {options.DEFAULT_STICKY_FOR},
    "max_crashes": {float(DEFAULT_MAX_CRASHES or 0)},
    "lease_ttl": {store.lease_ttl.default for store in stores().values()},  # each store's own
    "threshold": {DEFAULT_FAIR_THRESHOLD},
    "threads": {float(DEFAULT_THREADS)},
    "max_attempts": {_gate_default("max_attempts")},
    "flush_interval": {_gate_default("flush_interval")},
    "max_processing": {_stream_default("max_processing")},
    "max_search_ahead": {_stream_default("max_search_ahead")},
    "pool_size": {_sql("postgresql://x@127.0.0.1/x", "pool_size")},
    "connect_timeout": {_sql("postgresql://x@127.0.0.1/x", "connect_timeout")},
    # each store's (a page names the store beside it)
    "poll_interval": {_sql("postgresql://x@127.0.0.1/x", "poll_interval"),
                      _sql("sqlite:///defaults.db", "poll_interval"), ETCD_POLL_INTERVAL},
}
NOT_CHECKED = {
    "timeout": "several settings share the name (an etcd request, Consumer.wait_all)",
    "pid_max": "the kernel's, not metafora's",
}


def documented(text: str) -> Iterator[tuple[int, str, float]]:
    """(line, setting, value) for each default ``text`` gives a setting."""
    for number, found in _matches(text, SETTING_PATTERNS):
        yield number, found.group(1), float(found.group(2).replace(",", ""))


def balancers_called_default(text: str) -> Iterator[tuple[int, str]]:
    """(line, class) for each balancer ``text`` calls the default."""
    for number, found in _matches(text, BALANCER_PATTERNS):
        yield number, found.group(1)


def _matches(text: str, patterns: list[re.Pattern[str]]) -> Iterator[tuple[int, re.Match[str]]]:
    """The patterns' matches that start on each line, read with the next line appended (a
    phrase may wrap); a bullet's or heading's mark and a docstring's quotes left out."""
    lines = [re.sub(r"^\s*(?:[-*]\s|#+\s|\"\"\")?\s*", "", line).rstrip() for line in text.splitlines()]
    for number, (line, after) in enumerate(zip(lines, [*lines[1:], ""], strict=True), start=1):
        for pattern in patterns:
            yield from ((number, m) for m in pattern.finditer(f"{line} {after}") if m.start() < len(line))


def _default_balancer() -> str:
    def work(task: Task) -> bool:
        return True

    consumer = Consumer(open_coordinator("memory://defaults-check"), simple_handler(work))
    return type(consumer._balancer).__name__


def wrong_defaults(text: str, code_balancer: str) -> list[str]:
    """What ``text`` says of a default that the code does not do."""
    problems = []
    for line, name, value in documented(text):
        if name in NOT_CHECKED:
            continue
        if name not in CODE:
            problems.append(f"line {line}: a default of `{name}` ({value:g}) this test does not know")
        elif value not in CODE[name]:
            problems.append(f"line {line}: `{name}` documented as {value:g} by default, the code's"
                            f" is {', '.join(f'{v:g}' for v in sorted(CODE[name]))}")
    problems += [f"line {line}: {name} called the default balancer, the code's is {code_balancer}"
                 for line, name in balancers_called_default(text) if name != code_balancer]
    return sorted(set(problems))


def _sources() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md",
            *sorted((ROOT / "metafora" / "balancers").glob("*.py"))]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_documented_defaults_are_the_codes(path: Path) -> None:
    assert wrong_defaults(path.read_text(), _default_balancer()) == []


def test_the_docs_name_the_default_balancer_and_some_settings() -> None:
    """The check reads something: the pages still name the defaults it compares."""
    text = "\n".join(p.read_text() for p in _sources())
    assert {name for _, name in balancers_called_default(text)} == {_default_balancer()}
    assert {"balance_every", "lease_ttl", "max_crashes", "threshold"} <= {
        name for _, name, _ in documented(text)}


PLANTED = """
Nodes rebalance every `balance_every` seconds (90 by default, with jitter).
- [`DumbBalancer`][metafora.balancers.DumbBalancer] claims everything and releases nothing (the
  default).
A node that dies loses its claims when its lease expires (`lease_ttl`, 30 s by default).
Crashes are bounded by `max_attempts` (default 3).
Each wait is bounded by `wakeup_every` (default 2 s).
"""


def test_a_planted_wrong_default_is_found() -> None:
    assert wrong_defaults(PLANTED, "FairBalancer") == [
        "line 2: `balance_every` documented as 90 by default, the code's is 60",
        "line 3: DumbBalancer called the default balancer, the code's is FairBalancer",
        "line 7: a default of `wakeup_every` (2) this test does not know",
    ]
