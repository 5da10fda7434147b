"""metafora.core.config: store URLs and the typed reading of their options.

How URLs parse and redact in general, and a bad option met by open_client: test_values.py;
masking itself: test_masking.py.
"""

from __future__ import annotations

import pytest

from metafora.core.config import DEFAULT_NAMESPACE, OptionReader, parse_store_url, validate_namespace
from metafora.core.errors import ConfigError


def reader(url: str = "memory://m", **overrides: object) -> OptionReader:
    return OptionReader(parse_store_url(url), overrides)


def test_the_scheme_is_lowercased_and_the_path_unquoted() -> None:
    url = parse_store_url("SQLite:///tmp/a%20b.db")
    assert url.scheme == "sqlite" and url.path == "/tmp/a b.db" and url.hosts == ()


def test_brief_keeps_scheme_hosts_and_path_only() -> None:
    url = parse_store_url("postgresql://bob:pw@db:5432/app?namespace=blue&sslpassword=x")
    assert url.brief() == "postgresql://db:5432/app"
    assert "pw" not in url.redacted() and "sslpassword=***" in url.redacted()


@pytest.mark.parametrize(("bad", "message"), [
    (42, "store URL must be a string, got int"),
    ("memory:/x", "must look like scheme://"),
    ("postgresql://u@h/db?password=a@b", "has an '@' in an option value: write it as %40"),
    ("etcd://:2379/ns", "empty host"),
])
def test_bad_urls_name_the_wrong_part(bad: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_store_url(bad)  # type: ignore[arg-type]


def test_options_are_read_typed_with_their_defaults() -> None:
    opts = reader("memory://m?lease_ttl=2.5&batch=7&fast=yes&name=x")
    assert opts.number("lease_ttl", 10.0) == 2.5
    assert opts.integer("batch", 1) == 7
    assert opts.boolean("fast", False) is True
    assert opts.string("name") == "x"
    assert (opts.number("absent", 1.5), opts.integer("none", 3), opts.boolean("no", True)) == (1.5, 3, True)
    assert opts.string("nothing", "d") == "d"
    opts.finish()


@pytest.mark.parametrize(("text", "value"), [("1", True), ("TRUE", True), ("on", True),
                                             ("0", False), ("No", False), ("off", False)])
def test_boolean_words(text: str, value: bool) -> None:
    assert reader(f"memory://m?b={text}").boolean("b", not value) is value


def test_keyword_overrides_win_over_the_url_and_may_be_typed_values() -> None:
    opts = reader("memory://m?lease_ttl=2&fast=no", lease_ttl=4, fast=True)
    assert opts.number("lease_ttl", 1.0) == 4.0 and opts.boolean("fast", False) is True


@pytest.mark.parametrize(("call", "message"), [
    (lambda o: o.number("n", 1.0, minimum=0.5), "option 'n' must be >= 0.5, got 0.1"),
    (lambda o: o.number("big", 1.0, maximum=10), "option 'big' must be <= 10, got 99"),
    (lambda o: o.number("word", 1.0), "option 'word' must be a number, got 'soon'"),
    (lambda o: o.number("inf", 1.0), "option 'inf' must be finite"),
    (lambda o: o.integer("half", 1), "option 'half' must be an integer, got '1.5'"),
    (lambda o: o.integer("batch", 1, minimum=1), "option 'batch' must be >= 1, got 0"),
    (lambda o: o.integer("batch", 1, maximum=-1), "option 'batch' must be <= -1, got 0"),
    (lambda o: o.boolean("word", True), "option 'word' must be true or false, got 'soon'"),
])
def test_out_of_range_or_ill_typed_options_are_refused(call: object, message: str) -> None:
    opts = reader("memory://m?n=0.1&big=99&word=soon&inf=inf&half=1.5&batch=0")
    with pytest.raises(ConfigError, match=message):
        call(opts)  # type: ignore[operator]


def test_string_options_must_be_strings() -> None:
    with pytest.raises(ConfigError, match="option 'name' must be a string, got 3"):
        reader(name=3).string("name")


def test_a_credential_like_options_value_never_appears_in_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        reader("memory://m?api_token=s3cret").number("api_token", 1.0)
    assert "s3cret" not in str(err.value) and "***" in str(err.value)


def test_an_option_nobody_read_is_an_error_naming_it_and_the_store() -> None:
    opts = reader("memory://m?lease_tll=3&namespace=blue", extra=1)
    assert opts.namespace() == "blue"
    with pytest.raises(ConfigError, match=r"unknown option\(s\) 'extra', 'lease_tll' for store memory://m"):
        opts.finish()


def test_namespaces() -> None:
    assert reader().namespace() == DEFAULT_NAMESPACE
    assert validate_namespace("a" * 64) == "a" * 64
    for bad in ("", "-a", "a" * 65, "a b", "a/b"):
        with pytest.raises(ConfigError, match="is invalid"):
            validate_namespace(bad)
