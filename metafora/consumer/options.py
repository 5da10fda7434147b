"""The Consumer's options: one frozen value, validated once, with named defaults.

:class:`~metafora.consumer.Consumer` takes them as keyword arguments (seconds as a number
or a ``timedelta``) and keeps them as a :class:`ConsumerOptions`; every part of the consumer
reads the same value, so an option is parsed and checked in one place only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from metafora.coordinator import DEFAULT_MAX_CRASHES
from metafora.durations import seconds
from metafora.errors import ConfigError, InvalidProps
from metafora.holds import DEFAULT_STICKY_FOR, check_sticky_for
from metafora.http import parse_addr
from metafora.node import check_weight
from metafora.task import validate_labels

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
]

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
"""Seconds between two prune runs of the namespace (one node's; see metafora.retention)."""
DEFAULT_RENDEZVOUS_WAIT = 0.0
"""Seconds a node leaves a wave's offer to its preferred node (0: off, every node races)."""

# Options in seconds, whether 0 is allowed for each, in the order they are checked.
_SECONDS = {
    "placement_wait": True,
    "rendezvous_wait": True,
    "balance_every": False,
    "rebalance_window": True,
    "shutdown_timeout": True,
    "start_timeout": True,
    "handoff_timeout": True,
    "release_backoff": True,
    "release_backoff_max": True,
    "refuse_retry": False,
    "prune_every": False,
}


@dataclass(frozen=True)
class ConsumerOptions:
    """How a :class:`~metafora.consumer.Consumer` claims, balances and stops.

    ``Consumer(...)`` takes each as a keyword argument of the same name. Every duration is
    in seconds (a ``timedelta`` is taken too); the ``DEFAULT_*`` constants of this module are
    the defaults. Invalid values raise :class:`~metafora.errors.ConfigError` at construction.

    - ``balance_every``: seconds (or timedelta) between balancer runs, jittered by
      ``balance_jitter`` (a fraction) so nodes do not balance in lockstep.
    - ``rebalance_window``: when the store reports that a node joined, left or announced
      leaving (``Coordinator.listen_membership``), balance after a random delay between half
      this window and all of it (default 3 s), not only every ``balance_every``; every event
      of a burst falls into the same window, so repeated joins coalesce into one balance.
      One more balance follows a few seconds later (twice the window, at least 2 s), once
      the released tasks found their new owners. 0 balances at once on each change.
    - ``max_tasks``: at most this many tasks run at once on this node. Without it, handlers
      running on threads are capped at ``thread_cap``.
    - ``thread_cap``: at most this many thread (sync) handlers run at once on this node when
      ``max_tasks`` is not given; None (the default) derives it from the process's thread
      limits (see :func:`metafora.consumer.capacity.default_thread_cap`: a quarter of the
      tightest, at most 4096); 0 turns it off. Async handlers are not counted.
    - ``max_crashes``: a task whose last claims ended this many times in a row with their node
      dead (a handler that kills its process) is failed instead of run again (default 5;
      None or 0 turns it off).
    - ``shutdown_timeout``: how long ``shutdown()`` waits for handlers by default.
    - ``start_timeout``: how long ``run()`` waits for a store that cannot be reached when it
      starts (``CoordinatorUnavailable``), retrying with back-off, before it raises that error
      (default 30 s; 0 raises at once). Other errors (bad configuration, a live node with the
      same id) are raised at once.
    - ``handoff_timeout``: how long a handler asked to give its task up by the balancer or
      ``metafora stop`` may take to return (a stateful handler's final checkpoint, see
      :meth:`metafora.statemachine.handler.Commands.handoff`); past it the handler is
      abandoned (an async one cancelled) and the claim released, so the task moves anyway
      (its writes are fenced: a late one is refused). Default 30 s.
    - ``release_backoff`` / ``release_backoff_max``: after this node releases a task it
      ignores it for a back-off that doubles per release, so it is not re-claimed in a hot
      loop and other nodes get it first.
    - ``refuse_retry``: when the balancer refuses a task without a deadline, re-offer it
      after this many seconds.
    - ``slow_callback``: warn when an async handler holds the node's event loop (a blocking
      call) longer than this many seconds.
    - ``labels``: this node's placement labels (``{"zone": "eu", "gpu": "1"}``), published
      with its registration: it claims only tasks whose selector they match (see
      docs/placement.md). Offers are tried highest ``Task.priority`` first.
    - ``weight``: this node's weight, published with its registration (default 1.0): its
      fair share of the work is proportional to it, ``total work x weight / sum of the
      weights`` of the nodes that can run it, for clusters of unequal machines (see
      docs/rebalancing.md; ``FairBalancer`` follows it, ``ResourceBalancer`` keeps its own
      rule). A positive finite number.
    - ``rendezvous_wait``: in a wave of offers (a backlog at start-up, a bulk submit), each
      task is tried first by the node that rendezvous hashing ranks first for it among the
      live nodes; the others leave it to that node and try it once this many seconds passed
      with no new wave (at most ten times as long after they held it back), so a task is
      never left waiting for a node that is gone, full or frozen (see
      :mod:`metafora.consumer.preference`). Off by default (0: every node races for every
      offer): it cuts the offers lost to races, but holding shares back can make a large
      backlog slower to drain on a store where a lost race is cheap, so it is for stores
      where a lost race is expensive (see the benchmarks in the documentation).
    - ``placement_wait``: seconds this node holds back, once, before it takes a task whose
      soft placement it does not fit (``Task.prefer`` names labels it lacks while a live
      node has them, or it already runs a task of the task's ``spread`` group), so a better
      placed node may take it first (0 ignores soft placement).
    - ``prune_every``: seconds between two tries to take the namespace's prune turn (default
      60): one node per interval deletes the finished tasks the retention policy allows (see
      :mod:`metafora.retention`).
    - ``sticky_for``: seconds (default 0: off; at most an hour) a graceful shutdown holds this
      node's tasks for its id, so the same id registering again within them takes them
      back and nothing moves (a rolling restart of a StatefulSet or a systemd unit); other
      nodes take them after the window. Used only with an explicit node id (``node_id=``
      or ``METAFORA_NODE_ID``): with a generated id it is ignored, as such an id never
      comes back. ``shutdown(leaving=True)`` and a crash hold nothing (see
      :mod:`metafora.holds`); 0 turns it off.
    - ``http_addr``: ``"127.0.0.1:PORT"`` serves ``/info``, ``/metrics`` and ``/healthz``
      (see :mod:`metafora.http`); off by default.
    """

    balance_every: float = DEFAULT_BALANCE_EVERY
    balance_jitter: float = DEFAULT_BALANCE_JITTER
    rebalance_window: float = DEFAULT_REBALANCE_WINDOW
    max_tasks: int | None = None
    thread_cap: int | None = None
    max_crashes: int | None = DEFAULT_MAX_CRASHES
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    start_timeout: float = DEFAULT_START_TIMEOUT
    handoff_timeout: float = DEFAULT_HANDOFF_TIMEOUT
    release_backoff: float = DEFAULT_RELEASE_BACKOFF
    release_backoff_max: float = DEFAULT_RELEASE_BACKOFF_MAX
    refuse_retry: float = DEFAULT_REFUSE_RETRY
    slow_callback: float = DEFAULT_SLOW_CALLBACK
    http_addr: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    weight: float = 1.0
    placement_wait: float = DEFAULT_PLACEMENT_WAIT
    rendezvous_wait: float = DEFAULT_RENDEZVOUS_WAIT
    prune_every: float = DEFAULT_PRUNE_EVERY
    sticky_for: float = DEFAULT_STICKY_FOR

    def __post_init__(self) -> None:
        max_tasks, max_crashes = self.max_tasks, self.max_crashes
        if max_tasks is not None and (not isinstance(max_tasks, int) or max_tasks < 1):
            raise ConfigError(f"max_tasks must be a positive integer or None, got {max_tasks!r}")
        cap = self.thread_cap
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ConfigError(f"thread_cap must be a non-negative integer or None, got {cap!r}")
        if max_crashes is not None and (
            not isinstance(max_crashes, int) or isinstance(max_crashes, bool) or max_crashes < 0
        ):
            raise ConfigError(f"max_crashes must be a non-negative integer or None, got {max_crashes!r}")
        if not 0 <= self.balance_jitter < 1:
            raise ConfigError(f"balance_jitter must be in [0, 1), got {self.balance_jitter!r}")
        try:
            object.__setattr__(self, "labels", validate_labels(self.labels, "labels"))
        except InvalidProps as exc:
            raise ConfigError(str(exc)) from None
        object.__setattr__(self, "weight", check_weight(self.weight, "weight"))
        for name, allow_zero in _SECONDS.items():
            # Frozen, but normalised once here: a timedelta becomes seconds.
            object.__setattr__(self, name, seconds(getattr(self, name), name, allow_zero=allow_zero))
        if self.http_addr is not None:
            parse_addr(self.http_addr)  # a bad address is a ConfigError now, not at run()
        object.__setattr__(self, "slow_callback", seconds(self.slow_callback, "slow_callback"))
        object.__setattr__(self, "sticky_for", check_sticky_for(self.sticky_for))

    @property
    def crash_limit(self) -> int | None:
        """``max_crashes`` as the store takes it: None when off (None or 0)."""
        return self.max_crashes or None
