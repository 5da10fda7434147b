"""When the consumer balances: a jittered period, and soon after the cluster changes.

The balancer runs every ``balance_every`` seconds (jittered so nodes do not balance in
lockstep). When the store reports that a node joined, left or announced leaving, a balance
follows after a random delay within ``rebalance_window`` -- every event of a burst falls into
the same window -- and one more, a few seconds later, once the released tasks found their
new owners. Runs on the consumer's loop thread.

A frozen node (``metafora freeze``) skips these turns: it neither claims nor releases until
unfrozen, so an operator who froze it finds every task where it was (Metafora's freeze "stops
all task watching and balancing"). An explicit ``balance`` command (:meth:`Rebalancer.balance`)
and ``stop_task`` still act. Every turn, run or skipped, is counted in
``ConsumerStats.balance_turns``.
"""

from __future__ import annotations

from collections.abc import Callable

from metafora.consumer.context import PartsContext
from metafora.consumer.events import Event, Signal
from metafora.consumer.offers import OfferRouter
from metafora.contracts.balancer import Balancer
from metafora.core.errors import MetaforaError
from metafora.core.masking import mask_url

__all__ = ["Rebalancer"]


class Rebalancer:
    """Keeps the time of the next balance and runs it; follows the cluster's membership.

    ``release`` asks a running handler to give its task up (False when it does not run here).
    """

    def __init__(
        self,
        ctx: PartsContext,
        balancer: Balancer,
        *,
        offers: OfferRouter,
        release: Callable[[str], bool],
    ) -> None:
        self._coord = ctx.coordinator
        self._balancer = balancer
        self._options = ctx.options
        self._offers = offers
        self._release = release
        self._wake = ctx.wake
        self._clock = ctx.clock
        self._rng = ctx.rng
        self._log = ctx.log
        self._stats = ctx.stats
        self.next_balance = 0.0  # monotonic time of the next balance
        self._follow_up = False  # a membership balance is followed by one settling balance
        self._members: set[str] | None = None  # active nodes at the last membership event

    def schedule_first(self, pushed: bool) -> None:
        """Schedule the first balance (``pushed``: the store reports membership changes)."""
        self.next_balance = self._clock.monotonic() + self._interval()
        if pushed:
            # Joining is a membership change too: the tasks the others release race to
            # their new owners, and this node may take more than its share of them.
            self.next_balance = min(self.next_balance, self._clock.monotonic() + self._settle_after())

    def tick(self, now: float) -> None:
        """Balance if it is time (called by the loop on every pass); a frozen node skips
        the turn (it keeps every task it holds)."""
        if now < self.next_balance:
            return
        self._stats.incr("balance_turns")
        if self._offers.frozen:
            self._log.debug("frozen: balance turn skipped", extra={"action": "balance"})
        else:
            self.balance()
        self.next_balance = now + self._interval()
        if self._follow_up:
            # Released tasks race to new owners; a node at its share may take one
            # too many. One more look once they settled, not a whole period later.
            self._follow_up = False
            self.next_balance = min(self.next_balance, now + self._settle_after())

    def balance(self) -> None:
        """Run the balancer now and ask the handlers of the tasks it gives up to return
        (frozen or not: what the ``balance`` command does)."""
        try:
            ids = self._balancer.balance()
        except Exception as exc:
            self._log.exception("balancer failed: %s", exc, extra={"action": "balance"})
            return
        for task_id in ids:
            self._release(task_id)

    def listen(self, post: Callable[[Event], None]) -> bool:
        """Read the members and listen to their changes; False when the store cannot tell."""
        try:
            self._members = set(self._coord.published_task_count())
            self._offers.members(self._members)
        except MetaforaError as exc:  # only the first diff is less precise
            self._log.warning("could not read the cluster's nodes: %s", exc,
                              extra={"action": "members"})
        if not self._coord.listen_membership(lambda: post(Signal.MEMBERS)):
            self._log.debug("store %s reports no membership changes: balancing every %.0fs only",
                            mask_url(self._coord.name, brief=True), self._options.balance_every,
                            extra={"action": "members"})
            return False
        return True

    def tasks_ended(self) -> None:
        """Tasks ended: if the balancer's reason for refusing offers went away with them
        (``Balancer.refusals_lifted``), try the refused offers now."""
        try:
            lifted = self._balancer.refusals_lifted()
        except Exception as exc:
            self._log.exception("balancer failed on refusals_lifted: %s", exc,
                                extra={"action": "refusals_lifted"})
            return
        if lifted:
            self._offers.forgive_refusals(self._clock.monotonic())
            self._wake.set()

    def members_changed(self) -> None:
        """A node may have joined, left or announced leaving: see who, then act on it.

        A leave frees orphans, which are claimed at once (the balancer stops refusing after
        its own releases, and offers it refused are tried again); any change schedules a
        balance within the dampening window, unless one is due sooner already.
        """
        try:
            now_members = set(self._coord.published_task_count())
        except MetaforaError as exc:
            self._log.warning("could not read the cluster's nodes: %s", exc,
                              extra={"action": "members"})
            return
        before = self._members
        self._members = now_members
        self._offers.members(now_members)
        if before is not None and before == now_members:
            return  # spurious, or already handled
        joined = sorted(now_members - before) if before is not None else []
        left = sorted(before - now_members) if before is not None else []
        self._log.info("cluster membership changed: joined %s, left %s", joined or "-",
                       left or "-", extra={"action": "members"})
        try:
            self._balancer.nodes_changed(bool(left))
        except Exception as exc:
            self._log.exception("balancer failed on nodes_changed: %s", exc,
                                extra={"action": "members"})
        now = self._clock.monotonic()
        if left:
            self._offers.forgive_refusals(now)
        delay = self._options.rebalance_window * self._rng.uniform(0.5, 1.0)
        self.next_balance = min(self.next_balance, now + delay)
        self._follow_up = True
        self._wake.set()

    def _settle_after(self) -> float:
        return max(2 * self._options.rebalance_window, 2.0) * self._rng.uniform(1.0, 1.5)

    def _interval(self) -> float:
        spread = self._options.balance_jitter * self._options.balance_every
        return self._options.balance_every + self._rng.uniform(-spread, spread)
