"""The entry-point group ``metafora.stores``, read once a process: URL scheme -> the entry
point of a store's backend object.

The typed door is :mod:`metafora.contracts.backends` (:class:`~metafora.contracts.backends.StoreBackend`,
:func:`~metafora.contracts.backends.backend_of`); this module only reads the group, untyped, and
imports no contract.
"""

from __future__ import annotations

import functools
import sys
from importlib import metadata
from typing import Any

__all__ = ["GROUP", "entry_points", "find", "loaded", "schemes"]

GROUP = "metafora.stores"
"""The entry-point group that maps a URL scheme to a store's backend object."""


@functools.cache
def entry_points() -> dict[str, metadata.EntryPoint]:
    """The registered schemes (lower case) and their entry points."""
    return {ep.name.lower(): ep for ep in metadata.entry_points(group=GROUP)}


def schemes() -> list[str]:
    """Every URL scheme a store is registered under, sorted."""
    return sorted(entry_points())


def loaded() -> dict[str, Any]:
    """Every registered backend object that loads here, by its ``name`` (a store whose driver
    is missing, or an entry point whose object has no name, is left out)."""
    found: dict[str, Any] = {}
    for ep in entry_points().values():
        try:
            backend = ep.load()
        except ImportError:
            continue
        name = getattr(backend, "name", None)
        if isinstance(name, str) and name:
            found.setdefault(name, backend)
    return found


def find(name: str) -> Any:
    """The registered backend object whose ``name`` is ``name``, or None. The entry points
    whose module is imported already are tried first, so finding the store of an open client
    loads no other store (nor its driver)."""
    ordered = sorted(entry_points().values(), key=lambda ep: ep.module not in sys.modules)
    for ep in ordered:
        try:
            backend = ep.load()
        except ImportError:
            continue
        if getattr(backend, "name", None) == name:
            return backend
    return None
