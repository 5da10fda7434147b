"""Store URLs and their query options, parsed and validated once into typed values."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from metafora.core.errors import ConfigError
from metafora.core.masking import (
    MASK,
    is_secret_option,
    mask_hosts,
    mask_url,
    secret_option_cut,
    split_url,
)

__all__ = ["DEFAULT_NAMESPACE", "OptionReader", "StoreURL", "parse_store_url",
           "validate_namespace"]

DEFAULT_NAMESPACE = "metafora"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``str()`` and ``redacted()`` never show the password."""

    raw: str = field(repr=False)
    scheme: str
    username: str | None
    password: str | None = field(repr=False)
    hosts: tuple[tuple[str, int | None], ...]
    path: str
    query: Mapping[str, str] = field(repr=False)  # may hold a credential-like option

    def redacted(self) -> str:
        """The URL as typed, masked by :func:`~metafora.core.masking.mask_url`."""
        return mask_url(self.raw)

    def brief(self) -> str:
        """Scheme, hosts and path (database, file or namespace) only: what ``/info`` shows."""
        return mask_url(self.raw, brief=True)

    def __str__(self) -> str:
        return self.redacted()


def parse_store_url(url: str) -> StoreURL:
    """Parse ``scheme://[user[:pass]@]host[:port][,host[:port]...]/path?opts``.

    The URL is cut as :func:`~metafora.core.masking.split_url` cuts it (the credentials end at
    the last ``@``), so what is parsed and what is masked can never disagree; errors name
    the wrong part and show the URL masked.
    """
    if not isinstance(url, str):
        raise ConfigError(f"store URL must be a string, got {type(url).__name__}")
    parts = split_url(url)
    if parts.separator != "://":
        raise ConfigError(f"store URL must look like scheme://..., got {mask_url(url)!r}")
    if secret_option_cut(parts):
        raise ConfigError(
            f"store URL {mask_url(url)!r} has an '@' in an option value: write it as %40"
        )
    username = password = None
    if parts.userinfo is not None:
        user, colon, pw = parts.userinfo.partition(":")
        username = unquote(user)
        password = unquote(pw) if colon else None
    hosts = tuple(_parse_host(piece, url) for piece in parts.authority.split(",")) if parts.authority else ()
    query = _parse_query(parts.query or "", url)
    return StoreURL(url, parts.scheme.lower(), username, password, hosts, unquote(parts.path), query)


def _parse_query(text: str, url: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text))
    except ValueError:
        raise ConfigError(f"malformed query string in store URL {mask_url(url)!r}") from None
    query: dict[str, str] = {}
    for key, value in pairs:
        if key in query:
            raise ConfigError(f"option {key!r} is given twice in the store URL {mask_url(url)!r}")
        query[key] = value
    return query


def _parse_host(piece: str, url: str) -> tuple[str, int | None]:
    try:
        split = urlsplit("//" + piece)
        port = split.port
    except ValueError:
        raise ConfigError(
            f"bad host or port {mask_hosts(piece)!r} in store URL {mask_url(url)!r}"
            " (a port is a number 0-65535; write an '@' in a password as %40)"
        ) from None
    host = split.hostname or ""
    if not host:
        raise ConfigError(f"empty host in store URL {mask_url(url)!r}")
    return host, port


def validate_namespace(value: str) -> str:
    """A namespace is 1-64 of letters, digits, ``_ . -``, starting with a letter or digit."""
    if not _NAMESPACE_RE.match(value):
        raise ConfigError(
            f"namespace {value!r} is invalid: use 1-64 letters, digits, '_', '.' or '-'"
        )
    return value


class OptionReader:
    """Reads typed options from URL query values overridden by keyword arguments.

    Call :meth:`finish` at the end: an option nobody read is an error (a typo must not be
    silently ignored).
    """

    def __init__(self, url: StoreURL, overrides: Mapping[str, Any]) -> None:
        self._values: dict[str, Any] = dict(url.query)
        self._values.update(overrides)
        self._seen: set[str] = set()
        self._where = url.redacted()

    def _get(self, name: str) -> Any:
        self._seen.add(name)
        return self._values.get(name)

    def string(self, name: str, default: str | None = None) -> str | None:
        """A string option."""
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(f"option {name!r} must be a string, got {_shown(name, value)}")
        return value

    def number(
        self, name: str, default: float, *, minimum: float | None = None, maximum: float | None = None
    ) -> float:
        """A float option within [minimum, maximum]."""
        value = self._get(name)
        if value is None:
            return default
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"option {name!r} must be a number, got {_shown(name, value)}") from None
        if not math.isfinite(number):
            raise ConfigError(f"option {name!r} must be finite, got {_shown(name, value)}")
        if minimum is not None and number < minimum:
            raise ConfigError(f"option {name!r} must be >= {minimum:g}, got {number:g}")
        if maximum is not None and number > maximum:
            raise ConfigError(f"option {name!r} must be <= {maximum:g}, got {number:g}")
        return number

    def integer(
        self, name: str, default: int, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        """An integer option within [minimum, maximum]."""
        value = self._get(name)
        if value is None:
            return default
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"option {name!r} must be an integer, got {_shown(name, value)}") from None
        if minimum is not None and number < minimum:
            raise ConfigError(f"option {name!r} must be >= {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise ConfigError(f"option {name!r} must be <= {maximum}, got {number}")
        return number

    def boolean(self, name: str, default: bool) -> bool:
        """A boolean option (true/false/1/0/yes/no)."""
        value = self._get(name)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"option {name!r} must be true or false, got {_shown(name, value)}")

    def namespace(self, default: str = DEFAULT_NAMESPACE) -> str:
        """The ``namespace`` option, validated."""
        return validate_namespace(self.string("namespace", default) or default)

    def finish(self) -> None:
        """Raise ConfigError naming any option that no reader asked for."""
        unknown = sorted(set(self._values) - self._seen)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(map(repr, unknown))} for store {self._where}"
            )


def _shown(name: str, value: object) -> str:
    """How an option's value appears in an error: never, for a credential-like option."""
    return MASK if is_secret_option(name) else repr(value)
