"""Moved to :mod:`metafora.consumer.runner`; this path keeps working."""

from __future__ import annotations

from metafora.consumer.runner import Around, AsyncRun, Finish, HandlerRunner, Run, SyncRun, Write

__all__ = ["Around", "AsyncRun", "Finish", "HandlerRunner", "Run", "SyncRun", "Write"]
