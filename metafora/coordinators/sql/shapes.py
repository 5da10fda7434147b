"""Tasks built from stored rows, each shape of row validated once.

A backlog is mostly submitted alike: every row holds the same props, selector, priority and
placement texts. :class:`OfferShapes` validates such texts the first time and builds every
later row of the same shape as a copy (:func:`metafora.core.task.task_like`), for the watch's offers
and for the rows a claim returns.
"""

from __future__ import annotations

import json
from typing import Any

from metafora.core.task import Task, decode_labels, decode_props, decode_soft, task_like

__all__ = ["OfferShapes"]

_SHAPES = 64  # validated shapes kept
_SHAPE_TEXT = 512  # props / selector / placement texts longer than this are not kept


class OfferShapes:
    """Builds tasks from rows (offered, or claimed), validating each shape of row once.

    (props, selector, priority, placement) as stored -> a task validated with them: rows of
    one shape (a backlog of tasks submitted alike) are offered without validating the same
    texts again for every row (that was most of a start-up storm's offer cost).
    """

    def __init__(self) -> None:
        self._shapes: dict[tuple[Any, ...], Task] = {}

    def task(self, task_id: str, props: Any, selector: Any, priority: Any, placement: Any,
             token: int = 0) -> Task:
        """The task of one row, with ``token`` (raises MetaforaError when a text is invalid).

        A row shaped like one validated before (the same props, selector, priority and
        placement texts) becomes a copy of that task with its own id and its own props
        (decoded again from the same text): equal to what the constructor would build,
        without validating the same texts once more. The id is always validated.
        """
        key = (props, selector, priority, placement)
        shape = self._shapes.get(key)
        if shape is None:
            prefer, spread, group = decode_soft(placement, task_id)
            task = Task(task_id, decode_props(props, task_id), token,
                        selector=decode_labels(selector, f"stored selector of task {task_id!r}"),
                        priority=int(priority or 0), prefer=prefer, spread=spread, group=group)
            if all(v is None or len(v) <= _SHAPE_TEXT for v in (props, selector, placement)):
                if len(self._shapes) >= _SHAPES:
                    self._shapes.clear()
                self._shapes[key] = task
            return task
        return task_like(shape, task_id, {} if props == "{}" else json.loads(props), token)
