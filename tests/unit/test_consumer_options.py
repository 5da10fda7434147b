"""The consumer's options (metafora.consumer.options): one frozen value, checked once."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import pytest

from metafora import Consumer, open_coordinator, simple_handler
from metafora.consumer import ConsumerOptions
from metafora.consumer.options import DEFAULT_BALANCE_EVERY, DEFAULT_MAX_CRASHES, option_docs
from metafora.core.durations import seconds
from metafora.core.errors import ConfigError


def test_defaults_are_the_named_constants() -> None:
    options = ConsumerOptions()
    assert options.balance_every == DEFAULT_BALANCE_EVERY
    assert options.max_crashes == DEFAULT_MAX_CRASHES and options.crash_limit == DEFAULT_MAX_CRASHES
    assert options.max_tasks is None and options.http_addr is None and dict(options.labels) == {}


def test_a_timedelta_becomes_seconds_and_the_value_is_frozen() -> None:
    options = ConsumerOptions(balance_every=timedelta(minutes=2),  # type: ignore[arg-type]
                              handoff_timeout=timedelta(0))  # type: ignore[arg-type]
    assert (options.balance_every, options.handoff_timeout) == (120.0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.balance_every = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"balance_every": 0}, "balance_every must be a positive number of seconds, got 0"),
        ({"refuse_retry": float("nan")}, "refuse_retry must be a positive number of seconds"),
        ({"shutdown_timeout": -1}, "shutdown_timeout must be a non-negative number of seconds, got -1"),
        ({"slow_callback": 0}, "slow_callback must be a positive number of seconds"),
        ({"max_tasks": 0}, "max_tasks must be a positive integer or None, got 0"),
        ({"max_crashes": True}, "max_crashes must be a non-negative integer or None, got True"),
        ({"balance_jitter": 1}, r"balance_jitter must be in \[0, 1\), got 1"),
        ({"labels": {"": "x"}}, "labels key must not be empty"),
        ({"weight": 0}, "weight must be a positive number, got 0"),
        ({"weight": -1}, "weight must be a positive number, got -1"),
        ({"weight": float("nan")}, "weight must be a positive number, got nan"),
        ({"weight": float("inf")}, "weight must be a positive number, got inf"),
        ({"weight": True}, "weight must be a positive number, got True"),
        ({"weight": "2"}, "weight must be a positive number, got '2'"),
    ],
)
def test_bad_options_are_refused_with_the_consumers_messages(kwargs: dict[str, object],
                                                             message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConsumerOptions(**kwargs)  # type: ignore[arg-type]
    coord = open_coordinator("memory://options", node_id="n")
    with pytest.raises(ConfigError, match=message):
        Consumer(coord, simple_handler(lambda task, stop: True), **kwargs)  # type: ignore[arg-type]


def test_a_weight_is_a_float_and_one_by_default() -> None:
    assert ConsumerOptions().weight == 1.0
    options = ConsumerOptions(weight=3)
    assert options.weight == 3.0 and isinstance(options.weight, float)
    coord = open_coordinator("memory://options", node_id="w")
    consumer = Consumer(coord, simple_handler(lambda task, stop: True), weight=0.25)
    assert consumer.weight == 0.25


def test_zero_crash_limit_turns_it_off() -> None:
    assert ConsumerOptions(max_crashes=0).crash_limit is None
    assert ConsumerOptions(max_crashes=None).crash_limit is None


def test_seconds_takes_numbers_and_timedeltas() -> None:
    assert seconds(1, "x") == 1.0 and seconds(timedelta(milliseconds=250), "x") == 0.25
    assert seconds(0, "x", allow_zero=True) == 0.0
    with pytest.raises(ConfigError, match="x must be a positive number of seconds"):
        seconds(0, "x")


# Consumer's keyword options as DESIGN.md and every caller know them: names, order, defaults.
PUBLIC_OPTIONS = {
    "balance_every": 60.0, "balance_jitter": 0.1, "rebalance_window": 3.0, "max_tasks": None,
    "thread_cap": None, "max_crashes": DEFAULT_MAX_CRASHES, "shutdown_timeout": 30.0,
    "start_timeout": 30.0, "handoff_timeout": 30.0, "release_backoff": 1.0,
    "release_backoff_max": 60.0, "refuse_retry": 1.0, "slow_callback": 0.25, "http_addr": None,
    "labels": None, "weight": 1.0, "placement_wait": 2.0, "rendezvous_wait": 0.0,
    "prune_every": 60.0, "sticky_for": 0.0,
}


def test_the_consumers_signature_is_made_from_the_options_and_keeps_every_keyword() -> None:
    params = inspect.signature(Consumer).parameters
    assert list(params)[:3] == ["coordinator", "handler_func", "balancer"]
    keywords = {name: p.default for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == {**PUBLIC_OPTIONS, "clock": None, "rng": None, "options": None}
    assert [f.name for f in dataclasses.fields(ConsumerOptions)] == list(PUBLIC_OPTIONS)


def test_every_option_is_documented_under_its_field() -> None:
    docs = option_docs()
    assert set(docs) == set(PUBLIC_OPTIONS) and all(len(doc) > 20 for doc in docs.values())


def test_options_are_given_as_keywords_or_as_one_value_and_unknown_ones_are_refused() -> None:
    coord = open_coordinator("memory://options", node_id="o")
    handler = simple_handler(lambda task, stop: True)
    assert Consumer(coord, handler, options=ConsumerOptions(weight=2)).weight == 2.0
    assert Consumer(coord, handler, labels=None).labels == {}
    with pytest.raises(ConfigError, match="not both"):
        Consumer(coord, handler, options=ConsumerOptions(), weight=2)
    with pytest.raises(TypeError, match="'balance_evry'"):
        Consumer(coord, handler, balance_evry=1)


def test_parse_blames_the_name_it_is_given() -> None:
    with pytest.raises(ConfigError, match="--weight must be a positive number"):
        ConsumerOptions.parse({"weight": 0}, lambda name: "--" + name)
    assert ConsumerOptions.parse({"sticky_for": timedelta(seconds=5)}).sticky_for == 5.0
