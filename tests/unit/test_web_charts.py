"""The dashboard's chart builders: the data derived from tasks and nodes, and the SVG drawn."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

pytest.importorskip("starlette", reason="the dashboard needs the extra metafora-cluster[web]")

from metafora import Task, open_client, open_coordinator
from metafora.contracts.client import NodeInfo
from metafora.contracts.coordinator import CoordinatorContext
from metafora.coordinators.memory import drop_store
from metafora.core.limits import GroupUsage, Limit
from metafora.core.task import TaskInfo, TaskState
from metafora.web import charts
from metafora.web.charts import (
    NodeBar,
    PendingReason,
    WaitContext,
    node_bars,
    nodes_svg,
    pending_reasons,
    pending_svg,
    read_charts,
    shown_id,
    throughput,
    throughput_svg,
)

NOW = datetime(2026, 11, 25, 12, 0, 30, tzinfo=UTC)
HOSTILE = '<script>alert("x")</script>&\'node'


def _info(task_id: str, state: TaskState, *, claimed: float | None = None, finished: float | None = None,
          **fields: object) -> TaskInfo:
    """A task as a store returns it; ``claimed``/``finished`` are minutes before NOW."""
    def ago(minutes: float | None) -> datetime | None:
        return None if minutes is None else NOW - timedelta(minutes=minutes)

    return TaskInfo(task_id, fields.pop("props", {}), state, claimed_at=ago(claimed),  # type: ignore[arg-type]
                    finished_at=ago(finished), **fields)  # type: ignore[arg-type]


def test_throughput_buckets_claims_done_and_failed_per_minute() -> None:
    tasks = [
        _info("a", TaskState.CLAIMED, claimed=0.2),
        _info("b", TaskState.DONE, claimed=5.5, finished=0.1),
        _info("c", TaskState.DONE, claimed=30, finished=0.3),
        _info("d", TaskState.FAILED, claimed=61, finished=59.9),
        _info("e", TaskState.DONE, claimed=90, finished=75),  # outside the hour
        _info("f", TaskState.PENDING),
        _info("g", TaskState.EXPIRED, finished=1),  # not drawn
    ]
    data = throughput(tasks, NOW)
    assert len(data.claims) == len(data.done) == len(data.failed) == 60
    assert data.done[59] == 2 and sum(data.done) == 2
    assert data.failed[0] == 1 and sum(data.failed) == 1
    assert data.claims[59] == 1 and data.claims[54] == 1 and data.claims[30] == 1 and sum(data.claims) == 3
    assert not data.empty
    svg = throughput_svg(data)
    assert len(re.findall(r'class="bar claims"', svg)) == 3
    assert len(re.findall(r'class="bar done"', svg)) == 1  # both in one minute: one bar of 2
    assert len(re.findall(r'class="bar failed"', svg)) == 1
    assert "style=" not in svg and 'id="chart-throughput"' in svg


def test_throughput_without_events_says_so() -> None:
    data = throughput([_info("old", TaskState.DONE, claimed=200, finished=120)], NOW)
    assert data.empty
    shown = throughput_svg(data)
    assert "<svg" not in shown and "No claims and no finished tasks in the last hour" in shown


def test_fair_share_follows_weights() -> None:
    bars = node_bars([NodeInfo("b", 6, weight=2.0), NodeInfo("a", 0), NodeInfo("c", 0, frozen=True)])
    assert [b.id for b in bars] == ["a", "b", "c"]
    assert [b.share for b in bars] == [1.5, 3.0, 1.5]  # 6 held over weights 1 + 2 + 1
    assert bars[2].frozen
    plain = node_bars([NodeInfo("x", 3), NodeInfo("y", 1)])
    assert [b.share for b in plain] == [2.0, 2.0]
    svg = nodes_svg(plain)
    assert svg.count('class="bar node"') == 2 and svg.count('class="share"') == 2


def test_node_chart_caps_its_rows_and_says_empty() -> None:
    many = [NodeBar(f"n{i:03d}", i, 5.0) for i in range(60)]
    assert nodes_svg(many, limit=10).count("<rect") == 10
    assert "No live nodes." in nodes_svg([]) and "<svg" not in nodes_svg([])


def test_a_hostile_node_id_is_escaped_in_the_svg() -> None:
    svg = nodes_svg([NodeBar(HOSTILE, 2, 2.0), NodeBar("spoof\u202etxt", 1, 1.0)])
    assert "<script" not in svg and "&lt;script&gt;" in svg
    assert "\u202e" not in svg and "spoof\\u202etxt" in svg
    assert shown_id("x" * 40, 10) == "x" * 9 + "…"
    assert shown_id("a<b", 10) == "a&lt;b"


def test_pending_reasons_first_that_holds() -> None:
    ctx = WaitContext(NOW, [{"zone": "eu"}, {"zone": "us", "gpu": "yes"}])
    later = (NOW + timedelta(hours=1)).isoformat()
    earlier = (NOW - timedelta(hours=1)).isoformat()
    tasks = [
        _info("free", TaskState.PENDING),
        _info("gpu", TaskState.PENDING, selector={"gpu": "yes"}),
        _info("tpu", TaskState.PENDING, selector={"tpu": "yes"}),
        _info("tpu-later", TaskState.PENDING, selector={"tpu": "yes"}, props={"launch_at": later}),
        _info("later", TaskState.PENDING, props={"launch_at": later}),
        _info("due", TaskState.PENDING, props={"launch_at": earlier}),
        _info("running", TaskState.CLAIMED),
    ]
    counts = {r.key: n for r, n in pending_reasons(tasks, ctx)}
    assert counts == {"no-node": 2, "launch-ahead": 1, "group-full": 0, "held": 0, "claimable": 3}
    svg = pending_svg(pending_reasons(tasks, ctx))
    assert svg.count("<rect") == 5 and "launch time ahead" in svg
    # with no live node at all, nothing matches
    assert {r.key: n for r, n in pending_reasons(tasks, WaitContext(NOW, []))}["no-node"] == 6


def test_a_reason_can_be_added_before_claimable() -> None:
    in_group = PendingReason("group-limit", "group at its limit",
                             lambda info, ctx: info.props.get("group") in ctx.extra.get("full", ()))
    ctx = WaitContext(NOW, [{}], extra={"full": {"g1"}})
    tasks = [_info("a", TaskState.PENDING, props={"group": "g1"}), _info("b", TaskState.PENDING)]
    got = pending_reasons(tasks, ctx, [*charts.PENDING_REASONS, in_group])
    assert [(r.key, n) for r, n in got] == [("no-node", 0), ("launch-ahead", 0), ("group-full", 0),
                                            ("held", 0), ("group-limit", 1), ("claimable", 1)]
    assert 'class="bar group-limit"' in pending_svg(got)


def test_a_task_of_a_full_group_waits_for_its_group() -> None:
    full = GroupUsage(Limit("g", 1), running=1)
    ctx = WaitContext(NOW, [{}], extra={"group_usage": {"g": full, "h": GroupUsage(Limit("h", 2))}})
    tasks = [_info("a", TaskState.PENDING, group="g"), _info("b", TaskState.PENDING, group="h"),
             _info("c", TaskState.PENDING)]
    got = {r.key: n for r, n in pending_reasons(tasks, ctx)}
    assert (got["group-full"], got["claimable"]) == (1, 2)


def test_no_pending_task_says_so() -> None:
    shown = pending_svg(pending_reasons([], WaitContext(NOW, [])))
    assert "No pending tasks." in shown and "<svg" not in shown


class _Quiet(CoordinatorContext):
    def lost(self, task: Task) -> None:
        return


@pytest.fixture
def url() -> Iterator[str]:
    name = f"charts-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_store(f"{name}/metafora")


def test_read_charts_on_a_real_store_caps_each_state(url: str) -> None:
    with open_client(url) as client:
        node = open_coordinator(url, node_id=HOSTILE)
        node.init(_Quiet())
        try:
            for i in range(5):
                client.submit_task(Task(f"t{i}"))
            for i in range(3):
                claimed = node.claim(Task(f"t{i}"))
                assert claimed is not None
                if i < 2:
                    node.done(claimed)
            now = datetime.now(UTC)
            counts = client.task_counts()
            data = read_charts(client, now, counts, cap=1)
            assert data.read == {TaskState.CLAIMED: 1, TaskState.DONE: 1, TaskState.FAILED: 0,
                                 TaskState.PENDING: 1}
            assert data.capped(TaskState.DONE) and data.capped(TaskState.PENDING)
            assert not data.capped(TaskState.CLAIMED, TaskState.FAILED)
            full = read_charts(client, now, counts)
            assert sum(full.throughput.claims) == 3 and sum(full.throughput.done) == 2
            assert [(b.id, b.tasks, b.share) for b in full.nodes] == [(HOSTILE, 1, 1.0)]
            assert {r.key: n for r, n in full.pending} == {"no-node": 0, "launch-ahead": 0,
                                                           "group-full": 0, "held": 0,
                                                           "claimable": 2}
            assert "&lt;script&gt;" in nodes_svg(full.nodes) and "<script" not in nodes_svg(full.nodes)
        finally:
            node.close()
