"""Without a tracer provider, metafora makes no spans but keeps the submitter's trace current.

Run in a fresh interpreter: OpenTelemetry's global provider can be set only once per process,
and the SDK tests set it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from metafora.core import tracing

assert tracing._tracing_off(), "a provider is set in a fresh interpreter"
parent = SpanContext(trace_id=0x1234, span_id=0x99, is_remote=False,
                     trace_flags=TraceFlags(TraceFlags.SAMPLED))
with trace.use_span(NonRecordingSpan(parent)):
    props = tracing.with_trace_context({"x": 1})
assert tracing.TRACE_PROP in props, props
assert trace.get_current_span().get_span_context().trace_id == 0  # nothing current out here
with tracing.run_span("t1", 1, "n1", props):
    inside = trace.get_current_span().get_span_context()
with tracing.run_span("t2", 1, "n1", {"x": 1}):
    plain = trace.get_current_span().get_span_context()
after = trace.get_current_span().get_span_context()
print(inside.trace_id == 0x1234, plain.trace_id == 0, after.trace_id == 0)
'''


def test_the_submitters_trace_is_current_in_the_run_without_a_provider() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]
