"""The old names of the modules that moved into their floor's folder (metafora.core._moved):
each is served as the same module object as its new name, by one finder from one table, with
no file left at the old path; any other missing ``metafora.x`` is still not found."""

from __future__ import annotations

import copy
import importlib
import multiprocessing
import pickle
import sys
from pathlib import Path

import pytest

import metafora
from metafora.core._moved import MOVED_MODULES, MovedModuleFinder
from metafora.core.task import Task

PACKAGE = Path(metafora.__file__).resolve().parent


def test_every_old_name_is_the_same_module_as_its_new_one() -> None:
    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(old)
        assert module is importlib.import_module(new) is sys.modules[old], old
        assert module.__name__ == new and module.__spec__ is not None and module.__spec__.name == new
        assert getattr(metafora, old.rpartition(".")[2]) is module  # the package's attribute too
        assert not (PACKAGE / f"{old.rpartition('.')[2]}.py").exists(), f"a file left at {old}"


def test_the_old_import_forms_work() -> None:
    import metafora.task
    from metafora.errors import TaskNotFound
    from metafora.task import Task as OldTask

    import metafora.core.task

    assert metafora.task is metafora.core.task  # type: ignore[attr-defined]
    assert OldTask is Task
    assert TaskNotFound is importlib.import_module("metafora.core.errors").TaskNotFound


def test_an_unknown_name_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"metafora\.nosuchmodule"):
        importlib.import_module("metafora.nosuchmodule")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("metafora.task.nosuchmodule")
    assert MovedModuleFinder().find_spec("metafora.nosuchmodule", None) is None
    assert sum(isinstance(f, MovedModuleFinder) for f in sys.meta_path) == 1  # installed once


def test_a_pickle_written_under_an_old_name_loads() -> None:
    task = Task("pickled", props={"a": 1})
    assert pickle.loads(pickle.dumps(task)) == task
    old = pickle.dumps(task, protocol=0).replace(b"metafora.core.task", b"metafora.task")
    assert b"metafora.task\n" in old and pickle.loads(old) == task


def test_a_spawned_process_gets_an_object_of_a_moved_module() -> None:
    task = Task("spawned", props={"b": 2})
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(copy.copy, (task,)) == task
