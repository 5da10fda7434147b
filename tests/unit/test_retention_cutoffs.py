"""Cut-offs of a retention policy (:class:`metafora.core.retention.Cutoffs`): pure logic."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from metafora.core.retention import Cutoffs, prunable
from metafora.core.task import TaskInfo, TaskState

T0 = datetime(2026, 1, 10, tzinfo=UTC)
CUTS = [None, T0 - timedelta(days=1), T0 - timedelta(days=3)]
MACHINES = [None, '{"state":"killed"}', '{"state": "failed"}', '{"state":"runnable"}']


@pytest.mark.parametrize("state", list(TaskState))
def test_latest_for_bounds_what_any_state_machine_lets_prune(state: TaskState) -> None:
    """``latest_for`` (the etcd pruner's candidates, judged without the state machine) is the
    latest finish time that some state machine lets ``prunable`` take, and no later."""
    for done, failed, killed in itertools.product(CUTS, CUTS, CUTS):
        cutoffs = Cutoffs(done, failed, killed)
        bound = cutoffs.latest_for(state.value)
        takes = []
        for machine in MACHINES:
            for days in range(5):
                finished = T0 - timedelta(days=days)
                info = TaskInfo("t", {}, state, finished_at=finished)
                if prunable(info, machine, cutoffs):
                    takes.append(finished)
                    assert bound is not None and finished <= bound, (cutoffs, machine)
        assert (bound is None) == (not takes), (cutoffs, state)
        if takes:
            assert max(takes) == bound
