"""Soft placement: how long a node holds back a task that ``prefer`` or ``spread`` places
elsewhere (best effort: offered again after its wait, nobody better placed took it, so the
node does)."""

from __future__ import annotations

from collections.abc import Mapping

from metafora.consumer.options import ConsumerOptions
from metafora.contracts.coordinator import Coordinator
from metafora.core.clock import Clock
from metafora.core.errors import MetaforaError
from metafora.core.task import Task, matches

__all__ = ["Placement"]


class Placement:
    """Soft placement: how long to hold back a task ``prefer`` or ``spread`` places elsewhere."""

    def __init__(self, coordinator: Coordinator, options: ConsumerOptions, clock: Clock) -> None:
        self._coord = coordinator
        self._labels = options.labels
        self._wait = options.placement_wait
        self._refuse_retry = options.refuse_retry
        self._clock = clock
        # task id -> (until when soft placement holds it back, group tasks running then)
        self._held_back: dict[str, tuple[float, int]] = {}
        self._node_labels: tuple[float, list[dict[str, str]]] | None = None

    def hold_back(self, task: Task, approved: list[Task],
                  spreads: Mapping[str | None, int] | None) -> float | None:
        """Seconds to hold ``task`` back for its soft placement, or None to go on claiming.

        ``spread``: a node running ``n`` tasks of the group (``spreads``: running tasks per
        group, counted by the caller) waits ``n * placement_wait``, so
        nodes running fewer take it first; a task of a group another task of this offer wave
        was approved from waits only ``refuse_retry`` (that claim may be lost). ``prefer``: a
        node without the labels waits ``placement_wait`` while a live node has them. Offered
        again after its wait, nobody better placed took it, so this node does: best effort,
        never a task left waiting.
        """
        if (not task.prefer and task.spread is None) or not self._wait:
            return None
        in_wave = task.spread is not None and any(t.spread == task.spread for t in approved)
        running = spreads.get(task.spread, 0) if task.spread is not None and spreads else 0
        now = self._clock.monotonic()
        misplaced = (bool(task.prefer) and not matches(task.prefer, self._labels)
                     and self._preferred_node_live(task.prefer, now))
        held = self._held_back.get(task.id)
        if not (in_wave or running or misplaced):
            self._held_back.pop(task.id, None)
            return None
        if held is not None and now >= held[0] and not in_wave and running <= held[1]:
            del self._held_back[task.id]
            return None
        if held is None or now >= held[0] or running > held[1]:
            if len(self._held_back) > 10_000:  # forget holds long past (tasks taken elsewhere)
                self._held_back = {k: h for k, h in self._held_back.items() if h[0] > now - 60}
            wait = max(running * self._wait, self._wait if misplaced else 0.0)
            held = self._held_back[task.id] = (now + (wait or self._refuse_retry), running)
        return max(0.0, held[0] - now)

    def _preferred_node_live(self, prefer: Mapping[str, str], now: float) -> bool:
        """Whether a live node has the ``prefer`` labels (node labels cached for 5 s)."""
        cached = self._node_labels
        if cached is None or now - cached[0] > 5.0:
            try:
                cached = self._node_labels = (now, list(self._coord.node_labels().values()))
            except MetaforaError:
                return True  # unsure: hold back once, as if one did
        return any(matches(prefer, labels) for labels in cached[1])
