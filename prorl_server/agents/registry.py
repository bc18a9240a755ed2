"""Handlers by name: the request's `handler` field picks one."""

from __future__ import annotations

from collections.abc import Iterable

from prorl_server.agents.base import AnyHandler
from prorl_server.agents.code import CodeHandler
from prorl_server.agents.command import CommandHandler
from prorl_server.agents.math import MathHandler
from prorl_server.agents.stem import StemHandler
from prorl_server.agents.swe import SWEHandler
from prorl_server.errors import InvalidArgument


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


def default_registry() -> HandlerRegistry:
    return HandlerRegistry([MathHandler(), StemHandler(), CodeHandler(), SWEHandler(), CommandHandler()])
