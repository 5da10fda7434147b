"""What a node publishes of itself, as values: its weight and its capacity, each checked once.

A node's *weight* (``Consumer(weight=...)``, ``metafora worker --weight``) makes its fair share
proportional to it: a positive finite number, 1.0 when it says none. Its *capacity* is the most
tasks it can run now: a non-negative integer, or None for no bound. The consumer's options, the
CLI, the stores (what a node registers, and what they read back) and the balancers all check
these values here, so a weight means the same thing everywhere.
"""

from __future__ import annotations

import math
from typing import Final

from metafora.core.errors import ConfigError

__all__ = [
    "DEFAULT_WEIGHT",
    "capacity_or_none",
    "check_capacity",
    "check_weight",
    "finite_number",
    "weight_or_none",
]

DEFAULT_WEIGHT: Final = 1.0
"""The weight of a node that says none."""


def finite_number(value: object) -> float | None:
    """``value`` as a finite float if it is an int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def weight_or_none(value: object) -> float | None:
    """``value`` as a float if it is a weight (a positive finite number), else None."""
    number = finite_number(value)
    return number if number is not None and number > 0 else None


def check_weight(value: object, name: str = "weight") -> float:
    """``value`` as a float if it is a weight (a positive finite number), else
    :class:`ConfigError` naming ``name``."""
    weight = weight_or_none(value)
    if weight is None:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return weight


def capacity_or_none(value: object) -> int | None:
    """``value`` if it is a capacity (a non-negative integer), else None (no bound)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def check_capacity(value: object, name: str = "capacity") -> int:
    """``value`` if it is a capacity (a non-negative integer), else :class:`ConfigError`."""
    capacity = capacity_or_none(value)
    if capacity is None:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return capacity
