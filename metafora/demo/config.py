"""What ``metafora demo`` runs: its options, its store URL and the demo's errors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode
from uuid import uuid4

from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError, MetaforaError
from metafora.core.task import TaskState

FINISHED = (TaskState.DONE, TaskState.FAILED, TaskState.EXPIRED)
POLL_SECONDS = 0.25  # seconds between looks at the store (the live table refreshes at this pace)


class DemoError(MetaforaError):
    """The demo could not run or did not finish (the message says why)."""


@dataclass(frozen=True)
class DemoConfig:
    """What ``metafora demo`` runs: its options, validated."""

    nodes: int = 3
    tasks: int = 30
    url: str | None = None
    lease_ttl: float = 2.5
    min_seconds: float = 1.0
    max_seconds: float = 2.0
    time_limit: float = 55.0
    keep: bool = False
    live: bool | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= 32:
            raise ConfigError(f"the demo needs 2 to 32 nodes (one is killed), got {self.nodes}")
        if not 1 <= self.tasks <= 2000:
            raise ConfigError(f"the demo runs 1 to 2000 tasks, got {self.tasks}")
        if not 1.0 <= self.lease_ttl <= 30.0:
            raise ConfigError(f"the demo's lease_ttl must be 1 to 30 seconds, got {self.lease_ttl}")
        if not 0 < self.min_seconds <= self.max_seconds:
            raise ConfigError("task durations must satisfy 0 < min_seconds <= max_seconds")

    @property
    def max_tasks(self) -> int:
        """Tasks one node runs at once: low enough that all nodes share the work in waves."""
        return max(1, math.ceil(self.tasks / (self.nodes * 2.5)))


def demo_url(url: str | None, workdir: Path, lease_ttl: float) -> str:
    """The store URL the demo uses: a fresh SQLite file in ``workdir`` unless ``url`` is given.

    A given URL gets the demo's ``lease_ttl`` (whole seconds on etcd, whose leases count in
    seconds) and a namespace of its own (``demo-<hex>``) unless it sets them, so the demo
    never mixes with a real cluster's tasks.
    """
    if url is None:
        return f"sqlite:///{workdir / 'demo.db'}?" + urlencode({"lease_ttl": lease_ttl})
    parsed = parse_store_url(url)
    if parsed.scheme == "memory":
        raise ConfigError(
            "the demo runs its nodes as separate processes; a memory:// store lives in one process "
            "(use sqlite:///PATH.db, or leave --url out for a temporary one)"
        )
    extra: dict[str, str] = {}
    if "lease_ttl" not in parsed.query:
        whole = parsed.scheme in ("etcd", "etcds")
        extra["lease_ttl"] = f"{math.ceil(lease_ttl) if whole else lease_ttl:g}"
    if "namespace" not in parsed.query:
        extra["namespace"] = f"demo-{uuid4().hex[:8]}"
    if not extra:
        return url
    return url + ("&" if "?" in url else "?") + urlencode(extra)


def lease_ttl_of(url: str, default: float) -> float:
    """The lease TTL the demo's store will use (the URL's, when it sets one)."""
    try:
        return float(parse_store_url(url).query.get("lease_ttl", default))
    except ValueError:
        return default  # the store itself will refuse the URL, with a clearer message


