"""Stores by entry point: a URL scheme names its store through the group ``metafora.stores``,
for metafora's own stores and an outside package's alike.

The outside store here is a real distribution on ``sys.path`` (a package and its
``.dist-info`` with ``entry_points.txt``), read by ``importlib.metadata`` in a fresh
interpreter: the registry's real machinery, nothing patched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import metafora
from metafora.contracts import backends

ROOT = Path(metafora.__file__).resolve().parent.parent

OUTSIDE = textwrap.dedent('''
    """A store outside metafora: its client and coordinator are the memory store's, under a
    scheme of its own."""
    from metafora.contracts.backends import StoreBackend
    from metafora.core.config import parse_store_url
    from metafora.core.leases import LeaseTTL


    class ToyBackend(StoreBackend):
        name = "toy"
        lease_ttl = LeaseTTL(minimum=1.0)

        def check_driver(self, url):
            if url.scheme == "toyx":
                raise ModuleNotFoundError("No module named 'toydriver'")

        def _memory(self, url):
            return parse_store_url(f"memory://toy-{url.hosts[0][0]}")

        def open_coordinator(self, url, node_id, options):
            return backend_of_memory().open_coordinator(self._memory(url), node_id, options)

        def open_client(self, url, options):
            return backend_of_memory().open_client(self._memory(url), options)


    def backend_of_memory():
        from metafora.contracts.backends import backend_of_store
        return backend_of_store("memory")


    BACKEND = ToyBackend()
    NOT_A_BACKEND = object()
''')

ENTRY_POINTS = textwrap.dedent('''
    [metafora.stores]
    toy = outside_store:BACKEND
    toyx = outside_store:BACKEND [fast]
    toybroken = outside_store.missing:BACKEND [broken]
    toywrong = outside_store:NOT_A_BACKEND
''')

PROBE = textwrap.dedent('''
    import json
    from metafora import Task, open_client, open_coordinator
    from metafora.contracts.backends import schemes, store_of, stores
    from metafora.core.errors import ConfigError

    out = {"schemes": schemes(), "stores": sorted(stores())}
    with open_client("toy://one") as client:
        client.submit_task(Task("t1"))
        out["store_of"] = store_of(client)
    with open_client("memory://toy-one") as same:
        out["tasks"] = [t.id for t in same.tasks()]
    coord = open_coordinator("toy://one", node_id="n1")
    out["node"] = coord.node_id
    coord.close()
    for url in ("toyx://one", "toybroken://one", "toywrong://one"):
        try:
            open_client(url)
        except ConfigError as exc:
            out[url] = str(exc)
    print(json.dumps(out))
''')


def _outside_distribution(root: Path) -> None:
    package = root / "outside_store"
    package.mkdir()
    (package / "__init__.py").write_text(OUTSIDE)
    info = root / "outside_store-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-store\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)


def test_an_outside_store_registers_through_the_entry_point(tmp_path: Path) -> None:
    _outside_distribution(tmp_path)
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", PROBE], env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert {"toy", "toyx", "sqlite", "memory"} <= set(out["schemes"])
    assert out["stores"] == ["etcd", "memory", "sql", "toy"]
    assert out["store_of"] == "memory"  # the toy store hands out the memory store's client
    assert out["tasks"] == ["t1"] and out["node"] == "n1"
    # a missing driver, a module that does not import: the extra to install, by distribution
    assert "the toyx store is not available: No module named 'toydriver'" in out["toyx://one"]
    assert "pip install 'outside-store[fast]'" in out["toyx://one"]
    assert "pip install 'outside-store[broken]'" in out["toybroken://one"]
    assert "is not a metafora.contracts.backends.StoreBackend" in out["toywrong://one"]


def test_the_package_registers_its_own_stores_by_entry_point() -> None:
    registered = {ep.name: ep for ep in metadata.entry_points(group=backends.GROUP)}
    own = {"memory", "sqlite", "postgresql", "postgres", "postgresql+psycopg", "etcd", "etcds"}
    assert own <= set(registered)
    assert {name: registered[name].extras for name in own} == {
        "memory": [], "sqlite": [], "postgresql": ["postgres"], "postgres": ["postgres"],
        "postgresql+psycopg": ["postgres"], "etcd": ["etcd"], "etcds": ["etcd"]}
    assert {registered[name].load().name for name in own} == {"memory", "sql", "etcd"}

