"""A real network partition between a node and PostgreSQL (a TCP proxy that stops forwarding).

Unlike a server kill (connections refused at once), packets vanish: the node's statements and
renewals hang without an error. What this covers: the owner fences itself by its own clock
before its lease can lapse in the store, although its renewal is stuck in a socket; another
node (with a working link) claims the task only after that; when the link heals, the partitioned
node's late outcome is refused or ignored (the task stays with the new owner) and the node
closes. What it does not cover: a partition between PostgreSQL and the other node, or an
asymmetric one (one direction only).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.core.errors import ClaimLost, MetaforaError
from metafora.testing import RecordingContext, wait_for
from tests.fixtures.partition import PartitionProxy

pytestmark = pytest.mark.integration


@pytest.fixture
def proxied(postgres_url: str) -> Iterator[tuple[PartitionProxy, str, str]]:
    """(the proxy, the store URL through it, the direct store URL), one namespace."""
    proxy, through = PartitionProxy.for_url(postgres_url)
    with proxy:
        yield proxy, through, postgres_url


@pytest.mark.timing
def test_a_partitioned_owner_fences_itself_before_another_node_claims(
        proxied: tuple[PartitionProxy, str, str]) -> None:
    proxy, through, direct = proxied
    ttl = 3
    ctx = RecordingContext()
    a = open_coordinator(f"{through}&connect_timeout=2", node_id="a", lease_ttl=ttl)
    b = open_coordinator(direct, node_id="b", lease_ttl=ttl)
    client = open_client(direct)
    try:
        a.init(ctx)
        b.init(RecordingContext())
        client.submit_task(Task("t"))
        held = a.claim(Task("t"))
        assert held is not None and b.claim(Task("t")) is None

        proxy.cut()
        cut_at = time.monotonic()
        assert ctx.lost_event.wait(4 * ttl), "the partitioned owner never fenced itself"
        fenced_at = time.monotonic()
        assert [t.id for t in ctx.lost_tasks] == ["t"]
        # By its own clock, before its lease could lapse in the store (the renewal hangs).
        assert fenced_at - cut_at < ttl, f"fenced {fenced_at - cut_at:.2f}s after the cut"

        stolen = wait_for(lambda: b.claim(Task("t")), 10 * ttl, "b to claim the partitioned task")
        stolen_at = time.monotonic()
        assert stolen.token > held.token
        assert fenced_at < stolen_at, "another node claimed before the owner fenced itself"

        proxy.heal()
        with contextlib.suppress(ClaimLost):  # refused, or a no-op: never applied
            a.done(held)
        info = client.get_task("t")
        assert (info.state, info.owner) == (TaskState.CLAIMED, "b")
    finally:
        proxy.heal()
        for closing in (a, b, client):
            with contextlib.suppress(MetaforaError):
                closing.close()
