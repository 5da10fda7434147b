"""How ``metafora worker`` recognises MODULE:NAME (metafora.cli._load), without a subprocess."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import pytest

from metafora import Handler, Task
from metafora.balancers import FairBalancer
from metafora.cli._load import Kind, TargetError, classify, load_balancer
from metafora.cli.worker import make_balancer
from metafora.core.node import check_weight
from metafora.statemachine import AsyncCommands, Commands, Message


class Job(Handler):
    def __init__(self, task: Task) -> None:
        self.task = task

    def run(self) -> bool:
        return True

    def stop(self) -> None:
        pass


class NeedsTwo(Job):
    def __init__(self, task: Task, other: int) -> None:
        super().__init__(task)


def annotated_step(task: Task, c: Commands) -> Message:
    return Message.complete()


async def async_step(task: Task, c: AsyncCommands) -> Message:
    return Message.complete()


def step_by_name(task, cmds):  # type: ignore[no-untyped-def]
    return Message.complete()


def event_fn(task: Task, s: threading.Event) -> bool:
    return True


async def async_event_fn(task: Task, s: asyncio.Event) -> bool:
    return True


def stop_by_name(task, stop):  # type: ignore[no-untyped-def]
    return True


def with_extra(task: Task, stop: threading.Event, retries: int = 3) -> bool:
    return True


def factory(task: Task) -> Handler:
    return Job(task)


class Callable1:
    def __call__(self, task: Task) -> Handler:
        return Job(task)


def misnamed(task: Task, flag: threading.Lock) -> bool:
    return True


@pytest.mark.parametrize(("obj", "kind"), [
    (Job, Kind.HANDLER),
    (annotated_step, Kind.STEP),
    (async_step, Kind.STEP),
    (step_by_name, Kind.STEP),
    (event_fn, Kind.FUNCTION),
    (async_event_fn, Kind.FUNCTION),
    (stop_by_name, Kind.FUNCTION),
    (with_extra, Kind.FUNCTION),
    (functools.partial(with_extra, retries=1), Kind.FUNCTION),
    (factory, Kind.HANDLER_FUNC),
    (Callable1(), Kind.HANDLER_FUNC),
])
def test_recognised(obj: Any, kind: Kind) -> None:
    assert classify(obj, "m:n") is kind


@pytest.mark.parametrize(("obj", "message"), [
    (NeedsTwo, "does not take the task as its only argument"),
    (Handler, "an abstract class"),
    (dict, "not a metafora Handler"),
    (Job(Task("t")), "a Handler instance"),
    (misnamed, "cannot tell what it is"),  # an annotation that is neither Event nor Commands wins
    ("text", "not a Handler class or a function"),
    (lambda: None, "cannot tell what it is"),
])
def test_refused(obj: Any, message: str) -> None:
    with pytest.raises(TargetError, match=message):
        classify(obj, "m:n")


def test_annotations_as_objects() -> None:
    def two(task, second):  # type: ignore[no-untyped-def]
        return True

    for annotation, kind in ((Commands, Kind.STEP), (AsyncCommands, Kind.STEP),
                             (threading.Event, Kind.FUNCTION), (asyncio.Event, Kind.FUNCTION)):
        two.__annotations__ = {"second": annotation}
        assert classify(two, "m:n") is kind


def test_balancers_and_weight() -> None:
    assert isinstance(make_balancer("FAIR"), FairBalancer)
    assert isinstance(load_balancer("metafora.balancers:FairBalancer"), FairBalancer)
    with pytest.raises(TargetError, match="not a Balancer"):
        load_balancer("metafora.contracts.handler:Handler")
    assert check_weight(1.0) == 1.0 and check_weight(2.5) == 2.5
