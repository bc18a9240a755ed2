"""Shared test helpers: polling instead of sleeps, requests, event summaries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prorl_client import v1


async def assert_eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], *, timeout_s: float = 20.0, message: str = ""
) -> None:
    """Poll `check` until it is true; fail after timeout_s (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(message or f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.05)


def math_request(
    question: str,
    answer: str = "42",
    *,
    job_id: str = "",
    budget_s: float | None = None,
    max_turns: int | None = None,
    **fields: Any,
) -> v1.RolloutRequest:
    request = v1.RolloutRequest(job_id=job_id, handler="math", **fields)
    request.instance.update({"question": question, "answer": answer})
    if budget_s is not None:
        request.limits.budget.FromNanoseconds(int(budget_s * 1e9))
    if max_turns is not None:
        request.limits.max_turns = max_turns
    return request


def kinds(events: list[v1.RolloutEvent]) -> list[str]:
    return [str(event.WhichOneof("kind")) for event in events]
