"""Moved to :mod:`metafora.consumer.outcomes`; this path keeps working."""

from __future__ import annotations

from metafora.consumer.outcomes import OutcomeWriter, Pending, Settle

__all__ = ["OutcomeWriter", "Pending", "Settle"]
