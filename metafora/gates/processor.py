"""Processors: what turns an item into a :class:`~metafora.gates.Response`.

A :class:`Processor` has one method, ``process(item) -> Response``. Raising
:class:`~metafora.gates.PermanentError` fails the item at once; any other
exception is retryable (the handler tries up to ``max_attempts`` times, with back-off).
Its optional ``concurrency`` attribute is how many items of one partition it may process
at the same time (the handler's default).

- :func:`callable_processor` wraps a Python function ``fn(item) -> Response``.
- :class:`HTTPProcessor` POSTs the item as JSON to a URL and reads the answer as JSON.

A :class:`BatchProcessor` gets the items of a batch together instead:
``process_batch(items) -> list[Response]``, one answer per item in order (a bulk API, one
database round trip for many rows). :class:`HTTPBatchProcessor` is the HTTP processor's batch
mode: one POST per batch.
"""

from __future__ import annotations

import abc
import http.client
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from metafora.core.errors import ConfigError
from metafora.gates.model import Item, PermanentError, ProcessingError, Response

__all__ = [
    "BatchProcessor",
    "CallableProcessor",
    "HTTPBatchProcessor",
    "HTTPProcessor",
    "Processor",
    "callable_processor",
]

log = logging.getLogger(__name__)

_MAX_ANSWER = 64 * 1024 * 1024  # bytes: a bigger answer is refused (PermanentError)
_RETRYABLE_STATUS = frozenset({408, 425, 429})  # 4xx that mean "try again later"


@runtime_checkable
class Processor(Protocol):
    """Processes one item of a gated partition.

    Returns a :class:`Response`; raises :class:`PermanentError` for a failure retrying
    cannot fix, anything else for a retryable one. Called from the handler's worker threads
    (up to ``concurrency`` at once per partition), so it must be thread-safe.
    """

    def process(self, item: Item) -> Response:
        """Process ``item`` and say where it goes next."""
        ...


class BatchProcessor(abc.ABC):
    """Processes the items of a gated partition a batch at a time.

    :meth:`process_batch` gets the items taken together (in id order, up to
    :attr:`max_batch` of them per call; None: the whole batch the handler took, its
    ``batch_size``) and returns one :class:`Response` per item, in the same order. Raising
    :class:`PermanentError` fails every item of the call at once; any other exception is
    retryable: the whole call is tried again, up to ``max_attempts`` times with back-off.
    An answer that is not a list of as many Responses fails the call's items permanently.
    Up to :attr:`concurrency` calls of one partition run at once (from the handler's threads:
    it must be thread-safe). A BatchProcessor is also a :class:`Processor` (``process(item)``
    is a batch of one), so it fits wherever one does.
    """

    concurrency: int = 1
    """Calls of one partition in flight at once (the handler's default ``concurrency``)."""
    max_batch: int | None = None
    """The most items per call (None: every item the handler took at once)."""

    @abc.abstractmethod
    def process_batch(self, items: Sequence[Item]) -> list[Response]:
        """Process ``items`` and say, for each in order, where it goes next."""

    def process(self, item: Item) -> Response:
        """One item as a batch of one."""
        answers = self.process_batch([item])
        if not isinstance(answers, list) or len(answers) != 1:
            raise PermanentError(f"process_batch answered {answers!r} for one item")
        return answers[0]


def _concurrency(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
        raise ConfigError(f"concurrency must be an integer from 1 to 1024, got {value!r}")
    return value


class CallableProcessor:
    """A :class:`Processor` around ``fn(item) -> Response`` (see :func:`callable_processor`)."""

    def __init__(self, fn: Callable[[Item], Response], concurrency: int = 1) -> None:
        if not callable(fn):
            raise ConfigError("callable_processor needs a function: fn(item) -> Response")
        self.fn = fn
        self.concurrency = _concurrency(concurrency)

    def process(self, item: Item) -> Response:
        """Call the function; a result that is not a Response is a PermanentError."""
        result = self.fn(item)
        if not isinstance(result, Response):
            raise PermanentError(
                f"the processor returned {type(result).__name__}, not a gates.Response"
            )
        return result

    def __repr__(self) -> str:
        return f"callable_processor({getattr(self.fn, '__qualname__', self.fn)!r})"


def callable_processor(fn: Callable[[Item], Response], *, concurrency: int = 1) -> CallableProcessor:
    """A :class:`Processor` calling ``fn(item) -> Response`` in the handler's threads.

    ``concurrency`` (default 1) is how many items of one partition may be in ``fn`` at once.
    """
    return CallableProcessor(fn, concurrency)


class HTTPProcessor:
    """POSTs each item as JSON to ``url``; the JSON answer is the :class:`Response`.

    The request body is ``{"partition", "id", "gate", "attempts", "data", "data_base64"}``
    (``data`` is the item's bytes as UTF-8 text, or null when they are not UTF-8). The answer
    is ``{"gate": int, "done": bool, "data": ..., "spawn": [{"gate", "data"}, ...]}``: ``done``
    is required, ``gate`` defaults to the item's gate, ``data`` may be text, any JSON value
    (stored as compact JSON) or ``data_base64``; null keeps the item's data.

    Failures: a 4xx status is **non-retryable** (the item fails at once), except 408, 425
    and 429; a 5xx status, a timeout (``timeout`` seconds) or a connection error is
    **retryable**; a malformed answer is non-retryable. ``headers`` are sent with every
    request (e.g. ``Authorization``); ``concurrency`` bounds the requests in flight per
    partition (default 8).
    """

    def __init__(self, url: str, timeout: float = 30.0, headers: Mapping[str, str] | None = None,
                 *, concurrency: int = 8) -> None:
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise ConfigError(f"HTTPProcessor needs an http:// or https:// URL, got {url!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
            raise ConfigError(f"timeout must be in (0, 3600] seconds, got {timeout!r}")
        sent = dict(headers or {})
        for key, value in sent.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"headers must map strings to strings, got {key!r}: {value!r}")
        self.url = url
        self.timeout = float(timeout)
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **sent}
        self.concurrency = _concurrency(concurrency)

    def __repr__(self) -> str:
        return f"HTTPProcessor({self.url!r}, timeout={self.timeout:g})"

    def process(self, item: Item) -> Response:
        """POST the item; translate the outcome (see the class docstring)."""
        obj = _post(self.url, item.to_wire(), self.headers, self.timeout, f"POST {self.url} (item {item.id})")
        try:
            return Response.from_wire(obj, item.gate)
        except PermanentError as exc:
            raise PermanentError(f"POST {self.url} (item {item.id}): {exc}") from None


_MAX_BATCH = 10_000  # items per request of HTTPBatchProcessor at most


class HTTPBatchProcessor(BatchProcessor):
    """The batch mode of :class:`HTTPProcessor`: POSTs up to ``batch`` items in one request.

    The body is ``{"items": [item, ...]}`` (each item as :class:`HTTPProcessor` sends it);
    the answer is ``{"responses": [answer, ...]}`` (or the list alone), one answer per item in
    order, each as :class:`HTTPProcessor` reads it. Statuses, timeouts and malformed answers
    fail or retry the whole request as :class:`HTTPProcessor`'s do for one item.
    ``concurrency`` bounds the requests in flight per partition (default 4).
    """

    def __init__(self, url: str, batch: int = 100, timeout: float = 30.0,
                 headers: Mapping[str, str] | None = None, *, concurrency: int = 4) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= _MAX_BATCH:
            raise ConfigError(f"batch must be an integer from 1 to {_MAX_BATCH}, got {batch!r}")
        single = HTTPProcessor(url, timeout, headers, concurrency=concurrency)
        self.url = single.url
        self.timeout = single.timeout
        self.headers = single.headers
        self.concurrency = single.concurrency
        self.max_batch = batch

    def __repr__(self) -> str:
        return f"HTTPBatchProcessor({self.url!r}, batch={self.max_batch}, timeout={self.timeout:g})"

    def process_batch(self, items: Sequence[Item]) -> list[Response]:
        """POST the items together; one Response per item (see the class docstring)."""
        ids = f"{items[0].id}..{items[-1].id}" if items else "none"
        where = f"POST {self.url} ({len(items)} items, ids {ids})"
        obj = _post(self.url, {"items": [i.to_wire() for i in items]}, self.headers, self.timeout, where)
        answers = obj.get("responses") if isinstance(obj, Mapping) else obj
        if not isinstance(answers, list) or len(answers) != len(items):
            raise PermanentError(f"{where}: the answer must hold {len(items)} responses in a list "
                                 "('responses')")
        out = []
        for n, (item, answer) in enumerate(zip(items, answers, strict=True)):
            try:
                out.append(Response.from_wire(answer, item.gate))
            except PermanentError as exc:
                raise PermanentError(f"{where}: responses[{n}]: {exc}") from None
        return out


def _post(url: str, body_obj: object, headers: Mapping[str, str], timeout: float, where: str) -> Any:
    """POST ``body_obj`` as JSON; the answer parsed, or ProcessingError (retryable) /
    PermanentError as :class:`HTTPProcessor` documents."""
    body = json.dumps(body_obj, separators=(",", ":")).encode("utf-8")
    request = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status = int(answer.status)
            payload = answer.read(_MAX_ANSWER + 1)
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read(300).decode("utf-8", errors="replace").strip()
        except (OSError, http.client.HTTPException):
            detail = ""
        finally:
            exc.close()
        message = f"{where}: HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
        if exc.code >= 500 or exc.code in _RETRYABLE_STATUS:
            raise ProcessingError(message) from None
        raise PermanentError(message) from None
    except TimeoutError as exc:
        raise ProcessingError(f"{where}: no answer within {timeout:g}s") from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError | socket.timeout):
            raise ProcessingError(f"{where}: no answer within {timeout:g}s") from exc
        raise ProcessingError(f"{where}: {exc.reason}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise ProcessingError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if not 200 <= status < 300:
        raise PermanentError(f"{where}: unexpected HTTP {status}")
    if len(payload) > _MAX_ANSWER:
        raise PermanentError(f"{where}: the answer is larger than {_MAX_ANSWER} bytes")
    try:
        return json.loads(payload)
    except ValueError as exc:
        raise PermanentError(f"{where}: the answer is not JSON: {exc}") from None
