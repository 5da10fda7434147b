"""``metafora streams`` and ``metafora stream show|check|retry ID`` in subprocesses, on a
SQLite file a stream consumer runs on (in this process): the table, JSON like the other
verbs, a check that wakes the stream, a retry that resumes a failing one, clear errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from metafora import Task
from metafora.streams import Job, JobContext, stream_handler
from metafora.testing import LocalCluster, wait_for
from tests.acceptance.test_cli_subprocess import metafora
from tests.stream_kit import ListJobs, wait_failing


def test_stream_verbs_from_the_command_line(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    items = list(range(8))
    broken = threading.Event()
    broken.set()

    def work(job: Job, ctx: JobContext) -> None:
        if ctx.task.id == "bad" and job.index == 3 and broken.is_set():
            raise ValueError("job 3 is [bold]broken[/bold]")

    with LocalCluster(db) as cluster:
        cluster.add(stream_handler(lambda t: ListJobs(items), work, retry_delay=0.0,
                                   max_attempts=2, flush_every=0.01, poll_every=3600.0), "n1")
        cluster.client.submit_task(Task("good"))
        cluster.client.submit_task(Task("bad"))
        wait_for(lambda: cluster.client.stream("good").processed == 7, 30.0, "good caught up")
        wait_failing(cluster.client, "bad")

        table = metafora("--url", db, "streams", cwd=tmp_path)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert any("good" in line and "n1" in line and " 7 " in line for line in lines), table.stdout
        assert any("bad" in line and "#3" in line and "[bold]broken[/bold]" in line
                   for line in lines), table.stdout

        listed = metafora("--url", db, "streams", "--json", cwd=tmp_path)
        rows = {row["id"]: row for row in json.loads(listed.stdout)}
        assert rows["good"]["processed"] == 7 and rows["good"]["lag"] == 0
        assert rows["bad"]["failing"]["index"] == 3 and rows["bad"]["state"] == "paused"

        shown = metafora("--url", db, "stream", "show", "bad", "--json", cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        got = json.loads(shown.stdout)
        assert (got["processed"], got["head"], got["lag"]) == (2, 7, 5)
        assert "ValueError: job 3 is [bold]broken[/bold]" in got["failing"]["error"]
        text = metafora("--url", db, "stream", "show", "good", cwd=tmp_path)
        assert "processed" in text.stdout and "lag" in text.stdout

        items.extend([8, 9])
        checked = metafora("--url", db, "stream", "check", "good", cwd=tmp_path)
        assert checked.returncode == 0 and "checked good" in checked.stdout
        wait_for(lambda: cluster.client.stream("good").processed == 9, 30.0, "the check woke it")
        paused = metafora("--url", db, "stream", "check", "bad", cwd=tmp_path)
        assert paused.returncode == 0 and "nothing sent" in paused.stdout

        refused = metafora("--url", db, "stream", "retry", "good", cwd=tmp_path)
        assert refused.returncode == 1 and "not failing" in refused.stderr
        broken.clear()
        retried = metafora("--url", db, "stream", "retry", "bad", cwd=tmp_path)
        assert retried.returncode == 0, retried.stderr
        wait_for(lambda: cluster.client.stream("bad").processed == 9, 30.0, "bad resumed")

        missing = metafora("--url", db, "stream", "show", "nope", cwd=tmp_path)
        assert missing.returncode == 1 and missing.stderr.startswith("Error: ")
        bad_id = metafora("--url", db, "stream", "check", "a\tb", cwd=tmp_path)
        assert bad_id.returncode == 2 and "Error: " in bad_id.stderr
