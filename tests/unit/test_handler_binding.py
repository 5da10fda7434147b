"""A HandlerFunc that needs its node implements one hook, ``bind_node(NodeBinding)``
(metafora.contracts.handler): the coordinator, the node's stats and its gauges in one value. The older
hooks (bind_coordinator, attach_stats, gauges) still work for handler funcs written for them."""

from __future__ import annotations

from typing import Any

import pytest

from metafora import Consumer, open_coordinator, simple_handler
from metafora.contracts.binding import BindsToNode, NodeBinding, bind_handler_func
from metafora.contracts.coordinator import Coordinator
from metafora.contracts.handler import HandlerFunc
from metafora.core.errors import ConfigError
from metafora.core.metrics import ConsumerStats
from metafora.gates.handler import GateHandlerFunc
from metafora.messages import Router
from metafora.streams.handler import StreamHandlerFunc

_plain = simple_handler(lambda task, stop: True)


class _Binds:
    def __init__(self) -> None:
        self.node: NodeBinding | None = None

    def bind_node(self, node: NodeBinding) -> HandlerFunc:
        self.node = node
        node.add_gauges(lambda: {"metafora_things": ("Things", 3.0)})
        return _plain

    def __call__(self, task: Any) -> Any:
        raise AssertionError("the bound handler func runs, not this one")


class _OldHooks:
    def __init__(self) -> None:
        self.coordinator: Coordinator | None = None
        self.stats: ConsumerStats | None = None

    def bind_coordinator(self, coordinator: Coordinator) -> _OldHooks:
        self.coordinator = coordinator
        return self

    def attach_stats(self, stats: ConsumerStats) -> None:
        self.stats = stats

    def gauges(self) -> dict[str, tuple[str, float]]:
        return {"metafora_old": ("Old", 1.0)}

    def __call__(self, task: Any) -> Any:
        return _plain(task)


def test_bind_node_gets_the_coordinator_stats_and_a_place_for_gauges() -> None:
    coord = open_coordinator("memory://binding", node_id="b1")
    func = _Binds()
    consumer = Consumer(coord, func)
    assert isinstance(func, BindsToNode) and func.node is not None
    assert func.node.coordinator is coord and func.node.stats is consumer.stats
    assert consumer._handler_func is _plain
    assert consumer._handler_gauges() == {"metafora_things": ("Things", 3.0)}


def test_the_older_hooks_still_work() -> None:
    coord = open_coordinator("memory://binding", node_id="b2")
    func = _OldHooks()
    consumer = Consumer(coord, func)
    assert func.coordinator is coord and func.stats is consumer.stats
    assert consumer._handler_gauges() == {"metafora_old": ("Old", 1.0)}


def test_a_bind_that_returns_no_handler_func_is_refused() -> None:
    class Bad:
        def bind_node(self, node: NodeBinding) -> Any:
            return 3

        def __call__(self, task: Any) -> Any:
            return None

    node = NodeBinding(open_coordinator("memory://binding", node_id="b3"), ConsumerStats(), lambda g: None)
    with pytest.raises(ConfigError, match="bind_node must return a HandlerFunc"):
        bind_handler_func(Bad(), node)


def test_the_packaged_handler_funcs_bind_through_bind_node() -> None:
    for cls in (Router, StreamHandlerFunc, GateHandlerFunc):
        assert callable(getattr(cls, "bind_node", None)), cls
