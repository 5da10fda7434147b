"""``metafora worker``'s flags are made from the Consumer's options (ConsumerOptions' fields):
an option added to the dataclass is a flag, read from its variable too, checked by the
dataclass and blamed by its flag name."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from metafora.cli import main
from metafora.cli.worker import consumer_options, flag_of, worker
from metafora.consumer import ConsumerOptions
from metafora.core.errors import ConfigError


def test_every_option_of_the_consumer_is_a_flag_of_the_worker() -> None:
    flags = {opt for param in worker.params for opt in param.opts}
    names = [f.name for f in dataclasses.fields(ConsumerOptions)]
    assert [flag_of(name) for name in names if flag_of(name) not in flags] == []
    assert flag_of("http_addr") == "--http" and flag_of("balance_every") == "--balance-every"
    help_text = CliRunner().invoke(worker, ["--help"], terminal_width=200).output
    assert "METAFORA_WORKER_BALANCE_EVERY" in help_text and "default: 60s]" in help_text


def test_flags_not_given_leave_the_defaults_and_given_ones_are_checked_once() -> None:
    assert consumer_options({"weight": None, "labels": (), "max_tasks": None}) == ConsumerOptions()
    options = consumer_options({"labels": ("zone=eu",), "sticky_for": timedelta(seconds=10),
                                "balance_every": timedelta(minutes=2), "max_crashes": 0})
    assert (dict(options.labels), options.sticky_for, options.balance_every) == ({"zone": "eu"}, 10.0, 120.0)
    assert options.crash_limit is None


@pytest.mark.parametrize(("values", "message"), [
    ({"weight": 0.0}, "--weight must be a positive number"),
    ({"balance_every": timedelta(0)}, "--balance-every must be a positive number of seconds"),
    ({"sticky_for": timedelta(hours=2)}, "--sticky-for must be between 0 and"),
    ({"http_addr": "nowhere"}, "nowhere"),
    ({"balance_jitter": 1.5}, r"--balance-jitter must be in \[0, 1\)"),
])
def test_a_refused_flag_is_named(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        consumer_options(values)


def test_a_bad_flag_exits_2_before_the_store_is_touched(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--url", f"sqlite:///{tmp_path / 'm.db'}", "worker", "--max-tasks", "0", "nosuch:thing"])
    assert exited.value.code == 2
    assert "--max-tasks must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "m.db").exists()
