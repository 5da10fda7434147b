"""Durations: the one grammar of duration text, and the one rule for seconds given in code.

- :func:`parse_duration`: text such as ``90``, ``90s``, ``1.5m``, ``2h``, ``7d`` or ``250ms``
  as seconds (the CLI's ``--older-than``, ``+DURATION`` times, schedule periods, retention);
- :func:`seconds`: a number of seconds or a :class:`~datetime.timedelta` given to the API (an
  option of a consumer, a balancer, an error policy) as finite seconds, with a
  :class:`~metafora.core.errors.ConfigError` naming the option;
- :func:`whole_seconds`: a period of whole seconds, at least 1 s (schedules, retention);
- :func:`format_duration`: the shortest ``30s``/``5m``/``1h``/``1d`` text for whole seconds.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Final

from metafora.core.errors import ConfigError

__all__ = ["MAX_DURATION", "UNITS", "format_duration", "parse_duration", "seconds", "whole_seconds"]

MAX_DURATION: Final = timedelta(days=36500)
"""The longest duration a user may set anywhere (100 years): a longer one is refused where it
is parsed, because adding it to now (a cut-off, a launch time, a next tick, a thread's wait)
leaves the dates a computer can count and fails later, in a background loop."""
_MAX_SECONDS: Final = MAX_DURATION.total_seconds()

UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
"""The units a duration's text may end with, in seconds (none: seconds)."""

class _TooLong(ValueError):
    """A duration's text over :data:`MAX_DURATION`."""


_TEXT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)


def parse_duration(text: str, *, unit_required: bool = False) -> float:
    """``text`` (a number, then optionally a unit of :data:`UNITS`) as seconds.

    ValueError saying what a duration looks like; with ``unit_required``, a bare number is
    refused too (where a bare ``5`` would be ambiguous, as in a schedule period).
    """
    match = _TEXT.match(text)
    if match is None or (unit_required and match.group(2) is None):
        units = "30s, 5m, 1h or 1d" if unit_required else "seconds, or a number with ms/s/m/h/d"
        raise ValueError(f"{text!r} is not a duration ({units})")
    result = float(match.group(1)) * UNITS[(match.group(2) or "s").lower()]
    if not math.isfinite(result) or result > _MAX_SECONDS:
        raise _TooLong(f"{text[:40]!r} is too long a duration (at most {format_duration(int(_MAX_SECONDS))})")
    return result


def seconds(value: float | timedelta, name: str, *, allow_zero: bool = False) -> float:
    """``value`` (a number of seconds or a ``timedelta``) as finite seconds, positive (zero
    too with ``allow_zero``); else a :class:`ConfigError` naming ``name``."""
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        raise ConfigError(f"{name} must be seconds or a timedelta, got {value!r}")
    if not math.isfinite(result) or result < 0 or (result == 0 and not allow_zero):
        sign = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"{name} must be a {sign} number of seconds, got {value!r}")
    if result > _MAX_SECONDS:
        raise ConfigError(f"{name} must be at most {format_duration(int(_MAX_SECONDS))}, got {value!r}")
    return result


def whole_seconds(value: object, what: str) -> int:
    """A period of whole seconds, at least 1 s: text with a unit (``"30s"``, ``"5m"``,
    ``"1h"``, ``"1d"``), a whole number of seconds, or a ``timedelta`` of whole seconds.
    ConfigError naming ``what`` (``"a schedule period"``)."""
    if isinstance(value, str):
        try:
            total = parse_duration(value, unit_required=True)
        except _TooLong:
            raise ConfigError(f"{what} must be at most {format_duration(int(_MAX_SECONDS))}, "
                              f"got {value[:40]!r}") from None
        except ValueError:
            raise ConfigError(
                f"bad duration {value!r}: use a number and a unit, like 30s, 5m, 1h or 1d"
            ) from None
    elif isinstance(value, timedelta):
        total = value.total_seconds()
    elif isinstance(value, int) and not isinstance(value, bool):
        total = value
    else:
        raise ConfigError(f"{what} must be a duration like 30s, 5m, 1h, 1d, got {value!r}")
    if total != int(total):
        raise ConfigError(f"{what} must be whole seconds, got {value}")
    if total < 1:
        raise ConfigError(f"{what} must be at least 1s, got {value!r}")
    if total > _MAX_SECONDS:
        raise ConfigError(f"{what} must be at most {format_duration(int(_MAX_SECONDS))}, "
                          f"got {str(value)[:40]}")
    return int(total)


def format_duration(seconds: int) -> str:
    """The shortest ``30s``/``5m``/``1h``/``1d`` text for ``seconds`` (``90s`` stays seconds)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
