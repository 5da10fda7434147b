"""OpenTelemetry hooks (extra ``metafora-cluster[otel]``): spans around claims, task runs and outcomes,
claim and lease-renewal latency as metrics, and trace context carried in task props.

With the ``opentelemetry-api`` package installed, the consumer makes through the global tracer
and meter providers:

- a ``metafora.claim`` span per claim round trip (``metafora.node``, ``metafora.offered``,
  ``metafora.claimed``) and the histogram ``metafora.claim.duration`` (seconds);
- a ``metafora.task.run`` span per handler run (claim -> handler -> outcome) with
  ``metafora.task.id``, ``metafora.task.token``, ``metafora.node`` and ``metafora.outcome``
  (done, release, fail, lost), an error status and the exception when the handler raised, and a
  child ``metafora.task.outcome`` span around the store write;
- the histogram ``metafora.lease.renewal.duration`` (seconds).

A submitter that has a current span can carry it to the run: ``Task(id, with_trace_context(props))``
stores a W3C ``traceparent`` under the prop ``_trace``; the run span then has it as parent. Without
the API installed every hook is a no-op (and the API itself records nothing until an SDK is
configured).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

__all__ = ["TRACE_PROP", "claim_span", "enabled", "outcome_span", "record_renewal", "run_span",
           "start_outcome_span",
           "with_trace_context"]

log = logging.getLogger("metafora.tracing")  # its name before the move (users' log config names it)

TRACE_PROP = "_trace"
"""The task prop that carries the submitter's trace context (W3C ``traceparent``/``tracestate``)."""

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised where the API is absent
    _trace = None  # type: ignore[assignment]
    _metrics = None  # type: ignore[assignment]
    _propagate = None  # type: ignore[assignment]

_SCOPE = "metafora"

try:
    from opentelemetry import context as _context
    from opentelemetry.metrics import _internal as _metrics_state
except ImportError:  # pragma: no cover - exercised where the API is absent
    _context = None  # type: ignore[assignment]
    _metrics_state = None  # type: ignore[assignment]

# A provider named by the environment is loaded by the API on first use: then always ask it.
_PROVIDERS_FROM_ENV = bool(os.environ.get("OTEL_PYTHON_TRACER_PROVIDER")
                           or os.environ.get("OTEL_PYTHON_METER_PROVIDER"))


def _tracing_off() -> bool:
    """True while no tracer provider is set: the API would only make non-recording spans, and
    each lookup of the global provider reads the environment (on every claim, run and outcome).
    Where the API's global is not where we look (another version), spans are always made."""
    if _trace is None:
        return True
    return not _PROVIDERS_FROM_ENV and getattr(_trace, "_TRACER_PROVIDER", True) is None


def _metrics_off() -> bool:
    """True while no meter provider is set (as :func:`_tracing_off`, for the histograms)."""
    if _metrics is None:
        return True
    return not _PROVIDERS_FROM_ENV and getattr(_metrics_state, "_METER_PROVIDER", True) is None


def enabled() -> bool:
    """Whether the OpenTelemetry API is installed (spans then go to the global provider)."""
    return _trace is not None


def _tracer() -> Any:
    return _trace.get_tracer(_SCOPE)


_histograms: dict[str, tuple[Any, Any]] = {}


def _histogram(name: str, description: str) -> Any:
    # The meter is looked up on each call so that a provider configured later is used.
    meter = _metrics.get_meter(_SCOPE)
    cached = _histograms.get(name)
    if cached is not None and cached[0] is meter:
        return cached[1]
    hist = meter.create_histogram(name, unit="s", description=description)
    _histograms[name] = (meter, hist)
    return hist


class _Noop:
    """Stands for a span when tracing is off."""

    def set_attribute(self, key: str, value: Any) -> None:
        """Ignored."""

    def record_exception(self, exc: BaseException) -> None:
        """Ignored."""

    def set_error(self, description: str) -> None:
        """Ignored."""


class _Span:
    """A thin wrapper over an OpenTelemetry span (the handful of calls metafora makes)."""

    def __init__(self, span: Any) -> None:
        self._span = span

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one attribute."""
        self._span.set_attribute(key, value)

    def record_exception(self, exc: BaseException) -> None:
        """Record ``exc`` as an event of the span."""
        self._span.record_exception(exc)

    def set_error(self, description: str) -> None:
        """Mark the span failed."""
        self._span.set_status(_trace.Status(_trace.StatusCode.ERROR, description))


SpanLike = _Noop | _Span


@contextlib.contextmanager
def claim_span(node_id: str, offered: int) -> Iterator[SpanLike]:
    """Around one ``claim_many``: a ``metafora.claim`` span and the claim latency."""
    if _tracing_off() and _metrics_off():
        yield _Noop()
        return
    import time

    began = time.monotonic()
    attributes = {"metafora.node": node_id, "metafora.offered": offered}
    with _tracer().start_as_current_span("metafora.claim", attributes=attributes,
                                         record_exception=True) as span:
        try:
            yield _Span(span)
        finally:
            _histogram("metafora.claim.duration", "Time to claim a batch of offered tasks").record(
                time.monotonic() - began, {"metafora.node": node_id})


def _parent(props: Mapping[str, Any]) -> Any:
    carried = props.get(TRACE_PROP)
    if not isinstance(carried, Mapping) or _propagate is None:
        return None
    carrier = {k: v for k, v in carried.items() if isinstance(k, str) and isinstance(v, str)}
    try:
        return _propagate.extract(carrier)
    except Exception as exc:  # damaged context in props must never stop a run
        log.debug("ignoring a damaged trace context in task props: %s", exc)
        return None


@contextlib.contextmanager
def run_span(task_id: str, token: int, node_id: str, props: Mapping[str, Any]) -> Iterator[SpanLike]:
    """Around one handler run and its outcome: a ``metafora.task.run`` span."""
    if _tracing_off():
        # No span, but the submitter's trace context (if the props carry one) is current in
        # the run, as a non-recording span would make it: the handler's outgoing calls carry it.
        parent = _parent(props) if TRACE_PROP in props else None
        if parent is None:
            yield _Noop()
            return
        attached = _context.attach(parent)
        try:
            yield _Noop()
        finally:
            _context.detach(attached)
        return
    attributes = {"metafora.task.id": task_id, "metafora.task.token": token, "metafora.node": node_id}
    with _tracer().start_as_current_span(
        "metafora.task.run", context=_parent(props), kind=_trace.SpanKind.CONSUMER,
        attributes=attributes, record_exception=False, set_status_on_exception=False,
    ) as span:
        yield _Span(span)


@contextlib.contextmanager
def outcome_span(outcome: str) -> Iterator[SpanLike]:
    """Around the store write of a run's outcome: a ``metafora.task.outcome`` span."""
    if _tracing_off():
        yield _Noop()
        return
    with _tracer().start_as_current_span("metafora.task.outcome",
                                         attributes={"metafora.outcome": outcome}) as span:
        yield _Span(span)


def start_outcome_span(outcome: str) -> Callable[[], None]:
    """Start a ``metafora.task.outcome`` span under the current one; call the result to end it.

    For an outcome written later by another thread (the group commit): the span covers the
    wait in the queue and the write, and keeps the run's span as its parent.
    """
    if _tracing_off():
        return _nothing
    span = _tracer().start_span("metafora.task.outcome", attributes={"metafora.outcome": outcome})
    return cast(Callable[[], None], span.end)


def _nothing() -> None:
    """No span to end."""


def record_renewal(node_id: str, seconds: float) -> None:
    """Record one lease renewal's latency (``metafora.lease.renewal.duration``)."""
    if _metrics_off():
        return
    _histogram("metafora.lease.renewal.duration", "Time to renew a node's lease").record(
        seconds, {"metafora.node": node_id})


def with_trace_context(props: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``props`` plus the current trace context under ``_trace`` (unchanged without a span)."""
    out = dict(props or {})
    if _propagate is None:
        return out
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    if carrier:
        out[TRACE_PROP] = carrier
    return out
