"""What a stream's ``work(job, ctx)`` is given and how it is called: shared by the stream
handler (:mod:`metafora.streams.handler`) and its engine (:mod:`metafora.streams.run`)."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from metafora.core.task import Task
from metafora.streams.jobs import Job

__all__ = ["JobContext", "Work", "refuse_awaitable"]


@dataclass(frozen=True)
class JobContext:
    """What ``work(job, ctx)`` gets besides its job.

    ``task``: the stream's claimed task (props, fencing ``token``); ``attempt``: 1 for the
    first run of this job in this claim; ``stopping``: set when the stream is stopping -- a
    long job may raise to give up (it then re-runs on the next owner; returning means done).
    """

    task: Task
    attempt: int
    stopping: threading.Event = field(compare=False, repr=False)


Work = Callable[[Job, JobContext], "Awaitable[object] | object"]
"""``work(job, ctx)``: returns (anything) when the job is done, raises to have it retried."""


def refuse_awaitable(work: Work, result: object) -> None:
    """Raise TypeError if ``result`` of a plain ``work`` is an awaitable (it would count as
    done without running); closed first, so it warns of nothing."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()
        raise TypeError(f"work {work!r} returned an awaitable; declare it with 'async def' to "
                        "run it on the event loop")
