"""DumbBalancer: claim everything, release nothing."""

from __future__ import annotations

from datetime import datetime

from metafora.balancers._base import ContextBalancer
from metafora.core.task import Task

__all__ = ["DumbBalancer"]


class DumbBalancer(ContextBalancer):
    """Claims every task offered and never releases one (the consumer's default is
    :class:`~metafora.balancers.FairBalancer`).

    Fine for a single node or when every node is equally able and tasks are short enough
    that an uneven spread does not matter.
    """

    def __init__(self) -> None:
        super().__init__()

    def can_claim(self, task: Task) -> tuple[bool, datetime | None]:
        """Always ``(True, None)``."""
        self._context("can_claim")
        return True, None

    def balance(self) -> list[str]:
        """Always ``[]``."""
        self._context("balance")
        return []

    def __repr__(self) -> str:
        return "DumbBalancer()"
