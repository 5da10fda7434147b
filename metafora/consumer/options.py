"""The Consumer's options: one frozen value, validated once, with named defaults.

:class:`~metafora.consumer.Consumer` takes them as keyword arguments (seconds as a number
or a ``timedelta``) and keeps them as a :class:`ConsumerOptions`; every part of the consumer
reads the same value, so an option is parsed and checked in one place only.
"""

from __future__ import annotations

import ast
import inspect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from datetime import timedelta
from typing import Any, TypeVar

from metafora.consumer.http import parse_addr
from metafora.contracts.coordinator import DEFAULT_MAX_CRASHES
from metafora.core.durations import seconds
from metafora.core.errors import ConfigError, InvalidProps
from metafora.core.holds import DEFAULT_STICKY_FOR, check_sticky_for
from metafora.core.node import check_weight
from metafora.core.task import validate_labels

__all__ = [
    "DEFAULT_BALANCE_EVERY",
    "DEFAULT_BALANCE_JITTER",
    "DEFAULT_HANDOFF_TIMEOUT",
    "DEFAULT_MAX_CRASHES",
    "DEFAULT_PLACEMENT_WAIT",
    "DEFAULT_REBALANCE_WINDOW",
    "DEFAULT_REFUSE_RETRY",
    "DEFAULT_RELEASE_BACKOFF",
    "DEFAULT_RELEASE_BACKOFF_MAX",
    "DEFAULT_RENDEZVOUS_WAIT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DEFAULT_SLOW_CALLBACK",
    "DEFAULT_START_TIMEOUT",
    "DEFAULT_STICKY_FOR",
    "ConsumerOptions",
    "option_docs",
    "option_fields",
]

T = TypeVar("T")

DEFAULT_BALANCE_EVERY = 60.0
"""Seconds between balancer runs."""
DEFAULT_BALANCE_JITTER = 0.1
"""Fraction of ``balance_every`` the period is jittered by, so nodes do not balance in lockstep."""
DEFAULT_REBALANCE_WINDOW = 3.0
"""Seconds within which a membership change is balanced (a random delay in its second half)."""
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
"""Seconds ``shutdown()`` waits for handlers by default."""
DEFAULT_START_TIMEOUT = 30.0
"""Seconds ``run()`` waits for an unreachable store when it starts."""
DEFAULT_HANDOFF_TIMEOUT = 30.0
"""Seconds a handler asked to give its task up may take to return."""
DEFAULT_RELEASE_BACKOFF = 1.0
"""Seconds a released task is ignored after its first release (doubling per release)."""
DEFAULT_RELEASE_BACKOFF_MAX = 60.0
"""The longest release back-off."""
DEFAULT_REFUSE_RETRY = 1.0
"""Seconds before an offer the balancer refused without a deadline is tried again."""
DEFAULT_SLOW_CALLBACK = 0.25
"""Seconds an async handler may hold the node's event loop before a warning."""
DEFAULT_PLACEMENT_WAIT = 2.0
"""Seconds a node holds back, once, a task whose soft placement it does not fit."""
DEFAULT_PRUNE_EVERY = 60.0
"""Seconds between two prune runs of the namespace (one node's; see metafora.core.retention)."""
DEFAULT_RENDEZVOUS_WAIT = 0.0
"""Seconds a node leaves a wave's offer to its preferred node (0: off, one node per offer)."""

_Check = Callable[[Any, str], Any]


def _seconds(*, zero: bool) -> _Check:
    def check(value: Any, label: str) -> float:
        return seconds(value, label, allow_zero=zero)
    return check


def _count(*, least: int, what: str) -> _Check:
    def check(value: Any, label: str) -> int | None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ConfigError(f"{label} must be a {what} integer or None, got {value!r}")
        return value
    return check


def _jitter(value: Any, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ConfigError(f"{label} must be in [0, 1), got {value!r}")
    return float(value)


def _labels(value: Any, label: str) -> Mapping[str, str]:
    try:
        return validate_labels(value or {}, label)
    except InvalidProps as exc:
        raise ConfigError(str(exc)) from None


def _addr(value: Any, label: str) -> str | None:
    if value is not None:
        parse_addr(value)  # a bad address is a ConfigError now, not at run()
    return value  # type: ignore[no-any-return]


def _sticky(value: Any, label: str) -> float:
    return check_sticky_for(value.total_seconds() if isinstance(value, timedelta) else value, label)


def _option(default: T, check: _Check, kind: str) -> T:
    """A field of :class:`ConsumerOptions`: its default, the check that bounds it (called
    with the value and the name to blame) and its kind (``seconds``, ``count``, ``number``,
    ``labels``, ``text``), which the worker's flags are made from."""
    made: T = field(default=default, metadata={"check": check, "kind": kind})
    return made


@dataclass(frozen=True)
class ConsumerOptions:
    """How a :class:`~metafora.consumer.Consumer` claims, balances and stops.

    Each option is written here once, with its default, its bound and its documentation:
    ``Consumer(...)`` takes each as a keyword argument of the same name (its signature is
    made from these fields) and ``metafora worker`` as a flag (``--balance-every``,
    ``$METAFORA_WORKER_BALANCE_EVERY``). Every duration is in seconds (a ``timedelta`` is
    taken too and kept as seconds); the ``DEFAULT_*`` constants of this module are the
    defaults. Invalid values raise :class:`~metafora.core.errors.ConfigError` at construction.
    """

    balance_every: float = _option(DEFAULT_BALANCE_EVERY, _seconds(zero=False), "seconds")
    """Seconds between balancer runs, jittered by ``balance_jitter``."""
    balance_jitter: float = _option(DEFAULT_BALANCE_JITTER, _jitter, "number")
    """The fraction of ``balance_every`` the period is jittered by, so nodes do not balance in
    lockstep (in [0, 1))."""
    rebalance_window: float = _option(DEFAULT_REBALANCE_WINDOW, _seconds(zero=True), "seconds")
    """Seconds within which a membership change is balanced. When the store reports that a
    node joined, left or announced leaving (``Coordinator.listen_membership``), balance after
    a random delay between half this window and all of it (default 3 s), not only every
    ``balance_every``; every event of a burst falls into the same window, so repeated joins
    coalesce into one balance. One more balance follows a few seconds later (twice the
    window, at least 2 s), once the released tasks found their new owners. 0 balances at once
    on each change."""
    max_tasks: int | None = _option(None, _count(least=1, what="positive"), "count")
    """At most this many tasks run at once on this node. Without it, handlers running on
    threads are capped at ``thread_cap``."""
    thread_cap: int | None = _option(None, _count(least=0, what="non-negative"), "count")
    """At most this many thread (sync) handlers run at once on this node when ``max_tasks``
    is not given; None (the default) derives it from the process's thread limits (see
    :func:`metafora.consumer.capacity.default_thread_cap`: a quarter of the tightest, at most
    4096); 0 turns it off. Async handlers are not counted."""
    max_crashes: int | None = _option(DEFAULT_MAX_CRASHES, _count(least=0, what="non-negative"), "count")
    """A task whose last claims ended this many times in a row with their node dead (a
    handler that kills its process) is failed instead of run again (default 5; None or 0
    turns it off)."""
    shutdown_timeout: float = _option(DEFAULT_SHUTDOWN_TIMEOUT, _seconds(zero=True), "seconds")
    """How long ``shutdown()`` waits for handlers by default."""
    start_timeout: float = _option(DEFAULT_START_TIMEOUT, _seconds(zero=True), "seconds")
    """How long ``run()`` waits for a store that cannot be reached when it starts
    (``CoordinatorUnavailable``), retrying with back-off, before it raises that error
    (default 30 s; 0 raises at once). Other errors (bad configuration, a live node with the
    same id) are raised at once."""
    handoff_timeout: float = _option(DEFAULT_HANDOFF_TIMEOUT, _seconds(zero=True), "seconds")
    """How long a handler asked to give its task up by the balancer or ``metafora stop`` may
    take to return (a stateful handler's final checkpoint, see
    :meth:`metafora.statemachine.handler.Commands.handoff`); past it the handler is abandoned
    (an async one cancelled) and the claim released, so the task moves anyway (its writes
    are fenced: a late one is refused). Default 30 s."""
    release_backoff: float = _option(DEFAULT_RELEASE_BACKOFF, _seconds(zero=True), "seconds")
    """After this node releases a task it ignores it for this back-off, doubling per release
    (up to ``release_backoff_max``), so it is not re-claimed in a hot loop and other nodes
    get it first."""
    release_backoff_max: float = _option(DEFAULT_RELEASE_BACKOFF_MAX, _seconds(zero=True), "seconds")
    """The longest release back-off (see ``release_backoff``)."""
    refuse_retry: float = _option(DEFAULT_REFUSE_RETRY, _seconds(zero=False), "seconds")
    """When the balancer refuses a task without a deadline, re-offer it after this many
    seconds."""
    slow_callback: float = _option(DEFAULT_SLOW_CALLBACK, _seconds(zero=False), "seconds")
    """Warn when an async handler holds the node's event loop (a blocking call) longer than
    this many seconds."""
    http_addr: str | None = _option(None, _addr, "text")
    """``"127.0.0.1:PORT"`` serves ``/info``, ``/metrics`` and ``/healthz`` (see
    :mod:`metafora.consumer.http`); off by default."""
    labels: Mapping[str, str] = field(default_factory=dict, metadata={"check": _labels, "kind": "labels"})
    """This node's placement labels (``{"zone": "eu", "gpu": "1"}``), published with its
    registration: it claims only tasks whose selector they match (see docs/placement.md).
    Offers are tried highest ``Task.priority`` first."""
    weight: float = _option(1.0, check_weight, "number")
    """This node's weight, published with its registration (default 1.0): its fair share of
    the work is proportional to it, ``total work x weight / sum of the weights`` of the nodes
    that can run it, for clusters of unequal machines (see docs/rebalancing.md;
    ``FairBalancer`` follows it, ``ResourceBalancer`` keeps its own rule). A positive finite
    number."""
    placement_wait: float = _option(DEFAULT_PLACEMENT_WAIT, _seconds(zero=True), "seconds")
    """Seconds this node holds back, once, before it takes a task whose soft placement it
    does not fit (``Task.prefer`` names labels it lacks while a live node has them, or it
    already runs a task of the task's ``spread`` group), so a better placed node may take it
    first (0 ignores soft placement)."""
    rendezvous_wait: float = _option(DEFAULT_RENDEZVOUS_WAIT, _seconds(zero=True), "seconds")
    """Seconds a node leaves a wave's offer to its preferred node. In a wave of offers (a
    backlog at start-up, a bulk submit), each task is tried first by the node that rendezvous
    hashing ranks first for it among the live nodes; the others leave it to that node and try
    it once this many seconds passed with no new wave (at most ten times as long after they
    held it back), so a task is never left waiting for a node that is gone, full or frozen
    (see :mod:`metafora.consumer.preference`). Off by default (0: a wave goes as any offer,
    one node first and the others after a short delay, :mod:`metafora.consumer.first_offer`):
    it cuts the offers lost to races further, but holding shares back can make a large
    backlog slower to drain on a store where a lost race is cheap, so it is for stores where
    a lost race is expensive (see the benchmarks in the documentation)."""
    prune_every: float = _option(DEFAULT_PRUNE_EVERY, _seconds(zero=False), "seconds")
    """Seconds between two tries to take the namespace's prune turn (default 60): one node
    per interval deletes the finished tasks the retention policy allows (see
    :mod:`metafora.core.retention`)."""
    sticky_for: float = _option(DEFAULT_STICKY_FOR, _sticky, "seconds")
    """Seconds (default 0: off; at most an hour) a graceful shutdown holds this node's tasks
    for its id, so the same id registering again within them takes them back and nothing
    moves (a rolling restart of a StatefulSet or a systemd unit); other nodes take them after
    the window. Used only with an explicit node id (``node_id=`` or ``METAFORA_NODE_ID``):
    with a generated id it is ignored, as such an id never comes back.
    ``shutdown(leaving=True)`` and a crash hold nothing (see :mod:`metafora.core.holds`); 0 turns
    it off."""

    def __post_init__(self) -> None:
        for option in fields(self):
            # Frozen, but normalised once here: a timedelta becomes seconds, labels a dict.
            value = option.metadata["check"](getattr(self, option.name), option.name)
            object.__setattr__(self, option.name, value)

    @classmethod
    def parse(cls, values: Mapping[str, Any], label: Callable[[str], str] = str) -> ConsumerOptions:
        """The options ``values`` gives (the others at their defaults), each checked once and
        blamed by ``label(name)`` when refused (the worker names its flags: ``--weight``).
        An unknown name is a TypeError, as an unknown keyword argument is."""
        known = {option.name: option for option in fields(cls)}
        for name in values:
            if name not in known:
                raise TypeError(f"unexpected keyword argument {name!r} (not an option of the Consumer)")
        return cls(**{name: known[name].metadata["check"](value, label(name))
                      for name, value in values.items()})

    @property
    def crash_limit(self) -> int | None:
        """``max_crashes`` as the store takes it: None when off (None or 0)."""
        return self.max_crashes or None


def option_fields() -> tuple[Field[Any], ...]:
    """The options' fields in order; each field's ``metadata["kind"]`` says what it holds."""
    return fields(ConsumerOptions)


def option_docs() -> dict[str, str]:
    """Each option's documentation (the docstring under its field), by name, read from
    this module's source: what ``metafora worker --help`` shows of an option."""
    tree = ast.parse(inspect.getsource(ConsumerOptions))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, after in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[stmt.target.id] = inspect.cleandoc(str(after.value.value))
    return docs
