"""The state machine's data: states, messages, wire formats and the transition table."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metafora.statemachine import (
    COMMAND_KINDS,
    IGNORE,
    TRANSITIONS,
    ErrorRecord,
    InvalidMessage,
    InvalidState,
    Message,
    MessageKind,
    State,
    StateCode,
    apply,
    command_message,
    validate_command,
)
from metafora.statemachine.machine import (
    MAX_CURSOR_LENGTH,
    MAX_ERROR_TEXT,
    MAX_ERRORS,
    METAFORA_TRANSITIONS,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)
R, P, S, F = StateCode.RUNNABLE, StateCode.PAUSED, StateCode.SLEEPING, StateCode.FAULT
C, X, K = StateCode.COMPLETED, StateCode.FAILED, StateCode.KILLED
N = IGNORE

# The expected table, written out independently of the implementation.
# columns: run, pause, sleep, release, error, kill, complete, checkpoint, check
EXPECTED = {
    R: (R, P, S, R, F, K, C, R, R),
    P: (R, P, S, P, N, K, N, P, N),
    S: (R, P, S, S, F, K, N, S, N),
    F: (R, P, S, F, X, K, N, N, N),
    C: (N,) * 9,
    X: (N,) * 9,
    K: (N,) * 9,
}
COLUMNS = (MessageKind.RUN, MessageKind.PAUSE, MessageKind.SLEEP, MessageKind.RELEASE,
           MessageKind.ERROR, MessageKind.KILL, MessageKind.COMPLETE, MessageKind.CHECKPOINT,
           MessageKind.CHECK)

# Pairs where we differ from Go Metafora (which rejected them and turned them into errors).
DIFFERENCES = {
    (F, MessageKind.RUN): R,        # the error handler (or an operator) retries at once
    (F, MessageKind.PAUSE): P,      # an operator can pause a flapping task
    (F, MessageKind.KILL): K,       # ... or kill it
    (F, MessageKind.RELEASE): F,    # a release never changes the state (Go: -> failed)
    (R, MessageKind.CHECK): R,      # a wake-up for the handler; every other state drops it
}


def message_of(kind: MessageKind) -> Message:
    return {
        MessageKind.RUN: Message.run(),
        MessageKind.PAUSE: Message.pause(),
        MessageKind.SLEEP: Message.sleep(T0 + timedelta(hours=1)),
        MessageKind.RELEASE: Message.release(),
        MessageKind.ERROR: Message.error(RuntimeError("boom")),
        MessageKind.KILL: Message.kill(),
        MessageKind.COMPLETE: Message.complete(),
        MessageKind.CHECKPOINT: Message.checkpoint("c1"),
        MessageKind.CHECK: Message.check(),
    }[kind]


def state_of(code: StateCode) -> State:
    if code is S:
        return State(S, until=T0 + timedelta(minutes=5), cursor="k")
    if code in (F, X):
        return State(code, errors=(ErrorRecord(T0, "E: old"),), cursor="k")
    return State(code, cursor="k")


# -- the table -----------------------------------------------------------------------------


def test_table_covers_the_full_cross_product() -> None:
    assert set(TRANSITIONS) == {(c, k) for c in StateCode for k in MessageKind}
    assert len(TRANSITIONS) == 7 * 9


@pytest.mark.parametrize("code", list(StateCode))
@pytest.mark.parametrize("kind", list(MessageKind))
def test_every_pair_matches_the_expected_table(code: StateCode, kind: MessageKind) -> None:
    expected = EXPECTED[code][COLUMNS.index(kind)]
    assert TRANSITIONS[(code, kind)] == expected
    new = apply(state_of(code), message_of(kind), T0)
    if expected == IGNORE:
        assert new is None
    else:
        assert new is not None and new.code is expected


def test_metafora_rules_are_kept_and_only_the_documented_pairs_were_added() -> None:
    for pair, target in METAFORA_TRANSITIONS.items():
        assert TRANSITIONS[pair] is target, pair
    added = {p: t for p, t in TRANSITIONS.items() if t != IGNORE and p not in METAFORA_TRANSITIONS}
    assert added == DIFFERENCES


def test_terminal_states() -> None:
    assert {c for c in StateCode if c.terminal} == {C, X, K}


def test_release_never_changes_the_state() -> None:
    for code in (R, P, S, F):
        before = state_of(code)
        assert apply(before, Message.release(), T0) == before


def test_only_operator_kinds_are_commands() -> None:
    assert {
        MessageKind.RUN, MessageKind.PAUSE, MessageKind.SLEEP, MessageKind.KILL, MessageKind.RELEASE,
        MessageKind.CHECK,
    } == COMMAND_KINDS
    for kind in (MessageKind.ERROR, MessageKind.COMPLETE, MessageKind.CHECKPOINT):
        with pytest.raises(InvalidMessage, match="cannot be sent to a task as a command"):
            validate_command(message_of(kind))
    assert validate_command(Message.pause()) == Message.pause()


# -- apply ---------------------------------------------------------------------------------


def test_sleep_sets_until_and_checkpoint_or_release_keep_it() -> None:
    asleep = apply(State(), Message.sleep(T0), T0)
    assert asleep == State(S, until=T0)
    later = T0 + timedelta(days=1)
    assert apply(asleep, Message.sleep(later), T0) == State(S, until=later)
    assert apply(asleep, Message.checkpoint("x"), T0) == State(S, until=T0, cursor="x")
    assert apply(asleep, Message.release(), T0) == asleep
    assert apply(asleep, Message.run(), T0) == State(R)


def test_error_appends_a_timestamped_record_and_fault_error_fails() -> None:
    fault = apply(State(cursor="c"), Message.error(ValueError("bad page")), T0)
    assert fault == State(F, errors=(ErrorRecord(T0, "ValueError: bad page"),), cursor="c")
    failed = apply(fault, Message.error("gave up"), T0 + timedelta(seconds=1))
    assert failed is not None and failed.code is X
    assert [e.text for e in failed.errors] == ["ValueError: bad page", "gave up"]
    # Recovering keeps the errors (the policy counts them within its window) and the cursor.
    assert apply(fault, Message.run(), T0) == State(R, errors=fault.errors, cursor="c")


def test_errors_are_bounded_to_the_most_recent() -> None:
    state = State()
    for i in range(MAX_ERRORS + 5):
        state = apply(state, Message.error(f"e{i}"), T0 + timedelta(seconds=i)) or state
        state = apply(state, Message.run(), T0) or state
    assert len(state.errors) == MAX_ERRORS
    assert state.errors[-1].text == f"e{MAX_ERRORS + 4}"
    assert state.errors[0].text == "e5"


def test_checkpoint_without_a_cursor_keeps_the_cursor() -> None:
    assert apply(State(cursor="7"), Message.checkpoint(), T0) == State(cursor="7")
    assert apply(State(cursor="7"), Message.checkpoint("8"), T0) == State(cursor="8")


def test_long_error_text_is_cut() -> None:
    message = Message.error("x" * (MAX_ERROR_TEXT * 2))
    assert message.reason is not None and len(message.reason) == MAX_ERROR_TEXT
    assert message.reason.endswith("...")


# -- hypothesis: random message sequences --------------------------------------------------

times = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1),
                     timezones=st.just(UTC))
messages = st.one_of(
    st.just(Message.run()),
    st.just(Message.pause()),
    times.map(Message.sleep),
    st.just(Message.release()),
    st.text(min_size=1, max_size=20).filter(str.strip).map(Message.error),
    st.just(Message.kill()),
    st.just(Message.complete()),
    st.one_of(st.none(), st.text(max_size=10)).map(Message.checkpoint),
)


@settings(max_examples=300, deadline=None)
@given(start=st.sampled_from([R, P, S, F]), sequence=st.lists(messages, max_size=40))
def test_random_sequences_keep_the_invariants(start: StateCode, sequence: list[Message]) -> None:
    state = state_of(start)
    terminal_seen: State | None = None
    for message in sequence:
        new = apply(state, message, T0)
        expected = TRANSITIONS[(state.code, message.kind)]
        if terminal_seen is not None:
            assert new is None, "a terminal state never leaves"
            continue
        if expected == IGNORE:
            assert new is None
            continue
        assert new is not None and new.code is expected
        # Invariants of every reachable state.
        assert (new.code is S) == (new.until is not None)
        assert new.code is not F or new.errors
        assert len(new.errors) <= MAX_ERRORS
        if message.kind is MessageKind.CHECKPOINT and message.cursor is not None:
            assert new.cursor == message.cursor
        else:
            assert new.cursor == state.cursor
        if message.kind is MessageKind.ERROR:
            assert new.errors[-1].text == message.reason
        else:
            assert new.errors == state.errors
        assert State.from_json(new.to_json()) == new
        state = new
        if state.code.terminal:
            terminal_seen = state


@settings(max_examples=200, deadline=None)
@given(message=messages)
def test_message_wire_round_trip(message: Message) -> None:
    assert Message.from_json(message.to_json()) == message
    assert Message.from_json(json.loads(message.to_json())) == message


# -- wire formats --------------------------------------------------------------------------


def test_message_wire_format() -> None:
    assert json.loads(Message.pause().to_json()) == {"message": "pause"}
    assert json.loads(Message.sleep("2030-01-01T00:00:00Z").to_json()) == {
        "message": "sleep", "until": "2030-01-01T00:00:00+00:00"}
    assert json.loads(Message.error(KeyError("k")).to_json()) == {
        "message": "error", "error": "KeyError: 'k'"}
    assert json.loads(Message.checkpoint("p9").to_json()) == {"message": "checkpoint", "cursor": "p9"}
    assert Message.sleep(datetime(2030, 1, 1)).until == T0  # naive means UTC
    assert str(Message.sleep(T0)) == "sleep until 2030-01-01T00:00:00+00:00"
    assert Message.error(OSError("x")).exception is not None


def test_an_error_record_keeps_the_exception_of_this_run_but_never_stores_it() -> None:
    exc = PermissionError("no access to bucket")
    state = apply(State(), Message.error(exc), T0)
    assert state is not None
    record = state.errors[-1]
    assert record.exception is exc and record.exception_type is PermissionError
    assert record.text == "PermissionError: no access to bucket"
    back = State.from_json(state.to_json())
    assert "exception" not in state.to_json()
    assert back.errors[-1].exception is None and back.errors[-1].exception_type is None
    assert back == state  # the exception takes no part in equality
    text_only = apply(State(), Message.error("plain text"), T0)
    assert text_only is not None and text_only.errors[-1].exception is None
    with pytest.raises(InvalidState, match="must be an exception"):
        ErrorRecord(T0, "E: x", "not an exception")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"message": "explode"}', "unknown message 'explode'"),
        ('{"message": 3}', "must be a string"),
        ('{}', "must be a string"),
        ('{"message": "pause", "x": 1}', "unknown fields: x"),
        ('{"message": "sleep"}', "needs 'until'"),
        ('{"message": "sleep", "until": "tomorrow"}', "ISO-8601"),
        ('{"message": "pause", "until": "2030-01-01"}', "'until' belongs to sleep"),
        ('{"message": "error"}', "non-empty 'error'"),
        ('{"message": "error", "error": 5}', "'error' must be a string"),
        ('{"message": "kill", "error": "x"}', "'error' belongs to error"),
        ('{"message": "run", "cursor": "x"}', "'cursor' belongs to checkpoint"),
        ('{"message": "checkpoint", "cursor": 5}', "cursor must be a string"),
    ],
)
def test_malformed_messages_are_rejected_by_name(raw: str, problem: str) -> None:
    with pytest.raises(InvalidMessage, match=problem):
        Message.from_json(raw)


def test_overlong_cursor_is_rejected() -> None:
    with pytest.raises(InvalidMessage, match="limit"):
        Message.checkpoint("x" * (MAX_CURSOR_LENGTH + 1))
    with pytest.raises(InvalidState, match="limit"):
        State(cursor="x" * (MAX_CURSOR_LENGTH + 1))


def test_state_wire_format_round_trip() -> None:
    state = State(F, errors=(ErrorRecord(T0, "E: one"), ErrorRecord(T0, "E: two")), cursor="p3")
    assert json.loads(state.to_json()) == {
        "state": "fault", "until": None, "cursor": "p3",
        "errors": [{"time": "2030-01-01T00:00:00+00:00", "error": "E: one"},
                   {"time": "2030-01-01T00:00:00+00:00", "error": "E: two"}],
    }
    assert State.from_json(state.to_json()) == state
    asleep = State(S, until=T0)
    assert State.from_json(asleep.to_json()) == asleep
    assert State.from_json('{"state": "runnable"}') == State()
    assert str(asleep) == "sleeping until 2030-01-01T00:00:00+00:00"


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("nope", "not valid JSON"),
        ('"runnable"', "must be a JSON object"),
        ('{"state": "dancing"}', "unknown state 'dancing'"),
        ('{"state": null}', "must be a string"),
        ('{"state": "sleeping"}', "needs 'until'"),
        ('{"state": "runnable", "until": "2030-01-01"}', "only meaningful when sleeping"),
        ('{"state": "fault"}', "at least one error"),
        ('{"state": "fault", "errors": {}}', "must be a list"),
        ('{"state": "fault", "errors": [{"time": "2030-01-01"}]}', "each error"),
        ('{"state": "fault", "errors": [{"time": "x", "error": "e"}]}', "ISO-8601"),
        ('{"state": "runnable", "more": 1}', "unknown fields: more"),
    ],
)
def test_malformed_states_are_rejected_by_name(raw: str, problem: str) -> None:
    with pytest.raises(InvalidState, match=problem):
        State.from_json(raw)


def test_state_keeps_only_the_last_errors() -> None:
    errors = tuple(ErrorRecord(T0, f"e{i}") for i in range(MAX_ERRORS + 3))
    state = State(F, errors=errors)
    assert len(state.errors) == MAX_ERRORS and state.errors[0].text == "e3"


# -- CLI helper ----------------------------------------------------------------------------


def test_command_message_maps_cli_verbs() -> None:
    assert command_message("pause") == Message.pause()
    assert command_message("resume") == Message.run()
    assert command_message("kill") == Message.kill()
    assert command_message("release") == Message.release()
    assert command_message("sleep", "2030-01-01T00:00:00Z") == Message.sleep(T0)
    with pytest.raises(InvalidMessage, match="needs --until"):
        command_message("sleep")
    with pytest.raises(InvalidMessage, match="only for sleep"):
        command_message("pause", until=T0)
    with pytest.raises(InvalidMessage, match="unknown task command 'complete'"):
        command_message("complete")
    with pytest.raises(InvalidMessage, match="ISO-8601"):
        command_message("sleep", "soon")
