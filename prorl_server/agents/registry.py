"""Handlers by name: the request's `handler` field picks one.

The shipped families are registered by `default_registry`; more come from
installed packages through the `prorl.families` entry point group, so a task
family can live in a package of its own (docs/handlers.md, "A family in its
own package")::

    [project.entry-points."prorl.families"]
    chess = "prorl_chess:ChessHandler"

An entry point names an `AgentHandler` subclass (instantiated without
arguments), an instance of one, or a function returning one. A plugin that
fails to load, or names a family the server already has, stops start-up with
a message naming the entry point: a server that silently lacked a family
would reject every job of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points

from prorl_server.agents.base import AgentHandler, AnyHandler
from prorl_server.agents.code import CodeHandler
from prorl_server.agents.command import CommandHandler
from prorl_server.agents.math import MathHandler
from prorl_server.agents.rubric import RubricHandler
from prorl_server.agents.stem import StemHandler
from prorl_server.agents.swe import SWEHandler
from prorl_server.agents.terminal import TerminalHandler
from prorl_server.config import ConfigError
from prorl_server.errors import InvalidArgument

ENTRY_POINT_GROUP = "prorl.families"


class PluginError(ConfigError):
    """A family plugin could not be loaded (the message names its entry point): start-up stops."""


class HandlerRegistry:
    def __init__(self, handlers: Iterable[AnyHandler] = ()) -> None:
        self._handlers: dict[str, AnyHandler] = {}
        for handler in handlers:
            self.register(handler)

    def register(self, handler: AnyHandler) -> None:
        if not handler.name:
            raise ValueError(f"{type(handler).__name__} has no name")
        self._handlers[handler.name] = handler

    def get(self, name: str) -> AnyHandler:
        handler = self._handlers.get(name)
        if handler is None:
            known = ", ".join(sorted(self._handlers)) or "none"
            raise InvalidArgument(f"unknown handler {name!r}; this server has: {known}")
        return handler

    def names(self) -> list[str]:
        return sorted(self._handlers)


def load_plugin(entry_point: EntryPoint) -> AnyHandler:
    """The handler an entry point of `prorl.families` names."""
    where = f"entry point {entry_point.name!r} = {entry_point.value!r} (group {ENTRY_POINT_GROUP})"
    try:
        target = entry_point.load()
    except Exception as exc:  # an import error of someone else's package: say whose
        raise PluginError(f"{where} does not load: {type(exc).__name__}: {exc}") from exc
    handler = target() if callable(target) and not isinstance(target, AgentHandler) else target
    if not isinstance(handler, AgentHandler):
        raise PluginError(f"{where} gives a {type(handler).__name__}, not an AgentHandler")
    if not handler.name:
        raise PluginError(f"{where}: its handler has no name")
    return handler


def plugin_handlers(taken: Iterable[str] = ()) -> list[AnyHandler]:
    """The handlers of every installed family plugin, by entry point name."""
    names = set(taken)
    handlers = []
    for entry_point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        handler = load_plugin(entry_point)
        if handler.name in names:
            raise PluginError(
                f"entry point {entry_point.name!r} (group {ENTRY_POINT_GROUP}) names the family {handler.name!r}, "
                "which this server already has"
            )
        names.add(handler.name)
        handlers.append(handler)
    return handlers


def shipped_handlers() -> list[AnyHandler]:
    return [
        MathHandler(),
        StemHandler(),
        CodeHandler(),
        SWEHandler(),
        TerminalHandler(),
        CommandHandler(),
        RubricHandler(),
    ]


def default_registry(*, plugins: bool = True) -> HandlerRegistry:
    """The shipped families, and (unless `plugins` is False) those of installed plugins."""
    shipped = shipped_handlers()
    extra = plugin_handlers(h.name for h in shipped) if plugins else []
    return HandlerRegistry([*shipped, *extra])
