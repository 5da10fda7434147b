"""The dashboard's streams page over real HTTP on a SQLite store: progress, lag and the
failing job of each stream, escaped, read-only, paged; a bad ``after`` is a clear 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metafora import Task
from metafora.streams import Job, JobContext, stream_handler
from metafora.testing import LocalCluster, wait_for
from tests.stream_kit import ListJobs
from tests.web.conftest import http_call


def test_the_streams_page_shows_progress_lag_and_failing(tmp_path: Path, serve: Any) -> None:
    url = f"sqlite:///{tmp_path}/metafora.db"

    def work(job: Job, ctx: JobContext) -> None:
        if ctx.task.id == "bad<b>" and job.index == 2:
            raise ValueError("<script>alert(1)</script>")

    with LocalCluster(url) as cluster:
        cluster.add(stream_handler(lambda t: ListJobs(list(range(6))), work, retry_delay=0.0,
                                   max_attempts=2, flush_every=0.01), "node-1")
        cluster.client.submit_task(Task("good", {"secret": "props-are-not-read"}))
        cluster.client.submit_task(Task("bad<b>"))
        wait_for(lambda: cluster.client.stream("good").processed == 5, 15.0, "good done")
        wait_for(lambda: cluster.client.stream("bad<b>").failing, 15.0, "bad failing")
        served = serve(url)
        port = served.server.port
        status, text, _ = http_call(port, "GET", "/streams")
        assert status == 200
        assert 'data-stream="good"' in text and "node-1" in text
        assert "bad&lt;b&gt;" in text and "<b>" not in text.split("<h1>Streams</h1>")[1]
        assert "&lt;script&gt;" in text and "<script>alert" not in text
        assert "props-are-not-read" not in text
        assert 'class="num lag">4<' in text  # bad<b>: processed 1, head 5
        status, text, _ = http_call(port, "GET", "/streams?partial=1")
        assert status == 200 and "<h1>" not in text and 'data-stream="good"' in text
        status, text, _ = http_call(port, "GET", "/streams?after=%01x")
        assert status == 400 and "control character" in text
