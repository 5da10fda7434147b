"""Issue 50: typed handlers on real stores (SQLite and PostgreSQL).

One Router serves a dataclass (sync), a pydantic model (``async def``) and a protobuf message
that ships with protobuf. A task of an unknown type, and one whose field does not decode, are
failed with an error naming the type and the field while another task on the same consumer
runs on; registering the missing handler and ``retry`` then runs the unknown one to done.
``ctx.complete(conn=)`` completes a message inside the application's transaction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pydantic
import pytest
from google.protobuf import descriptor_pb2

from metafora import Task
from metafora.messages import MessageContext, Router, message
from metafora.testing import LocalCluster, wait_for
from tests.conformance.test_submit_in_transaction import App

pytestmark = pytest.mark.integration


@message("shop.OrderPlaced")
@dataclasses.dataclass
class OrderPlaced:
    order_id: str
    qty: int


@message("shop.Refund")
class Refund(pydantic.BaseModel):
    order_id: str
    amount: int


@message("shop.Shipped")
@dataclasses.dataclass
class Shipped:
    order_id: str


@pytest.fixture(params=["sqlite", "postgresql"])
def app(request: pytest.FixtureRequest, metafora_store_url: Callable[[str], str]) -> Iterator[App]:
    made = App(metafora_store_url(str(request.param)), "connection")
    yield made
    made.close()


def test_typed_handlers_bad_messages_fail_alone_and_retry_after_deploy(app: App) -> None:
    got: dict[str, Any] = {}
    release_blocker = threading.Event()
    blocker_running = threading.Event()
    router = Router()

    @router.handles(OrderPlaced)
    def placed(msg: OrderPlaced, ctx: MessageContext) -> bool | None:
        if msg.order_id == "block":
            blocker_running.set()
            release_blocker.wait(60)
            return None
        with app.txn() as (conn, add_order):
            add_order(msg.order_id)
            ctx.complete(conn=conn)
        got[ctx.task.id] = msg
        return False  # moot: the completion committed

    @router.handles(Refund)
    async def refunded(msg: Refund, ctx: MessageContext) -> bool | None:
        assert isinstance(ctx.stop, asyncio.Event)
        await asyncio.sleep(0)
        got[ctx.task.id] = msg
        return True

    @router.handles(descriptor_pb2.FieldDescriptorProto)
    def described(msg: descriptor_pb2.FieldDescriptorProto, ctx: MessageContext) -> None:
        got[ctx.task.id] = msg

    with LocalCluster(app.url) as cluster:
        client = cluster.client
        consumer = cluster.add(router, "runner")
        client.submit_message("blocker", OrderPlaced("block", 1))
        wait_for(blocker_running.is_set, 30, "the blocker runs")
        client.submit_message("order", OrderPlaced("o-1", 2))
        client.submit_message("refund", Refund(order_id="o-1", amount=5), priority=2)
        field = descriptor_pb2.FieldDescriptorProto(name="qty", number=3)
        client.submit_message("proto", field)
        client.submit_task(Task("bad", {"@type": "shop.OrderPlaced", "order_id": "o-2", "qty": "two"}))
        client.submit_task(Task("unknown", {"@type": "type.googleapis.com/shop.Shipped", "order_id": "o-3"}))
        for task_id in ("order", "refund", "proto"):
            cluster.wait_for_state(task_id, "done", 30)
        for task_id in ("bad", "unknown"):
            cluster.wait_for_state(task_id, "failed", 30)
        assert client.get_task("blocker").state.value == "claimed"  # ran on through it all
        bad = client.get_task("bad").error or ""
        assert "shop.OrderPlaced" in bad and "'qty'" in bad
        unknown = client.get_task("unknown").error or ""
        assert "UnknownMessageType" in unknown and "shop.Shipped" in unknown
        assert got["order"] == OrderPlaced("o-1", 2)
        assert got["refund"] == Refund(order_id="o-1", amount=5)
        assert got["proto"] == field
        assert app.orders() == ["o-1"]

        # Deploy the missing handler; `metafora retry` runs the task again.
        router.register(Shipped, lambda msg, ctx: got.__setitem__("unknown", msg))
        client.retry_task("unknown")
        cluster.wait_for_state("unknown", "done", 30)
        assert got["unknown"] == Shipped("o-3")
        release_blocker.set()
        cluster.wait_for_state("blocker", "done", 30)
        assert consumer.stats.failed == 2 and consumer.stats.lost == 0


@message("shop.Export")
@dataclasses.dataclass
class Export:
    pages: int


def test_ctx_checkpoint_in_the_application_transaction_and_cursor(app: App) -> None:
    seen: list[str | None] = []
    router = Router()

    class Boom(Exception):
        pass

    @router.handles(Export)
    def export(msg: Export, ctx: MessageContext) -> bool:
        seen.append(ctx.cursor)
        if ctx.cursor is None:
            with app.txn() as (conn, add_order):
                add_order("page-1")
                ctx.checkpoint("1", conn=conn)
            with pytest.raises(Boom), app.txn() as (conn, add_order):
                add_order("page-2")
                ctx.checkpoint("2", conn=conn)
                raise Boom
            seen.append(ctx.cursor)  # read back: the rolled-back cursor is not there
            return False  # release: the next run resumes from the cursor
        ctx.checkpoint("done")  # metafora's own write
        seen.append(ctx.cursor)
        return True

    with LocalCluster(app.url) as cluster:
        cluster.add(router, "runner")
        cluster.client.submit_message("export", Export(pages=2))
        cluster.wait_for_state("export", "done", 30)
        assert seen == [None, "1", "1", "done"]
        assert app.orders() == ["page-1"]
