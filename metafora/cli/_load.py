"""``MODULE:NAME`` for ``metafora worker``: import it, recognise what it is, build a HandlerFunc.

What NAME may be, and how each kind is recognised (the first rule that applies wins; ``--kind``
skips the guessing):

``handler``
    A class that subclasses :class:`~metafora.Handler` or :class:`~metafora.contracts.handler.AsyncHandler`;
    it is built per task as ``NAME(task)``.
``step``
    A function ``(task, cmds) -> Message`` (sync or ``async def``) run through the state
    machine (:func:`metafora.statemachine.handler_func`): its second parameter is annotated
    ``Commands`` or ``AsyncCommands``, or, without an annotation, is named ``cmds`` or
    ``commands``.
``function``
    A function ``(task, stop) -> bool`` (sync or ``async def``) wrapped with
    :func:`~metafora.simple_handler`: its second parameter is annotated ``threading.Event`` or
    ``asyncio.Event``, or, without an annotation, is named ``stop``.
``handler-func``
    A callable taking only the task and returning a Handler (a
    :data:`~metafora.HandlerFunc`, e.g. what ``simple_handler`` returns): one parameter.

Anything else (a module, an instance of a Handler, a class of another kind, an ``async def``
of one parameter, a second parameter with another name or annotation) is a
:class:`TargetError` naming what was found: a usage error, exit code 2.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import importlib
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from metafora.contracts.balancer import Balancer
from metafora.contracts.coordinator import Coordinator
from metafora.contracts.handler import AsyncHandler, Handler, HandlerFunc, simple_handler
from metafora.core.errors import ConfigError
from metafora.core.task import Task

__all__ = ["Kind", "Target", "TargetError", "import_object", "load_balancer", "load_target"]


class TargetError(ConfigError):
    """``MODULE:NAME`` cannot be imported or is not something the worker can run."""


class Kind(enum.Enum):
    """What a worker's ``MODULE:NAME`` is (the values are ``--kind``'s choices)."""

    HANDLER_FUNC = "handler-func"
    HANDLER = "handler"
    FUNCTION = "function"
    STEP = "step"


_STEP_TYPES = ("Commands", "AsyncCommands")
_STOP_TYPES = ("Event",)  # threading.Event, asyncio.Event
_STEP_NAMES = ("cmds", "commands")
_STOP_NAMES = ("stop",)


@dataclass(frozen=True)
class Target:
    """A recognised ``MODULE:NAME``: the object, what kind it is, and the text it came from."""

    spec: str
    obj: Any
    kind: Kind

    @property
    def is_async(self) -> bool:
        """Whether its work runs on the consumer's event loop."""
        if self.kind is Kind.HANDLER:
            return issubclass(self.obj, AsyncHandler) or inspect.iscoroutinefunction(self.obj.run)
        return _is_coroutine_fn(self.obj)

    def handler_func(self, coordinator: Coordinator) -> HandlerFunc:
        """The HandlerFunc a Consumer on ``coordinator`` runs (a step keeps its state there)."""
        if self.kind is Kind.FUNCTION:
            return simple_handler(self.obj)
        if self.kind is Kind.STEP:
            from metafora.statemachine import handler_func

            return handler_func(self.obj, coordinator)
        if self.kind is Kind.HANDLER:
            cls = self.obj

            def build(task: Task) -> Handler | AsyncHandler:
                return cls(task)  # type: ignore[no-any-return]

            return build
        func: HandlerFunc = self.obj
        return func


def _describe(obj: Any) -> str:
    """What was found, for an error message: ``a class 'Foo'``, ``an int (42)``."""
    if inspect.isclass(obj):
        return f"the class {obj.__qualname__!r}"
    if inspect.ismodule(obj):
        return f"the module {obj.__name__!r}"
    if inspect.isroutine(obj):
        return f"the function {getattr(obj, '__qualname__', repr(obj))!r}"
    text = repr(obj)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{'an' if type(obj).__name__[0] in 'aeiouAEIOU' else 'a'} {type(obj).__name__} ({text})"


def _import_error(module: str, exc: BaseException) -> TargetError:
    """The one-line message for a module that failed to import (no traceback)."""
    if isinstance(exc, ModuleNotFoundError) and exc.name is not None and (
        module == exc.name or module.startswith(exc.name + ".")
    ):
        return TargetError(f"cannot import {module!r}: no module named {exc.name!r} (searched the "
                           "current directory and PYTHONPATH)")
    if isinstance(exc, SyntaxError):
        return TargetError(f"cannot import {module!r}: {exc.msg} ({exc.filename}, line {exc.lineno})")
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return TargetError(f"cannot import {module!r}: {type(exc).__name__}: {exc}{where}")


@contextmanager
def _cwd_searched_last() -> Iterator[None]:
    """The current directory at the end of ``sys.path`` while the block runs (unless already there)."""
    cwd = os.getcwd()
    if cwd in sys.path or "" in sys.path:
        yield
        return
    sys.path.append(cwd)
    try:
        yield
    finally:
        with suppress(ValueError):
            sys.path.remove(cwd)


def import_object(spec: str, what: str = "MODULE:NAME") -> Any:
    """The object ``spec`` (``pkg.module:name`` or ``pkg.module:Class.attr``) names.

    The current directory is searched too, after everything else on ``sys.path``, and only
    for this import (a module planted there cannot shadow an installed one, nor be imported
    later by a library's own lazy import). Raises :class:`TargetError`
    with the module's own error when the import fails (a missing module or dependency, a
    syntax error, an exception raised at import time) or the name is missing.
    """
    module_name, sep, attr = spec.partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not sep or not module_name or not attr:
        raise TargetError(f"{what} must look like package.module:name (e.g. myapp.tasks:work), got {spec!r}")
    try:
        with _cwd_searched_last():
            obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise _import_error(module_name, exc) from None
    walked = module_name
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"{walked!r} has no attribute {part!r} (from {spec!r})") from None
        walked = f"{walked}:{part}" if walked == module_name else f"{walked}.{part}"
    return obj


def _is_coroutine_fn(fn: object) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object with an async __call__
    )


def _annotation_names(annotation: Any) -> str | None:
    """The bare type name of an annotation (``"Commands"`` for ``statemachine.Commands``)."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        return annotation.strip().strip("'\"").rsplit(".", 1)[-1] or None
    if isinstance(annotation, type):
        from metafora.statemachine import AsyncCommands, Commands

        if issubclass(annotation, (threading.Event, asyncio.Event)):
            return "Event"
        if issubclass(annotation, (Commands, AsyncCommands)):
            return "Commands"
        return annotation.__name__
    return getattr(annotation, "__name__", None)


def _positional(obj: Any, spec: str) -> list[inspect.Parameter]:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        raise TargetError(f"cannot read the parameters of {_describe(obj)} from {spec!r}; "
                          "pass --kind to say what it is") from None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.VAR_POSITIONAL)
    return [p for p in signature.parameters.values() if p.kind in kinds]


def _accepts(params: list[inspect.Parameter], count: int) -> bool:
    """Whether a call with ``count`` positional arguments binds to ``params``."""
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    fixed = [p for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    required = sum(p.default is inspect.Parameter.empty for p in fixed)
    return required <= count and (variadic or count <= len(fixed))


def _second_kind(param: inspect.Parameter) -> Kind | None:
    """STEP or FUNCTION from the second parameter's annotation, else its name; None if neither."""
    type_name = _annotation_names(param.annotation)
    if type_name in _STEP_TYPES:
        return Kind.STEP
    if type_name in _STOP_TYPES:
        return Kind.FUNCTION
    if type_name is None:
        if param.name in _STEP_NAMES:
            return Kind.STEP
        if param.name in _STOP_NAMES:
            return Kind.FUNCTION
    return None


def _classify_class(obj: type, spec: str) -> Kind:
    if not issubclass(obj, (Handler, AsyncHandler)):
        raise TargetError(f"{spec!r} is {_describe(obj)}, which is not a metafora Handler or AsyncHandler "
                          "subclass (a class must subclass one of them; it is built as NAME(task))")
    if inspect.isabstract(obj):
        raise TargetError(f"{spec!r} is {_describe(obj)}, an abstract class: implement run() and stop()")
    if not _accepts(_positional(obj, spec), 1):
        raise TargetError(f"{spec!r} is {_describe(obj)}, whose constructor does not take the task as "
                          "its only argument (it is built as NAME(task))")
    return Kind.HANDLER


def _classify_callable(obj: Any, spec: str) -> Kind:
    params = _positional(obj, spec)
    fixed = [p for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    if len(fixed) >= 2 and _accepts(params, 2):
        kind = _second_kind(fixed[1])
        if kind is not None:
            return kind
    if _accepts(params, 1):
        if _is_coroutine_fn(obj):
            raise TargetError(f"{spec!r} is {_describe(obj)}, an async function of one parameter: a "
                              "HandlerFunc must return a Handler; write async def fn(task, stop) -> bool "
                              "or an AsyncHandler subclass")
        return Kind.HANDLER_FUNC
    names = ", ".join(p.name for p in params) or "no parameters"
    raise TargetError(
        f"{spec!r} is {_describe(obj)} taking ({names}): cannot tell what it is. A plain function is "
        "(task, stop) -> bool and a stateful step (task, cmds) -> Message: name or annotate the second "
        "parameter so (stop: threading.Event | asyncio.Event, cmds: Commands | AsyncCommands), "
        "a HandlerFunc takes only the task, or pass --kind")


def classify(obj: Any, spec: str) -> Kind:
    """Which kind of target ``obj`` is, by the documented rules; TargetError if none."""
    if inspect.isclass(obj):
        return _classify_class(obj, spec)
    if isinstance(obj, (Handler, AsyncHandler)):
        raise TargetError(f"{spec!r} is {_describe(obj)}, a Handler instance: a task needs a handler of "
                          "its own, so give its class or a function returning one per task")
    if inspect.ismodule(obj) or not callable(obj):
        raise TargetError(f"{spec!r} is {_describe(obj)}, not a Handler class or a function")
    return _classify_callable(obj, spec)


def _check_kind(obj: Any, kind: Kind, spec: str) -> None:
    """``--kind`` given: refuse only what cannot work at all (the rest fails per task)."""
    if kind is Kind.HANDLER:
        if not inspect.isclass(obj) or not issubclass(obj, (Handler, AsyncHandler)):
            raise TargetError(f"--kind handler needs a Handler or AsyncHandler subclass; {spec!r} is "
                              f"{_describe(obj)}")
    elif inspect.isclass(obj) or not callable(obj):
        raise TargetError(f"--kind {kind.value} needs a function; {spec!r} is {_describe(obj)}")


def load_target(spec: str, kind: Kind | None = None) -> Target:
    """Import ``spec`` (``MODULE:NAME``) and recognise it (or take ``kind`` as given)."""
    obj = import_object(spec)
    if kind is None:
        kind = classify(obj, spec)
    else:
        _check_kind(obj, kind, spec)
    return Target(spec, obj, kind)


def load_balancer(spec: str) -> Balancer:
    """A Balancer from ``MODULE:NAME``: an instance, or a class or factory called with no arguments."""
    obj: Any = import_object(spec, "--balancer")
    if isinstance(obj, Balancer):
        return obj
    if not callable(obj) or inspect.ismodule(obj) or (inspect.isclass(obj) and not issubclass(obj, Balancer)):
        raise TargetError(f"--balancer {spec!r} is {_describe(obj)}, not a Balancer, a Balancer class "
                          "or a factory")
    made = _call_factory(obj, spec)
    if not isinstance(made, Balancer):
        raise TargetError(f"--balancer {spec!r} made {_describe(made)}, not a metafora Balancer")
    return made


def _call_factory(factory: Callable[[], Any], spec: str) -> Any:
    try:
        return factory()
    except ConfigError:
        raise
    except Exception as exc:
        raise TargetError(f"--balancer {spec!r}: calling it with no arguments failed: "
                          f"{type(exc).__name__}: {exc}") from None
