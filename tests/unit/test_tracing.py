"""OpenTelemetry spans and metrics of a consumer, recorded by the SDK's in-memory exporter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk (metafora-cluster[otel] + the SDK)")

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from metafora import Task, TaskState, simple_handler
from metafora.core import tracing
from metafora.testing import LocalCluster, wait_for


@pytest.fixture(scope="module")
def otel() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    """The SDK installed as the global providers (OpenTelemetry allows setting them once)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(meters)
    yield exporter, reader
    provider.shutdown()
    meters.shutdown()


def _runs(exporter: InMemorySpanExporter, task_id: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans()
            if s.name == "metafora.task.run" and s.attributes.get("metafora.task.id") == task_id]


def _metric_names(reader: InMemoryMetricReader) -> set[str]:
    data = reader.get_metrics_data()
    if data is None:
        return set()
    return {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def test_spans_around_claim_run_and_outcome(otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
                                            tmp_path: Any) -> None:
    exporter, reader = otel
    assert tracing.enabled()

    def work(task: Task, stop: threading.Event) -> bool:
        if task.id == "bad":
            raise ValueError("bad input")
        return True

    tracer = trace.get_tracer("submitter")
    with LocalCluster(f"sqlite:///{tmp_path / 'otel.db'}") as cluster:
        cluster.add(simple_handler(work), "traced-node", coordinator_options={"lease_ttl": 2})
        with tracer.start_as_current_span("submit-request") as parent:
            cluster.client.submit_task(Task("good", tracing.with_trace_context({"n": 1})))
        cluster.client.submit_task(Task("bad"))
        cluster.wait_for_state("good", TaskState.DONE, timeout=30)
        cluster.wait_for_state("bad", TaskState.FAILED, timeout=30)
        wait_for(lambda: _runs(exporter, "good") and _runs(exporter, "bad"), 30, "run spans")
        wait_for(lambda: "metafora.lease.renewal.duration" in _metric_names(reader), 30, "a renewal")

    (good,) = _runs(exporter, "good")
    assert good.attributes["metafora.node"] == "traced-node"
    assert good.attributes["metafora.task.token"] > 0
    assert good.attributes["metafora.outcome"] == "done"
    # the submitter's trace continues in the run
    assert good.context.trace_id == parent.get_span_context().trace_id
    assert good.parent is not None and good.parent.span_id == parent.get_span_context().span_id
    outcome = [s for s in exporter.get_finished_spans()
               if s.name == "metafora.task.outcome" and s.parent is not None
               and s.parent.span_id == good.context.span_id]
    assert [s.attributes["metafora.outcome"] for s in outcome] == ["done"]

    (bad,) = _runs(exporter, "bad")
    assert bad.attributes["metafora.outcome"] == "fail"
    assert bad.status.status_code is StatusCode.ERROR and "bad input" in (bad.status.description or "")
    assert any(e.name == "exception" for e in bad.events)
    assert bad.parent is None  # no trace context carried: a new trace

    claims = [s for s in exporter.get_finished_spans() if s.name == "metafora.claim"]
    assert claims and sum(s.attributes.get("metafora.claimed", 0) for s in claims) >= 2

    assert {"metafora.claim.duration", "metafora.lease.renewal.duration"} <= _metric_names(reader)


def test_damaged_trace_context_is_ignored(otel: tuple[InMemorySpanExporter, InMemoryMetricReader]) -> None:
    exporter, _ = otel
    with tracing.run_span("x", 1, "n", {"_trace": {"traceparent": "garbage"}}) as span:
        span.set_attribute("metafora.outcome", "done")
    (run,) = _runs(exporter, "x")
    assert run.parent is None


def test_async_handler_spans(otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
                             tmp_path: Any) -> None:
    import asyncio

    exporter, _ = otel
    inner: list[Any] = []

    async def work(task: Task, stop: asyncio.Event) -> bool:
        # The run span is current inside the handler's task: its own spans hang under it.
        with trace.get_tracer("handler").start_as_current_span("handler-work") as span:
            inner.append(span)
        if task.id == "async-bad":
            raise ValueError("async bad input")
        return True

    with LocalCluster(f"sqlite:///{tmp_path / 'otel-async.db'}") as cluster:
        cluster.add(simple_handler(work), "traced-async")
        cluster.client.submit_task(Task("async-good"))
        cluster.client.submit_task(Task("async-bad"))
        cluster.wait_for_state("async-good", TaskState.DONE, timeout=30)
        cluster.wait_for_state("async-bad", TaskState.FAILED, timeout=30)
        wait_for(lambda: _runs(exporter, "async-good") and _runs(exporter, "async-bad"), 30,
                 "run spans")
        wait_for(lambda: any(s.name == "metafora.task.outcome" and s.parent is not None
                             and s.parent.span_id == _runs(exporter, "async-good")[0].context.span_id
                             for s in exporter.get_finished_spans()), 30, "the outcome span")

    (good,) = _runs(exporter, "async-good")
    assert good.attributes["metafora.outcome"] == "done"
    assert any(s.parent is not None and s.parent.span_id == good.context.span_id for s in inner)
    (bad,) = _runs(exporter, "async-bad")
    assert bad.attributes["metafora.outcome"] == "fail"
    assert bad.status.status_code is StatusCode.ERROR
    assert "async bad input" in (bad.status.description or "")
