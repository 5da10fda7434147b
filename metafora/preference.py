"""Moved to :mod:`metafora.consumer.preference`; this path keeps working."""

from __future__ import annotations

from metafora.consumer.preference import Preference, preferred_node, weight

__all__ = ["Preference", "preferred_node", "weight"]
