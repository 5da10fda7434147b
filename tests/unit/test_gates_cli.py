"""``metafora items`` and ``metafora gate`` in-process (click's CliRunner) on a SQLite file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from metafora import Task, TaskState, open_client, open_coordinator
from metafora.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, cli
from metafora.gates import ItemResult, ItemStatus, ItemStore, NewItem
from metafora.statemachine import State, StateCode, get_state, state_store_for
from metafora.testing import RecordingContext


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/cli.db"


@pytest.fixture
def items(url: str) -> Iterator[ItemStore]:
    store = ItemStore(url)
    try:
        yield store
    finally:
        store.close()


def run(url: str, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(cli, ["--url", url, *args], input=stdin, env=env, catch_exceptions=True)
    assert "Traceback" not in result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_add_then_list_as_a_table_and_as_json(url: str, tmp_path: Path) -> None:
    pdf = tmp_path / "resume.bin"
    pdf.write_bytes(b"%PDF\xff\x00")
    added = run(url, "items", "add", "job-1", "--gate", "0", "--data", "alice", "--data", f"@{pdf}")
    assert added.exit_code == EXIT_OK, added.output
    assert "added 2 item(s) to partition job-1 at gate 0" in added.output
    assert run(url, "items", "add", "job-1", "--gate", "1", "--data", "@-", stdin=b"rank").exit_code == 0

    table = run(url, "items", "job-1")
    assert table.exit_code == EXIT_OK
    assert "alice" in table.output and "<6 bytes>" in table.output and "rank" in table.output
    assert "partition job-1: gate 0 (open), 3 item(s): 3 available" in table.output

    listed = run(url, "items", "job-1", "--gate", "0", "--json")
    doc = json.loads(listed.output)
    assert doc["partition"]["gate"] == 0 and doc["partition"]["counts"] == {"0": {"available": 2},
                                                                            "1": {"available": 1}}
    assert [(i["gate"], i["data"], i["data_base64"]) for i in doc["items"]] == [
        (0, "alice", "YWxpY2U="), (0, None, "JVBERv8A")]
    only_rank = json.loads(run(url, "items", "list", "job-1", "--status", "available", "--gate", "1",
                               "--json").output)
    assert [i["data"] for i in only_rank["items"]] == ["rank"]
    empty = run(url, "items", "job-1", "--status", "failed")
    assert empty.exit_code == 0 and "no matching items" in empty.output
    assert "no items" in run(url, "items", "nothing-here").output


def test_a_partition_named_like_a_subcommand_is_listed_with_list(url: str, items: ItemStore) -> None:
    items.add("add", [NewItem(0, b"x")])
    assert "1 item(s)" in run(url, "items", "list", "add").output
    assert "Usage" in run(url, "items", "--help").output


def test_refusals_and_usage_errors_exit_with_named_codes(url: str, items: ItemStore) -> None:
    items.add("p", [NewItem(0, b"a"), NewItem(2, b"b")])
    moved = run(url, "gate", "p", "1")
    assert moved.exit_code == EXIT_REFUSED and "would never run" in moved.output
    forced = run(url, "gate", "p", "2", "--force")
    assert forced.exit_code == EXIT_OK and "gate 0 -> 2" in forced.output
    below = run(url, "items", "add", "p", "--gate", "1", "--data", "late")
    assert below.exit_code == EXIT_REFUSED and "current gate is 2" in below.output
    assert run(url, "items", "add", "p", "--data", "@/no/such/file").exit_code == EXIT_USAGE
    assert run(url, "items", "add", "p", "--gate", "-1", "--data", "x").exit_code == EXIT_USAGE
    assert run(url, "items", "p", "--status", "bogus").exit_code == EXIT_USAGE
    assert run(url, "items", "add", "p").exit_code == EXIT_USAGE  # --data is required
    etcd = run("etcd://127.0.0.1:2379/ns", "items", "p")
    assert etcd.exit_code == EXIT_USAGE and "items live in SQL" in etcd.output
    assert run("etcd://127.0.0.1:2379/ns", "items", "p", "--items-url", url).exit_code == EXIT_OK
    env = {"METAFORA_ITEMS_URL": url}
    assert "2 item(s)" in run("etcd://127.0.0.1:2379/ns", "items", "p", env=env).output


def test_add_can_submit_the_partition(url: str) -> None:
    out = run(url, "items", "add", "job-9", "--data", "x", "--submit")
    assert out.exit_code == 0 and "submitted task job-9" in out.output
    assert "already exists" in run(url, "items", "add", "job-9", "--data", "y", "--submit").output
    with open_client(url) as client:
        assert client.get_task("job-9").state is TaskState.PENDING


def test_items_retry_reopens_failed_items_and_revives_a_failed_partition(url: str, items: ItemStore) -> None:
    ids = items.add("p", [NewItem(0, b"bad"), NewItem(0, b"good")])
    coord = open_coordinator(url, node_id="n1")
    coord.init(RecordingContext())
    try:
        with open_client(url) as client:
            client.submit_task(Task("p"))
            claimed = coord.claim(Task("p"))
            assert claimed is not None
            lease = items.lease(claimed, "n1", claim_fence=True)
            lease.take_over()
            lease.finish(0, [ItemResult(ids[0], ItemStatus.FAILED, 0, 1, error="HTTP 422", permanent=True)])
            state_store_for(coord).store(claimed, State(StateCode.FAILED, cursor="0"))
            coord.fail(claimed, "PartitionFailed: item 1 failed")

            failed = run(url, "items", "p", "--status", "failed")
            assert "HTTP 422" in failed.output and "failed (permanent)" in failed.output

            out = run(url, "items", "retry", "p")
            assert out.exit_code == EXIT_OK, out.output
            assert "1 failed item(s) of partition p made available again; task is pending" in out.output
            assert client.get_task("p").state is TaskState.PENDING
            assert items.get("p", ids[0]).status is ItemStatus.AVAILABLE
            state = get_state(url, "p")
            assert state is not None and state.code is StateCode.FAILED  # the next claim revives it
            again = run(url, "items", "retry", "p")
            assert "0 failed item(s)" in again.output
            assert "no task with that id" in run(url, "items", "retry", "ghost").output
    finally:
        coord.close()
