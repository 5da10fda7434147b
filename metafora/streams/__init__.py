"""Streams of indexed jobs: flow-go's job queue on the cluster.

Each claimed task is one stream. Its jobs come from a :class:`Jobs` source by index; a
bounded window of them runs at once, and the stream's **processed index** (every index
from ``start`` up to it is done) is stored fenced by the claim token, so a restart or a
move resumes without a gap and a zombie owner can never move it back.

:func:`stream_handler` makes the :data:`~metafora.contracts.handler.HandlerFunc`; the client's
``stream``, ``streams``, ``check_stream`` and ``retry_stream`` (and ``metafora streams``,
``metafora stream show|check|retry``) see and steer streams. See docs/streams.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metafora.contracts.recipes import register
from metafora.streams.handler import JobContext, StreamHandlerFunc, StreamOptions, stream_handler
from metafora.streams.jobs import Job, Jobs, StreamFailing, StreamInfo, Wake
from metafora.streams.ops import check_stream, retry_stream, stream_info

if TYPE_CHECKING:
    from metafora.coordinators.sql.joblog import SQLJobLog

__all__ = [
    "Job",
    "JobContext",
    "Jobs",
    "SQLJobLog",
    "StreamFailing",
    "StreamHandlerFunc",
    "StreamInfo",
    "StreamOptions",
    "Wake",
    "stream_handler",
]


def __getattr__(name: str) -> Any:
    # SQLJobLog is the SQL store's (SQLAlchemy), found through the stores' registry when first
    # named: `import metafora.streams` stays light for streams over other sources, and the
    # feature imports no store.
    if name == "SQLJobLog":
        from metafora.contracts.backends import implementation

        return implementation("sql", "job_log")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The client's stream verbs (the client knows no recipe of the streams: they tell it, when
# they load; metafora.contracts.recipes).
register("stream", stream_info)
register("check_stream", check_stream)
register("retry_stream", retry_stream)
