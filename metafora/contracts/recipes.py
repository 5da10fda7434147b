"""The client's verbs that a feature implements (kazoo's recipes use the client, never the
other way round).

``Client.retry_task(..., reset_state=True)`` (the state machine), ``Client.stream`` /
``check_stream`` / ``retry_stream`` (the streams), ``Client.submit_message`` (the typed
messages) and ``ItemStore.reopen_partition`` (the gates, whose item store interface stores
implement) call what their feature registered with
:func:`register` when it loaded: the contracts import no module of a feature. A verb asked
before its feature has loaded loads the feature's package by its name (:data:`PROVIDERS`),
which registers it: ``import metafora`` and the verbs of plain tasks load no feature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any, Final

from metafora.core.errors import ConfigError

__all__ = ["PROVIDERS", "register", "verb"]

PROVIDERS: Final[Mapping[str, str]] = {
    "reset_state": "metafora.statemachine",
    "stream": "metafora.streams",
    "check_stream": "metafora.streams",
    "retry_stream": "metafora.streams",
    "reopen_partition": "metafora.gates",
    "message_task": "metafora.messages",
}
"""Each verb and the package of the feature that registers it."""

_verbs: dict[str, Callable[..., Any]] = {}


def register(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn`` the client's verb ``name`` (a feature does, as it loads; a later
    registration replaces an earlier one)."""
    _verbs[name] = fn


def verb(name: str) -> Callable[..., Any]:
    """The verb ``name``, loading its feature first when it has not registered it yet."""
    fn = _verbs.get(name)
    if fn is None and name in PROVIDERS:
        import_module(PROVIDERS[name])  # the feature registers its verbs as it loads
        fn = _verbs.get(name)
    if fn is None:
        raise ConfigError(f"no feature provides the client verb {name!r}")
    return fn
