"""States, messages and the transition table of the state machine (pure data and functions).

A stateful task is always in one :class:`StateCode`. A :class:`Message` -- returned by the
user's handler, sent by an operator as a task command, produced by a sleep timer or by the
error handler -- moves it along :data:`TRANSITIONS`, a table written as data: for every
``(state, message kind)`` pair it names the next state, or :data:`IGNORE` when the message
means nothing in that state (it is logged and dropped; it never turns into an error, so a
stray command cannot poison a task).

The table (``*`` release keeps the state and ends the run: another consumer may claim the
task; ``-`` ignore; ``+`` differs from Go Metafora, where invalid pairs were turned into an
``error`` message -- a stray command could fault or fail a task)::

    state/message  run       pause    sleep     release    error   kill     complete   checkpoint check
    runnable       runnable  paused   sleeping  runnable*  fault   killed   completed  runnable   runnable+
    paused         runnable  paused   sleeping  paused*    -  +    killed   -  +       paused     -  +
    sleeping       runnable  paused   sleeping  sleeping*  fault   killed   -  +       sleeping   -  +
    fault          runnable+ paused+  sleeping  fault* +   failed  killed+  -  +       -  +       -  +
    completed, failed, killed: every message is ignored (terminal states never leave)

``check`` (not in Go Metafora) is a wake-up that can never resume: a runnable task's handler
gets it from ``poll()``/``get()`` (a stream re-reads its source's head), every other state
drops it. ``run`` to a runnable task is the same wake-up, but to a paused, sleeping or fault
task it is a resume -- so a wake-up racing a pause must be ``check``. A node older than
``check`` drops it as an unknown command (with a warning), never fails on it.

Both types have a JSON wire format (``to_json`` / ``from_json``) that is validated on the
way in: a malformed message or state raises :class:`InvalidMessage` / :class:`InvalidState`
naming the problem.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Final, Literal

from metafora.contracts.coordinator import error_text
from metafora.core.errors import InvalidProps, MetaforaError
from metafora.core.jsontext import load_object
from metafora.core.task import parse_time

__all__ = [
    "COMMAND_KINDS",
    "IGNORE",
    "MAX_CURSOR_LENGTH",
    "MAX_ERRORS",
    "MAX_ERROR_TEXT",
    "METAFORA_TRANSITIONS",
    "TRANSITIONS",
    "ErrorRecord",
    "InvalidMessage",
    "InvalidState",
    "Message",
    "MessageKind",
    "State",
    "StateCode",
    "apply",
    "cut_error_text",
    "next_code",
    "validate_command",
]

MAX_ERRORS: Final = 16
"""How many of the most recent errors a :class:`State` keeps (older ones are dropped)."""

MAX_ERROR_TEXT: Final = 2000
"""Error texts longer than this many characters are cut (with a trailing ``...``)."""

MAX_CURSOR_LENGTH: Final = 65536
"""The longest cursor (in characters) a checkpoint may save."""


class InvalidMessage(MetaforaError, ValueError):
    """A state machine message (or task command) is unknown or malformed."""


class InvalidState(MetaforaError, ValueError):
    """A stored state is malformed (unknown code, sleeping without ``until``, ...)."""


class StateCode(enum.StrEnum):
    """Where a stateful task is. ``completed``, ``failed`` and ``killed`` are terminal."""

    RUNNABLE = "runnable"
    """The user's handler runs (or is about to)."""
    PAUSED = "paused"
    """Waits for a command; keeps its claim."""
    SLEEPING = "sleeping"
    """Waits until ``State.until`` or a command; keeps its claim."""
    FAULT = "fault"
    """The handler failed; the error handler decides (retry, sleep, fail)."""
    COMPLETED = "completed"
    """Finished its work. Terminal."""
    FAILED = "failed"
    """Gave up after too many errors. Terminal."""
    KILLED = "killed"
    """Stopped for good by an operator (or the handler). Terminal."""

    @property
    def terminal(self) -> bool:
        """Whether the task never runs again in this state."""
        return self in _TERMINAL


_TERMINAL: Final = frozenset({StateCode.COMPLETED, StateCode.FAILED, StateCode.KILLED})


class MessageKind(enum.StrEnum):
    """What a :class:`Message` asks for."""

    RUN = "run"
    PAUSE = "pause"
    SLEEP = "sleep"
    RELEASE = "release"
    ERROR = "error"
    KILL = "kill"
    COMPLETE = "complete"
    CHECKPOINT = "checkpoint"
    CHECK = "check"


COMMAND_KINDS: Final = frozenset(
    {MessageKind.RUN, MessageKind.PAUSE, MessageKind.SLEEP, MessageKind.KILL, MessageKind.RELEASE,
     MessageKind.CHECK}
)
"""The kinds an operator may send to a task as a command (``resume`` is ``run``; ``check``
wakes a runnable task's handler and never resumes one)."""


def _utc(value: object, what: str, error: type[MetaforaError]) -> datetime:
    try:
        return parse_time(value, what)
    except InvalidProps as exc:
        raise error(str(exc)) from None


def cut_error_text(text: str) -> str:
    """``text`` cut to :data:`MAX_ERROR_TEXT` characters (with a trailing ``...``), as every
    stored error text is."""
    return text if len(text) <= MAX_ERROR_TEXT else text[: MAX_ERROR_TEXT - 3] + "..."


def _check_cursor(cursor: object, error: type[MetaforaError]) -> str | None:
    if cursor is None:
        return None
    if not isinstance(cursor, str):
        raise error(f"cursor must be a string (or null), not {type(cursor).__name__}")
    if len(cursor) > MAX_CURSOR_LENGTH:
        raise error(f"cursor is {len(cursor)} characters long; the limit is {MAX_CURSOR_LENGTH}")
    return cursor


def _load_object(data: str | bytes | Mapping[str, Any], what: str,
                 error: type[MetaforaError]) -> Mapping[str, Any]:
    if isinstance(data, str | bytes):
        return load_object(data, what, error)
    if not isinstance(data, Mapping):
        raise error(f"{what} must be a JSON object, not {type(data).__name__}")
    return data


@dataclass(frozen=True)
class ErrorRecord:
    """One error a handler reported: when (UTC) and what (``Type: message``).

    ``exception`` is the exception object itself for an error raised (or passed to
    :meth:`Message.error`) during this run of the machine, so a custom error handler can
    tell error types apart without parsing ``text``. It is not persisted: errors read back
    from the store (an earlier run, another node) have only their text and ``exception``
    None. It takes no part in equality.
    """

    time: datetime
    text: str
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.time, datetime):
            raise InvalidState(f"error time must be a datetime, not {type(self.time).__name__}")
        if not isinstance(self.text, str):
            raise InvalidState(f"error text must be a string, not {type(self.text).__name__}")
        object.__setattr__(self, "time", _utc(self.time, "error time", InvalidState))
        object.__setattr__(self, "text", cut_error_text(self.text))
        if self.exception is not None and not isinstance(self.exception, BaseException):
            raise InvalidState(
                f"error exception must be an exception, not {type(self.exception).__name__}"
            )

    @property
    def exception_type(self) -> type[BaseException] | None:
        """The type of :attr:`exception` (None for an error read back from the store)."""
        return None if self.exception is None else type(self.exception)

    def to_dict(self) -> dict[str, str]:
        """The wire form: ``{"time": ISO-8601, "error": text}`` (the exception is not kept)."""
        return {"time": self.time.isoformat(), "error": self.text}


@dataclass(frozen=True)
class State:
    """A stateful task's persisted state.

    ``until`` is set exactly when sleeping; ``errors`` keeps the last :data:`MAX_ERRORS`
    errors (oldest first; a fault always has at least one); ``cursor`` is the progress
    marker of the last checkpoint, carried across every state and every owner.
    """

    code: StateCode = StateCode.RUNNABLE
    until: datetime | None = None
    errors: tuple[ErrorRecord, ...] = ()
    cursor: str | None = None

    def __post_init__(self) -> None:
        try:
            code = StateCode(self.code)
        except ValueError:
            known = ", ".join(c.value for c in StateCode)
            raise InvalidState(f"unknown state {self.code!r} (known: {known})") from None
        object.__setattr__(self, "code", code)
        if code is StateCode.SLEEPING:
            if self.until is None:
                raise InvalidState("a sleeping state needs 'until'")
            object.__setattr__(self, "until", _utc(self.until, "until", InvalidState))
        elif self.until is not None:
            raise InvalidState(f"'until' is only meaningful when sleeping, not {code.value}")
        errors = tuple(self.errors)
        for record in errors:
            if not isinstance(record, ErrorRecord):
                raise InvalidState(f"errors must be ErrorRecord values, got {record!r}")
        object.__setattr__(self, "errors", errors[-MAX_ERRORS:])
        if code is StateCode.FAULT and not errors:
            raise InvalidState("a fault state needs at least one error")
        object.__setattr__(self, "cursor", _check_cursor(self.cursor, InvalidState))

    def __str__(self) -> str:
        if self.code is StateCode.SLEEPING and self.until is not None:
            return f"sleeping until {self.until.isoformat()}"
        if self.errors and self.code in (StateCode.FAULT, StateCode.FAILED):
            return f"{self.code.value} ({len(self.errors)} errors, last: {self.errors[-1].text})"
        return self.code.value

    def to_dict(self) -> dict[str, Any]:
        """The wire form as a JSON-ready dict."""
        return {
            "state": self.code.value,
            "until": None if self.until is None else self.until.isoformat(),
            "errors": [e.to_dict() for e in self.errors],
            "cursor": self.cursor,
        }

    def to_json(self) -> str:
        """``{"state": code, "until": ISO|null, "errors": [{"time", "error"}], "cursor": str|null}``."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> State:
        """Parse and validate the wire form; raise :class:`InvalidState` naming the problem."""
        obj = _load_object(data, "state", InvalidState)
        extra = set(obj) - {"state", "until", "errors", "cursor"}
        if extra:
            raise InvalidState(f"state has unknown fields: {', '.join(sorted(extra))}")
        code = obj.get("state")
        if not isinstance(code, str):
            raise InvalidState("state code ('state') must be a string")
        until = obj.get("until")
        raw_errors = obj.get("errors")
        if raw_errors is None:
            raw_errors = []
        if not isinstance(raw_errors, list):
            raise InvalidState("'errors' must be a list")
        errors = []
        for item in raw_errors:
            if not isinstance(item, Mapping) or set(item) != {"time", "error"}:
                raise InvalidState(f"each error must be {{'time', 'error'}}, got {item!r}")
            if not isinstance(item["error"], str):
                raise InvalidState("error text must be a string")
            errors.append(ErrorRecord(_utc(item["time"], "error time", InvalidState), item["error"]))
        if code not in _CODES:
            known = ", ".join(c.value for c in StateCode)
            raise InvalidState(f"unknown state {code!r} (known: {known})")
        return cls(
            StateCode(code),
            None if until is None else _utc(until, "until", InvalidState),
            tuple(errors),
            obj.get("cursor"),
        )


_CODES: Final = frozenset(c.value for c in StateCode)
_KINDS: Final = frozenset(k.value for k in MessageKind)


@dataclass(frozen=True)
class Message:
    """An event for the state machine. Build it with the class-method constructors.

    ``until`` belongs to ``sleep``, ``reason`` (the error text) to ``error``, ``cursor`` to
    ``checkpoint``; ``exception`` keeps the original exception of an ``error`` message: it
    reaches custom error handlers as ``ErrorRecord.exception`` of the state's newest error
    (it is not part of the wire format or of equality).
    """

    kind: MessageKind
    until: datetime | None = None
    reason: str | None = None
    cursor: str | None = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        try:
            kind = MessageKind(self.kind)
        except ValueError:
            known = ", ".join(k.value for k in MessageKind)
            raise InvalidMessage(f"unknown message {self.kind!r} (known: {known})") from None
        object.__setattr__(self, "kind", kind)
        if kind is MessageKind.SLEEP:
            if self.until is None:
                raise InvalidMessage("a sleep message needs 'until' (when to wake up)")
            object.__setattr__(self, "until", _utc(self.until, "until", InvalidMessage))
        elif self.until is not None:
            raise InvalidMessage(f"'until' belongs to sleep messages, not {kind.value}")
        if kind is MessageKind.ERROR:
            if not isinstance(self.reason, str) or not self.reason.strip():
                raise InvalidMessage("an error message needs a non-empty 'error' text")
            object.__setattr__(self, "reason", cut_error_text(self.reason))
        elif self.reason is not None:
            raise InvalidMessage(f"'error' belongs to error messages, not {kind.value}")
        if kind is MessageKind.CHECKPOINT:
            object.__setattr__(self, "cursor", _check_cursor(self.cursor, InvalidMessage))
        elif self.cursor is not None:
            raise InvalidMessage(f"'cursor' belongs to checkpoint messages, not {kind.value}")

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def run(cls) -> Message:
        """Run (or resume) the task: paused/sleeping/fault -> runnable."""
        return cls(MessageKind.RUN)

    @classmethod
    def pause(cls) -> Message:
        """Pause the task: it waits for a command, keeping its claim."""
        return cls(MessageKind.PAUSE)

    @classmethod
    def sleep(cls, until: datetime | str) -> Message:
        """Sleep until ``until`` (aware or UTC datetime, or ISO-8601), keeping the claim."""
        return cls(MessageKind.SLEEP, until=_utc(until, "until", InvalidMessage))

    @classmethod
    def release(cls) -> Message:
        """Stop running here without changing state; another consumer may claim the task."""
        return cls(MessageKind.RELEASE)

    @classmethod
    def error(cls, exc: BaseException | str) -> Message:
        """The handler failed with ``exc``: runnable -> fault (the error handler decides)."""
        text = error_text(exc) if isinstance(exc, BaseException) else str(exc)
        return cls(MessageKind.ERROR, reason=text.strip() or "error",
                   exception=exc if isinstance(exc, BaseException) else None)

    @classmethod
    def kill(cls) -> Message:
        """Stop the task for good (terminal ``killed``)."""
        return cls(MessageKind.KILL)

    @classmethod
    def complete(cls) -> Message:
        """The work is finished (terminal ``completed``)."""
        return cls(MessageKind.COMPLETE)

    @classmethod
    def checkpoint(cls, cursor: str | None = None) -> Message:
        """Persist the state (and ``cursor``, if given), then call the handler again."""
        return cls(MessageKind.CHECKPOINT, cursor=cursor)

    @classmethod
    def check(cls) -> Message:
        """Wake a runnable task's handler (it gets the command from ``poll()``/``get()``);
        ignored in every other state: unlike ``run`` it never resumes a task."""
        return cls(MessageKind.CHECK)

    # -- wire format ----------------------------------------------------------------------

    def __str__(self) -> str:
        if self.kind is MessageKind.SLEEP and self.until is not None:
            return f"sleep until {self.until.isoformat()}"
        if self.kind is MessageKind.ERROR:
            return f"error: {self.reason}"
        if self.kind is MessageKind.CHECKPOINT and self.cursor is not None:
            return f"checkpoint at {self.cursor!r}"
        return self.kind.value

    def to_dict(self) -> dict[str, Any]:
        """The wire form as a JSON-ready dict (only the fields this kind uses)."""
        obj: dict[str, Any] = {"message": self.kind.value}
        if self.until is not None:
            obj["until"] = self.until.isoformat()
        if self.reason is not None:
            obj["error"] = self.reason
        if self.kind is MessageKind.CHECKPOINT and self.cursor is not None:
            obj["cursor"] = self.cursor
        return obj

    def to_json(self) -> str:
        """``{"message": kind, "until"?: ISO, "error"?: text, "cursor"?: text}``."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> Message:
        """Parse and validate the wire form; raise :class:`InvalidMessage` naming the problem."""
        obj = _load_object(data, "message", InvalidMessage)
        extra = set(obj) - {"message", "until", "error", "cursor"}
        if extra:
            raise InvalidMessage(f"message has unknown fields: {', '.join(sorted(extra))}")
        kind = obj.get("message")
        if not isinstance(kind, str):
            raise InvalidMessage("message kind ('message') must be a string")
        if kind not in _KINDS:
            known = ", ".join(k.value for k in MessageKind)
            raise InvalidMessage(f"unknown message {kind!r} (known: {known})")
        until = obj.get("until")
        error = obj.get("error")
        if error is not None and not isinstance(error, str):
            raise InvalidMessage("'error' must be a string")
        return cls(
            MessageKind(kind),
            None if until is None else _utc(until, "until", InvalidMessage),
            error,
            obj.get("cursor"),
        )


def validate_command(message: Message) -> Message:
    """Return ``message`` if an operator may send it to a task, else raise InvalidMessage."""
    if not isinstance(message, Message):
        raise InvalidMessage(f"a task command must be a Message, not {type(message).__name__}")
    if message.kind not in COMMAND_KINDS:
        allowed = ", ".join(sorted(k.value for k in COMMAND_KINDS))
        raise InvalidMessage(
            f"{message.kind.value!r} cannot be sent to a task as a command (allowed: {allowed})"
        )
    return message


# -- the transition table ------------------------------------------------------------------

IGNORE: Final = "ignore"
"""A table entry: the message means nothing in this state; it is logged and dropped."""

Target = StateCode | Literal["ignore"]

_R, _P, _S, _F = StateCode.RUNNABLE, StateCode.PAUSED, StateCode.SLEEPING, StateCode.FAULT
_C, _X, _K = StateCode.COMPLETED, StateCode.FAILED, StateCode.KILLED
_M = MessageKind


def _row(**targets: Target) -> dict[MessageKind, Target]:
    row = {MessageKind(name): target for name, target in targets.items()}
    assert set(row) == set(MessageKind), "every row names every message kind"
    return row


_IGNORED: Final[dict[str, Target]] = {kind.value: IGNORE for kind in MessageKind}  # terminal rows

_TABLE: Final[dict[StateCode, dict[MessageKind, Target]]] = {
    #                 run   pause  sleep  release error  kill   complete  checkpoint  check
    _R: _row(run=_R, pause=_P, sleep=_S, release=_R, error=_F, kill=_K, complete=_C, checkpoint=_R,
             check=_R),
    _P: _row(run=_R, pause=_P, sleep=_S, release=_P, error=IGNORE, kill=_K, complete=IGNORE,
             checkpoint=_P, check=IGNORE),
    _S: _row(run=_R, pause=_P, sleep=_S, release=_S, error=_F, kill=_K, complete=IGNORE,
             checkpoint=_S, check=IGNORE),
    _F: _row(run=_R, pause=_P, sleep=_S, release=_F, error=_X, kill=_K, complete=IGNORE,
             checkpoint=IGNORE, check=IGNORE),
    _C: _row(**_IGNORED),
    _X: _row(**_IGNORED),
    _K: _row(**_IGNORED),
}

TRANSITIONS: Final[Mapping[tuple[StateCode, MessageKind], Target]] = {
    (code, kind): target for code, row in _TABLE.items() for kind, target in row.items()
}
"""The whole table: every ``(state, message kind)`` pair -> next state or :data:`IGNORE`.

``release`` never changes the state; the machine stops running the task (another consumer
may claim it) after applying it.
"""

METAFORA_TRANSITIONS: Final[Mapping[tuple[StateCode, MessageKind], StateCode]] = {
    (_R, _M.CHECKPOINT): _R, (_R, _M.RELEASE): _R, (_R, _M.SLEEP): _S, (_R, _M.COMPLETE): _C,
    (_R, _M.KILL): _K, (_R, _M.ERROR): _F, (_R, _M.PAUSE): _P, (_R, _M.RUN): _R,
    (_S, _M.CHECKPOINT): _S, (_S, _M.RELEASE): _S, (_S, _M.SLEEP): _S, (_S, _M.RUN): _R,
    (_S, _M.KILL): _K, (_S, _M.PAUSE): _P, (_S, _M.ERROR): _F,
    (_F, _M.SLEEP): _S, (_F, _M.ERROR): _X,
    (_P, _M.CHECKPOINT): _P, (_P, _M.RELEASE): _P, (_P, _M.RUN): _R, (_P, _M.SLEEP): _S,
    (_P, _M.KILL): _K, (_P, _M.PAUSE): _P,
}
"""Go Metafora's rules (``statemachine.Rules``), for comparison and documentation only.

Pairs missing here were *invalid* in Metafora, which turned the message into an error
(so a stray command could fault or fail a task).
"""


def next_code(code: StateCode, kind: MessageKind) -> Target:
    """The table lookup: the state after ``kind`` in ``code``, or :data:`IGNORE`."""
    return TRANSITIONS[(code, kind)]


def apply(state: State, message: Message, now: datetime | None = None) -> State | None:
    """The state after ``message``, or ``None`` when the table says :data:`IGNORE`.

    ``sleep`` sets ``until``; ``checkpoint`` and ``release`` keep the current ``until`` (a
    sleeping task stays asleep); an ``error`` appends ``(now, text)`` to the bounded error
    list (with the message's exception, for the error handler of this run); a
    ``checkpoint`` with a cursor replaces the cursor. Pure: no I/O.
    """
    target = TRANSITIONS[(state.code, message.kind)]
    if target == IGNORE:
        return None
    assert isinstance(target, StateCode)
    if target is StateCode.SLEEPING:
        until = message.until if message.kind is MessageKind.SLEEP else state.until
    else:
        until = None
    errors = state.errors
    if message.kind is MessageKind.ERROR:
        when = now if now is not None else datetime.now(UTC)
        record = ErrorRecord(when, message.reason or "error", message.exception)
        errors = (*errors, record)[-MAX_ERRORS:]
    cursor = state.cursor
    if message.kind is MessageKind.CHECKPOINT and message.cursor is not None:
        cursor = message.cursor
    return replace(state, code=target, until=until, errors=errors, cursor=cursor)
