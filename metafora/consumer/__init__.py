"""The Consumer and its parts: claims tasks, runs their handlers, balances, obeys commands.

:class:`Consumer` (:mod:`metafora.consumer.core`) owns the loop and the lifecycle; its
options are one :class:`ConsumerOptions` (:mod:`metafora.consumer.options`). The parts:
offer routing (:mod:`~metafora.consumer.offers`, :mod:`~metafora.consumer.preference`),
balancing (:mod:`~metafora.consumer.balancing`), handoff (:mod:`~metafora.consumer.handoff`),
a handler's end (:mod:`~metafora.consumer.finishing`, :mod:`~metafora.consumer.outcomes`),
shutdown (:mod:`~metafora.consumer.shutdown`), the handler runner
(:mod:`~metafora.consumer.runner`) and the loop's typed events
(:mod:`~metafora.consumer.events`).
"""

from __future__ import annotations

from metafora.consumer.core import Consumer
from metafora.consumer.options import ConsumerOptions

__all__ = ["Consumer", "ConsumerOptions"]
