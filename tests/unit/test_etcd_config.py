"""``etcd://`` URLs and options validated into :class:`EtcdConfig`: pure logic."""

from __future__ import annotations

from typing import Any

import pytest

from metafora.coordinators.etcd.config import DEFAULT_PORT, EtcdConfig
from metafora.core.config import parse_store_url
from metafora.core.errors import ConfigError


def config(url: str, **options: Any) -> EtcdConfig:
    return EtcdConfig.from_url(parse_store_url(url), options)


def test_defaults() -> None:
    cfg = config("etcd://h1")
    assert cfg.namespace == "metafora"
    assert (cfg.lease_ttl, cfg.poll_interval, cfg.timeout) == (30, 30.0, 5.0)
    assert cfg.connection.hosts == (("h1", DEFAULT_PORT),)
    assert not cfg.connection.secure


def test_hosts_namespace_and_options() -> None:
    cfg = config("etcd://h1:1,h2:2/jobs?lease_ttl=4", poll_interval=2, namespace="ignored")
    assert cfg.connection.hosts == (("h1", 1), ("h2", 2))
    assert cfg.namespace == "jobs"  # the path wins
    assert (cfg.lease_ttl, cfg.poll_interval) == (4, 2.0)
    assert cfg.connection.display == "http://h1:1,http://h2:2"


def test_the_password_stays_out_of_the_name() -> None:
    cfg = config("etcd://user:s3cret@h1/ns")
    assert "s3cret" not in cfg.name and "s3cret" not in repr(cfg.connection)
    assert (cfg.connection.user, cfg.connection.password) == ("user", "s3cret")


@pytest.mark.parametrize(("url", "options", "names"), [
    ("etcd://h1", {"lease_ttl": 1}, "lease_ttl"),
    ("etcd://h1", {"lease_ttl": 2.5}, "whole number"),
    ("etcd://h1/a/b", {}, "one namespace"),
    ("etcd://h1", {"ca_cert": "x.pem"}, "etcds://"),
    ("etcds://h1", {"cert_key": "k.pem"}, "together"),
    ("etcd://h1", {"bogus": 1}, "bogus"),
    ("etcd://h1", {"timeout": 0}, "timeout"),
])
def test_bad_values_are_named(url: str, options: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        config(url, **options)


def test_not_an_etcd_url() -> None:
    with pytest.raises(ConfigError):
        EtcdConfig.from_url(parse_store_url("sqlite:///x.db"), {})
