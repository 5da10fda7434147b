"""Store URLs and their query options, parsed and validated once into typed values."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from metafora.errors import ConfigError

__all__ = ["DEFAULT_NAMESPACE", "OptionReader", "StoreURL", "parse_store_url", "validate_namespace"]

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
    query: Mapping[str, str]

    def redacted(self) -> str:
        """The URL with its password replaced by ``***``."""
        auth = ""
        if self.username is not None:
            auth = quote(self.username, safe="")
            if self.password is not None:
                auth += ":***"
            auth += "@"
        hosts = ",".join(h if p is None else f"{_host(h)}:{p}" for h, p in self.hosts)
        query = "&".join(f"{k}={v}" for k, v in self.query.items())
        return f"{self.scheme}://{auth}{hosts}{self.path}" + (f"?{query}" if query else "")

    def __str__(self) -> str:
        return self.redacted()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_store_url(url: str) -> StoreURL:
    """Parse ``scheme://[user[:pass]@]host[:port][,host[:port]...]/path?opts``."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"store URL must look like scheme://..., got {_safe(url)!r}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    netloc, sep, tail = rest.partition("/")
    path = sep + tail
    query_text = ""
    if "?" in netloc:  # e.g. memory://name?x=1 has no path
        netloc, query_text = netloc.split("?", 1)
        path = ""
    elif "?" in path:
        path, query_text = path.split("?", 1)
    username = password = None
    if "@" in netloc:
        auth, netloc = netloc.rsplit("@", 1)
        user, colon, pw = auth.partition(":")
        username = unquote(user)
        password = unquote(pw) if colon else None
    hosts: list[tuple[str, int | None]] = []
    if netloc:
        for part in netloc.split(","):
            hosts.append(_parse_host(part, url))
    try:
        pairs = parse_qsl(query_text, keep_blank_values=True, strict_parsing=bool(query_text))
    except ValueError:
        raise ConfigError(f"malformed query string in store URL {_safe(url)!r}") from None
    query: dict[str, str] = {}
    for key, value in pairs:
        if key in query:
            raise ConfigError(f"option {key!r} is given twice in the store URL")
        query[key] = value
    return StoreURL(url, scheme, username, password, tuple(hosts), unquote(path), query)


def _parse_host(part: str, url: str) -> tuple[str, int | None]:
    try:
        split = urlsplit("//" + part)
        port = split.port
    except ValueError:
        raise ConfigError(f"bad host or port {part!r} in store URL {_safe(url)!r}") from None
    host = split.hostname or ""
    if not host:
        raise ConfigError(f"empty host in store URL {_safe(url)!r}")
    return host, port


def _safe(url: object) -> str:
    """Best-effort redaction for error messages about URLs that did not parse."""
    text = str(url)
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", text)


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
            raise ConfigError(f"option {name!r} must be a string, got {value!r}")
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
            raise ConfigError(f"option {name!r} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"option {name!r} must be finite, got {value!r}")
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
            raise ConfigError(f"option {name!r} must be an integer, got {value!r}") from None
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
        raise ConfigError(f"option {name!r} must be true or false, got {value!r}")

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
