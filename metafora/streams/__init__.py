"""Streams of indexed jobs: flow-go's job queue on the cluster.

Each claimed task is one stream. Its jobs come from a :class:`Jobs` source by index; a
bounded window of them runs at once, and the stream's **processed index** (every index
from ``start`` up to it is done) is stored fenced by the claim token, so a restart or a
move resumes without a gap and a zombie owner can never move it back.
"""

from __future__ import annotations

from metafora.streams.jobs import Job, Jobs, StreamFailing, StreamInfo, Wake

__all__ = ["Job", "Jobs", "StreamFailing", "StreamInfo", "Wake"]
