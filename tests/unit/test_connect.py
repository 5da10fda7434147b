"""metafora.surfaces.connect: choosing a store by URL scheme, the default URL and node ids.

An unknown scheme or option met by open_client: test_values.py; a missing driver's install
hint: test_release.py.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from metafora.contracts import backends
from metafora.coordinators.memory import drop_store
from metafora.core.errors import ConfigError
from metafora.core.task import Task
from metafora.surfaces.connect import (
    DEFAULT_URL,
    ENV_URL,
    default_url,
    new_node_id,
    open_client,
    open_coordinator,
    validate_node_id,
)


def test_the_default_url_is_the_environments_else_embedded_sqlite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_URL, raising=False)
    assert default_url() == DEFAULT_URL == "sqlite:///metafora.db"
    monkeypatch.setenv(ENV_URL, "")
    assert default_url() == DEFAULT_URL  # set but empty counts as unset
    monkeypatch.setenv(ENV_URL, "memory://from-env")
    assert default_url() == "memory://from-env"


def test_a_client_and_a_coordinator_without_a_url_open_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_URL, "memory://connect-default")
    try:
        with open_client() as client:
            client.submit_task(Task("t1"))
        with open_client("memory://connect-default") as again:
            assert [t.id for t in again.tasks()] == ["t1"]
        coord = open_coordinator(node_id="n1")
        assert coord.node_id == "n1"
        coord.close()
    finally:
        drop_store("connect-default/metafora")


def test_schemes_pick_their_store(tmp_path: Path) -> None:
    url = f"SQLITE:///{tmp_path / 'm.db'}"  # the scheme's case does not matter
    with open_client(url) as client:
        client.submit_task(Task("t"))
        assert [t.id for t in client.tasks()] == ["t"]
    assert (tmp_path / "m.db").exists()


def test_an_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        open_coordinator("mongodb://db/x", node_id="n1")
    assert "unknown store scheme 'mongodb'" in str(err.value)
    assert "etcd, etcds, memory, postgres, postgresql, postgresql+psycopg, sqlite" in str(err.value)


def test_a_new_node_id_is_the_short_host_name_and_eight_hex_digits() -> None:
    host = socket.gethostname().split(".")[0] or "node"
    node = new_node_id()
    assert re.fullmatch(re.escape(host) + r"-[0-9a-f]{8}", node)
    assert validate_node_id(node) == node


@pytest.mark.parametrize(("bad", "message"), [
    ("", "node id must not be empty"),
    (" n1", "node id ' n1' must not start or end with whitespace"),
    ("x" * 257, "node id is 257 characters long"),
    (7, "node id must be a string, not int"),
])
def test_node_ids_follow_the_task_id_rules_and_say_node_id(bad: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_node_id(bad)


def test_keyword_options_reach_the_store_over_the_urls() -> None:
    try:
        with pytest.raises(ConfigError, match="lease_ttl"):
            open_coordinator("memory://connect-opts?lease_ttl=5", node_id="n1", lease_ttl=-1)
        coord = open_coordinator("memory://connect-opts?lease_ttl=bad", node_id="n1", lease_ttl=5)
        coord.close()
    finally:
        drop_store("connect-opts/metafora")


def test_each_stores_backend_object_names_its_own_implementations() -> None:
    """Every feature a store's backend object names resolves, inside its own store package, to
    a class of the feature's interface (the names are text: this is their check)."""
    from metafora.gates import ItemStore
    from metafora.statemachine import StateStore, TaskCommands

    interfaces = {"state_store": StateStore, "task_commands": TaskCommands, "item_store": ItemStore}
    assert sorted(backends.stores()) == ["etcd", "memory", "sql"]
    for store, backend in backends.stores().items():
        for feature, interface in interfaces.items():
            kind = backends.implementation(store, feature)
            if kind is None:
                continue
            assert issubclass(kind, interface), (store, feature)
            package = type(backend).__module__.rpartition(".")[0]
            assert kind.__module__.startswith(package + "."), (store, feature)
    assert backends.implementation("sql", "item_store") is not None
    assert backends.implementation("etcd", "item_store") is None


def test_a_coordinator_says_which_store_it_belongs_to() -> None:

    coord = open_coordinator("memory://connect-backend", node_id="n1")
    client = open_client("memory://connect-backend")
    try:
        assert backends.store_of(coord) == backends.store_of(client) == "memory"
        assert backends.store_of_url("sqlite:///x.db")[1] == "sql"
        with pytest.raises(ConfigError, match="belongs to no registered store"):
            backends.store_of(object())
    finally:
        coord.close()
        client.close()
        drop_store("connect-backend/metafora")
