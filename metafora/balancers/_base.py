"""Shared plumbing for the bundled balancers: the context they keep."""

from __future__ import annotations

import threading

from metafora.contracts.balancer import Balancer, BalancerContext
from metafora.core.clock import Clock

__all__ = ["ContextBalancer"]


class ContextBalancer(Balancer):
    """A balancer that keeps the context handed to :meth:`init` (and its clock).

    ``clock`` given at construction wins over the context's clock. Using the balancer
    before ``init`` raises :class:`RuntimeError` naming the method.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self._given_clock = clock
        self._ctx: BalancerContext | None = None
        self._clock: Clock | None = clock

    def init(self, ctx: BalancerContext) -> None:
        """Keep ``ctx`` (and its clock unless one was given at construction)."""
        self._ctx = ctx
        self._clock = self._given_clock if self._given_clock is not None else ctx.clock

    def _context(self, method: str) -> tuple[BalancerContext, Clock]:
        ctx, clock = self._ctx, self._clock
        if ctx is None or clock is None:
            raise RuntimeError(
                f"{type(self).__name__}.{method}() called before init(ctx): "
                "a balancer must be handed to a Consumer (or init'ed) before use"
            )
        return ctx, clock

    @staticmethod
    def _sleep(clock: Clock, delay: float) -> None:
        """Wait ``delay`` seconds on ``clock`` (a fresh event: fake clocks set due events)."""
        if delay > 0:
            clock.wait(threading.Event(), delay)
