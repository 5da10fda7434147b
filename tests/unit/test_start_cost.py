"""What a start on SQLite imports (issue 51's first second; issue 53: the acceptance tests start
the command and worker processes hundreds of times): no psycopg, and a CLI verb loads its own
module only, not the gates', the state machine's, the worker's, the dashboard's or the demo's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import metafora

ROOT = Path(metafora.__file__).resolve().parent.parent


def _loaded_after(code: str, cwd: Path) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (in ``cwd``)."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_a_sqlite_client_and_node_load_no_psycopg(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    loaded = _loaded_after(
        "import threading, metafora\n"
        f"client = metafora.open_client({url!r})\nclient.submit_task(metafora.Task('a'))\n"
        "def run(task, stop):\n    threading.Thread(target=consumer.shutdown).start()\n    return True\n"
        f"consumer = metafora.Consumer(metafora.open_coordinator({url!r}, node_id='n'),"
        " metafora.simple_handler(run), shutdown_timeout=5)\n"
        "consumer.run()\nassert client.get_task('a').state == 'done'\nclient.close()", tmp_path)
    assert "metafora.coordinators.sql.client" in loaded  # the probe ran on the SQL store
    assert not {m for m in loaded if m == "psycopg" or m.startswith("psycopg.")}


def test_a_cli_verb_loads_its_own_module_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    loaded = _loaded_after(
        "from metafora.cli import main\n"
        f"try:\n    main(['--url', {url!r}, 'tasks'])\nexcept SystemExit as done:\n"
        "    assert done.code in (0, None), done.code", tmp_path)
    assert "metafora.cli.tasks" in loaded
    heavy = ("metafora.gates", "metafora.statemachine", "metafora.cli.worker", "metafora.cli.web",
             "metafora.cli.demo_cmd", "metafora.cli.items", "metafora.web", "psycopg")
    assert sorted(m for m in loaded if m.startswith(heavy)) == []


def test_every_verb_of_the_lazy_table_resolves_to_its_command() -> None:
    """COMMANDS is kept by hand: each name must be a click command of that name in the module
    it names (a typo would fail only when a user typed the verb)."""
    import click

    from metafora.cli import COMMANDS, cli

    ctx = click.Context(cli)
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        assert isinstance(command, click.Command) and command.name == name, name
    assert cli.list_commands(ctx)[:len(COMMANDS)] == list(COMMANDS)
